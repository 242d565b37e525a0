"""The scale bench's event streams (bench/scale.py, section 4): the SSE load process, one
event to each followed session written as its worker would, each event's delivery latency,
and the RSS per stream of a bare app on the same server stack (the baseline).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from acp_state import events
from acp_state.store import RedisStore, Transition
from testbed.processes import ROOT
from testbed.redis_server import free_port

from .__main__ import wait_port
from .procs import percentile, rss_bytes
from .scale_load import now_ns


class Streams:
    """The SSE load process (bench/scale_load.py streams)."""

    def __init__(self, port: int, paths: list[str], logs: Path, name: str = "sse", sequential: bool = False) -> None:
        self.paths_file = logs / f"{name}-paths.txt"
        self.paths_file.write_text("\n".join(paths) + "\n")
        self.out = logs / f"{name}-result.json"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.scale_load", "streams", "--port", str(port),
             "--paths-file", str(self.paths_file), "--out", str(self.out), *(["--sequential"] if sequential else [])],
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )

    async def ready(self) -> None:
        assert self.proc.stdout is not None
        line = await asyncio.to_thread(self.proc.stdout.readline)
        if line.strip() != "ready":
            raise RuntimeError(f"the SSE load did not attach: {line!r}")

    async def finish(self) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("end\n")
        self.proc.stdin.flush()
        await asyncio.to_thread(self.proc.stdout.readline)
        await asyncio.to_thread(self.proc.wait, 120)
        return json.loads(self.out.read_text())


async def bare_stream_rss_bytes(server: str, path: str, count: int, logs: Path) -> int:
    """RSS growth per open stream of a fresh bare app (bench/hello_app.py) on `server`:
    `/sse` is Starlette's StreamingResponse, `/raw-sse` the server's ASGI interface alone."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "bench.hello_app", "--server", server, "--port", str(port)],
                               cwd=ROOT, stdout=subprocess.DEVNULL)
    try:
        await wait_port(port)
        await asyncio.sleep(1)
        before = rss_bytes(process.pid)
        streams = Streams(port, [path] * count, logs, name=f"bare{path.replace('/', '-')}")
        try:
            await streams.ready()
            await asyncio.sleep(2)
            grown = rss_bytes(process.pid) - before
            await streams.finish()
        finally:
            if streams.proc.poll() is None:
                streams.proc.kill()
        return round(grown / max(count, 1))
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:  # a baseline's own shutdown is not measured here
            process.kill()
            process.wait()


async def emit_one_event_each(store: RedisStore, owners: dict[str, str], targets: list[tuple[str, str]],
                              rate: int) -> dict[int, tuple[int, int]]:
    """One `session_update` event to each target session, written by its owner's APPLY (as
    its worker would), `rate` per second; returns, per target index, (event id, start ns)."""
    starts: dict[int, tuple[int, int]] = {}
    interval = 1 / rate
    begun = time.monotonic()
    batch = 50

    async def one(n: int, ws: str, sid: str) -> None:
        update = {"sessionUpdate": "agent_message_chunk", "content": {"type": "text", "text": f"scale {n}"}}
        t0 = now_ns()
        applied = await store.apply(ws, sid, owners[sid], Transition(events=[events.body("session_update", {"sessionId": sid, "update": update})]))
        starts[n] = (applied.last_event_id, t0)

    for first in range(0, len(targets), batch):
        await asyncio.gather(*(one(n, ws, sid) for n, (ws, sid) in enumerate(targets[first:first + batch], first)))
        lag = begun + (first + batch) * interval - time.monotonic()
        if lag > 0:
            await asyncio.sleep(lag)
    return starts


def delivery(starts: dict[int, tuple[int, int]], arrivals: list[list[int]]) -> dict[str, Any]:
    """Per emitted event, the time from its APPLY call to its arrival on its stream."""
    latencies, missing = [], 0
    for n, (event_id, t0) in starts.items():
        stamps = dict(zip(arrivals[n][::2], arrivals[n][1::2]))
        if event_id in stamps:
            latencies.append((stamps[event_id] - t0) / 1e6)
        else:
            missing += 1
    return {"events": len(starts), "missing": missing,
            "p50_ms": round(percentile(latencies, 50), 2) if latencies else None,
            "p99_ms": round(percentile(latencies, 99), 2) if latencies else None}
