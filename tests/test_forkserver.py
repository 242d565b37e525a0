"""The fork server the suite starts its processes from (testbed/forkserver.py) gives each one
what an exec'd `python -m acp_state.cli` has: its own pid, environment, output and exit code."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import httpx
import pytest

from acp_state.ids import workspace_id
from testbed import forkserver
from testbed.redis_server import RedisServer, free_port

ROOT = str(Path(__file__).resolve().parent.parent)


@pytest.fixture(autouse=True)
def forked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(forkserver.ENABLED_BY, "1")


async def test_a_forked_api_serves_from_its_cwd_and_environment_then_exits_0_on_sigterm(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """Its workspace is the working directory given (the default `--workspace .`) and its
    server the one its environment names, not the fork server's."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": ROOT, "ACP_STATE_SERVER": "uvicorn"}
    api = await forkserver.start(
        ["api", "--redis-url", redis_server.url, "--port", str(port)],
        env=env, cwd=str(tmp_path), stdout=forkserver.PIPE, stderr=forkserver.PIPE,
    )
    assert isinstance(api, forkserver.Child) and api.pid != os.getpid()
    banner = await asyncio.wait_for(api.stdout.readline(), 60)  # type: ignore[union-attr]
    assert banner.decode().strip() == f"acp-state api listening on http://127.0.0.1:{port} (uvicorn)"
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
        listed = await client.get(f"/workspace/{workspace_id(str(tmp_path))}/sessions")
    assert listed.status_code == 200 and listed.json()["sessions"] == []
    api.terminate()
    assert await asyncio.wait_for(api.wait(), 30) == 0


async def test_a_usage_error_exits_2_with_its_words_in_the_log(tmp_path: Path) -> None:
    """A usage error: exit code 2, and argparse's words in the log file given."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    with open(tmp_path / "usage.log", "ab") as stderr:
        child = await forkserver.start(["worker", "--max-sessions", "many"], env=env, cwd=str(tmp_path),
                                       stdout=forkserver.PIPE, stderr=stderr)
    assert await asyncio.wait_for(child.wait(), 30) == 2
    assert "invalid int value: 'many'" in (tmp_path / "usage.log").read_text()


async def test_a_killed_child_reports_the_signal(redis_server: RedisServer, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": ROOT}
    worker = await forkserver.start(["worker", "--redis-url", redis_server.url], env=env, cwd=ROOT,
                                    stdout=forkserver.PIPE, stderr=forkserver.PIPE)
    assert b"acp-state worker " in await asyncio.wait_for(worker.stdout.readline(), 60)  # type: ignore[union-attr]
    worker.kill()
    assert await asyncio.wait_for(worker.wait(), 30) == -signal.SIGKILL


async def test_a_prefixed_process_is_execd(tmp_path: Path) -> None:
    """Through a prefix (a host's `ip netns exec`), a fork would stay in this namespace."""
    process = await forkserver.start(["--help"], prefix=["env"], env={**os.environ, "PYTHONPATH": ROOT}, cwd=ROOT,
                                     stdout=forkserver.PIPE, stderr=forkserver.PIPE)
    assert isinstance(process, asyncio.subprocess.Process)
    assert b"usage: acp-state" in await process.stdout.read()  # type: ignore[union-attr]
    assert await process.wait() == 0
