"""Agent children, and whatever they started, die with their worker: even a worker killed
with SIGKILL, even an agent that ignores stdin EOF and SIGTERM (worker/reaper.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from testbed.processes import ROOT
from tests.harness import Harness
from tests.helpers import proc_stat

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")

GONE_TIMEOUT_S = 15  # the reaper's 2 s grace, with room for a slow machine

# An ACP agent that outlives stdin EOF and SIGTERM, with a grandchild that does too. An
# ignored signal stays ignored across fork and exec, so both children ignore SIGTERM as well.
STUBBORN_AGENT = """
import signal, subprocess, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)
subprocess.Popen([sys.executable, "-c", "import signal\\nwhile True: signal.pause()"],
                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
subprocess.Popen([sys.executable, "-m", "acp_state.testing.scripted_agent"]).wait()  # ACP on our stdio
while True:
    signal.pause()
"""


def _alive(pid: int) -> bool:
    stat = proc_stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")  # a zombie has ended: only its entry is left


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except (FileNotFoundError, ProcessLookupError):
        return ""


def _children(pid: int, marker: str) -> list[int]:
    return [p for p in _pids() if (s := proc_stat(p)) and s[1] == pid and marker in _cmdline(p)]


def _group(pgid: int) -> set[int]:
    return {p for p in _pids() if (s := proc_stat(p)) and s[2] == pgid and _alive(p)}


async def _all_gone(pids: set[int], timeout: float = GONE_TIMEOUT_S) -> set[int]:
    """Wait until none of `pids` lives (a process's end in another tree is not an event we
    can await: poll /proc, bounded); returns the ones still alive at the deadline."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while (left := {p for p in pids if _alive(p)}) and loop.time() < deadline:
        await asyncio.sleep(0.05)
    return left


def _ignores_sigterm(pid: int) -> bool:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGTERM - 1)))
    return False


async def _create_session(harness: Harness, workspace: str) -> None:
    api = await harness.api()
    response = await api.client.post("/session", json={"cwd": workspace, "sessionScope": "thread"})
    assert response.status_code == 200, response.text




async def test_a_killed_workers_stubborn_agent_and_grandchildren_die(
    own_harness: Harness, workspace: str, tmp_path: Path
) -> None:
    script = tmp_path / "stubborn_agent.py"
    script.write_text(STUBBORN_AGENT)
    worker = await own_harness.worker("--agent", f"{sys.executable} {script}")
    await _create_session(own_harness, workspace)

    (agent,) = _children(worker.pid, str(script))
    group = _group(agent)  # its own group: the wrapper, its stubborn child, the scripted agent
    assert len(group) == 3, [_cmdline(p) for p in group]
    (reaper,) = _children(worker.pid, "reaper.py")
    assert os.getsid(reaper) == reaper != os.getsid(worker.pid)  # out of the worker's session and group

    await worker.kill9()
    left = await _all_gone(group | {reaper})
    assert not left, [_cmdline(p) for p in left]


# An ACP agent that starts a daemon in a session of its own (as Cline starts its hub): out of
# the agent's process group, so no group signal reaches it. The daemon writes its pid down.
DAEMONIZING_AGENT = """
import os, subprocess, sys
daemon = "import os, signal, sys\\nopen(sys.argv[1], 'w').write(str(os.getpid()))\\nwhile True: signal.pause()"
subprocess.Popen([sys.executable, "-c", daemon, sys.argv[1]], start_new_session=True,
                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
os.execv(sys.executable, [sys.executable, "-m", "acp_state.testing.scripted_agent"])  # ACP on our stdio
"""


async def _daemon_of(harness: Harness, workspace: str, tmp_path: Path) -> tuple[object, int]:
    script, pid_file = tmp_path / "daemonizing_agent.py", tmp_path / "daemon.pid"
    script.write_text(DAEMONIZING_AGENT)
    worker = await harness.worker("--agent", f"{sys.executable} {script} {pid_file}")
    await _create_session(harness, workspace)
    while not pid_file.exists() or not pid_file.read_text():  # written at the daemon's start
        await asyncio.sleep(0.02)
    daemon = int(pid_file.read_text())
    assert _alive(daemon) and os.getsid(daemon) == daemon  # out of the agent's group and session
    return worker, daemon


async def test_a_daemon_that_left_its_agents_group_dies_with_a_killed_worker(
    own_harness: Harness, workspace: str, tmp_path: Path
) -> None:
    worker, daemon = await _daemon_of(own_harness, workspace, tmp_path)
    await worker.kill9()  # type: ignore[attr-defined]
    assert not await _all_gone({daemon}), _cmdline(daemon)


