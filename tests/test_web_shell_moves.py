"""The Web Shell in a real browser (see tests/test_web_shell.py): conversations outlive their
worker. A persisted session's Resume (a refusal said under its row; a session that is not
live opened read-only), and a drain (the workspace and the session while the session moves,
the deployment view's draining worker, the moved session), with screenshots in English and
Chinese.
"""

from __future__ import annotations

import asyncio
import re
import shlex
import sys

from tests.harness import Harness
from tests.helpers import create, prompt, status
from tests.web_shell_helpers import (  # noqa: F401  (browser, open_page: fixtures, each module's own)
    TEXT, OpenPage, agent_says, browser, expect, open_page, send_from_page, shoot,
)


LEASE_MS = "1500"  # a killed worker's sessions are swept (and listed as persisted) within it


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
    # Outlives the drain's grace: the drain stops it. `flush`: the agent says a last word of
    # the turn after the drain ended it, which must not take the error's place.
    await send_from_page(page, "en", "#slow 30 flush")
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

    # Loaded again (a new tab; a stream that resumed past a gap reloads the same way), the
    # session still explains the stopped turn: the drain keeps its turn_error for the
    # reload's refresh-append. (It did not: a page that reloaded during the move lost it.)
    reloaded = await open_page(api, "en-US", f"/#/session/{sid}")
    await expect(reloaded.locator(".conn")).to_have_attribute("data-state", "live")
    await expect(reloaded.locator(".turn-error")).to_have_attribute("data-error-code", "worker_draining")
    await expect(reloaded.locator(".turn-error")).to_contain_text(TEXT["en"]["draining_text"])

    await send_from_page(page, "en", "#recall")  # the conversation goes on, on the other worker
    await expect(agent_says(page, "recall: remember OSPREY")).to_be_visible()
    await expect(moved).to_be_visible()
    await expect(error).to_have_count(0)  # the new turn supersedes the stopped one
    await expect(sessions["zh-CN"].locator(".notice-moved")).to_have_text(TEXT["zh-CN"]["moved_note"])
    await expect(sessions["zh-CN"].locator(".banner-moving")).to_be_hidden()
    for view in (*rows.values(), *sessions.values(), deployment, reloaded):
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
