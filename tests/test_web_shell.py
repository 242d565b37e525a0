"""The Web Shell in a real browser: Playwright drives Debian's Chromium (headless) against
real API and worker processes on a real Redis. No sleeps: Playwright's expectations wait.

Screenshots of the workspace view, of a loop-stopped session and of the deployment view; of
persisted sessions' Resume (a refusal said under the row; a session that is not live, opened
read-only), and of a drain (the workspace and the session while the session moves, the
deployment view's draining worker, the moved session), in English and Chinese, go to
artifacts/screenshots/ at the repository root.
"""

from __future__ import annotations

import asyncio
import re
import shlex
import shutil
import sys
from pathlib import Path
from typing import AsyncIterator, Awaitable, Callable

import pytest

try:
    from playwright.async_api import Browser, Page, async_playwright, expect
except ImportError:  # pragma: no cover - scripts/test installs it
    pytest.fail("playwright is not installed (scripts/test installs the test extra)", pytrace=False)

from acp_state.turn_errors import LOOP_DETECTED_MESSAGE
from tests.harness import ApiProcess, Harness, SseClient
from tests.helpers import create, prompt, status

ROOT = Path(__file__).resolve().parent.parent
SCREENSHOTS = ROOT / "artifacts" / "screenshots"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
VIEWPORT = {"width": 1200, "height": 860}
TIMEOUT_MS = 15_000

# What the page says, per language (a few words of each catalogue string are enough).
TEXT = {
    "en": {
        "composer": "Message to the agent",
        "send": "Send",
        "retry": "Retry",
        "loop_title": "Turn stopped: the agent was repeating itself",
        "loop_text": "Only this turn ended: the session is still open. Continue with a more specific instruction.",
        "interrupted": "The model's response stream broke off before the turn finished.",
        "needs_approval": "Needs approval",
        "idle": "Idle",
        "new_session": "New session",
        "needs_answer": "Waiting for answer",
        "failed": "Turn failed",
        "deployment": "Deployment",
        "inbox": "Waiting for a human",
        "workers": "Workers",
        "lease_col": "Lease age",
        "answer_in_session": "Answer in the session",
        "open_session": "Open session",
    },
    "zh-CN": {
        "composer": "发给智能体的消息",
        "send": "发送",
        "retry": "重试",
        "loop_title": "本轮已停止：智能体在重复操作",
        "loop_text": "只有本轮被停止，会话仍然可以继续使用。请给出更具体的指示后继续。",
        "needs_approval": "待批准",
        "idle": "空闲",
        "new_session": "新建会话",
        "needs_answer": "等待回答",
        "failed": "本轮出错",
        "deployment": "部署",
        "inbox": "等待人工处理",
        "workers": "工作进程",
        "lease_col": "租约时长",
        "answer_in_session": "在会话中回答",
        "open_session": "打开会话",
    },
}

expect.set_options(timeout=TIMEOUT_MS)


@pytest.fixture(scope="session")
async def browser() -> AsyncIterator[Browser]:
    if not Path(CHROMIUM).exists():
        pytest.fail("chromium is not installed (scripts/test installs it)", pytrace=False)
    async with async_playwright() as playwright:
        # Debian's Chromium, never a downloaded one; --no-sandbox for containers run as root.
        launched = await playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield launched
        await launched.close()


OpenPage = Callable[..., Awaitable[Page]]


@pytest.fixture
async def open_page(browser: Browser, tmp_path: Path) -> AsyncIterator[OpenPage]:
    """Open the shell of `api` in a fresh browser context (own storage) with `locale`.

    Each page's last state is saved as `page-<n>.png` in the test's tmp_path, next to the
    worker and API logs, so a failure can be looked at afterwards.
    """
    contexts = []

    async def opener(
        api: ApiProcess, locale: str = "en-US", path: str = "/", prepare: Callable[[Page], Awaitable[None]] | None = None
    ) -> Page:
        context = await browser.new_context(locale=locale, viewport=VIEWPORT)
        contexts.append(context)
        page = await context.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.errors = errors  # type: ignore[attr-defined]
        if prepare is not None:  # e.g. routes, before the page's first request
            await prepare(page)
        await page.goto(f"http://127.0.0.1:{api.port}{path}")
        return page

    yield opener
    for n, context in enumerate(contexts):
        for page in context.pages:
            try:
                await page.screenshot(path=str(tmp_path / f"page-{n}.png"), full_page=True, timeout=5000)
            except Exception:  # noqa: BLE001 - a diagnostic only
                pass
        await context.close()


