"""Publish-to-SSE latency: from a worker's state transition to an SSE client's receipt.

Baseline, same run: a bare sharded Redis publish (SPUBLISH, what the APPLY script uses) to a
redis-py SSUBSCRIBE subscriber. Run:
    python -m bench.sse_latency [--samples 2000] [--server granian|uvicorn]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import httpx
import redis.asyncio as aioredis

from acp_state import events
from acp_state.ids import workspace_id
from acp_state.store import RedisStore, Transition

from acp_state.cli.serving import DEFAULT_SERVER, SERVERS

from .procs import RedisServer, api, percentile, worker

RESULTS = Path(__file__).resolve().parent / "results"


async def _bare_publish(redis_url: str, samples: int) -> list[float]:
    publisher = aioredis.Redis.from_url(redis_url)
    subscriber = aioredis.Redis.from_url(redis_url)
    pubsub = subscriber.pubsub()
    await pubsub.ssubscribe("bench:bare")
    await pubsub.get_message(timeout=1)  # the subscribe confirmation
    payload = b"x" * 300
    latencies = []
    for _ in range(samples):
        started = time.perf_counter()
        await publisher.spublish("bench:bare", payload)
        while (await pubsub.get_message(timeout=5)) is None:
            pass
        latencies.append((time.perf_counter() - started) * 1000)
    await pubsub.aclose()
    await publisher.aclose()
    await subscriber.aclose()
    return latencies


async def _publish_to_sse(redis_url: str, port: int, workspace: str, samples: int) -> list[float]:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
        sid = (await client.post("/session", json={"cwd": workspace, "sessionScope": "thread"})).json()["sessionId"]
        redis = aioredis.Redis.from_url(redis_url, decode_responses=True)
        store = RedisStore(redis)
        ws = workspace_id(workspace)
        owner = (await store.session(ws, sid)).owner  # type: ignore[union-attr]
        arrived: asyncio.Queue[float] = asyncio.Queue()

        async def read() -> None:
            async with client.stream("GET", f"/session/{sid}/events", timeout=None) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: ") and '"bench_probe"' in line:
                        arrived.put_nowait(time.perf_counter())

        reader = asyncio.ensure_future(read())
        # Warm up until the stream is attached.
        while True:
            await store.apply(ws, sid, owner, Transition(events=[events.body("bench_probe", {"n": -1})]))
            try:
                await asyncio.wait_for(arrived.get(), 0.5)
                break
            except asyncio.TimeoutError:
                continue
        latencies = []
        for n in range(samples):
            started = time.perf_counter()
            # The worker's path exactly: one APPLY (hash + stream + SPUBLISH), then fan-out.
            await store.apply(ws, sid, owner, Transition(events=[events.body("bench_probe", {"n": n, "pad": "x" * 200})]))
            received = await asyncio.wait_for(arrived.get(), 10)
            latencies.append((received - started) * 1000)
        reader.cancel()
        await redis.aclose()
        return latencies


async def run(samples: int, server_name: str = DEFAULT_SERVER) -> dict:
    server = RedisServer()
    logs = Path(tempfile.mkdtemp(prefix="acp-bench-"))
    workspace = str(logs)
    processes = []
    try:
        processes.append(await worker(server.url, logs))
        api_process, port = await api(server.url, workspace, logs, server=server_name)
        processes.append(api_process)
        bare = await _bare_publish(server.url, samples)
        sse = await _publish_to_sse(server.url, port, workspace, samples)
    finally:
        for process in reversed(processes):
            await process.terminate(30)
        server.stop()

    def summary(values: list[float]) -> dict:
        return {"p50_ms": round(percentile(values, 50), 3), "p99_ms": round(percentile(values, 99), 3)}

    result = {
        "server": server_name,
        "samples": samples,
        "publish_to_sse": summary(sse),
        "baseline_bare_publish": summary(bare),
    }
    result["ratio_p50"] = round(result["publish_to_sse"]["p50_ms"] / result["baseline_bare_publish"]["p50_ms"], 2)
    result["ratio_p99"] = round(result["publish_to_sse"]["p99_ms"] / result["baseline_bare_publish"]["p99_ms"], 2)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--server", choices=SERVERS, default=DEFAULT_SERVER, help="the API's ASGI server")
    args = parser.parse_args()
    result = asyncio.run(run(args.samples, args.server))
    print(f"{'':28} {'p50 ms':>8} {'p99 ms':>8}")
    print(f"{'worker publish -> SSE':28} {result['publish_to_sse']['p50_ms']:8.3f} {result['publish_to_sse']['p99_ms']:8.3f}")
    print(f"{'bare PUBLISH -> subscriber':28} {result['baseline_bare_publish']['p50_ms']:8.3f} {result['baseline_bare_publish']['p99_ms']:8.3f}")
    print(f"{'ratio':28} {result['ratio_p50']:8.2f} {result['ratio_p99']:8.2f}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "sse_latency.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
