"""Real processes for benchmarks: a throwaway redis-server and `acp-state` API / worker
processes, with the one process wrapper every bench uses (the chaos run records what its
processes do on top of it: bench/chaos_history.py)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path
from typing import IO, Sequence

from acp_state.cli.serving import DEFAULT_SERVER

from testbed import forkserver
from testbed.redis_server import RedisServer as _RedisServer
from testbed.redis_server import free_port

ROOT = Path(__file__).resolve().parent.parent
WORKER_BANNER = "acp-state worker "  # `acp-state worker <incarnation> serving <url>`
API_BANNER = "acp-state api listening on "


class RedisServer(_RedisServer):
    """redis-server on a free loopback port, no persistence; never the shared 6379."""

    def __init__(self) -> None:
        super().__init__()
        self.start()


class AcpProcess:
    """An `acp-state` subprocess run from this tree, ready once it printed its banner line
    (the first stdout line holding `marker`). Its stderr goes to `log`; its stdout is read
    on past the banner, so a process that prints more never blocks on a full pipe.

    `prefix` runs it through another command (`ip netns exec <host>`: on a host of the
    test bed, testbed/hosts.py); `env` is laid over this process's environment."""

    # A subclass that sets this reads every stderr line (`on_stderr`) before it is logged;
    # otherwise stderr is the log file itself, and the event loop never sees it.
    watches_stderr = False

    def __init__(
        self, *argv: str, marker: str, log: Path, env: dict[str, str] | None = None, prefix: Sequence[str] = (),
        log_level: str = "WARNING", ready_timeout_s: float = 60,
    ) -> None:
        self.argv = argv
        self.marker = marker
        self.log = log
        self.env = env or {}
        self.prefix = list(prefix)
        self.log_level = log_level
        self.ready_timeout_s = ready_timeout_s
        self.proc: asyncio.subprocess.Process | forkserver.Child | None = None
        self.banner = ""
        self.ready = False
        self._log_file: IO[bytes] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False

    async def start(self) -> AcpProcess:
        env = {**os.environ, **self.env, "PYTHONPATH": str(ROOT), "ACP_STATE_LOG": self.log_level}
        self._log_file = open(self.log, "ab")  # noqa: SIM115 - closed once the process is gone
        self.proc = await forkserver.start(
            list(self.argv), prefix=self.prefix, stdout=forkserver.PIPE,
            stderr=forkserver.PIPE if self.watches_stderr else self._log_file, cwd=str(ROOT), env=env,
        )
        if self.watches_stderr:
            self._tasks.append(asyncio.ensure_future(self._pump_stderr()))
        assert self.proc.stdout is not None
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            line = (await asyncio.wait_for(self.proc.stdout.readline(), max(0.1, deadline - time.monotonic()))).decode()
            if not line:
                await asyncio.sleep(0.2)  # its last words reach the log first
                raise RuntimeError(f"{self.argv[0]} exited before it was ready; see {self.log}")
            if self.marker in line:
                self.banner = line.strip()
                break
        self.on_ready()
        self.ready = True
        self._tasks.append(asyncio.ensure_future(self._drain_stdout()))
        return self

    def on_ready(self) -> None:
        """Its banner came (a subclass records the start)."""

    def on_stderr(self, line: bytes) -> None:
        """One stderr line once it is ready (with `watches_stderr`)."""

    def on_exit(self) -> None:
        """It exited, and its output is read to the end (once)."""

    async def _drain_stdout(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        while await self.proc.stdout.readline():
            pass

    async def _pump_stderr(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        while line := await self.proc.stderr.readline():
            if self._log_file is not None:
                self._log_file.write(line)
            if self.ready:
                self.on_stderr(line)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    def signal(self, sig: int) -> None:
        if self.alive:
            os.kill(self.pid, sig)

    def sigterm(self) -> None:
        """SIGTERM (a worker drains, then exits; see worker/drain.py), after a SIGCONT: a
        stopped process (SIGSTOP) would not act on it."""
        if self.alive:
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGTERM)

    async def wait_exit(self, timeout: float) -> str:
        """Until it exits; SIGKILL past `timeout`. Returns how it ended."""
        assert self.proc is not None
        try:
            await asyncio.wait_for(self.proc.wait(), timeout)
            how = f"exit {self.proc.returncode}"
        except asyncio.TimeoutError:
            self.proc.kill()
            how = f"ignored SIGTERM for {timeout}s: killed"
        await self.closed()
        return how

    async def kill9(self) -> None:
        if self.alive:
            self.proc.kill()  # type: ignore[union-attr]
        await self.closed()

    async def terminate(self, timeout: float = 30) -> str:
        """SIGTERM first; SIGKILL only if it is ignored. Returns how it ended."""
        if not self.alive:
            await self.closed()
            return "already exited"
        self.sigterm()
        return await self.wait_exit(timeout)

    async def stop(self, timeout: float = 30) -> None:
        """SIGTERM, and its exit within `timeout` (asyncio.TimeoutError otherwise): a bench
        tearing its deployment down."""
        if self.alive:
            self.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
            await asyncio.wait_for(self.proc.wait(), timeout)  # type: ignore[union-attr]
        await self.closed()

    async def closed(self) -> None:
        """Once it has exited: its output read to the end, its log closed, `on_exit` told."""
        if self.proc is None:
            return
        await self.proc.wait()
        for task in self._tasks:
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(task, 2)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if not self._closed:
            self._closed = True
            self.on_exit()


class WorkerProcess(AcpProcess):
    """An `acp-state worker`; its banner names its first incarnation."""

    def __init__(self, *argv: str, log: Path, env: dict[str, str] | None = None, prefix: Sequence[str] = (),
                 log_level: str = "WARNING") -> None:
        super().__init__("worker", *argv, marker=WORKER_BANNER, log=log, env=env, prefix=prefix, log_level=log_level)

    @property
    def incarnation(self) -> str:
        return self.banner.split()[2]


class ApiProcess(AcpProcess):
    """An `acp-state api` listening on `port` (which `argv` gives as `--port`)."""

    def __init__(self, *argv: str, port: int, log: Path, env: dict[str, str] | None = None, prefix: Sequence[str] = (),
                 log_level: str = "WARNING") -> None:
        super().__init__("api", *argv, marker=API_BANNER, log=log, env=env, prefix=prefix, log_level=log_level)
        self.port = port


async def api(
    redis_url: str, workspace: str, log_dir: Path, *extra: str, server: str = DEFAULT_SERVER
) -> tuple[AcpProcess, int]:
    """An API process on the ASGI server `server` (`acp-state api --server`)."""
    port = free_port()
    process = ApiProcess(
        "--redis-url", redis_url, "--port", str(port), "--workspace", workspace, "--server", server, *extra,
        port=port, log=log_dir / f"api-{port}.log",
    )
    return await process.start(), port


async def worker(redis_url: str, log_dir: Path, *extra: str) -> AcpProcess:
    """A worker whose SIGTERM closes its sessions at once (a bench tears its deployment down),
    unless `extra` gives `--drain-grace-s`."""
    if "--drain-grace-s" not in extra:
        extra = (*extra, "--drain-grace-s", "0")
    process = WorkerProcess("--redis-url", redis_url, *extra, log=log_dir / f"worker-{time.monotonic_ns()}.log")
    return await process.start()


def percentile(samples: list[float], p: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> int:
    return int(Path(f"/proc/{pid}/status").read_text().split("VmRSS:")[1].split()[0]) * 1024


def children(pid: int) -> list[int]:
    """Direct children (a worker's agent processes)."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found
