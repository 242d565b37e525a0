"""The reference's own Web Shell served by acp-state, in Chromium, inside a session (issue 39
item 3, the steps after the list and New task of tests/test_reference_web_shell_browser.py):
two API processes and two workers with the scripted agent on a real Redis, the page on one
API process and the test's own calls on the other.

A permission is approved and a question answered on the page's cards; `loop_detected` is
shown in the page's words, in English and in Chinese; a reload with a pending permission
and one after a turn error keep the transcript's times and its state; the approval mode
changes from the composer; the context meter, Settings and Plugins open without an error;
one viewer counts as one client after switching sessions. Screenshots:
artifacts/screenshots/reference-*.png.
"""

from __future__ import annotations

import re

from playwright.async_api import Page

from testbed.processes import ApiProcess
from tests.harness import Harness
from tests.helpers import create, eventually, prompt, status
from tests.web_shell_helpers import (  # noqa: F401  (browser, open_page: fixtures, each module's own)
    OpenPage,
    browser,
    expect,
    needs_reference_shell,
    open_page,
    reference_deployment,
    send_from_reference_page,
    shoot,
)

pytestmark = needs_reference_shell

# The scripted agent offers three of the reference's approval modes and reports how full its
# context window is after each turn.
AGENT_ENV = {"ACP_SCRIPTED_MODES": "default,plan,yolo", "ACP_SCRIPTED_CONTEXT_SIZE": "32000"}
# The page's words (its catalogue, web-shell/assets/index-*.js).
LOOP_DETECTED = {
    "en": "The model got stuck while using tools or reached a safety limit",
    "zh-CN": "模型在调用工具时反复尝试或达到了安全上限",
}
TIME = re.compile(r"^\d\d:\d\d(:\d\d)?$")
HTTP_ERROR = re.compile(r"HTTP \d{3}")


def permission_panel(page: Page):
    return page.locator("[data-web-shell-permission-panel]")


def assistant_says(page: Page, text: str):
    return page.locator('[data-markdown-source="assistant"]', has_text=text)


def times(page: Page):
    """The times the transcript shows (a message's, a turn's end)."""
    return page.locator("[data-web-shell-message-list]").get_by_text(TIME)


async def assert_times_kept(page: Page, before: list[str]) -> None:
    """The transcript shows the times it showed before a reload. The page stamps a live
    message with when it arrived and a reloaded one with the server's time of it, a few
    milliseconds earlier, which may fall in the second before: within a second is the same."""
    await expect(times(page)).to_have_count(len(before))
    after = await times(page).all_inner_texts()

    def seconds(text: str) -> int:
        parts = [int(part) for part in text.split(":")]
        return parts[0] * 3600 + parts[1] * 60 + (parts[2] if len(parts) > 2 else 0)

    slack = 1 if all(text.count(":") == 2 for text in before) else 60
    assert all(abs(seconds(a) - seconds(b)) <= slack for a, b in zip(after, before)), (before, after)


async def new_session(api: ApiProcess, workspace: str) -> str:
    """A session as the page makes them (its source), its creator detached: the page is then
    its only client."""
    created = await create(api, workspace, sourceType="default", sessionScope="thread")
    left = await api.client.post(f"/session/{created['sessionId']}/detach", headers={"X-Qwen-Client-Id": created["clientId"]})
    assert left.status_code == 204, left.text
    return created["sessionId"]


async def test_cards_the_loop_and_the_controls_on_the_reference_page(
    harness: Harness, workspace: str, open_page: OpenPage
) -> None:
    events = await harness.events()
    api, other = await reference_deployment(harness, AGENT_ENV)
    sid = await new_session(other, workspace)
    page = await open_page(api, "en-US", f"/session/{sid}")

    # A permission, approved on its card.
    await send_from_reference_page(page, "#permission")
    await expect(permission_panel(page)).to_be_visible()
    assert (await status(other, sid))["isWaitingForPermission"] is True
    await shoot(page, "reference-permission.png")
    await permission_panel(page).locator('[data-option-id="proceed_once"]').click()
    await expect(assistant_says(page, "permission granted: proceed_once")).to_be_visible()
    await expect(permission_panel(page)).to_have_count(0)

    # A question (the agent's ask_user_question), answered on its card.
    await send_from_reference_page(page, "#question")
    await expect(page.get_by_text("Which color?")).to_be_visible()
    await shoot(page, "reference-question.png")
    await page.locator("[data-web-shell-ask-option]", has_text="Blue").click()
    await page.get_by_role("button", name="Submit").click()
    await expect(assistant_says(page, 'answers: {"0":"Blue"}')).to_be_visible()

    # A looping turn is stopped (loop_detected), explained in the page's words.
    await send_from_reference_page(page, "#loop")
    await expect(page.get_by_text(LOOP_DETECTED["en"])).to_be_visible()
    assert (await status(other, sid))["hasActivePrompt"] is False
    await shoot(page, "reference-loop-detected-en.png")

    # The approval mode, switched from the composer: the agent's session mode.
    await page.get_by_role("button", name="Approval mode").click()
    await page.get_by_text("Full Access (yolo)").click()
    await events.wait_type(sid, "approval_mode_changed", next="yolo")
    assert (await status(other, sid))["approvalMode"] == "yolo"
    await expect(page.get_by_role("button", name="Approval mode")).to_contain_text("Full Access")
    await shoot(page, "reference-approval-mode.png")

    # The context meter: what the agent reported after its last turn (1000 tokens a turn).
    await page.get_by_role("button", name="Context Usage").click()
    await expect(page.get_by_text("/ 32.0k tokens")).to_be_visible()
    await shoot(page, "reference-context-usage.png")

    # Settings and Plugins open empty, with no error (they answered 404 before: red toasts).
    await page.get_by_role("button", name="Settings").click()
    await expect(page.get_by_text("Chat width")).to_be_visible()
    await shoot(page, "reference-settings.png")
    await page.get_by_role("button", name="Plugins").click()
    await expect(page.get_by_text("No extensions installed.")).to_be_visible()
    await shoot(page, "reference-plugins.png")
    await expect(page.get_by_text(HTTP_ERROR)).to_have_count(0)
    assert page.errors == []  # type: ignore[attr-defined]


