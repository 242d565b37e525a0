"""The Web Shell's token and headers in a real browser (issue 37 item 6): Playwright drives
Debian's Chromium against real API and worker processes on a real Redis, with a token.

The page keeps the token in the tab's sessionStorage (never localStorage) and never puts it
in a URL: its event streams open with single-use tickets, and reopen with fresh ones after
the API restarts. `/` and `/static/*` send a Content-Security-Policy the page lives with (no
violation reported), `nosniff` and `no-referrer`.
"""

from __future__ import annotations

import re

from playwright.async_api import Dialog, Page, Request, Response

from tests.harness import Harness
from tests.helpers import create, prompt
from tests.web_shell_helpers import (  # noqa: F401  (browser, open_page: fixtures, each module's own)
    OpenPage, agent_says, browser, expect, open_page, send_from_page,
)

ADMIN = "admin-token-0123456789"
SECURITY_HEADERS = {
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
}


async def test_the_token_stays_out_of_storage_and_urls_and_streams_use_tickets(
    harness: Harness, workspace: str, open_page: OpenPage
) -> None:
    events = await harness.events()
    await harness.worker()
    api = await harness.api("--token", f"{ADMIN},role=admin")
    api.client.headers["Authorization"] = f"Bearer {ADMIN}"
    sid = (await create(api, workspace))["sessionId"]
    requests: list[Request] = []
    responses: list[Response] = []
    asked: list[str] = []
    console: list[str] = []

    async def answer(dialog: Dialog) -> None:  # the person pastes the token when asked
        asked.append(dialog.message)
        await dialog.accept(ADMIN)

    async def watch(page: Page) -> None:
        page.on("dialog", answer)
        page.on("request", lambda request: requests.append(request))
        page.on("response", lambda response: responses.append(response))
        page.on("console", lambda message: console.append(message.text))

    page = await open_page(api, "en-US", f"/#/session/{sid}", prepare=watch)
    await send_from_page(page, "en", "before the restart")
    await expect(agent_says(page, "before the restart")).to_be_visible()  # echoed, pushed on the stream
    assert len(asked) == 1, asked

    def stream_urls(part: str) -> list[str]:
        return [r.url for r in requests if part in r.url and "/stream-tickets" not in r.url]

    opened = stream_urls(f"/session/{sid}/events")
    assert opened and all("ticket=" in url for url in opened), opened

    # The API restarts: the stream breaks, and reopens with a fresh ticket (the spent one
    # would be refused), and the page goes on.
    assert await api.terminate() in (0, None)
    async with page.expect_response(lambda r: f"/session/{sid}/events" in r.url and r.status == 200) as reopened:
        await api.start()  # the same port
    again = (await reopened.value).url
    assert "ticket=" in again and again not in opened, again
    await expect(page.locator(".conn")).to_have_attribute("data-state", "live")
    await send_from_page(page, "en", "after the restart")
    await expect(agent_says(page, "after the restart")).to_be_visible()

    # The workspace view's live feed and the deployment view's inbox: tickets too.
    await page.goto(f"http://127.0.0.1:{api.port}/#/")
    await expect(page.locator(".ws-live")).to_have_attribute("data-feed", "live")
    await prompt(api, sid, "#permission")
    await expect(page.locator(f'.session-row[data-session-id="{sid}"]')).to_have_attribute("data-status", "needsApproval")
    await page.goto(f"http://127.0.0.1:{api.port}/#/deployment")
    await expect(page.locator(f'.inbox-item[data-session-id="{sid}"]')).to_have_count(1)
    assert len(asked) == 1, asked  # a reload of the tab keeps the token: sessionStorage
    for part in ("/sessions/live-state/events", "/attention/events"):
        urls = stream_urls(part)
        assert urls and all("ticket=" in url for url in urls), (part, urls)

    # Nowhere but the tab's sessionStorage; in no URL the page asked for; no Referer sent.
    stored = await page.evaluate("[JSON.stringify({...localStorage}), JSON.stringify({...sessionStorage})]")
    assert ADMIN not in stored[0], stored[0]
    assert ADMIN in stored[1]
    assert requests and not [r.url for r in requests if ADMIN in r.url]
    # (Judged on the requests that reached the API: one the page made while the API was down
    # for its restart never went out, and Chromium reports it with the headers it meant to send.)
    reached = [r for r in requests if await r.response() is not None]
    assert reached and not [r.url for r in reached if "referer" in await r.all_headers()]
    assert await events.wait_type(sid, "permission_request")

    # The page's own answers carry the headers, and it lives with its policy.
    page_files = [r for r in responses if r.url.endswith("/") or "/static/" in r.url]
    assert {r.url.rsplit("/", 1)[-1] for r in page_files} >= {"", "main.js", "api.js", "shell.css"}
    for response in page_files:
        headers = await response.all_headers()
        policy = headers.get("content-security-policy", "")
        assert "default-src 'self'" in policy and "frame-ancestors 'none'" in policy, (response.url, headers)
        for name, value in SECURITY_HEADERS.items():
            assert headers.get(name) == value, (response.url, name, headers)
    assert not [text for text in console if "Content Security Policy" in text], console
    assert page.errors == []  # type: ignore[attr-defined]