async def shoot(page: Page, name: str) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    await page.evaluate("window.scrollTo(0, 0)")
    await page.screenshot(path=str(SCREENSHOTS / name), full_page=True, animations="disabled")


async def send_from_page(page: Page, lang: str, text: str) -> None:
    composer = page.get_by_label(TEXT[lang]["composer"])
    await composer.fill(text)
    await page.get_by_role("button", name=TEXT[lang]["send"], exact=True).click()
    await expect(composer).to_have_value("")


def agent_says(page: Page, text: str):
    return page.locator(".msg-agent .msg-body", has_text=text)


@pytest.mark.parametrize("locale, lang", [("en-US", "en"), ("zh-CN", "zh-CN")])
async def test_loop_error_is_localized_and_stays_until_the_next_prompt(
    harness: Harness, workspace: str, open_page: OpenPage, locale: str, lang: str
) -> None:
    await harness.worker()
    api = await harness.api()
    sid = (await create(api, workspace))["sessionId"]
    page = await open_page(api, locale, f"/#/session/{sid}")
    words = TEXT[lang]

    await send_from_page(page, lang, "#loop")
    error = page.locator(".turn-error")
    await expect(error).to_be_visible()
    await expect(error).to_have_attribute("data-error-kind", "loop_detected")
    await expect(error).to_contain_text(words["loop_title"])
    await expect(error).to_contain_text(words["loop_text"])
    await expect(error).not_to_contain_text(LOOP_DETECTED_MESSAGE)  # never the internal English
    await expect(page.get_by_role("button", name=words["retry"])).to_have_count(0)
    await expect(page.get_by_label(words["composer"])).to_be_editable()
    await expect(page.get_by_role("button", name=words["send"], exact=True)).to_be_enabled()
    # The tool cards of the stopped turn stay, collapsed.
    await expect(page.locator("details.tool")).to_have_count(7)
    await expect(page.locator("details.tool[open]")).to_have_count(0)
    await shoot(page, f"session-loop-{lang}.png")

    await page.reload()  # the error comes back through the load route's refresh-append
    await expect(error).to_contain_text(words["loop_text"])
    await expect(page.locator("details.tool")).to_have_count(7)
    await expect(page.locator("details.tool[open]")).to_have_count(0)
    await expect(page.get_by_label(words["composer"])).to_be_editable()

    if lang == "en":  # the switch: another language at once, remembered across a reload
        await page.get_by_label("Language").select_option("zh-CN")
        await expect(error).to_contain_text(TEXT["zh-CN"]["loop_text"])
        await page.reload()
        await expect(error).to_contain_text(TEXT["zh-CN"]["loop_text"])
        await expect(page.locator("html")).to_have_attribute("lang", "zh-CN")
        await page.get_by_label("语言").select_option("en")
        await expect(error).to_contain_text(words["loop_text"])

    await send_from_page(page, lang, "#slow 1")  # a newer turn supersedes the error
    await expect(agent_says(page, "tick 1")).to_be_visible()
    await expect(error).to_have_count(0)
    await page.reload()
    await expect(agent_says(page, "tick 1")).to_be_visible()
    await expect(error).to_have_count(0)
    assert page.errors == []  # type: ignore[attr-defined]


async def test_permission_and_question_answered_from_the_page(harness: Harness, workspace: str, open_page: OpenPage) -> None:
    await harness.worker()
    api = await harness.api()
    sid = (await create(api, workspace))["sessionId"]
    page = await open_page(api, "en-US", f"/#/session/{sid}")

    await send_from_page(page, "en", "#permission")
    card = page.locator(".interaction-permission")
    await expect(card).to_be_visible()
    await expect(card).to_contain_text("touch perm_check.txt (create a file)")  # the action's title
    await expect(card.locator(".action-meta")).to_contain_text("execute")  # its kind
    await expect(card.locator(".action-input")).to_contain_text('"command": "touch perm_check.txt"')
    await expect(page.locator(".session-badge")).to_contain_text("Needs approval")
    await expect(card.get_by_role("button", name="Reject")).to_be_visible()
    await card.get_by_role("button", name="Allow").click()
    await expect(agent_says(page, "permission granted: proceed_once")).to_be_visible()
    await expect(card).to_have_count(0)
    await expect(page.locator(".session-badge")).to_contain_text("Idle")

    await send_from_page(page, "en", "#question")
    question = page.locator(".interaction-question")
    await expect(question).to_be_visible()
    await expect(question.get_by_role("group", name="Which color?")).to_be_visible()
    await expect(page.locator(".session-badge")).to_contain_text("Waiting for answer")
    await expect(question.get_by_role("radio", name="Red")).to_be_visible()
    await question.get_by_role("radio", name="Blue").check()
    await question.get_by_role("button", name="Submit").click()
    await expect(agent_says(page, 'answers: {"0":"Blue"}')).to_be_visible()
    await expect(question).to_have_count(0)
    status = (await api.client.get(f"/session/{sid}/status")).json()
    assert status["pendingInteractionCount"] == 0 and status["hasActivePrompt"] is False
    assert page.errors == []  # type: ignore[attr-defined]


