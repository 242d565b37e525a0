"""What one open event stream costs the API process, in two figures of one run.

1. **RSS per stream, against the server's bare ASGI stream** (`rss`), on each server
   (granian, uvicorn): an `acp-state api --server S` process on a redis-server and a worker
   of its own, `--rss-streams` streams of `GET /session/:id/events` (and of the live feed,
   `GET /workspaces/:ws/sessions/live-state/events`) held open by a load process of their own
   (bench/scale_load.py), the process's RSS before and after; beside it a fresh bare app on
   the same server holding as many of its `/raw-sse` streams (bench/hello_app.py: the
   server's ASGI interface alone, no Starlette). acp-state's own share of a stream is the
   difference. Beside it, the same bare stream sending also a first frame of the size of
   the session stream's and the feed's first frame (`/raw-sse?first=N`): what the server
   itself keeps for having sent those bytes, so the share over it is what acp-state's own
   objects cost. Each is taken
   `--rounds` times, the rounds alternating. The load opens its streams in a burst, as many
   clients at once would; `--sequential` opens each once the one before got its first frame
   (what an open stream holds, without what the burst of opens in flight left behind).
2. **Python heap per stream** (`heap`): the stream served below Starlette's stack (as
   `acp-state api` serves it) against the same stream through the stack (the route), in
   this process: per stream, the bytes `tracemalloc` sees allocated and the objects the
   garbage collector tracks (a full collection walks every one of them).

The heap figure's streams are opened one after another (so the Redis pool does not grow
with them); all are then held idle.

    python -m bench.stream_memory [--only rss,heap] [--servers granian,uvicorn] [--rss-streams 2000] [--rounds 2]
                                  [--sequential]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import subprocess
import sys
import tempfile
import tracemalloc
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx

from acp_state.api.app import create_app
from acp_state.api.settings import Settings
from acp_state.cli.serving import SERVERS
from acp_state.ids import workspace_id
from testbed.processes import ROOT
from testbed.redis_server import free_port

from .__main__ import create_sessions, log, wait_port
from .procs import RedisServer, api, rss_bytes, worker
from .scale_streams import Streams

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
            call = app(scope(sid), receive, send)  # as the server calls it: the stream is served below the stack
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


async def heap(streams: int) -> dict[str, Any]:
    server = RedisServer()
    logs = Path(tempfile.mkdtemp(prefix="acp-stream-memory-"))
    workspace = tempfile.mkdtemp(prefix="acp-stream-memory-ws-")
    hosting = await worker(server.url, logs)
    result: dict[str, Any] = {"streams": streams}
    try:
        app = create_app(Settings(redis_url=server.url, workspaces=[workspace]))
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
                sids = [(await client.post("/session", json={"cwd": workspace}, timeout=60)).json()["sessionId"]
                        for _ in range(SESSIONS)]
            result["through_the_stack"] = await held_per_stream(app, sids, streams, below_stack=False)
            result["below_the_stack"] = await held_per_stream(app, sids, streams, below_stack=True)
    finally:
        await hosting.terminate(30)
        server.stop()
    return result


async def rss_per_stream(
    port: int, pid: int, paths: list[str], logs: Path, name: str, sequential: bool = False
) -> dict[str, Any]:
    """Process `pid`'s RSS growth per stream while `paths` are held open by a load process,
    over 200 streams of the same paths held open from before (the process's one-time costs:
    pools, caches, hubs, the allocator's first arenas). Each figure is taken in a fresh
    process: memory that earlier streams left to the allocator would be reused unseen."""
    loads = [Streams(port, paths[:200], logs, name=f"{name}-warm")]
    try:
        await loads[0].ready()
        await asyncio.sleep(1)
        before = rss_bytes(pid)
        loads.append(Streams(port, paths, logs, name=name, sequential=sequential))
        await loads[1].ready()
        await asyncio.sleep(2)
        grown = rss_bytes(pid) - before
        held = await loads[1].finish()
        await loads[0].finish()
    finally:
        for load in loads:
            if load.proc.poll() is None:
                load.proc.kill()
    return {"bytes_per_stream": round(grown / max(held["streams"], 1)), "open": held["streams"], "refused": len(held["refused"])}


async def first_frame_bytes(port: int, path: str) -> int:
    """The size of a stream's first frame after its `retry:` (its snapshot)."""
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
        async with client.stream("GET", path) as response:
            body = b""
            async for chunk in response.aiter_raw():
                body += chunk
                if body.count(b"\n\n") >= 2:
                    return len(body.split(b"\n\n")[1]) + 2
    raise RuntimeError(f"{path} ended before its first frame")


async def one_round(name: str, count: int, logs: Path, sequential: bool = False) -> dict[str, int]:
    """On server `name`, in fresh processes: RSS per stream of the session stream and the
    live feed (one API process each) and of the bare ASGI stream, also sending a first frame
    of the size of the session stream's and the feed's (the server's own cost of those bytes)."""
    figures: dict[str, int] = {}
    redis = RedisServer()
    workspace = tempfile.mkdtemp(prefix="acp-stream-memory-ws-")
    processes = [await worker(redis.url, logs)]
    try:
        async def api_with_sessions() -> tuple[Any, int, list[str]]:
            process, port = await api(redis.url, workspace, logs, server=name)
            processes.append(process)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
                return process, port, await create_sessions(client, workspace, SESSIONS)

        process, port, sids = await api_with_sessions()
        figures["session_stream_first_frame"] = await first_frame_bytes(port, f"/session/{sids[0]}/events")
        held = await rss_per_stream(port, process.pid, [f"/session/{sids[n % SESSIONS]}/events" for n in range(count)],
                                    logs, f"session-{name}", sequential)
        figures["session_stream"] = held["bytes_per_stream"]
        process, port, _ = await api_with_sessions()
        feed = f"/workspaces/{workspace_id(workspace)}/sessions/live-state/events"
        figures["live_feed_first_frame"] = await first_frame_bytes(port, feed)
        figures["live_feed"] = (await rss_per_stream(port, process.pid, [feed] * count, logs, f"feed-{name}",
                                                     sequential))["bytes_per_stream"]
    finally:
        for process in reversed(processes):
            await process.terminate(30)
        redis.stop()
    figures["bare_raw_asgi_stream"] = await bare_rss(name, "/raw-sse", count, logs, f"bare-{name}", sequential)
    for stream in ("session_stream", "live_feed"):
        figures[f"bare_with_{stream}_first_frame"] = await bare_rss(
            name, f"/raw-sse?first={figures[f'{stream}_first_frame']}", count, logs, f"bare-{stream}-{name}", sequential)
    return figures


async def bare_rss(name: str, path: str, count: int, logs: Path, label: str, sequential: bool = False) -> int:
    """RSS per stream of `path` held open on a fresh bare app (bench/hello_app.py) on `name`."""
    port = free_port()
    bare = subprocess.Popen([sys.executable, "-m", "bench.hello_app", "--server", name, "--port", str(port)],
                            cwd=ROOT, stdout=subprocess.DEVNULL)
    try:
        await wait_port(port)
        return (await rss_per_stream(port, bare.pid, [path] * count, logs, label, sequential))["bytes_per_stream"]
    finally:
        bare.terminate()
        bare.wait(30)


async def rss(servers: list[str], count: int, rounds: int, sequential: bool = False) -> dict[str, Any]:
    """Per server, `rounds` times, the servers alternating: RSS per open stream of the
    session stream, the live feed and the bare ASGI stream on that server; the streams opened
    in a burst, as a load opens them, or `sequential`ly, each once the one before is open
    (what a stream holds once open, without what a burst of opens in flight leaves behind)."""
    result: dict[str, Any] = {"streams": count, "rounds": rounds, "opened": "sequentially" if sequential else "in a burst"}
    logs = Path(tempfile.mkdtemp(prefix="acp-stream-memory-"))
    taken: dict[str, dict[str, list[int]]] = {name: {} for name in servers}
    for round_ in range(rounds):
        for name in servers:
            log(f"stream memory on {name}, round {round_ + 1}: {count} streams each")
            for figure, value in (await one_round(name, count, logs, sequential)).items():
                taken[name].setdefault(figure, []).append(value)
    for name, figures in taken.items():
        bare = sorted(figures["bare_raw_asgi_stream"])[len(figures["bare_raw_asgi_stream"]) // 2]
        result[name] = {
            **{f"{k}_bytes": v for k, v in figures.items()},
            # acp-state's own share: the API's stream over the bare one, medians of the rounds.
            "session_stream_share_bytes": sorted(figures["session_stream"])[rounds // 2] - bare,
            "live_feed_share_bytes": sorted(figures["live_feed"])[rounds // 2] - bare,
            # ... and over the bare stream that also sends a first frame of the same size.
            **{f"{stream}_share_over_same_first_frame_bytes": sorted(figures[stream])[rounds // 2]
               - sorted(figures[f"bare_with_{stream}_first_frame"])[rounds // 2]
               for stream in ("session_stream", "live_feed")},
        }
    return result


async def run(args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                              "load_average_before": os.getloadavg()}
    if "rss" in args.only:
        result["rss"] = await rss(args.servers, args.rss_streams, args.rounds, args.sequential)
    if "heap" in args.only:
        result["heap"] = await heap(args.streams)
    result["load_average_after"] = os.getloadavg()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="rss,heap", help="comma-separated: rss,heap")
    parser.add_argument("--servers", default=",".join(SERVERS), help="comma-separated: granian,uvicorn")
    parser.add_argument("--rss-streams", type=int, default=2000, help="streams held open per RSS figure")
    parser.add_argument("--rounds", type=int, default=2, help="RSS figures per server, alternating")
    parser.add_argument("--sequential", action="store_true",
                        help="open the RSS figures' streams one after another instead of in a burst")
    parser.add_argument("--streams", type=int, default=400, help="streams opened for the heap figure")
    parser.add_argument("--out", type=Path, default=RESULTS / "stream_memory.json")
    args = parser.parse_args()
    args.only, args.servers = args.only.split(","), args.servers.split(",")
    result = asyncio.run(run(args))
    for name in args.servers if "rss" in result else []:
        r = result["rss"][name]
        print(f"{name}: RSS per open stream, {result['rss']['streams']} streams opened {result['rss']['opened']}, "
              f"rounds {result['rss']['rounds']}: "
              f"session stream {r['session_stream_bytes']} B, live feed {r['live_feed_bytes']} B, "
              f"the server's bare ASGI stream {r['bare_raw_asgi_stream_bytes']} B; acp-state's own share "
              f"{r['session_stream_share_bytes']:,} B (session), {r['live_feed_share_bytes']:,} B (live feed); over the bare "
              f"stream that also sends a first frame of the same size ({r['session_stream_first_frame_bytes']}, "
              f"{r['live_feed_first_frame_bytes']} B): {r['session_stream_share_over_same_first_frame_bytes']:,} B (session), "
              f"{r['live_feed_share_over_same_first_frame_bytes']:,} B (live feed)")
    if "heap" in result:
        for name in ("through_the_stack", "below_the_stack"):
            r = result["heap"][name]
            print(f"heap {name:>18}: {r['bytes_per_stream']:,} B and {r['tracked_objects_per_stream']} tracked objects per stream")
    print(f"load average before {result['load_average_before']}, after {result['load_average_after']}")
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
