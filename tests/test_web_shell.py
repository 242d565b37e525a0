"""The Web Shell in a real browser: Playwright drives Debian's Chromium (headless) against
real API and worker processes on a real Redis. No sleeps: Playwright's expectations wait.

Here: a session's page (a loop-stopped turn, in English and Chinese; permissions and
questions answered; an interrupted stream; the transcript model) and the workspace view's
order. The live feed and the deployment view are in tests/test_web_shell_feeds.py, resume
and drain in tests/test_web_shell_moves.py; what they share in tests/web_shell_helpers.py.
Screenshots go to artifacts/screenshots/ at the repository root.
"""

from __future__ import annotations

import re

import pytest

from acp_state.turn_errors import LOOP_DETECTED_MESSAGE
from tests.harness import Harness
from tests.helpers import create, prompt
from tests.web_shell_helpers import (  # noqa: F401  (browser, open_page: fixtures, each module's own)
    TEXT, OpenPage, agent_says, browser, expect, open_page, send_from_page, shoot,
)


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
