"""A fork server for `acp-state` processes: one Python that has imported the product once
forks each worker and API a test or bench asks for, instead of a fresh interpreter that
imports it all again.

Why: a worker's start is ~1.2 s of CPU, most of it importing the ACP SDK's 274 pydantic
models, and the suite starts about two hundred of them on two cores. A forked child runs
the same `acp-state` main as `python -m acp_state.cli` would, in a process of its own: its
own pid, signals, exit code, stdout and stderr, environment and working directory.

It is opt-in (`ACP_STATE_FORK_SERVER=1`; tests/conftest.py sets it for the suite and the
benches the suite runs), so a bench that measures a process's start-up measures the real
one. A process run through a prefix (`ip netns exec`, a host of the test bed) is always
exec'd: a fork would stay in the fork server's network namespace.

`start` returns a `Child` that answers like `asyncio.subprocess.Process` (`pid`,
`returncode`, `stdout`, `stderr`, `wait`, `send_signal`, `terminate`, `kill`).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path
from typing import IO, Any

import orjson

from .redis_server import die_with_parent

ROOT = Path(__file__).resolve().parent.parent
ENABLED_BY = "ACP_STATE_FORK_SERVER"
PIPE = asyncio.subprocess.PIPE
# What a worker and an API import, done once in the server (the ACP SDK's models above all).
PRELOAD = (
    "acp_state.cli.commands", "acp_state.worker.worker", "acp_state.api.app", "granian.server.embed", "uvicorn",
)


def enabled() -> bool:
    return os.environ.get(ENABLED_BY) == "1"


async def start(
    argv: list[str], *, env: dict[str, str], cwd: str, stdout: int | IO[bytes], stderr: int | IO[bytes],
    prefix: list[str] | None = None, preexec_fn: Any = None,
) -> Any:
    """`python -m acp_state.cli *argv`: forked by this process's fork server when enabled
    (and no `prefix`), else exec'd. `stdout`/`stderr`: `PIPE` or an open file."""
    if prefix or not enabled():
        return await asyncio.create_subprocess_exec(
            *(prefix or []), sys.executable, "-m", "acp_state.cli", *argv,
            stdout=stdout, stderr=stderr, cwd=cwd, env=env, preexec_fn=preexec_fn,
        )
    return await _server().spawn(argv, env=env, cwd=cwd, stdout=stdout, stderr=stderr)


# ---- the caller's side --------------------------------------------------------------------


class Child:
    """A forked `acp-state` process, answering like `asyncio.subprocess.Process`."""

    def __init__(self, pid: int, exit_code: asyncio.Task[int], stdout: asyncio.StreamReader | None,
                 stderr: asyncio.StreamReader | None) -> None:
        self.pid = pid
        self.stdout = stdout
        self.stderr = stderr
        self._exited = exit_code

    @property
    def returncode(self) -> int | None:
        return self._exited.result() if self._exited.done() else None

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Server:
    """This process's fork server: started on first use, gone with this process."""

    def __init__(self) -> None:
        folder = tempfile.mkdtemp(prefix="acp-forkserver-")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        self.path = os.path.join(folder, "socket")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "testbed.forkserver", self.path], cwd=str(ROOT),
            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
            preexec_fn=die_with_parent,  # this process gone: the server, then its children
        )
        assert self.process.stdout is not None
        if self.process.stdout.readline() != b"ready\n":
            raise RuntimeError(f"the fork server did not start (exit {self.process.wait()})")
        atexit.register(self.stop)

    def stop(self) -> None:
        """SIGTERM, and wait: its children's CPU then counts in this process's own rusage."""
        self.process.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(10)

    async def spawn(self, argv: list[str], *, env: dict[str, str], cwd: str, stdout: int | IO[bytes],
                    stderr: int | IO[bytes]) -> Child:
        loop = asyncio.get_running_loop()
        readers: list[asyncio.StreamReader | None] = []
        sent: list[int] = []  # the child's ends, closed here once they are passed on
        for target in (stdout, stderr):
            if target == PIPE:
                read_end, write_end = os.pipe()
                reader = asyncio.StreamReader(loop=loop)
                await loop.connect_read_pipe(lambda r=reader: asyncio.StreamReaderProtocol(r), os.fdopen(read_end, "rb", 0))
                readers.append(reader)
                sent.append(write_end)
            else:
                assert not isinstance(target, int), "a file or PIPE"
                readers.append(None)
                sent.append(os.dup(target.fileno()))
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.setblocking(False)
            await loop.sock_connect(conn, self.path)
            request = orjson.dumps({"argv": argv, "env": env, "cwd": cwd})
            socket.send_fds(conn, [request], sent)  # small: a local socket takes it at once
        finally:
            for fd in sent:
                os.close(fd)
        reply = await _read_line(loop, conn)
        return Child(int(reply), asyncio.ensure_future(self._exit_code(loop, conn)), readers[0], readers[1])

    @staticmethod
    async def _exit_code(loop: asyncio.AbstractEventLoop, conn: socket.socket) -> int:
        """The child's exit code, as its fork server tells it once it has reaped the child."""
        try:
            return int(await _read_line(loop, conn))
        except (ValueError, OSError):
            return -signal.SIGKILL  # the server is gone, and the child with it
        finally:
            conn.close()