async def test_workspace_view_puts_a_session_waiting_for_a_vote_first(
    harness: Harness, workspace: str, open_page: OpenPage
) -> None:
    events = await harness.events()
    await harness.worker()
    api = await harness.api()
    older = (await create(api, workspace))["sessionId"]
    first = await prompt(api, older, "first session")
    await events.wait_type(older, "turn_complete", promptId=first["promptId"])
    newer = (await create(api, workspace))["sessionId"]
    second = await prompt(api, newer, "second session")
    await events.wait_type(newer, "turn_complete", promptId=second["promptId"])

    page = await open_page(api, "en-US")
    rows = page.locator(".session-row")
    await expect(rows).to_have_count(2)
    await expect(rows.nth(0)).to_contain_text("second session")  # both idle: the most recent first
    await expect(rows.nth(1)).to_contain_text("first session")
    await expect(rows.nth(1).locator(".badge")).to_have_text(re.compile(TEXT["en"]["idle"]))

    await prompt(api, older, "#permission")  # the older one now waits for a vote
    await expect(rows.nth(0)).to_contain_text("first session")
    await expect(rows.nth(0)).to_have_attribute("data-status", "needsApproval")
    await expect(rows.nth(0).locator(".badge")).to_contain_text(TEXT["en"]["needs_approval"])
    await expect(rows.nth(0).locator(".row-pending")).to_have_text("1 pending")
    await expect(rows.nth(1)).to_contain_text("second session")
    await expect(rows.nth(1).locator(".row-pending")).to_have_text("0 pending")
    await shoot(page, "workspace-en.png")

    await page.get_by_label("Language").select_option("zh-CN")
    await expect(rows.nth(0).locator(".badge")).to_contain_text(TEXT["zh-CN"]["needs_approval"])
    await expect(rows.nth(1).locator(".badge")).to_contain_text(TEXT["zh-CN"]["idle"])
    await shoot(page, "workspace-zh-CN.png")

    # Opening the row shows the same pending vote; "new session" starts a thread session.
    await rows.nth(0).click()
    await expect(page.locator(".interaction-permission")).to_be_visible()
    await page.get_by_role("link", name="全部会话").click()
    await page.get_by_role("button", name=TEXT["zh-CN"]["new_session"]).click()
    await expect(page).to_have_url(re.compile(r"#/session/[0-9a-f-]+$"))
    created = page.url.rsplit("/", 1)[1]
    assert created not in (older, newer)
    await expect(page.locator(".conn")).to_have_attribute("data-state", "live")
    await page.go_back()
    await expect(rows).to_have_count(3)
    assert page.errors == []  # type: ignore[attr-defined]