async def test_a_daemon_that_left_its_agents_group_dies_with_a_worker_that_stops(
    harness: Harness, workspace: str, tmp_path: Path
) -> None:
    worker, daemon = await _daemon_of(harness, workspace, tmp_path)
    assert await worker.terminate() == 0  # type: ignore[attr-defined]
    assert not await _all_gone({daemon}), _cmdline(daemon)


# An ACP agent that stays when its stdin closes, as codex-acp does (SIGTERM still ends it).
EOF_IGNORING_AGENT = """
import signal, subprocess, sys
subprocess.Popen([sys.executable, "-m", "acp_state.testing.scripted_agent"]).wait()  # ACP on our stdio
while True:
    signal.pause()
"""


async def test_an_agent_that_outlives_stdin_eof_is_stopped_by_a_worker_that_stops(
    harness: Harness, workspace: str, tmp_path: Path
) -> None:
    script = tmp_path / "eof_ignoring_agent.py"
    script.write_text(EOF_IGNORING_AGENT)
    worker = await harness.worker("--agent", f"{sys.executable} {script}")
    await _create_session(harness, workspace)
    (agent,) = _children(worker.pid, str(script))
    group = _group(agent)
    assert await worker.terminate() == 0  # stdin closed, then SIGTERM to its group after 2 s
    assert not await _all_gone(group), [_cmdline(p) for p in group]


async def test_the_reaper_leaves_with_a_worker_that_stops(harness: Harness, workspace: str) -> None:
    worker = await harness.worker()
    await _create_session(harness, workspace)
    (agent,) = _children(worker.pid, "acp_state.testing.scripted_agent")
    (reaper,) = _children(worker.pid, "reaper.py")

    assert await worker.terminate() == 0
    assert not await _all_gone({agent, reaper})


async def test_the_reaper_ignores_sigterm_and_kills_only_groups_it_still_knows() -> None:
    def stubborn_group() -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, "-c", "import signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
             "while True: signal.pause()"],
            start_new_session=True,
        )

    kept, forgotten = stubborn_group(), stubborn_group()
    # Each ignores SIGTERM only once its interpreter ran that line: a group the reaper
    # signalled before then died of the SIGTERM, not of the SIGKILL under test.
    while not (_ignores_sigterm(kept.pid) and _ignores_sigterm(forgotten.pid)):
        await asyncio.sleep(0.01)
    reaper = subprocess.Popen(
        [sys.executable, "-m", "acp_state.worker.reaper", "0.2"], stdin=subprocess.PIPE, cwd=str(ROOT)
    )
    try:
        assert reaper.stdin is not None
        reaper.stdin.write(f"+{kept.pid}\n+{forgotten.pid}\nnoise\n+1\n-{forgotten.pid}\n".encode())
        reaper.stdin.flush()
        while not _ignores_sigterm(reaper.pid):  # its handlers are set at start-up
            await asyncio.sleep(0.01)
        reaper.send_signal(signal.SIGTERM)
        reaper.stdin.close()  # what a worker's death does
        assert await asyncio.to_thread(reaper.wait, GONE_TIMEOUT_S) == 0
        assert await asyncio.to_thread(kept.wait, GONE_TIMEOUT_S) == -signal.SIGKILL
        assert forgotten.poll() is None
    finally:
        for process in (kept, forgotten, reaper):
            if process.poll() is None:
                process.kill()
                process.wait()


async def test_a_dead_reaper_is_replaced_and_told_every_group() -> None:
    from acp_state.worker.reaper import Reaper

    groups = [subprocess.Popen([sys.executable, "-c", "import signal\nsignal.pause()"], start_new_session=True)
              for _ in range(2)]
    handle = Reaper(grace_s=5)
    try:
        handle.watch(groups[0].pid)
        first = handle.process
        assert first is not None
        first.kill()  # killed by hand
        first.wait()
        handle.watch(groups[1].pid)
        second = handle.process
        assert second is not None and second is not first
        handle.close()  # EOF: both groups get SIGTERM
        for group in groups:
            assert await asyncio.to_thread(group.wait, GONE_TIMEOUT_S) == -signal.SIGTERM
        assert await asyncio.to_thread(second.wait, GONE_TIMEOUT_S) == 0
    finally:
        handle.close()
        for process in groups:
            if process.poll() is None:
                process.kill()
                process.wait()
