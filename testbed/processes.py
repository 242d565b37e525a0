"""The one wrapper of an `acp-state` worker or API process, for tests and benchmarks alike:
run from this checkout (forked by the fork server when it is on: forkserver.py), ready once
it printed its banner, and stopped the way each caller needs (SIGTERM that must be obeyed,
SIGTERM with SIGKILL behind it, kill -9)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import time
from pathlib import Path
from typing import IO, Sequence

import httpx

from . import forkserver
from .redis_server import die_with_parent

ROOT = Path(__file__).resolve().parent.parent
WORKER_BANNER = "acp-state worker "  # `acp-state worker <incarnation> serving <url>`
API_BANNER = "acp-state api listening on "
READY_TIMEOUT_S = 30
TERMINATE_TIMEOUT_S = 20


async def python_stacks(pid: int) -> str:
    """The Python stacks of a live process, by py-spy when it is installed (else a note)."""
    if shutil.which("py-spy") is None:
        return "(install py-spy for its stacks)"
    dump = await asyncio.create_subprocess_exec(
        "py-spy", "dump", "--pid", str(pid), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await dump.communicate()
    return out.decode(errors="replace")


class AcpProcess:
    """`acp-state *argv` (its command first: `["worker", "--redis-url", ...]`), ready once it
    printed its banner line (the first stdout line holding `marker`). Its stderr goes to
    `log_path`; its stdout is read on past the banner, so a process that prints more never
    blocks on a full pipe. It dies with the thread that started it, even one killed with -9
    (a crashed test or bench leaves no worker behind).

    `prefix` runs it through another command (`ip netns exec <host>`: on a host of the bed,
    hosts.py; `setsid`); `env` is laid over this process's environment."""

    # A subclass that sets this reads every stderr line (`on_stderr`) before it is logged;
    # otherwise stderr is the log file itself, and the event loop never sees it.
    watches_stderr = False

    def __init__(
        self, argv: Sequence[str], log_path: Path, *, marker: str, env: dict[str, str] | None = None,
        prefix: Sequence[str] | None = None, log_level: str = "INFO", ready_timeout_s: float = READY_TIMEOUT_S,
    ) -> None:
        self.argv = list(argv)
        self.log_path = log_path
        self.marker = marker
        self.env = env or {}
        self.prefix = list(prefix or ())
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
        self._log_file = open(self.log_path, "ab")  # noqa: SIM115 - closed once the process is gone
        self.proc = await forkserver.start(
            self.argv, prefix=self.prefix, stdout=forkserver.PIPE,
            stderr=forkserver.PIPE if self.watches_stderr else self._log_file, cwd=str(ROOT), env=env,
            preexec_fn=die_with_parent,
        )
        if self.watches_stderr:
            self._tasks.append(asyncio.ensure_future(self._pump_stderr()))
        assert self.proc.stdout is not None
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            line = (await asyncio.wait_for(self.proc.stdout.readline(), max(0.1, deadline - time.monotonic()))).decode()
            if not line:
                await self._last_words()
                raise RuntimeError(
                    f"{self.argv[0]} exited before it was ready; see {self.log_path}:\n"
                    + self.log_path.read_text(errors="replace")[-3000:]
                )
            if self.marker in line:
                self.banner = line.strip()
                break
        self.on_ready()
        self.ready = True
        self._tasks.append(asyncio.ensure_future(self._drain_stdout()))
        return self

    async def _last_words(self) -> None:
        """Once its stdout closed before the banner: its exit, so its stderr is all in the log."""
        assert self.proc is not None
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.proc.wait(), 5)
        for task in self._tasks:
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(task, 2)
        if self._log_file is not None:
            self._log_file.flush()

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
        """SIGTERM (a worker drains, then exits; see worker/move.py), after a SIGCONT: a
        stopped process (SIGSTOP) would not act on it."""
        if self.alive:
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGTERM)

    async def terminate(self, timeout: float = TERMINATE_TIMEOUT_S) -> int | None:
        """SIGTERM, and its exit code: every process must shut down cleanly on it, so one
        that ignores it for `timeout` fails the caller (AssertionError, with the stacks it
        hung in), killed."""
        if not self.alive:
            await self.closed()
            return self.proc.returncode if self.proc else None
        assert self.proc is not None
        self.sigterm()
        try:
            code = await asyncio.wait_for(self.proc.wait(), timeout)
        except asyncio.TimeoutError:
            stacks = await python_stacks(self.proc.pid)  # where it hangs, before it is gone
            await self.kill9()
            raise AssertionError(f"{self.argv[0]} ignored SIGTERM for {timeout}s; its threads:\n{stacks}") from None
        await self.closed()
        return code

    async def shut_down(self, timeout: float) -> str:
        """SIGTERM first; SIGKILL only if it is ignored for `timeout`. Returns how it ended,
        for a run that records it (the chaos run) rather than fails on it."""
        if not self.alive:
            await self.closed()
            return "already exited"
        self.sigterm()
        return await self.wait_exit(timeout)

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

    def __init__(self, argv: Sequence[str], log_path: Path, *, env: dict[str, str] | None = None,
                 prefix: Sequence[str] | None = None, log_level: str = "INFO",
                 ready_timeout_s: float = READY_TIMEOUT_S) -> None:
        super().__init__(argv, log_path, marker=WORKER_BANNER, env=env, prefix=prefix, log_level=log_level,
                         ready_timeout_s=ready_timeout_s)

    @property
    def incarnation(self) -> str:
        return self.banner.split()[2]


class ApiProcess(AcpProcess):
    """An `acp-state api` listening on `host`:`port` (which `argv` gives as `--port`), with
    an HTTP client of it (`client`; `token` its bearer token) made on first use."""

    def __init__(self, argv: Sequence[str], log_path: Path, port: int, *, host: str = "127.0.0.1",
                 token: str | None = None, env: dict[str, str] | None = None, prefix: Sequence[str] | None = None,
                 log_level: str = "INFO", ready_timeout_s: float = READY_TIMEOUT_S) -> None:
        super().__init__(argv, log_path, marker=API_BANNER, env=env, prefix=prefix, log_level=log_level,
                         ready_timeout_s=ready_timeout_s)
        self.port = port
        self.host = host
        self.token = token
        self._client: httpx.AsyncClient | None = None

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
            self._client = httpx.AsyncClient(base_url=f"http://{self.host}:{self.port}", timeout=30, headers=headers)
        return self._client

    async def close_client(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
