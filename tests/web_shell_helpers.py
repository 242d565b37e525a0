"""What the Web Shell's browser tests share (tests/test_web_shell*.py): Debian's Chromium,
headless (the fixture `browser`, one per module that imports it), pages opened on an API in
a fresh context each (`open_page`), the words the page says per language (`TEXT`),
screenshots (`shoot`), and the page's composer and agent messages. tests/conftest.py runs
the modules that use these fixtures on one runner. Playwright's names come from here,
behind the check that it is installed.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import AsyncIterator, Awaitable, Callable

import pytest

try:
    from playwright.async_api import Browser, Page, async_playwright, expect
except ImportError:  # pragma: no cover - scripts/test installs it
    pytest.fail("playwright is not installed (scripts/test installs the test extra)", pytrace=False)

from testbed.processes import ApiProcess
from tests.harness import Harness

ROOT = Path(__file__).resolve().parent.parent
# The reference's own Web Shell (`@qwen-code/qwen-code` 0.24.4's build), which
# tests/test_reference_web_shell*.py serve with `acp-state api --web-shell`.
REFERENCE_SHELL = ROOT / "tests" / "node" / "node_modules" / "@qwen-code" / "qwen-code" / "web-shell"
needs_reference_shell = pytest.mark.skipif(not (REFERENCE_SHELL / "index.html").is_file(),
                                           reason="npm install --prefix tests/node (scripts/test) installs the reference")
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
        # resume and drain (tests/test_web_shell_moves.py)
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
        # resume and drain (tests/test_web_shell_moves.py)
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
    },
}

expect.set_options(timeout=TIMEOUT_MS)


@pytest.fixture(scope="module")
async def browser() -> AsyncIterator[Browser]:
    """A browser for the module that imports this fixture (each gets its own): Debian's
    Chromium, never a downloaded one; --no-sandbox for containers run as root."""
    if not Path(CHROMIUM).exists():
        pytest.fail("chromium is not installed (scripts/test installs it)", pytrace=False)
    async with async_playwright() as playwright:
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
        # What the page could not load (a module script that fails leaves the page its bare
        # HTML, with no pageerror), printed as it happens: a failing test's output shows it.
        name = f"page-{len(contexts) - 1} ({locale} {path})"
        page.on("requestfailed", lambda r: print(f"{name}: failed {r.method} {r.url}: {r.failure}"))
        page.on("response", lambda r: r.status >= 400 and print(f"{name}: {r.status} {r.request.method} {r.url}"))
        page.on("console", lambda m: m.type == "error" and print(f"{name}: console: {m.text}"))
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


# -- the reference's Web Shell ---------------------------------------------------------------


async def reference_deployment(harness: Harness, env: dict[str, str] | None = None) -> tuple[ApiProcess, ApiProcess]:
    """Two workers (their scripted agents with `env`) and two API processes serving the
    reference's Web Shell, on the harness's Redis."""
    for _ in range(2):
        await harness.worker(env=env)
    return (await harness.api("--web-shell", str(REFERENCE_SHELL)), await harness.api("--web-shell", str(REFERENCE_SHELL)))


def reference_composer(page: Page):
    """The reference page's composer (a contenteditable textbox)."""
    return page.get_by_role("textbox").and_(page.locator("[contenteditable=true]")).first


async def send_from_reference_page(page: Page, text: str) -> None:
    await reference_composer(page).click()
    await page.keyboard.type(text)
    await page.keyboard.press("Enter")