async def test_interrupted_stream_offers_retry_and_unknown_errors_show_the_message(
    harness: Harness, workspace: str, open_page: OpenPage
) -> None:
    await harness.worker()
    api = await harness.api()
    sid = (await create(api, workspace))["sessionId"]
    page = await open_page(api, "en-US", f"/#/session/{sid}")
    error = page.locator(".turn-error")

    await send_from_page(page, "en", "#slow 30")  # the Stop button cancels a running turn
    stop = page.get_by_role("button", name="Stop turn")
    await expect(page.locator(".session-badge")).to_contain_text("Running")
    await expect(agent_says(page, "tick 1")).to_be_visible()
    await stop.click()
    await expect(page.locator(".session-badge")).to_contain_text("Idle")
    await expect(stop).to_be_disabled()

    interrupted = '#error -32603 {"errorKind":"model_stream_interrupted"}'
    await send_from_page(page, "en", interrupted)
    await expect(error).to_have_attribute("data-error-kind", "model_stream_interrupted")
    await expect(error).to_contain_text(TEXT["en"]["interrupted"])
    retry = page.get_by_role("button", name=TEXT["en"]["retry"])
    await retry.click()  # sends the same prompt again: it fails the same way
    await expect(page.locator(".msg-user", has_text=interrupted)).to_have_count(2)
    await expect(error).to_have_count(1)
    await expect(error).to_contain_text(TEXT["en"]["interrupted"])

    await send_from_page(page, "en", "#fail")  # no kind: the daemon's own message
    await expect(error).to_have_attribute("data-error-kind", "")
    await expect(error).to_contain_text("scripted failure")
    await expect(page.get_by_role("button", name=TEXT["en"]["retry"])).to_have_count(0)
    await page.reload()
    await expect(error).to_contain_text("scripted failure")
    assert page.errors == []  # type: ignore[attr-defined]


async def test_urgency_order_and_transcript_model(harness: Harness, open_page: OpenPage) -> None:
    """The page's own modules: every status in its rank, then recency; the transcript's
    merging, upserts, collapse and supersede rules."""
    api = await harness.api()  # serves the page; no worker needed
    page = await open_page(api)
    result = await page.evaluate(
        """async () => {
        const { sortSessions } = await import("/static/js/status.js");
        const { Transcript } = await import("/static/js/transcript.js");
        const live = { pendingInteractionCount: 0, isWaitingForPermission: false, isWaitingForUserQuestion: false,
                       hasActivePrompt: false, hasTurnError: false };
        const rows = [
          { sessionId: "ended", updatedAt: "2026-01-09T00:00:00Z" },
          { ...live, sessionId: "idle-old", updatedAt: "2026-01-01T00:00:00Z" },
          { ...live, sessionId: "idle-new", updatedAt: "2026-01-05T00:00:00Z" },
          { ...live, sessionId: "failed", hasTurnError: true, updatedAt: "2026-01-02T00:00:00Z" },
          { ...live, sessionId: "running", hasActivePrompt: true, hasTurnError: true, updatedAt: "2026-01-03T00:00:00Z" },
          { ...live, sessionId: "question", isWaitingForUserQuestion: true, hasActivePrompt: true,
            pendingInteractionCount: 1, updatedAt: "2026-01-08T00:00:00Z" },
          { ...live, sessionId: "approval", isWaitingForPermission: true, isWaitingForUserQuestion: true,
            hasActivePrompt: true, pendingInteractionCount: 2, updatedAt: "2026-01-01T00:00:00Z" },
        ];
        const order = sortSessions(rows).map((row) => row.sessionId);

        const model = new Transcript();
        const update = (promptId, body) => ({ type: "session_update", promptId, data: { update: body } });
        const text = (kind, value) => ({ sessionUpdate: kind, content: { type: "text", text: value } });
        model.applyAll([
          update("p1", text("user_message_chunk", "hi")),
          update("p1", text("agent_message_chunk", "hel")),
          update("p1", text("agent_message_chunk", "lo")),
          update("p1", { sessionUpdate: "tool_call", toolCallId: "t1", title: "read", status: "pending", rawInput: { a: 1 } }),
          update("p1", { sessionUpdate: "tool_call_update", toolCallId: "t1", status: "completed" }),
          { type: "turn_error", promptId: "p1", data: { message: "internal", errorKind: "loop_detected" } },
        ]);
        const shape = model.items.map((item) =>
          item.kind === "message" ? [item.role, item.blocks[0].text]
          : item.kind === "tool" ? [item.status, item.title, item.input.a, item.collapsedByError]
          : [item.kind, item.errorKind]);
        model.apply(update("p2", { sessionUpdate: "available_commands_update", availableCommands: [] }));
        const keptByBookkeeping = model.turnError !== null;
        const retryText = model.promptText("p1");
        model.apply(update("p2", text("user_message_chunk", "again")));
        return { order, shape, keptByBookkeeping, retryText, supersededByNewTurn: model.turnError === null };
    }"""
    )
    assert result["order"] == ["approval", "question", "running", "failed", "idle-new", "idle-old", "ended"]
    assert result["shape"] == [
        ["user", "hi"],
        ["agent", "hello"],
        ["completed", "read", 1, True],
        ["error", "loop_detected"],
    ]
    assert result["keptByBookkeeping"] is True and result["supersededByNewTurn"] is True
    assert result["retryText"] == "hi"


