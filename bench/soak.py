"""Soak: a scaled-out deployment under steady load for a while, watching for drift.

4 workers, 2 API processes, 2,000 live scripted sessions; a separate load process keeps
prompting (`#permission` turns answered by votes, plain echo turns) and polling status and
listings for `--minutes`. Reports throughput, p99 latencies, Redis memory per session, and
the processes' RSS over time (flat = no leak). `--cluster` runs it all on a 3-master Redis
Cluster instead of one Redis (results in soak-cluster.json). Run:
    python -m bench.soak [--minutes 10] [--sessions 2000] [--cluster]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import redis.asyncio as aioredis

from acp_state.ids import workspace_id
from testbed.redis_server import RedisCluster

from .__main__ import create_sessions, log
from .procs import RedisServer, api, percentile, worker

RESULTS = Path(__file__).resolve().parent / "results"


def rss_mb(pid: int) -> float:
    return int(Path(f"/proc/{pid}/status").read_text().split("VmRSS:")[1].split()[0]) / 1024


async def used_memory(ports: list[int]) -> int:
    """Redis memory in use, summed over every node."""
    total = 0
    for port in ports:
        client = aioredis.Redis(port=port)
        total += (await client.info("memory"))["used_memory"]
        await client.aclose()
    return total


async def soak(minutes: float, sessions: int, cluster: bool = False) -> dict[str, Any]:
    server: Any = RedisCluster().start() if cluster else RedisServer()
    ports = [node.port for node in server.nodes] if cluster else [server.port]
    logs = Path(tempfile.mkdtemp(prefix="acp-soak-"))
    workspace = str(logs)
    workers = [await worker(server.url, logs, "--max-sessions", str(sessions)) for _ in range(4)]
    apis = [await api(server.url, workspace, logs) for _ in range(2)]
    clients = [httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) for _, port in apis]
    latencies: dict[str, list[float]] = {"status": [], "listing": [], "prompt": [], "vote": [], "turn": []}
    counts = dict.fromkeys(latencies, 0)
    errors: list[str] = []
    transport_errors: list[str] = []
    rss: list[dict[str, float]] = []
    try:
        base_memory = await used_memory(ports)
        sids = await create_sessions(clients[0], workspace, sessions)
        memory_per_session = (await used_memory(ports) - base_memory) / sessions
        ws = workspace_id(workspace)
        stop_at = time.monotonic() + minutes * 60

        async def timed(kind: str, call) -> Any:
            started = time.perf_counter()
            try:
                response = await call
            except httpx.TransportError as error:  # a keep-alive connection closed under us
                transport_errors.append(f"{kind} {type(error).__name__}")
                return httpx.Response(599)
            latencies[kind].append((time.perf_counter() - started) * 1000)
            counts[kind] += 1
            if response.status_code >= 500:
                errors.append(f"{kind} {response.status_code} {response.text[:200]}")
            return response

        async def turns(n: int) -> None:
            """One conversation at a time per task: a permission turn, voted from the other API."""
            while time.monotonic() < stop_at:
                sid = random.choice(sids)
                client, other = random.sample(clients, 2)
                started = time.perf_counter()
                text = "#permission" if n % 2 else "hello"
                accepted = await timed("prompt", client.post(f"/session/{sid}/prompt", json={"prompt": [{"type": "text", "text": text}]}))
                if accepted.status_code != 202:  # 503 queue full, or a dropped connection
                    await asyncio.sleep(0.05)
                    continue
                while time.monotonic() < stop_at:
                    answer = await timed("status", other.get(f"/session/{sid}/status"))
                    if answer.status_code != 200:
                        continue
                    status = answer.json()
                    pending = status.get("pendingInteractions") or []
                    if pending:
                        rid = pending[0]["requestId"]
                        body = {"outcome": {"outcome": "selected", "optionId": "proceed_once"}}
                        await timed("vote", client.post(f"/session/{sid}/permission/{rid}", json=body))
                    elif not status.get("hasActivePrompt"):
                        break
                    await asyncio.sleep(0.02)
                latencies["turn"].append((time.perf_counter() - started) * 1000)
                counts["turn"] += 1

        async def pollers() -> None:
            while time.monotonic() < stop_at:
                client = random.choice(clients)
                await timed("listing", client.get(f"/workspace/{ws}/sessions?size=100"))
                await timed("status", client.get(f"/session/{random.choice(sids)}/status"))

        async def sample_rss() -> None:
            while time.monotonic() < stop_at:
                rss.append({"t": round(time.monotonic() - (stop_at - minutes * 60)),
                            **{f"worker{i}": rss_mb(w.pid) for i, w in enumerate(workers)},
                            **{f"api{i}": rss_mb(a.pid) for i, (a, _) in enumerate(apis)}})
                await asyncio.sleep(max(5.0, minutes * 60 / 20))

        log(f"soak: {sessions} sessions, {minutes} min")
        started = time.monotonic()
        await asyncio.gather(*(turns(n) for n in range(24)), *(pollers() for _ in range(8)), sample_rss())
        elapsed = time.monotonic() - started
    finally:
        for client in clients:
            await client.aclose()
        for process in workers + [a for a, _ in apis]:
            await process.terminate(30)
        server.stop()
    first, last = rss[0], rss[-1]
    return {
        "redis": "3-master cluster" if cluster else "single",
        "minutes": minutes,
        "sessions": sessions,
        "throughput_per_s": {k: round(v / elapsed, 1) for k, v in counts.items()},
        "p99_ms": {k: round(percentile(v, 99), 2) for k, v in latencies.items() if v},
        "p50_ms": {k: round(percentile(v, 50), 2) for k, v in latencies.items() if v},
        "server_errors": len(errors),
        "client_transport_errors": len(transport_errors),
        "first_errors": errors[:5],
        "redis_bytes_per_session": round(memory_per_session),
        "rss_mb_first_last": {k: [round(first[k]), round(last[k])] for k in first if k != "t"},
        "rss_samples": rss,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--sessions", type=int, default=2000)
    parser.add_argument("--cluster", action="store_true", help="a 3-master Redis Cluster instead of one Redis")
    args = parser.parse_args()
    result = asyncio.run(soak(args.minutes, args.sessions, args.cluster))
    summary = {k: v for k, v in result.items() if k != "rss_samples"}
    print(json.dumps(summary, indent=2))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / ("soak-cluster.json" if args.cluster else "soak.json")).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
