"""The Python cost of a kept status read, without the ASGI server and the machine's noise.

`python -m bench --scale` measures the API's status reads through `wrk` and an ASGI server,
and on a shared 2-core machine their rate swings by a factor of three between rounds. This
measures only what runs in the API's event loop for one read, in one process: the API app
(`create_app`, its lifespan, a real redis-server and worker of its own, one live session
read once so that its status is kept) is called as the ASGI server calls it, 2,000 reads at
once, and the CPU time of the process is divided by the reads. Beside it, in the same
rounds and with the same fake server around them:

- `floor`: the least a linearizable kept read can do: wait for the same `Fanout.sync` of
  the session's workspace (the same Redis ping round), then send the same bytes in the
  same two ASGI messages;
- `hello`: the bare Starlette hello of `bench/hello_app.py`, the scale goal's baseline.

Prints microseconds per read (the least of the rounds: what is left once the neighbours'
noise is removed) and the ratios. The ASGI server's own cost per request, the same for all
three, is not in these figures, so the shares here are lower than through a server.

    python -m bench.hot_read [--rounds 15] [--reads 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

import httpx

from acp_state.api.app import create_app
from acp_state.api.reads.cache import CACHE_HITS
from acp_state.api.settings import Settings
from acp_state.ids import workspace_id

from .hello_app import hello
from .procs import RedisServer, worker

RESULTS = Path(__file__).resolve().parent / "results"
App = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


def http_get(path: str) -> dict[str, Any]:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": "GET", "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
            "query_string": b"", "headers": [(b"host", b"127.0.0.1"), (b"accept", b"*/*")],
            "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1)}


async def cpu_us_per_read(app: App, path: str, reads: int) -> float:
    """`reads` concurrent GETs of `path`, each in a task as a server runs it: the process's
    CPU microseconds per read."""
    statuses: list[int] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            statuses.append(message["status"])

    loop = asyncio.get_running_loop()
    started = time.process_time()
    await asyncio.gather(*(loop.create_task(app(http_get(path), receive, send)) for _ in range(reads)))
    spent = time.process_time() - started
    if statuses != [200] * reads:
        raise RuntimeError(f"{path}: answered {sorted(set(statuses))}, not 200 alone")
    return spent / reads * 1e6


async def run(rounds: int, reads: int) -> dict[str, Any]:
    server = RedisServer()
    logs = Path(tempfile.mkdtemp(prefix="acp-hot-read-"))
    workspace = tempfile.mkdtemp(prefix="acp-hot-read-ws-")
    hosting = await worker(server.url, logs)
    try:
        app = create_app(Settings(redis_url=server.url, workspaces=[workspace]))
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as client:
                sid = (await client.post("/session", json={"cwd": workspace}, timeout=60)).json()["sessionId"]
                status = await client.get(f"/session/{sid}/status")  # read once: kept from now on
            state = app.acp
            assert state is not None
            ws = workspace_id(workspace)
            body = status.content

            async def floor(scope: dict[str, Any], receive: Any, send: Any) -> None:
                if not await state.fanout.sync(ws):
                    raise RuntimeError("the change link is not current")
                await send({"type": "http.response.start", "status": 200,
                            "headers": [(b"content-length", str(len(body)).encode()), (b"content-type", b"application/json")]})
                await send({"type": "http.response.body", "body": body})

            bare = hello()
            hits = sum(CACHE_HITS.counts.values())
            runs: dict[str, list[float]] = {"status": [], "floor": [], "hello": []}
            for _ in range(rounds):
                runs["status"].append(await cpu_us_per_read(app, f"/session/{sid}/status", reads))
                runs["floor"].append(await cpu_us_per_read(floor, f"/session/{sid}/status", reads))
                runs["hello"].append(await cpu_us_per_read(bare, "/", reads))
            if sum(CACHE_HITS.counts.values()) - hits < rounds * reads:
                raise RuntimeError("status reads were not served from the cache")
    finally:
        await hosting.terminate(30)
        server.stop()
    least = {name: round(min(values), 2) for name, values in runs.items()}
    return {
        "rounds": rounds,
        "reads_per_round": reads,
        "cpu_us_per_read": least,
        "cpu_us_per_read_of_rounds": {name: [round(v, 2) for v in values] for name, values in runs.items()},
        "status_extra_over_floor_us": round(least["status"] - least["floor"], 2),
        "status_share_of_floor": round(least["floor"] / least["status"], 3),
        "status_share_of_hello": round(least["hello"] / least["status"], 3),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--reads", type=int, default=2000)
    args = parser.parse_args()
    try:
        import uvloop

        uvloop.install()  # as `acp-state api` runs
    except ImportError:
        pass
    result = asyncio.run(run(args.rounds, args.reads))
    least = result["cpu_us_per_read"]
    print(f"CPU per read, least of {args.rounds} rounds of {args.reads}: status {least['status']} us, "
          f"floor (the same sync, then the same bytes) {least['floor']} us, Starlette hello {least['hello']} us")
    print(f"status: {result['status_extra_over_floor_us']} us above the floor; "
          f"{result['status_share_of_floor']:.0%} of the floor's rate, {result['status_share_of_hello']:.0%} of the hello's")
    (RESULTS / "hot_read.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