# ---- push, not poll: the live feed and the deployment view ---------------------------------


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


# ---- conversations outlive their worker: resume and drain ----------------------------------

LEASE_MS = "1500"  # a killed worker's sessions are swept (and listed as persisted) within it

TEXT["en"].update({
    "resume": "Resume",
    "cannot_resume": "Can't be resumed",
    "no_store_worker": "No live worker can read this session's history yet; retry in a moment.",
    "ended_resume": "Resume it to continue the conversation on a live worker.",
    "ended_cannot": "It cannot be resumed: its agent cannot reload sessions.",
    "moving": "Moving",
    "moving_banner": "Moving to another worker.",
    "moved_note": "Moved to another worker because the previous one was shutting down. The conversation continues.",
    "draining_title": "Turn stopped: its worker was shutting down",
    "draining_text": "The session itself moves to another worker and stays open",
    "draining_worker": "Draining",
})
TEXT["zh-CN"].update({
    "resume": "恢复",
    "cannot_resume": "无法恢复",
    "no_store_worker": "暂时没有能读取此会话历史记录的在线工作进程，请稍后重试。",
    "moving": "迁移中",
    "moving_banner": "正在迁移到另一个工作进程。",
    "ended_resume": "恢复后即可在在线的工作进程上继续对话。",
    "draining_worker": "排空中",
    "moved_note": "原工作进程正在关闭，会话已迁移到另一个工作进程，对话继续。",
    "draining_title": "本轮已停止：工作进程正在关闭",
    "draining_text": "会话本身会迁移到另一个工作进程并保持可用",
})


