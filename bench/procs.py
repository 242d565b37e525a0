"""A benchmark's deployment on the test bed: a throwaway redis-server, started, and
`acp-state` API and worker processes (testbed/processes.py) that log warnings only; and
what a benchmark measures of a process (CPU, memory, its children, percentiles)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from acp_state.cli.serving import DEFAULT_SERVER
from testbed.processes import AcpProcess, ApiProcess, WorkerProcess
from testbed.redis_server import RedisServer as _RedisServer
from testbed.redis_server import free_port

LOG_LEVEL = "WARNING"  # a benchmark's processes log no more than they must
READY_TIMEOUT_S = 60


class RedisServer(_RedisServer):
    """redis-server on a free loopback port, no persistence; never the shared 6379."""

    def __init__(self) -> None:
        super().__init__()
        self.start()


async def api(
    redis_url: str, workspace: str, log_dir: Path, *extra: str, server: str = DEFAULT_SERVER
) -> tuple[AcpProcess, int]:
    """An API process on the ASGI server `server` (`acp-state api --server`)."""
    port = free_port()
    process = ApiProcess(
        ["api", "--redis-url", redis_url, "--port", str(port), "--workspace", workspace, "--server", server, *extra],
        log_dir / f"api-{port}.log", port, log_level=LOG_LEVEL, ready_timeout_s=READY_TIMEOUT_S,
    )
    return await process.start(), port


async def worker(redis_url: str, log_dir: Path, *extra: str) -> AcpProcess:
    """A worker whose SIGTERM closes its sessions at once (a bench tears its deployment down),
    unless `extra` gives `--drain-grace-s`."""
    if "--drain-grace-s" not in extra:
        extra = (*extra, "--drain-grace-s", "0")
    process = WorkerProcess(
        ["worker", "--redis-url", redis_url, *extra], log_dir / f"worker-{time.monotonic_ns()}.log",
        log_level=LOG_LEVEL, ready_timeout_s=READY_TIMEOUT_S,
    )
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
