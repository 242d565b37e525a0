"""The reference's own Web Shell (`@qwen-code/qwen-code` 0.24.4's `web-shell/`), served by
acp-state (`acp-state api --web-shell`), in Chromium (issue 39 item 3, its first steps):
two API processes and two workers on a real Redis. The session list loads (it asked for
`size=1000` and was answered 400), New task creates a session (its create sends
`sourceType`, which needs `session_source_metadata`) and sends its prompt, the answer
streams, and a page load of the session's URL shows its transcript again. The page's CSP
reports no violation. Screenshots: artifacts/screenshots/reference-*.png.
"""

from __future__ import annotations

import re

from playwright.async_api import Page

from tests.harness import Harness
from tests.helpers import create, prompt
from tests.web_shell_helpers import (  # noqa: F401  (browser, open_page: fixtures, each module's own)
    REFERENCE_SHELL as WEB_SHELL,
    OpenPage,
    browser,
    expect,
    needs_reference_shell,
    open_page,
    reference_composer as composer,
    shoot,
)

SESSION_URL = re.compile(r"/session/([0-9a-f-]{36})$")

pytestmark = needs_reference_shell

# Every violation of the page's CSP, as the browser reports it to the page (an init script
# runs before the page's own and is not subject to its policy).
WATCH_CSP = """
window.__cspViolations = [];
document.addEventListener('securitypolicyviolation', (e) => {
  window.__cspViolations.push(e.violatedDirective + ' ' + (e.blockedURI || 'inline') + ' ' + (e.sourceFile || ''));
});
"""


async def test_the_reference_shell_lists_sessions_and_runs_a_new_task(
    harness: Harness, workspace: str, open_page: OpenPage
) -> None:
    events = await harness.events()
    await harness.worker()
    await harness.worker()
    api = await harness.api("--web-shell", str(WEB_SHELL))
    other = await harness.api("--web-shell", str(WEB_SHELL))
    # A session made elsewhere (the other API process) before the page opens, with a title.
    before = (await create(other, workspace))["sessionId"]
    said = await prompt(other, before, "listed before the page opened")
    await events.wait_type(before, "turn_complete", promptId=said["promptId"])

    console: list[str] = []

    async def watch(page: Page) -> None:
        await page.add_init_script(WATCH_CSP)
        page.on("console", lambda message: console.append(message.text))

    page = await open_page(api, "en-US", "/", prepare=watch)
    # The session list loads: the session is there, and no error in its place.
    listed = page.locator("[data-web-shell-session-title]", has_text="listed before the page opened")
    await expect(listed).to_be_visible()
    await expect(page.get_by_text("Failed to load sessions")).to_have_count(0)
    await shoot(page, "reference-session-list.png")

    # New task: the composer's first message creates a session and sends it.
    await composer(page).click()
    await page.keyboard.type("hello from the reference shell")
    await page.keyboard.press("Enter")
    await expect(page).to_have_url(SESSION_URL)
    match = SESSION_URL.search(page.url)
    assert match is not None
    sid = match[1]
    answer = page.locator('[data-markdown-source="assistant"]', has_text="hello from the reference shell")
    await expect(answer).to_be_visible()  # the scripted agent's echo, streamed to the page
    await expect(page.locator("[data-web-shell-user-bubble]", has_text="hello from the reference shell")).to_be_visible()
    await shoot(page, "reference-new-task.png")

    # The session is a real one of the deployment, with the source the page gave it; the
    # other API process lists it so.
    listing = await other.client.get(f"/workspace/{workspace.replace('/', '%2F')}/sessions", params={"size": "1000"})
    rows = {row["sessionId"]: row for row in listing.json()["sessions"]}
    assert rows[sid]["sourceType"] == "default" and rows[sid]["displayName"] == "hello from the reference shell"

    # A page load of the session's URL (a reload, a shared link) gets the shell again, and the
    # transcript comes back from the load.
    await page.reload()
    await expect(page.locator('[data-markdown-source="assistant"]', has_text="hello from the reference shell")).to_be_visible()
    await expect(page.locator("[data-web-shell-user-bubble]", has_text="hello from the reference shell")).to_be_visible()

    # An answer with math, code and a diagram renders whole under the CSP: KaTeX, the code
    # highlighter (its WebAssembly engine), mermaid's SVG.
    rich = await prompt(other, sid, "Math $x^2$ here.\n\n```python\nprint('hi')\n```\n\n```mermaid\ngraph TD; A-->B;\n```\n")
    await events.wait_type(sid, "turn_complete", promptId=rich["promptId"])
    await expect(page.locator('[data-markdown-source="assistant"] .katex').first).to_be_visible()
    await expect(page.locator('[data-markdown-source="assistant"] pre span[style*="color"]').first).to_be_visible()
    await expect(page.locator('[data-markdown-source="assistant"] svg', has_text="A").first).to_be_visible()
    await shoot(page, "reference-rich-answer.png")

    # The one report is zod's probe of whether eval is allowed (`new Function("")` in a
    # try): it catches the refusal and parses without eval, which this CSP withholds.
    violations = await page.evaluate("window.__cspViolations")
    assert all(re.fullmatch(r"script-src eval \S+/assets/index-[\w-]+\.js", v) for v in violations), violations
    assert not [text for text in console if "Content Security Policy" in text], console
    assert page.errors == []  # type: ignore[attr-defined]


def clock_s(text: str) -> int:
    """Seconds into the day of a time the page shows (`HH:MM` or `HH:MM:SS`)."""
    parts = [int(part) for part in text.split(":")] + [0]
    return parts[0] * 3600 + parts[1] * 60 + parts[2]


async def test_a_reloaded_transcript_keeps_its_times(harness: Harness, workspace: str, open_page: OpenPage) -> None:
    """A load's replayed entries carry their times (`_meta.serverTimestamp`), as the
    reference's do: a reload showed every message at the reload's time."""
    events = await harness.events()
    await harness.worker()
    api = await harness.api("--web-shell", str(WEB_SHELL))
    sid = (await create(api, workspace, sourceType="default"))["sessionId"]
    page = await open_page(api, "en-US", f"/session/{sid}")  # a page load of the session's URL
    turn = await prompt(api, sid, "#slow 2")  # the scripted agent's answer takes two seconds
    await events.wait_type(sid, "turn_complete", promptId=turn["promptId"])
    times = page.locator("[data-web-shell-message-list]").get_by_text(re.compile(r"^\d\d:\d\d(:\d\d)?$"))
    await expect(page.locator('[data-markdown-source="assistant"]', has_text="tick 1")).to_be_visible()
    await expect(times).to_have_count(2)  # the prompt's time, and the answer's when it ended
    live = await times.all_inner_texts()

    await page.reload()
    await expect(page.locator('[data-markdown-source="assistant"]', has_text="tick 1")).to_be_visible()
    await expect(times).to_have_count(2)
    reloaded = await times.all_inner_texts()
    # Each replayed entry shows its own time on the server: the prompt's and the answer's, two
    # seconds apart (stamped with the reload's time, both would read the same).
    assert reloaded[0] != reloaded[1], reloaded
    # A live entry shows when the page got it, which a loaded machine delays, and the server
    # stamped it before: never later, and within the second where the page was prompt.
    assert all(clock_s(r) <= clock_s(l) + 1 for r, l in zip(reloaded, live, strict=True)), (reloaded, live)
    await shoot(page, "reference-reloaded-times.png")