async def test_a_session_whose_worker_died_is_resumed_from_its_row(
    harness: Harness, workspace: str, open_page: OpenPage
) -> None:
    """A persisted row gets Resume (or says it cannot be resumed); a refusal is said in
    words; opening a session that is not live does not resume it; Resume does, and opens it."""
    events = await harness.events()
    # A session whose agent cannot load sessions, on a worker that is then killed.
    no_load = await harness.worker("--lease-ms", LEASE_MS, env={"ACP_SCRIPTED_NO_LOAD": "1"})
    api = await harness.api()
    stuck = (await create(api, workspace))["sessionId"]
    turn = await prompt(api, stuck, "remember IBIS")
    await events.wait_type(stuck, "turn_complete", promptId=turn["promptId"])
    await no_load.kill9()
    await events.wait_type(stuck, "session_died")
    # A session whose agent can, on a worker that is killed while the page watches.
    first = await harness.worker("--lease-ms", LEASE_MS)
    sid = (await create(api, workspace))["sessionId"]
    turn = await prompt(api, sid, "remember PELICAN")
    await events.wait_type(sid, "turn_complete", promptId=turn["promptId"])

    page = await open_page(api, "en-US")
    row = page.locator(f'.session-row[data-session-id="{sid}"]')
    item = page.locator(".session-item", has=row)
    stuck_item = page.locator(".session-item", has=page.locator(f'.session-row[data-session-id="{stuck}"]'))
    await expect(row).to_have_attribute("data-status", "idle")
    await expect(item.get_by_role("button", name=TEXT["en"]["resume"])).to_have_count(0)  # live: nothing to resume
    await expect(stuck_item.locator(".row-cannot")).to_have_text(TEXT["en"]["cannot_resume"])
    await expect(stuck_item.get_by_role("button")).to_have_count(0)
    await first.kill9()
    await events.wait_type(sid, "session_died")
    await expect(row).to_have_attribute("data-status", "ended")
    resume = item.get_by_role("button", name=TEXT["en"]["resume"])

    # The only live worker reads another agent-state store than the session's history is in:
    # the refusal (503 no_worker_for_state_store) is said under the row. (With no worker at
    # all the API waits for one to start, up to its create timeout.)
    await harness.worker("--lease-ms", LEASE_MS, "--state-store", "another-host")
    await resume.click()
    error = item.locator(".row-error")
    await expect(error).to_have_text(TEXT["en"]["no_store_worker"])
    await expect(error).to_have_attribute("role", "alert")
    await expect(resume).to_be_focused()  # redrawn, the button keeps the keyboard
    await shoot(page, "workspace-resume-en.png")
    await page.get_by_label("Language").select_option("zh-CN")
    await expect(error).to_have_text(TEXT["zh-CN"]["no_store_worker"])
    await expect(stuck_item.locator(".row-cannot")).to_have_text(TEXT["zh-CN"]["cannot_resume"])
    await expect(item.get_by_role("button", name=TEXT["zh-CN"]["resume"])).to_be_visible()
    await shoot(page, "workspace-resume-zh-CN.png")
    await page.get_by_label("语言").select_option("en")

    # Opening a session that is not live shows it read-only and resumes nothing, though a
    # worker that could resume it is up now.
    await harness.worker("--lease-ms", LEASE_MS)
    await page.goto(f"http://127.0.0.1:{api.port}/#/session/{stuck}")
    ended = page.locator(".banner-ended")
    await expect(ended).to_contain_text(TEXT["en"]["ended_resume"])
    await expect(page.locator(".msg-user", has_text="remember IBIS")).to_be_visible()  # its persisted transcript
    await expect(page.locator(".conn")).to_have_attribute("data-state", "ended")
    # Its agent cannot load sessions: the daemon's 409 turns the offer into the reason.
    await ended.get_by_role("button", name=TEXT["en"]["resume"]).click()
    await expect(ended).to_contain_text(TEXT["en"]["ended_cannot"])
    await expect(ended.get_by_role("button")).to_have_count(0)
    await page.goto(f"http://127.0.0.1:{api.port}/#/session/{sid}")
    await expect(ended).to_contain_text(TEXT["en"]["ended_resume"])
    await expect(page.locator(".msg-user", has_text="remember PELICAN")).to_be_visible()
    assert (await api.client.get(f"/session/{sid}/status")).status_code == 404  # still not live
    await shoot(page, "session-ended-en.png")
    await page.get_by_label("Language").select_option("zh-CN")
    await expect(ended).to_contain_text(TEXT["zh-CN"]["ended_resume"])
    await expect(ended.get_by_role("button", name=TEXT["zh-CN"]["resume"])).to_be_visible()
    await shoot(page, "session-ended-zh-CN.png")
    await page.get_by_label("语言").select_option("en")

    # Resume from the row makes the session live (on the worker that reads its history) and opens it.
    await page.get_by_role("link", name="All sessions").click()
    await item.get_by_role("button", name=TEXT["en"]["resume"]).click()
    await expect(page).to_have_url(re.compile(rf"#/session/{sid}$"))
    await expect(page.locator(".conn")).to_have_attribute("data-state", "live")
    await expect(page.locator(".session-badge")).to_contain_text(TEXT["en"]["idle"])
    await expect(page.locator(".banner-ended")).to_be_hidden()
    await expect(page.locator(".msg-user", has_text="remember PELICAN")).to_be_visible()  # its conversation
    assert (await status(api, sid))["sessionId"] == sid
    await send_from_page(page, "en", "#recall")  # the agent loaded its history
    await expect(agent_says(page, "recall: remember PELICAN")).to_be_visible()
    await page.go_back()
    await expect(row).to_have_attribute("data-status", "idle")
    await expect(item.locator(".row-actions")).to_have_count(0)
    await expect(item.locator(".row-error")).to_have_count(0)
    assert page.errors == []  # type: ignore[attr-defined]


