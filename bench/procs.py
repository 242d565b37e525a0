"""Real processes for benchmarks: a throwaway redis-server and `acp-state` API / worker."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

from acp_state.cli.serving import DEFAULT_SERVER

from .redis_server import RedisServer as _RedisServer
from .redis_server import free_port

ROOT = Path(__file__).resolve().parent.parent


class RedisServer(_RedisServer):
    """redis-server on a free loopback port, no persistence; never the shared 6379."""

    def __init__(self) -> None:
        super().__init__()
        self.start()


class AcpProcess:
    """An `acp-state` subprocess, ready once it printed its banner line."""

    def __init__(self, *argv: str, marker: str, log: Path) -> None:
        self.argv = argv
        self.marker = marker
        self.log = log
        self.proc: asyncio.subprocess.Process | None = None
        self.banner = ""

    async def start(self) -> AcpProcess:
        env = dict(os.environ, PYTHONPATH=str(ROOT), ACP_STATE_LOG="WARNING")
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "acp_state.cli", *self.argv,
            stdout=asyncio.subprocess.PIPE, stderr=open(self.log, "ab"), env=env, cwd=str(ROOT),
        )
        assert self.proc.stdout is not None
        while True:
            line = (await asyncio.wait_for(self.proc.stdout.readline(), 60)).decode()
            if not line:
                raise RuntimeError(f"{self.argv[0]} exited; see {self.log}")
            if self.marker in line:
                self.banner = line.strip()
                return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    async def stop(self) -> None:
        if self.proc and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(self.proc.wait(), 30)


async def api(
    redis_url: str, workspace: str, log_dir: Path, *extra: str, server: str = DEFAULT_SERVER
) -> tuple[AcpProcess, int]:
    """An API process on the ASGI server `server` (`acp-state api --server`)."""
    port = free_port()
    process = AcpProcess(
        "api", "--redis-url", redis_url, "--port", str(port), "--workspace", workspace, "--server", server, *extra,
        marker="listening", log=log_dir / f"api-{port}.log",
    )
    return await process.start(), port


async def worker(redis_url: str, log_dir: Path, *extra: str) -> AcpProcess:
    """A worker whose SIGTERM closes its sessions at once (a bench tears its deployment down),
    unless `extra` gives `--drain-grace-s`."""
    if "--drain-grace-s" not in extra:
        extra = (*extra, "--drain-grace-s", "0")
    process = AcpProcess("worker", "--redis-url", redis_url, *extra, marker="serving", log=log_dir / f"worker-{time.monotonic_ns()}.log")
    return await process.start()


def percentile(samples: list[float], p: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]