async def test_loop_detected_in_chinese(harness: Harness, workspace: str, open_page: OpenPage) -> None:
    api, other = await reference_deployment(harness, AGENT_ENV)
    sid = await new_session(other, workspace)
    page = await open_page(api, "zh-CN", f"/session/{sid}")
    await send_from_reference_page(page, "#loop")
    await expect(page.get_by_text(LOOP_DETECTED["zh-CN"])).to_be_visible()
    await shoot(page, "reference-loop-detected-zh-CN.png")


async def test_reloads_keep_a_pending_permission_and_a_turn_error(
    harness: Harness, workspace: str, open_page: OpenPage
) -> None:
    events = await harness.events()
    api, other = await reference_deployment(harness, AGENT_ENV)
    sid = await new_session(other, workspace)
    page = await open_page(api, "en-US", f"/session/{sid}")
    # A turn before, three seconds long: its prompt's time is at least that long before the
    # reloads (a page that showed a reloaded message at the reload's time would differ).
    said = await prompt(other, sid, "#slow 3")
    await events.wait_type(sid, "turn_complete", promptId=said["promptId"])
    await expect(assistant_says(page, "tick 1")).to_be_visible()

    # Reload while a permission waits: the card is still there, the times unchanged, and
    # the answer given after the reload ends the turn.
    asked = await prompt(other, sid, "#permission")
    await expect(permission_panel(page)).to_be_visible()
    before = await times(page).all_inner_texts()
    await page.reload()
    await expect(permission_panel(page)).to_be_visible()
    await assert_times_kept(page, before)
    await shoot(page, "reference-reload-pending-permission.png")
    await permission_panel(page).locator('[data-option-id="proceed_once"]').click()
    await events.wait_type(sid, "turn_complete", promptId=asked["promptId"])
    await expect(assistant_says(page, "permission granted: proceed_once")).to_be_visible()

    # Reload after a turn error: the error is still explained, the times unchanged.
    failed = await prompt(other, sid, "#fail")
    await events.wait_type(sid, "turn_error", promptId=failed["promptId"])
    await expect(page.get_by_text("scripted failure")).to_be_visible()
    before = await times(page).all_inner_texts()
    await page.reload()
    await expect(page.get_by_text("scripted failure")).to_be_visible()
    await expect(assistant_says(page, "permission granted: proceed_once")).to_be_visible()
    await assert_times_kept(page, before)
    assert (await status(other, sid))["hasTurnError"] is True
    await shoot(page, "reference-reload-turn-error.png")


async def test_one_viewer_is_one_client_after_switching_sessions(
    harness: Harness, workspace: str, open_page: OpenPage
) -> None:
    events = await harness.events()
    api, other = await reference_deployment(harness, AGENT_ENV)
    first, second = await new_session(other, workspace), await new_session(other, workspace)
    for sid, title in ((first, "first session"), (second, "second session")):
        said = await prompt(other, sid, title)
        await events.wait_type(sid, "turn_complete", promptId=said["promptId"])
    page = await open_page(api, "en-US", f"/session/{first}")
    await expect(assistant_says(page, "first session")).to_be_visible()

    row = page.locator("[data-web-shell-session-title]", has_text="first session")
    for title in ("second session", "first session", "second session", "first session"):
        await page.locator("[data-web-shell-session-title]", has_text=title).click()
        await expect(assistant_says(page, title)).to_be_visible()
    # The page left each session it switched away from (detach): one viewer, one client.
    await eventually(lambda: _clients_are(other, {first: 1, second: 0}), "one client on the open session, none on the other")
    await row.hover()
    await expect(page.get_by_text("1 client(s)")).to_be_visible()
    await shoot(page, "reference-one-viewer.png")


async def _clients_are(api: ApiProcess, counts: dict[str, int]) -> bool:
    seen = {sid: (await status(api, sid))["clientCount"] for sid in counts}
    return seen == counts