async def test_a_drained_session_shows_moving_then_the_move_and_the_stopped_turn(
    harness: Harness, workspace: str, open_page: OpenPage
) -> None:
    """SIGTERM with another worker up moves the session. The worker it moves to starts its
    agent 5 s late, so the hand-over (and the session's `moving`) lasts long enough to be
    seen live: the workspace rows (both languages) and the session view say "moving", the
    deployment view says the worker drains; then the transcript has the stopped turn
    explained and the move noted, and the conversation goes on."""
    events = await harness.events()
    draining = await harness.worker("--drain-grace-s", "2")
    api = await harness.api()
    sid = (await create(api, workspace))["sessionId"]
    told = await prompt(api, sid, "remember OSPREY")
    await events.wait_type(sid, "turn_complete", promptId=told["promptId"])
    late_agent = f"sh -c {shlex.quote(f'sleep 5; exec {shlex.quote(sys.executable)} -m acp_state.testing.scripted_agent')}"
    await harness.worker("--agent", late_agent)

    languages = (("en-US", "en"), ("zh-CN", "zh-CN"))
    rows = {lang: await open_page(api, locale) for locale, lang in languages}
    sessions = {lang: await open_page(api, locale, f"/#/session/{sid}") for locale, lang in languages}
    deployment = await open_page(api, "en-US", "/#/deployment")
    page = sessions["en"]
    for lang, view in rows.items():
        await expect(view.locator(f'.session-row[data-session-id="{sid}"]')).to_have_attribute("data-status", "idle")
    await expect(deployment.locator(".workers-table tbody tr")).to_have_count(2)
    await expect(deployment.locator('.workers-table tr[data-draining="true"]')).to_have_count(0)
    await send_from_page(page, "en", "#slow 30")  # outlives the drain's grace: the drain stops it
    await expect(agent_says(page, "tick 1")).to_be_visible()

    stopping = asyncio.ensure_future(draining.terminate())

    async def row_moving(lang: str) -> None:
        row = rows[lang].locator(f'.session-row[data-session-id="{sid}"]')
        await expect(row).to_have_attribute("data-moving", "true")
        await expect(row.locator(".moving-badge")).to_have_text(re.compile(TEXT[lang]["moving"]))
        await shoot(rows[lang], f"workspace-moving-{lang}.png")

    async def worker_draining() -> None:
        marked = deployment.locator(f'.workers-table tr[data-incarnation="{draining.incarnation}"]')
        await expect(marked).to_have_attribute("data-draining", "true")
        for lang in ("en", "zh-CN"):  # redrawn from the last read at once: the switch is safe here
            if lang != "en":
                await deployment.get_by_label("Language").select_option(lang)
            await expect(marked.locator(".draining-badge")).to_have_text(re.compile(TEXT[lang]["draining_worker"]))
            await shoot(deployment, f"deployment-draining-{lang}.png")
        await deployment.get_by_label("语言").select_option("en")

    async def session_moving(lang: str) -> None:
        view = sessions[lang]
        error = view.locator(".turn-error")
        await expect(error).to_have_attribute("data-error-code", "worker_draining")
        await expect(error).to_contain_text(TEXT[lang]["draining_title"])
        await expect(view.locator(".banner-moving")).to_contain_text(TEXT[lang]["moving_banner"])
        await expect(view.locator(".session-badge")).to_contain_text(TEXT[lang]["moving"])
        await shoot(view, f"session-moving-{lang}.png")

    # Each waits on its own: the states last only as long as the hand-over.
    await asyncio.gather(
        row_moving("en"), row_moving("zh-CN"), worker_draining(), session_moving("en"), session_moving("zh-CN")
    )

    moved = page.locator(".notice-moved")
    await expect(moved).to_have_text(TEXT["en"]["moved_note"])
    assert await stopping == 0
    await expect(page.locator(".banner-moving")).to_be_hidden()
    await expect(page.locator(".session-badge")).not_to_contain_text(TEXT["en"]["moving"])
    await expect(page.locator(".conn")).to_have_attribute("data-state", "live")
    error = page.locator(".turn-error")  # the stopped turn stays explained, above the note
    await expect(error).to_contain_text(TEXT["en"]["draining_text"])
    await expect(error).not_to_contain_text("the worker was drained before the turn completed")  # not the internal English
    await expect(page.get_by_role("button", name=TEXT["en"]["retry"])).to_be_visible()
    assert await error.evaluate("(el, note) => !!(el.compareDocumentPosition(note) & Node.DOCUMENT_POSITION_FOLLOWING)",
                                await moved.element_handle())
    await shoot(page, "session-moved-en.png")
    await page.get_by_label("Language").select_option("zh-CN")
    await expect(moved).to_have_text(TEXT["zh-CN"]["moved_note"])
    await expect(error).to_contain_text(TEXT["zh-CN"]["draining_title"])
    await expect(error).to_contain_text(TEXT["zh-CN"]["draining_text"])
    await shoot(page, "session-moved-zh-CN.png")
    await page.get_by_label("语言").select_option("en")

    for view in rows.values():  # arrived: no longer moving
        row = view.locator(f'.session-row[data-session-id="{sid}"]')
        await expect(row).not_to_have_attribute("data-moving", "true")
        # Live, on the other worker. (Its status does not carry the stopped turn's error:
        # idle, though its stream said `turn_error`.)
        await expect(row).to_have_attribute("data-status", re.compile("^(idle|failed)$"))
    await expect(deployment.locator(".workers-table tbody tr")).to_have_count(1)  # the drained worker left
    await expect(deployment.locator('.workers-table tr[data-draining="true"]')).to_have_count(0)

    await send_from_page(page, "en", "#recall")  # the conversation goes on, on the other worker
    await expect(agent_says(page, "recall: remember OSPREY")).to_be_visible()
    await expect(moved).to_be_visible()
    await expect(error).to_have_count(0)  # the new turn supersedes the stopped one
    await expect(sessions["zh-CN"].locator(".notice-moved")).to_have_text(TEXT["zh-CN"]["moved_note"])
    await expect(sessions["zh-CN"].locator(".banner-moving")).to_be_hidden()
    for view in (*rows.values(), *sessions.values(), deployment):
        assert view.errors == []  # type: ignore[attr-defined]


