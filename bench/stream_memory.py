"""What one open event stream holds in the API process's Python heap: the stream served
below Starlette's stack (as `acp-state api` serves it) against the same stream through the
stack (the route), in the same process, on a redis-server and a worker of its own.

Streams are opened one after another (so the Redis pool does not grow with them), then
held idle: per stream, the bytes `tracemalloc` sees allocated and the objects the garbage
collector tracks (a full collection walks every one of them). What the ASGI server itself
keeps per connection is not in here: `python -m bench --scale` measures a process's RSS
beside a raw ASGI stream on the same server.

    python -m bench.stream_memory [--streams 400]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import tempfile
import tracemalloc
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from acp_state.api import event_stream
from acp_state.api.app import create_app
from acp_state.api.settings import Settings

from .procs import RedisServer, worker

RESULTS = Path(__file__).resolve().parent / "results"
SESSIONS = 20


async def held_per_stream(app: Any, sids: list[str], streams: int, below_stack: bool) -> dict[str, Any]:
    """Open `streams` streams of `sids` in turn, each until its snapshot is sent; what the
    heap holds per stream once they are all idle."""
    left = asyncio.Event()
    snapshot_sent = asyncio.Event()

    async def receive() -> dict[str, Any]:
        await left.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if b"session_snapshot" in message.get("body", b""):
            snapshot_sent.set()

    def scope(sid: str) -> dict[str, Any]:
        path = f"/session/{sid}/events"
        return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                "method": "GET", "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
                "query_string": b"", "headers": [], "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1)}

    async def open_one(sid: str) -> asyncio.Task[Any]:
        snapshot_sent.clear()
        if below_stack:
            call = event_stream.answer(app.state.acp, app.authenticator, app.counts, scope(sid), receive, send)
        else:
            call = super(type(app), app).__call__(scope(sid), receive, send)  # Starlette's stack, the route
        task = asyncio.ensure_future(call)
        await asyncio.wait_for(snapshot_sent.wait(), 30)
        return task

    warm = [await open_one(sid) for sid in sids]  # the pool's connections, the caches, the watch
    gc.collect()
    objects_before = len(gc.get_objects())
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    tasks = [await open_one(sids[n % len(sids)]) for n in range(streams)]
    gc.collect()
    after = tracemalloc.take_snapshot()
    objects_after = len(gc.get_objects())
    by_type = Counter(type(o).__name__ for o in gc.get_objects())
    tracemalloc.stop()
    grown = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    left.set()
    await asyncio.gather(*warm, *tasks, return_exceptions=True)
    return {
        "bytes_per_stream": round(grown / streams),
        "tracked_objects_per_stream": round((objects_after - objects_before) / streams, 1),
        "most_tracked_types": by_type.most_common(8),
    }


async def run(streams: int) -> dict[str, Any]:
    server = RedisServer()
    logs = Path(tempfile.mkdtemp(prefix="acp-stream-memory-"))
    workspace = tempfile.mkdtemp(prefix="acp-stream-memory-ws-")
    hosting = await worker(server.url, logs)
    result: dict[str, Any] = {"streams": streams}
    try:
        app = create_app(Settings(redis_url=server.url, workspaces=[workspace]))
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
                sids = [(await client.post("/session", json={"cwd": workspace}, timeout=60)).json()["sessionId"]
                        for _ in range(SESSIONS)]
            result["through_the_stack"] = await held_per_stream(app, sids, streams, below_stack=False)
            result["below_the_stack"] = await held_per_stream(app, sids, streams, below_stack=True)
    finally:
        await hosting.stop()
        server.stop()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=400)
    args = parser.parse_args()
    result = asyncio.run(run(args.streams))
    for name in ("through_the_stack", "below_the_stack"):
        r = result[name]
        print(f"{name:>18}: {r['bytes_per_stream']:,} B and {r['tracked_objects_per_stream']} tracked objects per stream")
    (RESULTS / "stream_memory.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