async def _read_line(loop: asyncio.AbstractEventLoop, conn: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = await loop.sock_recv(conn, 64)
        if not chunk:
            raise OSError("the fork server closed the connection")
        data += chunk
    return data.strip()


_servers: dict[int, _Server] = {}
_lock = threading.Lock()


def _server() -> _Server:
    with _lock:  # one per process (a forked test process starts its own)
        server = _servers.get(os.getpid())
        if server is None:
            server = _servers[os.getpid()] = _Server()
        return server


# ---- the server -------------------------------------------------------------------------


def serve(path: str) -> None:
    """Fork a child per request; tell each requester its child's pid, then its exit code."""
    for module in PRELOAD:
        __import__(module)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wakeup_r, wakeup_w = socket.socketpair()
    wakeup_w.setblocking(False)
    signal.set_wakeup_fd(wakeup_w.fileno())
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the selector; children are reaped below
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(wakeup_r, selectors.EVENT_READ)
    requesters: dict[int, socket.socket] = {}
    sys.stdout.buffer.write(b"ready\n")
    sys.stdout.flush()
    while True:
        for key, _ in selector.select():
            if key.fileobj is listener:
                conn, _ = listener.accept()
                with conn:
                    pid = _fork_child(conn, [selector, listener, wakeup_r, wakeup_w, *requesters.values()])
                    requesters[pid] = conn.dup()
                    _send(requesters[pid], f"{pid}\n")
            else:
                wakeup_r.recv(4096)
                _reap(requesters)


def _fork_child(conn: socket.socket, inherited: list[Any]) -> int:
    request, fds, _, _ = socket.recv_fds(conn, 1 << 20, 2)
    spec = orjson.loads(request)
    pid = os.fork()
    if pid:
        for fd in fds:
            os.close(fd)
        return pid
    code = 1
    try:
        die_with_parent()  # the fork server gone (its test process is): this child too
        signal.set_wakeup_fd(-1)
        for handled in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(handled, signal.SIG_DFL)
        for sock in (conn, *inherited):
            sock.close()
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in (devnull, *fds):
            os.close(fd)
        os.chdir(spec["cwd"])
        os.environ.clear()
        os.environ.update(spec["env"])
        sys.argv = [sys.argv[0], *spec["argv"]]
        code = _run_main(spec["argv"])
    finally:
        os._exit(code)


def _run_main(argv: list[str]) -> int:
    """The child's life: `acp-state` main, then what an interpreter does at exit."""
    from acp_state.cli.commands import main

    code = 0
    try:
        main(argv)
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        if not isinstance(exit_.code, int | None):
            print(exit_.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    return code


def _reap(requesters: dict[int, socket.socket]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = requesters.pop(pid, None)
        if conn is not None:
            _send(conn, f"{os.waitstatus_to_exitcode(status)}\n")
            conn.close()


def _send(conn: socket.socket, line: str) -> None:
    with contextlib.suppress(OSError):  # its requester is gone (its test ended): nobody to tell
        conn.sendall(line.encode())


if __name__ == "__main__":
    serve(sys.argv[1])