async def test_resume_and_move_in_the_page_modules(harness: Harness, open_page: OpenPage) -> None:
    """The listing's `resumable` and the feed's `moving` through the row merge, the move in
    the transcript model, and a refused resume in words."""
    api = await harness.api()  # serves the page; no worker needed
    page = await open_page(api)
    result = await page.evaluate(
        """async () => {
        const { mergeRows } = await import("/static/js/live-rows.js");
        const { Transcript } = await import("/static/js/transcript.js");
        const { isResumable, resumeErrorText } = await import("/static/js/resume.js");
        const { isMoving, sessionStatus } = await import("/static/js/status.js");
        const flags = { clientCount: 0, hasActivePrompt: false, isWaitingForPermission: false,
                        isWaitingForUserQuestion: false };
        const persisted = (sid, extra) => ({ sessionId: sid, createdAt: "2026-01-01T00:00:00Z", clientCount: 0,
                                             hasActivePrompt: false, isArchived: false, ...extra });
        const listed = [
          persisted("old"), persisted("cannot", { resumable: false }), persisted("can", { resumable: true }),
          { sessionId: "live", createdAt: "2026-01-01T00:00:00Z", pendingInteractionCount: 0, moving: true, ...flags },
        ];
        const moving = mergeRows(listed, new Map([["live", { sessionId: "live", ...flags, moving: true }]]));
        const arrived = mergeRows(listed, new Map([["live", { sessionId: "live", ...flags }]]));
        const byId = (rows) => Object.fromEntries(rows.map((row) => [row.sessionId, row]));

        const model = new Transcript();
        model.applyAll([
          { type: "session_update", promptId: "p1", data: { update: { sessionUpdate: "user_message_chunk",
            content: { type: "text", text: "#slow 30" } } } },
          { type: "turn_error", promptId: "p1", data: { message: "the worker was drained before the turn completed",
            code: "worker_draining", promptId: "p1" } },
          { type: "session_moved", data: { sessionId: "s", reason: "worker_draining" } },
        ]);
        return {
          resumable: Object.fromEntries(listed.slice(0, 3).map((row) => [row.sessionId, isResumable(byId(moving)[row.sessionId])])),
          statuses: Object.fromEntries(moving.map((row) => [row.sessionId, sessionStatus(row)])),
          moving: [isMoving(byId(moving).live), isMoving(byId(arrived).live), isMoving(byId(mergeRows(listed, null)).live)],
          items: model.items.map((item) => item.kind === "error" ? ["error", item.code] : [item.kind, item.notice ?? item.role]),
          errors: [
            resumeErrorText({ status: 503, code: "no_worker_for_state_store", message: "x" }),
            resumeErrorText({ status: 409, code: "not_resumable", message: "x" }),
            resumeErrorText({ status: 503, code: "something_new", message: "it broke" }),
            resumeErrorText({ status: 0, message: "Failed to fetch" }),
          ],
        };
    }"""
    )
    assert result["resumable"] == {"old": True, "cannot": False, "can": True}  # absent: resumable
    assert result["statuses"] == {"old": "ended", "cannot": "ended", "can": "ended", "live": "idle"}
    # Moving while the feed says so; the listing's own flag counts only while the feed is down.
    assert result["moving"] == [True, False, True]
    assert result["items"] == [["message", "user"], ["error", "worker_draining"], ["notice", "moved"]]
    assert result["errors"] == [
        TEXT["en"]["no_store_worker"],
        "This session cannot be resumed: its agent cannot reload earlier sessions.",
        "Could not resume the session: it broke",
        "Could not reach the server; check the connection and retry.",
    ]
