"""The Web Shell in a real browser (see tests/test_web_shell.py), push, not poll: the
workspace view follows the live feed (and polls only while it is down), the deployment
view's inbox answers what waits in any workspace, in English and Chinese, and a workspace
token sees its own feed and inbox but not the workers.
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.harness import Harness, SseClient
from tests.helpers import create, prompt
from tests.web_shell_helpers import (  # noqa: F401  (browser, open_page: fixtures, each module's own)
    TEXT, OpenPage, Page, agent_says, browser, expect, open_page, shoot,
)


def polls(urls: list[str]) -> list[str]:
    """The reads a polling page makes: the listing and the live-state route (not its feed)."""
    return [u for u in urls if re.search(r"/sessions(/live-state)?(\?|$)", u)]


async def test_workspace_view_follows_the_live_feed_without_polling(
    harness: Harness, workspace: str, open_page: OpenPage
) -> None:
    events = await harness.events()
    await harness.worker()
    api = await harness.api()
    page = await open_page(api, "en-US")
    live = page.locator(".ws-live")
    await expect(live).to_have_attribute("data-feed", "live")
    await expect(page.locator(".empty")).to_contain_text("No sessions yet")

    sid = (await create(api, workspace))["sessionId"]  # the feed names it; the listing is read for it
    row = page.locator(f'.session-row[data-session-id="{sid}"]')
    await expect(row).to_have_attribute("data-status", "idle")
    first = await prompt(api, sid, "followed by the feed")
    await events.wait_type(sid, "turn_complete", promptId=first["promptId"])
    await expect(row).to_contain_text("followed by the feed")  # its title: read once, at its first turn

    urls: list[str] = []
    page.on("request", lambda request: urls.append(request.url))
    # Two seconds of a running turn (two poll intervals), then a vote asked: all pushed.
    slow = await prompt(api, sid, "#slow 2")
    await expect(row).to_have_attribute("data-status", "running")
    await events.wait_type(sid, "turn_complete", promptId=slow["promptId"])
    await expect(row).to_have_attribute("data-status", "idle")
    await prompt(api, sid, "#permission")
    await expect(row).to_have_attribute("data-status", "needsApproval")
    await expect(row.locator(".badge")).to_contain_text(TEXT["en"]["needs_approval"])
    await expect(row.locator(".row-pending")).to_have_text("1 pending")
    await expect(live).to_have_attribute("data-feed", "live")
    assert polls(urls) == [], urls
    assert not [u for u in urls if "/events" in u], urls  # the one stream stayed open
    assert page.errors == []  # type: ignore[attr-defined]


async def test_workspace_view_polls_only_while_the_feed_is_down(
    harness: Harness, workspace: str, open_page: OpenPage
) -> None:
    events = await harness.events()
    await harness.worker()
    api = await harness.api()
    sid = (await create(api, workspace))["sessionId"]
    feed = "**/sessions/live-state/events*"

    async def refuse_feed(page: Page) -> None:
        await page.route(feed, lambda route: route.abort())

    page = await open_page(api, "en-US", prepare=refuse_feed)
    live = page.locator(".ws-live")
    row = page.locator(f'.session-row[data-session-id="{sid}"]')
    await expect(live).to_have_attribute("data-feed", "down")
    await expect(live).to_contain_text("refreshing every 1 s")
    async with page.expect_request(lambda request: bool(polls([request.url]))):
        pass  # the listing is polled while the feed is down
    await prompt(api, sid, "#permission")
    await expect(row).to_have_attribute("data-status", "needsApproval")

    # The feed comes back: polling stops.
    await page.unroute(feed)
    await expect(live).to_have_attribute("data-feed", "live")
    urls: list[str] = []
    page.on("request", lambda request: urls.append(request.url))
    rid = (await api.client.get(f"/session/{sid}/status")).json()["pendingInteractions"][0]["requestId"]
    vote = {"outcome": {"outcome": "selected", "optionId": "proceed_once"}}
    assert (await api.client.post(f"/session/{sid}/permission/{rid}", json=vote)).status_code == 200
    await expect(row).to_have_attribute("data-status", "idle")
    slow = await prompt(api, sid, "#slow 2")  # longer than a poll interval
    await expect(row).to_have_attribute("data-status", "running")
    await events.wait_type(sid, "turn_complete", promptId=slow["promptId"])
    await expect(row).to_have_attribute("data-status", "idle")
    assert polls(urls) == [], urls

    # The API process restarts: the view polls (and says so) until the feed is back, and asks
    # it for what it missed since the last revision it saw, in the same generation.
    async with page.expect_request(lambda request: "/live-state/events" in request.url) as reopened:
        assert await api.terminate() in (0, None)
        await expect(live).to_have_attribute("data-feed", "down")
    resumed = (await reopened.value).url
    assert re.search(r"[?&]lastEventId=\d+", resumed) and re.search(r"[?&]generation=[^&]+", resumed), resumed
    await api.start()  # the same port
    await expect(live).to_have_attribute("data-feed", "live")
    await prompt(api, sid, "#question")
    await expect(row).to_have_attribute("data-status", "needsAnswer")
    assert page.errors == []  # type: ignore[attr-defined]


async def test_deployment_view_answers_a_permission_waiting_in_another_workspace(
    harness: Harness, workspace: str, open_page: OpenPage, tmp_path: Path
) -> None:
    other = tmp_path / "other"
    other.mkdir()
    worker = await harness.worker()
    api = await harness.api(workspaces=[workspace, str(other)])
    page = await open_page(api, "en-US", "/#/deployment")
    await expect(page.get_by_role("heading", level=1)).to_have_text(TEXT["en"]["deployment"])
    await expect(page.get_by_role("link", name=TEXT["en"]["deployment"])).to_have_attribute("aria-current", "page")
    workers = page.locator(".workers-table tbody tr")
    await expect(workers).to_have_count(1)
    await expect(workers.first).to_have_attribute("data-incarnation", worker.incarnation)
    await expect(page.get_by_role("columnheader", name=TEXT["en"]["lease_col"])).to_be_visible()
    inbox = page.locator(".panel-inbox")
    await expect(inbox.locator(".ws-live")).to_have_attribute("data-feed", "live")
    await expect(inbox.locator(".empty")).to_contain_text("Nobody is waiting")

    asking = (await create(api, str(other)))["sessionId"]  # the page's own workspace is the first one
    turn = await SseClient(api, asking).start()
    await prompt(api, asking, "#permission")
    item = page.locator(f'.inbox-item[data-session-id="{asking}"]')
    await expect(item).to_have_attribute("data-kind", "permission")
    await expect(item).to_contain_text("touch perm_check.txt (create a file)")
    await expect(item.locator(".ws-cwd")).to_have_text(str(other))
    await expect(item.locator(".badge")).to_contain_text(TEXT["en"]["needs_approval"])

    questioning = (await create(api, workspace))["sessionId"]
    await prompt(api, questioning, "#question")
    question = page.locator(f'.inbox-item[data-session-id="{questioning}"]')
    await expect(question).to_contain_text("Which color?")
    items = page.locator(".inbox-item")
    await expect(items).to_have_count(2)
    await expect(items.nth(0)).to_have_attribute("data-session-id", asking)  # the oldest wait first
    # Each worker reports its load with its heartbeat: the table catches up on its own.
    await expect(workers.first.locator(".worker-sessions")).to_contain_text("2")

    await item.get_by_role("button", name="Allow").click()
    await expect(item).to_have_count(0)  # the stream said it was resolved
    await turn.wait_for(lambda f: f["event"] == "turn_complete")
    status = (await api.client.get(f"/session/{asking}/status")).json()
    assert status["pendingInteractionCount"] == 0 and status["hasActivePrompt"] is False
    assert any("permission granted: proceed_once" in str(f["data"]) for f in turn.frames)
    await turn.close()

    # A question needs its form: the item opens the session, where it is answered.
    await question.get_by_role("link", name=TEXT["en"]["answer_in_session"]).click()
    await expect(page).to_have_url(re.compile(rf"#/session/{questioning}$"))
    card = page.locator(".interaction-question")
    await card.get_by_role("radio", name="Red").check()
    await card.get_by_role("button", name="Submit").click()
    await expect(agent_says(page, 'answers: {"0":"Red"}')).to_be_visible()
    await page.go_back()
    await expect(page.locator(".panel-inbox .empty")).to_contain_text("Nobody is waiting")
    assert page.errors == []  # type: ignore[attr-defined]


async def test_deployment_view_in_chinese_and_english(harness: Harness, workspace: str, open_page: OpenPage) -> None:
    await harness.worker()
    api = await harness.api()
    page = await open_page(api, "zh-CN", "/#/deployment")
    items = page.locator(".inbox-item")
    for n, text in enumerate(("#permission", "#question", "#fail")):
        sid = (await create(api, workspace))["sessionId"]
        await prompt(api, sid, text)
        await expect(items).to_have_count(n + 1)  # one after the other: their waits are in this order
    await expect(items.nth(0)).to_have_attribute("data-kind", "permission")
    await expect(items.nth(1)).to_have_attribute("data-kind", "user_question")
    await expect(items.nth(2)).to_have_attribute("data-kind", "turn_error")
    error_item = (await api.client.get("/attention")).json()["items"][2]
    assert error_item["kind"] == "turn_error" and error_item["title"]
    await expect(items.nth(2)).to_contain_text(error_item["title"])  # the turn error, with its title

    for lang in ("zh-CN", "en"):
        words = TEXT[lang]
        if lang == "en":
            await page.get_by_label("语言").select_option("en")
        await expect(page.locator("html")).to_have_attribute("lang", lang)
        await expect(page.get_by_role("heading", level=1)).to_have_text(words["deployment"])
        await expect(page.get_by_role("heading", name=words["inbox"])).to_be_visible()
        await expect(page.get_by_role("heading", name=words["workers"], exact=True)).to_be_visible()
        await expect(page.get_by_role("columnheader", name=words["lease_col"])).to_be_visible()
        await expect(items.nth(0).locator(".badge")).to_contain_text(words["needs_approval"])
        await expect(items.nth(1).locator(".badge")).to_contain_text(words["needs_answer"])
        await expect(items.nth(2).locator(".badge")).to_contain_text(words["failed"])
        await expect(items.nth(1).get_by_role("link", name=words["answer_in_session"])).to_be_visible()
        await expect(items.nth(2).get_by_role("link", name=words["open_session"])).to_be_visible()
        await expect(items.nth(0).get_by_role("button", name="Allow")).to_be_visible()  # the agent's own labels
        await expect(page.locator(".workers-table .worker-sessions")).to_contain_text("3")
        await shoot(page, f"deployment-{lang}.png")
    assert page.errors == []  # type: ignore[attr-defined]


async def test_feed_rows_over_the_listing_and_the_inbox_order(harness: Harness, open_page: OpenPage) -> None:
    """The page's own merge of the listing and the feed, and the inbox's order and keys."""
    api = await harness.api()  # serves the page; no worker needed
    page = await open_page(api)
    result = await page.evaluate(
        """async () => {
        const { mergeRows, applyChange } = await import("/static/js/live-rows.js");
        const { sessionStatus } = await import("/static/js/status.js");
        const { compareItems, itemKey } = await import("/static/js/attention-inbox.js");
        const flags = { clientCount: 0, hasActivePrompt: false, activeWorkState: "idle",
                        isWaitingForPermission: false, isWaitingForUserQuestion: false };
        const listed = [
          { sessionId: "named", displayName: "fix the build", createdAt: "2026-01-01T00:00:00Z",
            updatedAt: "2026-01-02T00:00:00Z", pendingInteractionCount: 2, hasTurnError: false, ...flags,
            isWaitingForPermission: true },
          { sessionId: "gone", displayName: "old", createdAt: "2026-01-01T00:00:00Z", pendingInteractionCount: 0,
            hasTurnError: true, ...flags },
          { sessionId: "failed", createdAt: "2026-01-01T00:00:00Z", pendingInteractionCount: 0, hasTurnError: true, ...flags },
        ];
        const live = new Map([
          ["named", { sessionId: "named", ...flags, isWaitingForPermission: true, updatedAt: "2026-01-03T00:00:00Z" }],
          ["failed", { sessionId: "failed", ...flags }],
        ]);
        applyChange(live, { sessions: [{ sessionId: "new", ...flags, hasActivePrompt: true }], removed: [] });
        const rows = mergeRows(listed, live);
        const byId = Object.fromEntries(rows.map((row) => [row.sessionId, row]));
        const answered = mergeRows(listed, new Map([["named", { sessionId: "named", ...flags }]]));
        applyChange(live, { sessions: [], removed: ["named"] });
        const items = [
          { workspaceId: "w2", sessionId: "b", kind: "turn_error", since: 30 },
          { workspaceId: "w1", sessionId: "a", kind: "permission", requestId: "r1", since: 10 },
          { workspaceId: "w1", sessionId: "a", kind: "user_question", requestId: "r2", since: 20 },
        ];
        return {
          statuses: Object.fromEntries(rows.map((row) => [row.sessionId, sessionStatus(row)])),
          named: [byId.named.displayName, byId.named.pendingInteractionCount, byId.named.updatedAt],
          answeredPending: answered.find((row) => row.sessionId === "named").pendingInteractionCount,
          notFollowed: mergeRows(listed, null) === listed,
          removed: !live.has("named"),
          order: [...items].sort(compareItems).map(itemKey),
        };
    }"""
    )
    assert result["statuses"] == {
        "named": "needsApproval", "gone": "ended", "failed": "failed", "new": "running",
    }
    # The listing's title and higher count stay; the feed's later updatedAt wins.
    assert result["named"] == ["fix the build", 2, "2026-01-03T00:00:00Z"]
    assert result["answeredPending"] == 0 and result["notFollowed"] and result["removed"]
    assert result["order"] == ["w1|a|r1", "w1|a|r2", "w2|b|turn_error"]


async def test_a_workspace_token_follows_its_feed_and_inbox_but_not_the_workers(
    harness: Harness, workspace: str, open_page: OpenPage, tmp_path: Path
) -> None:
    """EventSource sends no headers: both streams carry the token in `access_token`."""
    other = tmp_path / "other"
    other.mkdir()
    scoped = "scoped-token-0123456789"
    await harness.worker()
    api = await harness.api(
        "--token", "admin-token-0123456789,role=admin", "--token", f"{scoped},workspace={workspace}",
        workspaces=[workspace, str(other)],
    )
    api.client.headers["Authorization"] = "Bearer admin-token-0123456789"

    async def sign_in(page: Page) -> None:
        await page.add_init_script(f"localStorage.setItem('acp-shell.token', {scoped!r})")

    page = await open_page(api, "en-US", "/#/deployment", prepare=sign_in)
    await expect(page.locator(".panel-workers")).to_contain_text("This token sees only its own workspaces")
    inbox = page.locator(".panel-inbox")
    await expect(inbox.locator(".ws-live")).to_have_attribute("data-feed", "live")
    theirs = (await create(api, str(other)))["sessionId"]
    ours = (await create(api, workspace))["sessionId"]
    await prompt(api, theirs, "#permission")
    await prompt(api, ours, "#permission")
    item = page.locator(f'.inbox-item[data-session-id="{ours}"]')
    await item.get_by_role("button", name="Allow").click()
    await expect(item).to_have_count(0)
    await expect(inbox.locator(".empty")).to_contain_text("Nobody is waiting")  # never saw the other one
    assert (await api.client.get("/attention")).json()["items"][0]["sessionId"] == theirs

    await page.get_by_role("link", name="Sessions", exact=True).click()
    await expect(page.locator(".ws-live")).to_have_attribute("data-feed", "live")
    row = page.locator(f'.session-row[data-session-id="{ours}"]')
    await expect(row).to_have_attribute("data-status", "idle")
    await prompt(api, ours, "#question")
    await expect(row).to_have_attribute("data-status", "needsAnswer")
    assert page.errors == []  # type: ignore[attr-defined]


async def test_the_inbox_reads_the_attention_route_while_its_stream_is_down(
    harness: Harness, workspace: str, open_page: OpenPage
) -> None:
    await harness.worker()
    api = await harness.api()
    stream = "**/attention/events*"

    async def refuse_stream(page: Page) -> None:
        await page.route(stream, lambda route: route.abort())

    page = await open_page(api, "en-US", "/#/deployment", prepare=refuse_stream)
    live = page.locator(".panel-inbox .ws-live")
    await expect(live).to_have_attribute("data-feed", "down")
    await expect(live).to_contain_text("refreshing every 2 s")
    sid = (await create(api, workspace))["sessionId"]
    await prompt(api, sid, "#question")
    await expect(page.locator(f'.inbox-item[data-session-id="{sid}"]')).to_contain_text("Which color?")

    await page.unroute(stream)  # back: the stream's snapshot takes over and the reads stop
    await expect(live).to_have_attribute("data-feed", "live")
    urls: list[str] = []
    page.on("request", lambda request: urls.append(request.url))
    await prompt(api, (await create(api, workspace))["sessionId"], "#permission")
    await expect(page.locator(".inbox-item")).to_have_count(2)
    assert not [u for u in urls if re.search(r"/attention(\?|$)", u)], urls
    assert page.errors == []  # type: ignore[attr-defined]
