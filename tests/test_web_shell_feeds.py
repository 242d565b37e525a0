"""The Web Shell in a real browser (see tests/test_web_shell.py), push, not poll: the
workspace view follows the live feed (and polls only while it is down), the deployment
view's inbox answers what waits in any workspace, in English and Chinese, and a workspace
token sees its own feed and inbox but not the workers.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from acp_state.ids import workspace_id
from testbed.redis_server import free_port
from tests.harness import Harness, SseClient
from tests.helpers import create, eventually, prompt
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
    # it for what it missed since the last frame it saw: the browser's own reconnect, with
    # that frame's id alone (it names the generation with the revision).
    assert await api.terminate() in (0, None)
    await expect(live).to_have_attribute("data-feed", "down")
    async with page.expect_response(lambda response: "/live-state/events" in response.url) as reopened:
        await api.start()  # the same port
    resumed = (await reopened.value).request
    assert re.fullmatch(r"\d+-\d+", (await resumed.all_headers()).get("last-event-id", "")), resumed.url
    assert "lastEventId=" not in resumed.url and "generation=" not in resumed.url, resumed.url
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
    """EventSource sends no headers: both streams open with stream tickets the token got."""
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
        await page.add_init_script(f"sessionStorage.setItem('acp-shell.token', {scoped!r})")

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


@dataclass(eq=False)
class Proxied:
    """One connection through the `StreamCutter`: the feed request it carried (if any), and
    what the API sent on it from then on."""

    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter
    request: bytes = b""
    received: bytearray = field(default_factory=bytearray)

    def events(self) -> list[str]:
        return re.findall(r"^event: (\S+)", self.received.decode(errors="replace"), re.M)


class StreamCutter:
    """A TCP proxy between the page and the API that cuts the live feed's connection under
    the page (as a network or a load balancer may) and holds the page's reconnect until let
    through, keeping what the API sends on each feed connection."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port, self.port = upstream_port, free_port()
        self.feeds: list[Proxied] = []  # the connections that carried a feed request, in order
        self.passing = asyncio.Event()  # feed requests go through (else they wait)
        self.passing.set()
        self._connections: list[Proxied] = []
        self._server: asyncio.Server | None = None

    async def start(self) -> StreamCutter:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        return self

    def cut(self) -> None:
        """Reset every feed connection, and hold the reconnects."""
        self.passing.clear()
        for conn in self.feeds:
            conn.client.transport.abort()
            conn.upstream.transport.abort()

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for conn in self._connections:
            conn.client.transport.abort()
            conn.upstream.transport.abort()

    async def _serve(self, client_in: asyncio.StreamReader, client_out: asyncio.StreamWriter) -> None:
        upstream_in, upstream_out = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        conn = Proxied(client_out, upstream_out)
        self._connections.append(conn)
        await asyncio.gather(self._pipe(client_in, upstream_out, conn, up=True), self._pipe(upstream_in, client_out, conn, up=False),
                             return_exceptions=True)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, conn: Proxied, up: bool) -> None:
        try:
            while chunk := await reader.read(65536):
                if up and chunk.startswith(b"GET ") and b"/live-state/events" in chunk.split(b"\r\n", 1)[0]:
                    conn.request = chunk
                    self.feeds.append(conn)
                    await self.passing.wait()
                elif not up and conn.request:
                    conn.received += chunk
                writer.write(chunk)
                await writer.drain()
        finally:
            writer.transport.abort()


async def test_a_feed_cut_under_the_page_resumes_with_what_it_missed_not_a_snapshot(
    harness: Harness, workspace: str, open_page: OpenPage
) -> None:
    """(issue 27) The workspace view's feed connection is cut under the page. The browser's
    EventSource reconnects by itself, sending only `Last-Event-ID` (the last frame's id,
    which names the generation with the revision), and gets what changed meanwhile as a
    `live_state_changed`, not a whole snapshot."""
    await harness.worker()
    api = await harness.api()
    sid = (await create(api, workspace))["sessionId"]
    feed_path = f"/workspaces/{workspace_id(workspace)}/sessions/live-state/events"
    witness = await SseClient(api, path=feed_path).start()  # the API's feed of the workspace
    cutter = await StreamCutter(api.port).start()
    try:
        page = await open_page(SimpleNamespace(port=cutter.port), "en-US")  # type: ignore[arg-type]
        live = page.locator(".ws-live")
        row = page.locator(f'.session-row[data-session-id="{sid}"]')
        await expect(live).to_have_attribute("data-feed", "live")
        await expect(row).to_have_attribute("data-status", "idle")
        assert cutter.feeds[0].events() == ["live_state_snapshot"]

        cutter.cut()
        await expect(live).to_have_attribute("data-feed", "down")
        await prompt(api, sid, "#permission")  # what the page misses while its feed is cut
        await witness.wait_for(lambda f: f["event"] == "live_state_changed" and any(
            r["sessionId"] == sid and r["isWaitingForPermission"] for r in f["data"]["sessions"]))
        reconnect = await eventually(lambda: cutter.feeds[-1] if len(cutter.feeds) > 1 else None, "the page's reconnect")
        head = reconnect.request.decode()
        assert re.search(r"^last-event-id: \d+-\d+\r$", head, re.M | re.I), head  # its last frame's id
        assert "generation=" not in head.split("\r\n", 1)[0], head  # and nothing beside it

        cutter.passing.set()
        await expect(live).to_have_attribute("data-feed", "live")
        await expect(row).to_have_attribute("data-status", "needsApproval")
        got = await eventually(lambda: reconnect.events(), "a frame on the reconnected feed")
        assert got == ["live_state_changed"], got
        assert page.errors == []  # type: ignore[attr-defined]
    finally:
        await cutter.stop()
        await witness.close()
