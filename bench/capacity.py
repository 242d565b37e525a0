"""`python -m bench.capacity`: the capacity model of docs/capacity.md, from measured unit costs.

    python -m bench.capacity [--run] [--scale bench/results/scale.json] [--sessions 1000000]
                             [--sse-clients 100000] [--active 0.05] [--events-per-s 5] ...

Reads the scale run's unit costs (`python -m bench --scale`; `--run` runs it first), measures
a cluster shard's own figures (a 3-master cluster of redis-server: Redis CPU per state
transition and per bare HSET on each shard), and prints, for the deployment asked for, how
many Redis shards, API processes and workers it needs and which unit sets each number.
Writes bench/results/capacity.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from pathlib import Path
from typing import Any


from acp_state import events
from acp_state.store import Mode, RedisStore, Transition
from acp_state.store.connection import connect
from testbed.redis_server import RedisCluster

from .procs import cpu_s
from .scale import RESULTS

MIB = 2**20


async def shard_figures(transitions: int = 20_000, sessions: int = 300) -> dict[str, Any]:
    """Redis CPU per APPLY (one event, one subscriber-less channel) and per bare HSET, on
    each master of a 3-master cluster, with the load spread over all shards."""
    cluster = RedisCluster(masters=3).start()
    try:
        store = RedisStore(connect(cluster.url))
        workspaces = [f"capacityws{n:06d}" for n in range(30)]  # spread over the slots
        owner = "capacity-owner"
        targets = [(workspaces[n % len(workspaces)], f"s{n}") for n in range(sessions)]
        for ws, sid in targets:
            await store.apply(ws, sid, owner, Transition(mode=Mode.CREATE, meta={}))
        pids = [node.process.pid for node in cluster.nodes]
        cpu0 = [cpu_s(p) for p in pids]
        started = time.perf_counter()
        per_session = transitions // sessions

        async def churn(ws: str, sid: str) -> None:
            for i in range(per_session):
                await store.apply(ws, sid, owner, Transition(active=bool(i % 2), events=[events.body("bench", {"i": i})]))

        await asyncio.gather(*(churn(ws, sid) for ws, sid in targets))
        elapsed = time.perf_counter() - started
        done = per_session * sessions
        apply_cpu = sum(cpu_s(p) - c for p, c in zip(pids, cpu0))
        await store.close()

        bare = connect(cluster.url)
        cpu0 = [cpu_s(p) for p in pids]
        hsets = 20_000

        async def hset(n: int) -> None:
            for i in range(hsets // 200):
                await bare.hset(f"capacity:bare:{n}", "f", i)

        await asyncio.gather(*(hset(n) for n in range(200)))
        hset_cpu = sum(cpu_s(p) - c for p, c in zip(pids, cpu0))
        await bare.aclose()
        return {
            "shards": 3,
            "transitions": done,
            "transitions_per_s_driven": round(done / elapsed),
            "redis_cpu_us_per_transition": round(apply_cpu * 1e6 / done, 1),
            "redis_cpu_us_per_bare_hset": round(hset_cpu * 1e6 / hsets, 1),
            "note": "CPU summed over the three masters; a shard's ceiling is one core divided by it",
        }
    finally:
        cluster.stop()


def model(scale: dict[str, Any], shard: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """What `args.sessions` live sessions and `args.sse_clients` streams need, and why."""
    rest, creation, streams, reads = scale["at_rest"], scale["creation"], scale["event_streams"], scale["reads"]
    busy = args.busy  # the share of a core or of a memory budget we plan to use
    events_per_s = args.sessions * args.active * args.events_per_s
    deliveries_per_s = args.sse_clients * args.active * args.events_per_s
    reads_per_s = args.sse_clients * args.reads_per_s
    creates_per_s = args.creates_per_s

    # Redis: memory of the idle sessions, and CPU of the transitions.
    redis_bytes = rest["redis_bytes_per_session"] * args.sessions
    shards_memory = redis_bytes / (args.shard_memory_gib * 1024 * MIB * busy)
    redis_us = shard["redis_cpu_us_per_transition"]
    shards_cpu = events_per_s * redis_us / 1e6 / busy
    shards = max(1, math.ceil(max(shards_memory, shards_cpu)))

    # Workers: memory per hosted session (worker + its agent children), and create CPU.
    per_session_rss = rest["worker_rss_bytes_per_session"] + rest["agent_children_rss_bytes_per_session"]
    by_rss = args.worker_memory_gib * 1024 * MIB * busy / per_session_rss
    sessions_per_worker = min(by_rss, args.max_sessions_per_worker)
    workers_memory = args.sessions / sessions_per_worker
    worker_create_ms = creation["cpu_ms_per_create"]["worker"] + creation["cpu_ms_per_create"]["agent"]
    workers_cpu = creates_per_s * worker_create_ms / 1000 / busy
    workers = max(1, math.ceil(max(workers_memory, workers_cpu)))

    # API processes: memory per stream, CPU per delivered event, per status read, per create.
    api_rss = streams["api_rss_bytes_per_connection"]
    apis_memory = args.sse_clients * api_rss / (args.api_memory_gib * 1024 * MIB * busy)
    api_event_ms = streams["cpu_ms_per_event"]["api"]
    status_ms = 1000 / reads["status"]["rps"]  # one process at 100% of a core
    api_create_ms = creation["cpu_ms_per_create"]["api"]
    api_cpu = (deliveries_per_s * api_event_ms + reads_per_s * status_ms + creates_per_s * api_create_ms) / 1000 / busy
    apis = max(1, math.ceil(max(apis_memory, api_cpu, args.sse_clients / args.max_streams_per_api)))

    def why(memory: float, cpu: float, other: float = 0.0) -> str:
        return max((memory, "memory"), (cpu, "CPU"), (other, "streams per process"))[1]

    return {
        "asked": {"sessions": args.sessions, "sse_clients": args.sse_clients, "active_share": args.active,
                  "events_per_s_per_active_session": args.events_per_s, "status_reads_per_s_per_client": args.reads_per_s,
                  "creates_per_s": creates_per_s, "planned_utilisation": busy},
        "load": {"transitions_per_s": round(events_per_s), "event_deliveries_per_s": round(deliveries_per_s),
                 "status_reads_per_s": round(reads_per_s)},
        "redis": {"shards": shards, "bound_by": why(shards_memory, shards_cpu),
                  "memory_gib": round(redis_bytes / 1024 / MIB, 2), "by_memory": round(shards_memory, 2),
                  "by_cpu": round(shards_cpu, 2), "shard_memory_gib": args.shard_memory_gib},
        "workers": {"processes": workers,
                    "bound_by": ("sessions per worker (--max-sessions-per-worker)" if by_rss > args.max_sessions_per_worker
                                 and workers_memory >= workers_cpu else why(workers_memory, workers_cpu)),
                    "sessions_per_worker": round(sessions_per_worker), "by_memory": round(workers_memory, 2),
                    "by_create_cpu": round(workers_cpu, 2), "worker_memory_gib": args.worker_memory_gib},
        "apis": {"processes": apis, "bound_by": why(apis_memory, api_cpu, args.sse_clients / args.max_streams_per_api),
                 "by_memory": round(apis_memory, 2), "by_cpu": round(api_cpu, 2),
                 "by_streams_per_process": round(args.sse_clients / args.max_streams_per_api, 2)},
    }


def markdown(scale: dict[str, Any], shard: dict[str, Any], plan: dict[str, Any]) -> str:
    rest, creation, streams, reads = scale["at_rest"], scale["creation"], scale["event_streams"], scale["reads"]
    asked, load = plan["asked"], plan["load"]
    lines = [
        f"Unit costs from the scale run of {scale['date']} ({scale['machine']}, {scale['server']}), "
        f"{rest['live_sessions']:,} live sessions; shard figures from a 3-master cluster in the same command.",
        "",
        "| unit | measured | where its limit comes from |",
        "| --- | --- | --- |",
        f"| Redis memory per idle live session | {rest['redis_bytes_per_session']:,} B | the session hash, its index entries and locator (`INFO memory` before and after) |",
        f"| Redis CPU per state transition (APPLY with one event) | {shard['redis_cpu_us_per_transition']} µs per shard (bare HSET {shard['redis_cpu_us_per_bare_hset']} µs) | one core per shard: Redis runs scripts on one thread |",
        f"| worker RSS per idle session | {rest['worker_rss_bytes_per_session']:,} B (+ {rest['agent_children_rss_bytes_per_session']:,} B in the scripted agent children) | the worker's session objects; a real agent's child costs far more, per workspace |",
        "| CPU per create, ms (API / Redis / worker / agent / load) | " + " / ".join(str(creation['cpu_ms_per_create'][r]) for r in ("api", "redis", "worker", "agent", "load")) + f" | the busiest process: {max(('api', 'worker', 'agent', 'redis'), key=lambda r: creation['cpu_ms_per_create'][r])} |",
        f"| API RSS per open event stream | {streams['api_rss_bytes_per_connection']:,} B | the stream's task, its subscription buffer and the server's connection |",
        f"| API CPU per delivered event | {streams['cpu_ms_per_event']['api'] * 1000:.0f} µs | one core per API process (one event loop) |",
        f"| API CPU per status read | {1e6 / reads['status']['rps']:.0f} µs ({reads['status']['rps']:,} req/s per process) | one event loop per process |",
        "| Redis commands per heartbeat | " + " / ".join(f"{v} at {n} sessions" for n, v in rest['heartbeat_commands'].items()) + " | constant: one script, whatever the session count |",
        "",
        f"Deployment asked: {asked['sessions']:,} live sessions, {asked['sse_clients']:,} SSE clients, "
        f"{asked['active_share']:.0%} of sessions running a turn at {asked['events_per_s_per_active_session']} events/s, "
        f"{asked['status_reads_per_s_per_client']} status reads/s per client, {asked['creates_per_s']} creates/s, "
        f"planned at {asked['planned_utilisation']:.0%} of each core and memory budget. "
        f"That is {load['transitions_per_s']:,} transitions/s, {load['event_deliveries_per_s']:,} event deliveries/s "
        f"and {load['status_reads_per_s']:,} status reads/s.",
        "",
        "| tier | needs | bound by | by memory | by CPU | note |",
        "| --- | --- | --- | --- | --- | --- |",
        f"| Redis shards | **{plan['redis']['shards']}** | {plan['redis']['bound_by']} | {plan['redis']['by_memory']} | {plan['redis']['by_cpu']} | {plan['redis']['memory_gib']} GiB of sessions; {plan['redis']['shard_memory_gib']} GiB per shard |",
        f"| workers | **{plan['workers']['processes']}** | {plan['workers']['bound_by']} | {plan['workers']['by_memory']} | {plan['workers']['by_create_cpu']} | {plan['workers']['sessions_per_worker']:,} sessions each, {plan['workers']['worker_memory_gib']} GiB each (scripted agent) |",
        f"| API processes | **{plan['apis']['processes']}** | {plan['apis']['bound_by']} | {plan['apis']['by_memory']} | {plan['apis']['by_cpu']} | {plan['apis']['by_streams_per_process']} by streams per process |",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run", action="store_true", help="run `python -m bench --scale` first")
    parser.add_argument("--scale", default=str(RESULTS / "scale.json"))
    parser.add_argument("--sessions", type=int, default=1_000_000)
    parser.add_argument("--sse-clients", type=int, default=100_000)
    parser.add_argument("--active", type=float, default=0.05, help="share of sessions running a turn")
    parser.add_argument("--events-per-s", type=float, default=5, help="events/s of a running turn")
    parser.add_argument("--reads-per-s", type=float, default=0.2, help="status reads/s per SSE client")
    parser.add_argument("--creates-per-s", type=float, default=500)
    parser.add_argument("--busy", type=float, default=0.7, help="planned share of each core and memory budget")
    parser.add_argument("--shard-memory-gib", type=float, default=8)
    parser.add_argument("--worker-memory-gib", type=float, default=4)
    parser.add_argument("--api-memory-gib", type=float, default=4)
    parser.add_argument("--max-sessions-per-worker", type=int, default=50_000)
    parser.add_argument("--max-streams-per-api", type=int, default=10_000, help="the most measured on one process")
    args = parser.parse_args()
    if args.run:
        from . import scale

        scale.main(["--out", args.scale])
    scale_result = json.loads(Path(args.scale).read_text())
    shard = asyncio.run(shard_figures())
    plan = model(scale_result, shard, args)
    print(markdown(scale_result, shard, plan))
    (RESULTS / "capacity.json").write_text(json.dumps({"shard": shard, "plan": plan}, indent=2) + "\n")


if __name__ == "__main__":
    main()