async def test_a_token_an_older_shell_left_in_local_storage_is_removed(
    harness: Harness, workspace: str, open_page: OpenPage
) -> None:
    await harness.worker()
    api = await harness.api("--token", f"{ADMIN},role=admin")
    asked: list[str] = []

    async def answer(dialog: Dialog) -> None:
        asked.append(dialog.message)
        await dialog.accept(ADMIN)

    async def older_shell(page: Page) -> None:
        page.on("dialog", answer)
        await page.goto(f"http://127.0.0.1:{api.port}/static/shell.css")  # the origin, before the page
        await page.evaluate(f"localStorage.setItem('acp-shell.token', {ADMIN!r})")

    page = await open_page(api, "en-US", "/#/", prepare=older_shell)
    await expect(page.locator(".ws-live")).to_have_attribute("data-feed", "live")
    assert await page.evaluate("localStorage.getItem('acp-shell.token')") is None
    assert len(asked) == 1  # asked again: the token now lives in the tab only


async def test_a_ticketed_feed_reopens_from_its_last_frame_after_a_restart(
    harness: Harness, workspace: str, open_page: OpenPage
) -> None:
    """The browser's own reconnect would repeat a spent ticket, so the page reopens the live
    feed itself, with a fresh ticket and the last frame's id (`lastEventId`): what changed
    while it was down (here through another API process) arrives."""
    await harness.worker()
    api = await harness.api("--token", f"{ADMIN},role=admin")
    other = await harness.api("--token", f"{ADMIN},role=admin")
    other.client.headers["Authorization"] = f"Bearer {ADMIN}"
    sid = (await create(other, workspace))["sessionId"]

    async def sign_in(page: Page) -> None:
        page.on("dialog", lambda dialog: dialog.accept(ADMIN))

    page = await open_page(api, "en-US", "/#/", prepare=sign_in)
    live = page.locator(".ws-live")
    row = page.locator(f'.session-row[data-session-id="{sid}"]')
    await expect(live).to_have_attribute("data-feed", "live")
    await expect(row).to_have_attribute("data-status", "idle")

    assert await api.terminate() in (0, None)
    await expect(live).to_have_attribute("data-feed", "down")
    await prompt(other, sid, "#permission")  # what the page misses while its API is down
    async with page.expect_response(lambda r: "/live-state/events" in r.url and r.status == 200) as reopened:
        await api.start()  # the same port
    url = (await reopened.value).url
    assert "ticket=" in url and re.search(r"[?&]lastEventId=\d+-\d+(&|$)", url), url
    assert ADMIN not in url
    await expect(live).to_have_attribute("data-feed", "live")
    await expect(row).to_have_attribute("data-status", "needsApproval")
    assert page.errors == []  # type: ignore[attr-defined]
