"""The reference's official TypeScript SDK (`@qwen-code/sdk` 0.1.14, `DaemonClient`), unchanged,
drives acp-state: two workers hosting the real `qwen --acp` (the scripted model endpoint behind
it), two API processes, and tests/node/sdk_test.mjs as the client. Halfway, API A is SIGKILLed while the
script holds an event stream on it; the script resumes the stream on API B.

The script prints one JSON line per step; on failure this test shows them all. Skipped, with
the reason, when node, the SDK (tests/node: `npm install`) or qwen is missing.

The same script is also run against the reference daemon itself (`qwen serve`, given as both
A and B, no failover), so what it expects is what the reference does.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path
from typing import Awaitable, Callable, Iterator

import pytest

from testbed.model_endpoint import ModelEndpoint
from testbed.qwen import find_qwen, qwen_env
from tests.harness import Harness

pytestmark = pytest.mark.qwen

NODE_DIR = Path(__file__).resolve().parent / "node"
SCRIPT = NODE_DIR / "sdk_test.mjs"
SDK = NODE_DIR / "node_modules" / "@qwen-code" / "sdk" / "package.json"
NODE = shutil.which("node")
QWEN = find_qwen()
RUN_TIMEOUT_S = 420  # the whole script: four qwen turns with tools, two session starts
EVENT_TIMEOUT_MS = 90_000


@pytest.fixture
def tools() -> tuple[str, str]:
    if NODE is None:
        pytest.skip("node is not installed: the SDK test runs tests/node/sdk_test.mjs")
    if not SDK.exists():
        pytest.skip("@qwen-code/sdk is not installed: npm install --prefix tests/node")
    if QWEN is None:
        pytest.skip("qwen is not installed: npm install --prefix tests/node (@qwen-code/qwen-code@0.24.4)")
    return NODE, QWEN


@pytest.fixture
def fake_llm() -> Iterator[ModelEndpoint]:
    with ModelEndpoint() as fake:
        yield fake


async def run_script(
    node: str, env: dict[str, str], log: list[str], kill_api_a: Callable[[], Awaitable[None]] | None = None
) -> tuple[int, str]:
    """Run the script; when it asks (`{"control":"kill-api-a"}`), call `kill_api_a` and say so
    on its stdin. Returns its exit code and stderr; every stdout line goes to `log` as it comes."""
    proc = await asyncio.create_subprocess_exec(
        node, str(SCRIPT), env=env, cwd=str(NODE_DIR),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    stderr_task = asyncio.ensure_future(proc.stderr.read())

    async def follow() -> None:
        assert proc.stdin is not None and proc.stdout is not None
        async for raw in proc.stdout:
            line = raw.decode().rstrip("\n")
            log.append(line)
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if isinstance(message, dict) and message.get("control") == "kill-api-a":
                assert kill_api_a is not None, "the script asked for a failover this run has no API to kill for"
                await kill_api_a()
                proc.stdin.write(b"killed\n")
                await proc.stdin.drain()

    try:
        await asyncio.wait_for(follow(), RUN_TIMEOUT_S)
        code = await asyncio.wait_for(proc.wait(), 30)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        code = -1
        log.append(f"(the script did not finish within {RUN_TIMEOUT_S} s and was killed)")
    return code, (await stderr_task).decode()


def script_env(api_a: str, api_b: str, workspace: str, **extra: str) -> dict[str, str]:
    env = {
        **os.environ,
        "ACP_SDK_API_A": api_a,
        "ACP_SDK_API_B": api_b,
        "ACP_SDK_CWD": workspace,
        "ACP_SDK_TIMEOUT_MS": str(EVENT_TIMEOUT_MS),
        **extra,
    }
    env.pop("QWEN_SERVER_TOKEN", None)  # the SDK would send it as a bearer token
    return env


def assert_passed(code: int, log: list[str], stderr: str) -> None:
    failed = []
    for line in log:
        try:
            step = json.loads(line)
        except ValueError:
            continue
        if isinstance(step, dict) and step.get("ok") is False:
            failed.append(f"{step['step']}: {step['error'].get('message')}")
    report = "\n".join(log) + (f"\n--- stderr ---\n{stderr[-4000:]}" if stderr.strip() else "")
    assert code == 0 and log, (
        f"sdk_test.mjs exited {code}; failed steps:\n  " + "\n  ".join(failed) + f"\n--- output ---\n{report}"
    )


async def test_the_reference_sdk_drives_acp_state(
    tools: tuple[str, str], fake_llm: ModelEndpoint, harness: Harness, workspace: str, tmp_path: Path
) -> None:
    node, qwen = tools
    # `fake_llm` comes before `harness`, so it outlives the workers and their qwen children.
    for n in range(2):
        scratch = tmp_path / f"qwen-tmp-{n}"  # qwen leaves qwen-socks-* folders in its temp dir
        scratch.mkdir()
        env = qwen_env(tmp_path / f"home-{n}", fake_llm.openai_url)
        env["TMPDIR"] = str(scratch)
        await harness.worker(
            "--agent", f"{qwen} --acp", "--session-mode", "default",
            "--agent-stderr", str(tmp_path / f"qwen-stderr-{n}.log"),
            env=env,
        )
    api_a = await harness.api()
    api_b = await harness.api()

    env = script_env(f"http://127.0.0.1:{api_a.port}", f"http://127.0.0.1:{api_b.port}", workspace)
    log: list[str] = []
    code, stderr = await run_script(node, env, log, kill_api_a=api_a.kill9)
    assert_passed(code, log, stderr)


async def test_the_script_passes_against_the_reference(
    tools: tuple[str, str], fake_llm: ModelEndpoint, workspace: str, tmp_path: Path
) -> None:
    """The reference daemon (`qwen serve`) passes every step but the failover (one daemon:
    nothing to kill), so the script asks nothing of acp-state that the reference does not do."""
    node, qwen = tools
    env = qwen_env(tmp_path / "home", fake_llm.openai_url)
    scratch = tmp_path / "qwen-tmp"
    scratch.mkdir()
    env["TMPDIR"] = str(scratch)
    env.pop("QWEN_SERVER_TOKEN", None)
    serve = await asyncio.create_subprocess_exec(
        qwen, "serve", "--port", "0", "--workspace", workspace, "--no-web",
        env=env, cwd=workspace, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )
    assert serve.stdout is not None
    serve_log = tmp_path / "qwen-serve.log"
    copy: asyncio.Future[None] | None = None
    try:
        base = await asyncio.wait_for(listening_url(serve.stdout, serve_log), 60)
        copy = asyncio.ensure_future(copy_rest(serve.stdout, serve_log))
        log: list[str] = []
        code, stderr = await run_script(node, script_env(base, base, workspace, ACP_SDK_FAILOVER="none"), log)
        assert_passed(code, log, stderr)
    finally:
        serve.terminate()
        try:
            await asyncio.wait_for(serve.wait(), 20)
        except asyncio.TimeoutError:
            serve.kill()
            await serve.wait()
        if copy is not None:
            await asyncio.gather(copy, return_exceptions=True)


async def listening_url(stream: asyncio.StreamReader, log_path: Path) -> str:
    """The base URL from the reference's `qwen serve listening on http://…` line."""
    with open(log_path, "ab") as log:
        async for raw in stream:
            log.write(raw)
            line = raw.decode(errors="replace")
            if "listening on http://" in line:
                return line.split("listening on ", 1)[1].split()[0]
    raise AssertionError(f"qwen serve exited before listening; see {log_path}:\n{log_path.read_text()[-3000:]}")


async def copy_rest(stream: asyncio.StreamReader, log_path: Path) -> None:
    """Keep draining the daemon's output (a full pipe would stall it) into its log."""
    with open(log_path, "ab") as log:
        async for raw in stream:
            log.write(raw)
