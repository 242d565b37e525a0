"""`python -m bench --scale`: one Redis, 4 workers and 2 API processes holding 100,000 live
scripted sessions in 10 workspaces on this machine; each figure beside its goal and the
baseline of the same run.

    python -m bench --scale [--sessions 100000] [--sse-clients 10000] [--profile]

Sections, in order (each reuses what the one before built):

1. creation: every session created through the 2 APIs, with the CPU each process spent per
   create (API, Redis, worker, agent child, load) and, with --profile, a py-spy profile of
   the busiest process;
2. at rest: Redis memory and worker RSS per idle session, the heartbeat's cost;
3. reads: status and a listing page of a 10,000-session workspace, beside a bare hello on
   the same stack;
4. event streams: --sse-clients SSE connections on one API process, each following another
   session; the API's RSS per connection; one event to each session, and its delivery
   latency; status reads meanwhile;
5. recovery: kill -9 of the worker with the most sessions; when readers stop seeing them,
   when their keys are gone, when each SSE client following one had its `session_died`, and
   the survivors' renewals meanwhile.

Writes bench/results/scale.json; `python -m bench.capacity` turns it into docs/capacity.md's
model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import redis.asyncio as aioredis

from acp_state.ids import workspace_id
from acp_state.store import RedisStore, keys
from testbed.processes import ROOT, AcpProcess
from testbed.redis_server import free_port

from .__main__ import heartbeat_cost, log, run_wrk, server_stack, wait_port
from .procs import RedisServer, api, children, cpu_s, percentile, rss_bytes, worker
from .scale_load import Http, now_ns
from .scale_streams import Streams, bare_stream_rss_bytes, delivery, emit_one_event_each

RESULTS = Path(__file__).resolve().parent / "results"
WORKERS = 4
APIS = 2
WORKSPACES = 10
LEASE_MS = 3000
CREATE_CONNECTIONS = 48  # per API process
REPLY_KEPT_S = 80  # a create's answer is kept 75 s (the API's wait + 15 s)

GOALS = {
    "redis_bytes_per_session": 1536,
    "worker_rss_bytes_per_session": 4096,
    "listing_p99_ms": 20.0,
    "read_share_of_hello": 0.8,
    "creates_per_s": 500,
    "readers_stop_seeing_s": LEASE_MS / 1000,
    "died_within_s": LEASE_MS / 1000 + 2,
    "sse_rss_bytes_per_connection": 10 * 1024,
    "sse_event_p99_ms": 100.0,
    "status_p99_during_sse_ms": 50.0,
}


# ---- processes --------------------------------------------------------------------------


class Cluster:
    """The processes of one run and what they cost."""

    def __init__(self, redis: RedisServer, logs: Path, cwds: list[str]) -> None:
        self.redis = redis
        self.logs = logs
        self.cwds = cwds
        self.workers: list[AcpProcess] = []
        self.apis: list[tuple[AcpProcess, int]] = []

    def pids(self) -> dict[str, list[int]]:
        agents = [c for w in self.workers if w.proc and w.proc.returncode is None for c in children(w.pid)]
        return {
            "api": [p.pid for p, _ in self.apis],
            "worker": [w.pid for w in self.workers if w.proc and w.proc.returncode is None],
            "agent": agents,
            "redis": [self.redis.process.pid],
            "load": [os.getpid()],
        }

    def cpu(self) -> dict[str, float]:
        return {role: sum(cpu_s(p) for p in pids) for role, pids in self.pids().items()}


# ---- 1. creation ------------------------------------------------------------------------


async def create_all(cluster: Cluster, total: int) -> tuple[dict[str, list[str]], float, int]:
    """Create `total` sessions, spread evenly over the workspaces and the API processes;
    returns the session ids per workspace cwd, the seconds it took and the failures."""
    plan = [cluster.cwds[n % len(cluster.cwds)] for n in range(total)]
    sids: dict[str, list[str]] = {cwd: [] for cwd in cluster.cwds}
    failures = 0
    cursor = 0

    async def client(port: int) -> None:
        nonlocal cursor, failures
        http = Http(port)
        try:
            while cursor < len(plan):
                cwd = plan[cursor]
                cursor += 1
                status, body = await http.request("POST", "/session", {"cwd": cwd, "sessionScope": "thread"})
                if status == 200:
                    sids[cwd].append(json.loads(body)["sessionId"])
                    done = sum(len(v) for v in sids.values())
                    if done % 10_000 == 0:
                        log(f"  {done}/{total} sessions")
                else:
                    failures += 1
                    if failures <= 5:
                        log(f"  create failed: {status} {body[:200]!r}")
        finally:
            await http.close()

    started = time.monotonic()
    await asyncio.gather(*(client(port) for _, port in cluster.apis for _ in range(CREATE_CONNECTIONS)))
    return sids, time.monotonic() - started, failures


def profile(pid: int, seconds: int, out: Path, after_s: float = 0) -> dict[str, Any] | None:
    """py-spy samples of a process, `after_s` from now: the functions its CPU went to (by
    own time, and by time including callees), top 15 each; the collapsed stacks are kept."""
    spy = shutil.which("py-spy")
    if spy is None:
        return None
    time.sleep(after_s)
    raw = out.with_suffix(".collapsed.txt")
    subprocess.run([spy, "record", "--pid", str(pid), "--duration", str(seconds), "--format", "raw",
                    "--output", str(raw), "--nonblocking"], capture_output=True)
    if not raw.exists():
        return None
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = [f.split(" (")[0] + " (" + f.split(" (")[-1].split(":")[0].rsplit("/", 1)[-1] + ")" for f in stack.split(";")]
        n = int(count)
        total += n
        own[frames[-1]] += n
        for frame in set(frames):
            inclusive[frame] += n

    def top(counter: Counter[str]) -> list[str]:
        return [f"{100 * n / total:5.1f}%  {name}" for name, n in counter.most_common(15)]

    return {"samples": total, "own": top(own), "inclusive": top(inclusive), "collapsed": str(raw)}


# ---- 5. recovery ------------------------------------------------------------------------


async def recovery(store: RedisStore, victim: AcpProcess, victim_inc: str,
                   victim_sids: list[tuple[str, str]], api_port: int) -> dict[str, Any]:
    """kill -9 the victim; time what readers see, what Redis holds and the survivors' renewals."""
    sample = random.Random(14).sample(victim_sids, min(100, len(victim_sids)))
    survivor_deadlines: dict[str, list[tuple[float, float]]] = {}
    readers = [Http(api_port) for _ in range(10)]
    leases = await store.lease_view()
    deadline_ms = leases.deadlines.get(victim_inc)
    killed = time.monotonic()
    lease_left_s = (deadline_ms - leases.redis_now_ms) / 1000 if deadline_ms else None
    assert victim.proc is not None
    victim.proc.kill()
    await victim.proc.wait()
    stop_watch = asyncio.Event()

    async def watch_renewals() -> None:
        while not stop_watch.is_set():
            for member, score in (await store.lease_view()).deadlines.items():
                if member != victim_inc:
                    series = survivor_deadlines.setdefault(member, [])
                    if not series or series[-1][1] != score:
                        series.append((time.monotonic() - killed, score))
            await asyncio.sleep(0.05)

    async def watch_readers() -> tuple[float, float]:
        """Status reads of the sample, each reader going round its part until every one of
        them answers 404: when the last read that still found one live was sent, and when
        its answer came (the API may have been busy in between)."""
        last_live: tuple[float, float] = (0.0, 0.0)

        async def read(reader: Http, part: list[tuple[str, str]]) -> None:
            nonlocal last_live
            gone: set[str] = set()
            while len(gone) < len(part):
                for _, sid in part:
                    sent = time.monotonic() - killed
                    if (await reader.request("GET", f"/session/{sid}/status"))[0] == 404:
                        gone.add(sid)
                    else:
                        gone.discard(sid)
                        last_live = max(last_live, (sent, time.monotonic() - killed))

        await asyncio.gather(*(read(r, sample[n::len(readers)]) for n, r in enumerate(readers)))
        return last_live

    async def watch_keys() -> float:
        """When no key of the victim's sessions is left. The sweeper deletes the worker's
        session index last, once every session is gone (`forget_worker`): whether it is still
        there is asked every 50 ms, and when it is gone every session is looked up, which
        must find none (else the watch goes on). Asking for all 25,000 every round loaded
        the very Redis and cores being measured: the readers' rounds took 1.9 s in that run."""
        remaining = list(victim_sids)
        while True:
            if not await store.has_worker_index(victim_inc):
                at = time.monotonic() - killed
                left = []
                for first in range(0, len(remaining), 1000):
                    batch = remaining[first:first + 1000]
                    views = await asyncio.gather(*(store.session(ws, sid) for ws, sid in batch))
                    left += [session for session, view in zip(batch, views) if view is not None]
                remaining = left
                if not remaining:
                    return at
            await asyncio.sleep(0.05)

    watcher = asyncio.ensure_future(watch_renewals())
    try:
        limit_s = LEASE_MS / 1000 * 4 + 30
        (seen_sent, seen_answered), gone_at = await asyncio.wait_for(asyncio.gather(watch_readers(), watch_keys()), limit_s)
    finally:
        stop_watch.set()
        await watcher
        for reader in readers:
            await reader.close()
    gaps = []
    for series in survivor_deadlines.values():
        renewals = [t for t, _ in series]
        gaps += [b - a for a, b in zip(renewals, renewals[1:])]
    return {
        "victim_sessions": len(victim_sids),
        "readers_stop_seeing_s": round(seen_sent, 2),
        "readers_last_live_answer_s": round(seen_answered, 2),
        "lease_left_at_kill_s": round(lease_left_s, 2) if lease_left_s is not None else None,
        "keys_gone_s": round(gone_at, 2) if gone_at is not None else None,
        "survivor_renewal_gap_max_s": round(max(gaps), 2) if gaps else None,
        "survivor_renewals": sum(len(s) for s in survivor_deadlines.values()),
        "heartbeat_interval_s": round(LEASE_MS / 3000, 2),
    }


# Seven short rounds: the machine's speed drifts within seconds (neighbours on a shared
# host), and a median of seven paired ratios rides out a slow spell that three did not.
READ_ROUNDS = 7
READ_SECONDS = 3
# A reader takes the latest moment Redis can have read its clock in a lease view's round
# trip (acp_state/store/registry.py), erring towards "live" by up to that round trip.
READER_LENIENCY_S = 0.1


def interleaved(urls: dict[str, str], pids: dict[str, int], rounds: int = READ_ROUNDS) -> dict[str, dict[str, Any]]:
    """`run_wrk` on each URL in turn, `rounds` times over: per URL, the run of median
    requests/s, and the CPU its server process spent per request (`pids`: the process
    serving each URL; granian's threads included). A shared machine's speed drifts within
    a minute (the hello alone moved by a third between runs), so shares are taken round by
    round (`paired_share`); CPU per request drifts much less than requests/s."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in urls}
    for _ in range(rounds):
        for name, url in urls.items():
            before = cpu_s(pids[name])
            run = run_wrk(url, READ_SECONDS)
            run["cpu_us_per_request"] = round((cpu_s(pids[name]) - before) * 1e6 / max(run["requests"], 1), 1)
            runs[name].append(run)
    return {name: {**sorted(each, key=lambda run: run["rps"])[len(each) // 2],
                   "rps_of_rounds": [run["rps"] for run in each],
                   "cpu_us_per_request_of_rounds": [run["cpu_us_per_request"] for run in each]}
            for name, each in runs.items()}


def paired_share(reads: dict[str, Any], name: str, baseline: str) -> float:
    """The median over rounds of `name`'s requests/s over `baseline`'s of the same round."""
    shares = sorted(a / b for a, b in zip(reads[name]["rps_of_rounds"], reads[baseline]["rps_of_rounds"]))
    return round(shares[len(shares) // 2], 2)


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def cpu_share(reads: dict[str, Any], name: str, baseline: str) -> float:
    """Requests per CPU-second of `name`'s server over `baseline`'s, the median over rounds:
    what each would answer with a core to itself."""
    shares = sorted(b / a for a, b in zip(reads[name]["cpu_us_per_request_of_rounds"],
                                          reads[baseline]["cpu_us_per_request_of_rounds"]))
    return round(shares[len(shares) // 2], 2)


# ---- the run ----------------------------------------------------------------------------


async def run(args: argparse.Namespace) -> dict[str, Any]:
    total, sse_clients = args.sessions, args.sse_clients
    redis_server = RedisServer()
    logs = Path(tempfile.mkdtemp(prefix="acp-scale-"))
    cwds = []
    for n in range(WORKSPACES):
        path = logs / f"ws{n}"
        path.mkdir()
        cwds.append(str(path))
    cluster = Cluster(redis_server, logs, cwds)
    redis = aioredis.Redis.from_url(redis_server.url, decode_responses=True)  # the server's own figures (INFO)
    store = RedisStore.from_url(redis_server.url)
    result: dict[str, Any] = {"sessions": total, "workers": WORKERS, "apis": APIS, "workspaces": WORKSPACES,
                              "lease_ms": LEASE_MS, "goals": GOALS}
    hello_proc = None
    try:
        per_worker = total // WORKERS + 1000
        for _ in range(WORKERS):
            cluster.workers.append(await worker(redis_server.url, logs, "--max-sessions", str(per_worker),
                                                "--lease-ms", str(LEASE_MS)))
        extra = [a for cwd in cwds[1:] for a in ("--workspace", cwd)]
        for _ in range(APIS):
            cluster.apis.append(await api(redis_server.url, cwds[0], logs, *extra, server=args.server))
        # One session per workspace first: the agent children start, the APIs follow the
        # workspaces; what follows measures steady creation.
        warm, _, _ = await create_all(cluster, WORKSPACES)
        await asyncio.sleep(1)
        memory0 = (await redis.info("memory"))["used_memory"]
        rss0 = {w.pid: rss_bytes(w.pid) for w in cluster.workers}
        agents_rss0 = sum(rss_bytes(p) for p in cluster.pids()["agent"])

        # 1. creation
        log(f"creation: {total} sessions through {APIS} APIs ({CREATE_CONNECTIONS} connections each), {WORKERS} workers")
        cpu0 = cluster.cpu()
        profilers = {}
        if args.profile:  # an API process and a worker, for 15 s once the creation is steady
            after = min(20.0, total / 2000)
            profilers = {
                "api": asyncio.ensure_future(asyncio.to_thread(profile, cluster.apis[0][0].pid, 15, RESULTS / "scale-create-api", after)),
                "worker": asyncio.ensure_future(asyncio.to_thread(profile, cluster.workers[0].pid, 15, RESULTS / "scale-create-worker", after)),
            }
        sids, elapsed, failures = await create_all(cluster, total - WORKSPACES)
        cpu1 = cluster.cpu()
        created = sum(len(v) for v in sids.values())
        for cwd, first in warm.items():
            sids[cwd] = first + sids[cwd]
        cpu_ms = {role: round((cpu1[role] - cpu0[role]) * 1000 / max(created, 1), 3) for role in cpu0}
        result["creation"] = {
            "created": created, "failed": failures, "seconds": round(elapsed, 1),
            "creates_per_s": round(created / elapsed), "cpu_ms_per_create": cpu_ms,
            "cpu_ms_per_create_total": round(sum(cpu_ms.values()), 3),
        }
        for role, profiler in profilers.items():
            result["creation"][f"{role}_profile"] = await profiler
        log(f"  {created} in {elapsed:.0f} s: {created / elapsed:.0f}/s; CPU ms per create {cpu_ms}")

        # 2. at rest, once the creates' answers (kept 75 s for their APIs) have expired
        memory_busy = (await redis.info("memory"))["used_memory"]
        log(f"  waiting {REPLY_KEPT_S} s for the creates' answers to expire")
        await asyncio.sleep(REPLY_KEPT_S)
        memory_held = (await redis.info("memory"))["used_memory"]
        # Their TTLs ran out, but Redis frees an expired key only when something touches it
        # or its expire cycle samples it (20 keys a round): 18% of them were still held 80 s
        # on at 10,000 sessions, 29% at 100,000. A SCAN over them frees them, as Redis would in time.
        async for _ in redis.scan_iter(match="acp:reply:*", count=1000):
            pass
        memory1 = (await redis.info("memory"))["used_memory"]
        # A worker whose lease lapsed on the loaded machine had its sessions swept and
        # resumed: the figures below would not be idle sessions'.
        declared_dead = await redis.zcard(keys.DEAD)
        reports = await store.worker_reports(list((await store.lease_view()).deadlines))
        per_worker_sessions = {inc: r.sessions for inc, r in reports.items()}
        rss1 = {w.pid: rss_bytes(w.pid) for w in cluster.workers}
        all_sessions = sum(len(v) for v in sids.values())
        hosted = sum(per_worker_sessions.values())
        result["at_rest"] = {
            "live_sessions": hosted,
            "redis_used_memory_mb": round(memory1 / 2**20, 1),
            "redis_bytes_per_session_right_after_creation": round((memory_busy - memory0) / max(all_sessions - WORKSPACES, 1)),
            "redis_bytes_per_session_with_expired_answers_held": round((memory_held - memory0) / max(all_sessions - WORKSPACES, 1)),
            "redis_bytes_per_session": round((memory1 - memory0) / max(all_sessions - WORKSPACES, 1)),
            "workers_declared_dead": declared_dead,
            "worker_rss_mb": [round(rss1[p] / 2**20, 1) for p in rss1],
            "worker_rss_bytes_per_session": round(sum(rss1[p] - rss0[p] for p in rss1) / max(hosted, 1)),
            "agent_children_rss_mb": round(sum(rss_bytes(p) for p in cluster.pids()["agent"]) / 2**20, 1),
            "agent_children_rss_bytes_per_session": round(
                (sum(rss_bytes(p) for p in cluster.pids()["agent"]) - agents_rss0) / max(hosted, 1)),
            "heartbeat_commands": {"0": await heartbeat_cost(0), str(total // WORKERS): await heartbeat_cost(total // WORKERS)},
        }
        log(f"  at rest: {result['at_rest']}")

        # 3. reads
        port = cluster.apis[0][1]
        big = cwds[0]
        sid = sids[big][0]
        status_path = f"/session/{sid}/status"
        listing_path = f"/workspace/{workspace_id(big)}/sessions?size=100"
        # The bare app also answers each route's very bytes: the stack's own cost of sending
        # a body that size (a listing page of 100 rows is ~30 KB, a hello 17 bytes).
        bodies = {}
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            for name, path in (("status", status_path), ("listing", listing_path)):
                bodies[name] = logs / f"{name}-body.json"
                bodies[name].write_bytes((await http.get(path)).content)
        hello_port = free_port()
        hello_proc = subprocess.Popen([sys.executable, "-m", "bench.hello_app", "--server", args.server,
                                       "--port", str(hello_port), "--ping-url", redis_server.url,
                                       *(f"--body={n}={p}" for n, p in bodies.items())],
                                      cwd=ROOT, stdout=subprocess.DEVNULL)
        await wait_port(hello_port)
        log("reads: status, a listing page of a 10,000-session workspace, bare hello, bare answers of the same bytes")
        bare = f"http://127.0.0.1:{hello_port}"
        urls = {
            "hello": f"{bare}/",
            "status": f"http://127.0.0.1:{port}{status_path}",
            "bare_status_body": f"{bare}/body/status",
            "bare_status_body_after_ping": f"{bare}/raw-ping/status",
            "listing": f"http://127.0.0.1:{port}{listing_path}",
            "bare_listing_body": f"{bare}/body/listing",
        }
        api_pid = cluster.apis[0][0].pid
        reads: dict[str, Any] = interleaved(urls, {name: api_pid if not url.startswith(bare) else hello_proc.pid
                                                   for name, url in urls.items()})
        reads["status_share_of_hello"] = paired_share(reads, "status", "hello")
        reads["status_share_of_bare_after_ping"] = paired_share(reads, "status", "bare_status_body_after_ping")
        reads["bare_after_ping_share_of_hello"] = paired_share(reads, "bare_status_body_after_ping", "hello")
        reads["status_cpu_share_of_hello"] = cpu_share(reads, "status", "hello")
        reads["listing_cpu_share_of_hello"] = cpu_share(reads, "listing", "hello")
        reads["listing_share_of_hello"] = paired_share(reads, "listing", "hello")
        reads["status_share_of_bare_same_body"] = paired_share(reads, "status", "bare_status_body")
        reads["listing_share_of_bare_same_body"] = paired_share(reads, "listing", "bare_listing_body")
        reads["listing_body_bytes"] = bodies["listing"].stat().st_size
        reads["workspace_sessions"] = len(sids[big])
        result["reads"] = reads
        log(f"  {reads}")

        # 4. event streams: one per session, `sse_clients` of them, on API 0
        per_ws = sse_clients // WORKSPACES
        targets = [(workspace_id(cwd), s) for cwd in cwds for s in sids[cwd][1:per_ws + 1]]
        owners = {}
        for first in range(0, len(targets), 1000):
            batch = targets[first:first + 1000]
            for (ws, s), view in zip(batch, await asyncio.gather(*(store.session(ws, s) for ws, s in batch))):
                owners[s] = view.owner if view is not None else None
        log(f"event streams baselines: {len(targets)} bare streams on the same stack, in Starlette and below it")
        bare_stream_rss = {path: await bare_stream_rss_bytes(args.server, path, len(targets), logs)
                           for path in ("/sse", "/raw-sse")}
        api_rss0 = rss_bytes(api_pid)
        log(f"event streams: {len(targets)} SSE connections on one API process")
        streams = Streams(port, [f"/session/{s}/events" for _, s in targets], logs)
        try:
            await streams.ready()
            await asyncio.sleep(2)
            api_rss1 = rss_bytes(api_pid)
            # Round 1, alone: what an event costs. Round 2: the same with status reads meanwhile.
            cpu0 = cluster.cpu()
            alone = await emit_one_event_each(store, owners, targets, rate=args.event_rate)
            await asyncio.sleep(1)
            cpu1 = cluster.cpu()
            wrk = asyncio.ensure_future(asyncio.to_thread(run_wrk, f"http://127.0.0.1:{port}/session/{sid}/status", 5, 8))
            await asyncio.sleep(0.5)
            with_reads = await emit_one_event_each(store, owners, targets, rate=args.event_rate)
            status_during = await wrk
            await asyncio.sleep(2)
            streamed = await streams.finish()
        finally:
            if streams.proc.poll() is None:
                streams.proc.kill()
        result["event_streams"] = {
            "connections": streamed["streams"], "attach_s": streamed["attach_s"],
            "refused": len(streamed["refused"]), "refused_examples": list(streamed["refused"].values())[:3],
            "api_rss_mb_before": round(api_rss0 / 2**20, 1), "api_rss_mb_with_streams": round(api_rss1 / 2**20, 1),
            "api_rss_bytes_per_connection": round((api_rss1 - api_rss0) / max(streamed["streams"], 1)),
            "baseline_bare_stream_rss_bytes_per_connection": bare_stream_rss["/sse"],
            "baseline_raw_asgi_stream_rss_bytes_per_connection": bare_stream_rss["/raw-sse"],
            "event_rate_per_s": args.event_rate,
            "alone": delivery(alone, streamed["arrivals"]),
            "with_status_reads": delivery(with_reads, streamed["arrivals"]),
            "status_during": status_during,
            "cpu_ms_per_event": {role: round((cpu1[role] - cpu0[role]) * 1000 / max(len(alone), 1), 4)
                                 for role in ("api", "redis", "load")},
        }
        log(f"  {result['event_streams']}")

        # 5. recovery
        inc_of_pid = {report["pid"]: inc for inc, report in reports.items()}
        victim = max(cluster.workers, key=lambda w: per_worker_sessions.get(inc_of_pid.get(w.pid, ""), 0))
        victim_inc = inc_of_pid[victim.pid]
        victim_sids = await store.worker_index(victim_inc)
        died_streams = [n for n, (ws, s) in enumerate(targets) if owners[s] == victim_inc]
        log(f"recovery: kill -9 of a worker holding {len(victim_sids)} sessions ({len(died_streams)} followed by SSE)")
        streams = Streams(port, [f"/session/{s}/events" for _, s in targets], logs)
        try:
            await streams.ready()
            killed_ns = now_ns()
            recovered = await recovery(store, victim, victim_inc, victim_sids, cluster.apis[1][1])
            await asyncio.sleep(2)
            streamed = await streams.finish()
        finally:
            if streams.proc.poll() is None:
                streams.proc.kill()
        cluster.workers.remove(victim)
        died = [int(streamed["died"][str(n)]) for n in died_streams if str(n) in streamed["died"]]
        died_streams = [n for n in died_streams if str(n) not in streamed["refused"]]
        recovered["sse_refused"] = len(streamed["refused"])
        recovered["sse_following"] = len(died_streams)
        recovered["sse_told"] = len(died)
        recovered["session_died_last_s"] = round((max(died) - killed_ns) / 1e9, 2) if died else None
        recovered["session_died_p50_s"] = round((percentile(died, 50) - killed_ns) / 1e9, 2) if died else None
        result["recovery"] = recovered
        log(f"  {recovered}")
    finally:
        if hello_proc is not None:
            hello_proc.terminate()
            hello_proc.wait(10)
        for w in cluster.workers:
            await w.terminate(30)
        for process, _ in cluster.apis:
            await process.terminate(30)
        await store.close()
        await redis.aclose()
        redis_server.stop()
    result["date"] = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    result["machine"] = f"{os.uname().machine}, {os.cpu_count()} cores"
    result["server"] = server_stack(args.server)
    return result


def table(result: dict[str, Any]) -> str:
    """Each figure beside its goal and its baseline."""
    g = result["goals"]
    c, r, rd = result["creation"], result["at_rest"], result["reads"]
    e, k = result["event_streams"], result["recovery"]

    def mark(ok: bool) -> str:
        return "met" if ok else "MISSED"

    rows = [
        ("live sessions (4 workers, 1 Redis, 10 workspaces)", f"{r['live_sessions']:,}", f"goal {result['sessions']:,}",
         mark(r["live_sessions"] >= result["sessions"])),
        ("Redis memory per idle session (bytes)", f"{r['redis_bytes_per_session']:,}",
         f"goal <= {g['redis_bytes_per_session']:,}; workers declared dead {r.get('workers_declared_dead', 0)}",
         mark(r["redis_bytes_per_session"] <= g["redis_bytes_per_session"] and not r.get("workers_declared_dead"))),
        ("worker RSS per idle session (bytes)", f"{r['worker_rss_bytes_per_session']:,}",
         f"goal <= {g['worker_rss_bytes_per_session']:,}; agent children {r['agent_children_rss_bytes_per_session']:,} more",
         mark(r["worker_rss_bytes_per_session"] <= g["worker_rss_bytes_per_session"])),
        ("heartbeat: Redis commands per beat", " / ".join(f"{v} at {n}" for n, v in r["heartbeat_commands"].items()),
         "unchanged is the goal", mark(max(r["heartbeat_commands"].values()) <= 1.05 * min(r["heartbeat_commands"].values()))),
        ("creates/s (2 APIs, 4 workers)", f"{c['creates_per_s']:,} ({c['failed']} failed)", f"goal >= {g['creates_per_s']}",
         mark(c["creates_per_s"] >= g["creates_per_s"] and not c["failed"])),
        ("CPU ms per create", ", ".join(f"{k2} {v}" for k2, v in c["cpu_ms_per_create"].items()),
         f"total {c['cpu_ms_per_create_total']}", ""),
        ("status req/s (p99)", f"{rd['status']['rps']:,} ({rd['status']['p99_ms']} ms)",
         f"bare hello {rd['hello']['rps']:,}: {rd['status_share_of_hello']:.0%}, goal >= 80%",
         mark(rd["status_share_of_hello"] >= g["read_share_of_hello"])),
        (f"listing page of 100, workspace of {rd['workspace_sessions']:,}, req/s (p99)",
         f"{rd['listing']['rps']:,} ({rd['listing']['p99_ms']} ms)",
         f"{rd['listing_share_of_hello']:.0%} of hello; goal p99 < {g['listing_p99_ms']} ms",
         mark(rd["listing"]["p99_ms"] < g["listing_p99_ms"] and rd["listing_share_of_hello"] >= g["read_share_of_hello"])),
        ("  per CPU-second of the serving process, share of the hello's", f"status {rd['status_cpu_share_of_hello']:.0%}, "
         f"listing {rd['listing_cpu_share_of_hello']:.0%}",
         f"CPU per request: hello {_median(rd['hello']['cpu_us_per_request_of_rounds'])} µs, status "
         f"{_median(rd['status']['cpu_us_per_request_of_rounds'])} µs, listing {_median(rd['listing']['cpu_us_per_request_of_rounds'])} µs", ""),
        ("  status beside a bare read of its bytes after one Redis ping", f"{rd['status_share_of_bare_after_ping']:.0%}",
         f"that bare read: {rd['bare_status_body_after_ping']['rps']:,} req/s, {rd['bare_after_ping_share_of_hello']:.0%} of the hello", ""),
        ("  each beside the bare stack answering its very bytes", f"status {rd['status_share_of_bare_same_body']:.0%}, "
         f"listing {rd['listing_share_of_bare_same_body']:.0%}",
         f"bare: {rd['bare_status_body']['rps']:,} / {rd['bare_listing_body']['rps']:,} req/s "
         f"(listing p99 {rd['bare_listing_body']['p99_ms']} ms, {rd['listing_body_bytes']:,} B)", ""),
        ("SSE connections on one API: RSS per connection (bytes)", f"{e['api_rss_bytes_per_connection']:,} ({e['connections']:,} open, {e['refused']} refused)",
         f"goal <= {g['sse_rss_bytes_per_connection']:,}; bare Starlette stream {e['baseline_bare_stream_rss_bytes_per_connection']:,}"
         f", the server's own {e['baseline_raw_asgi_stream_rss_bytes_per_connection']:,}",
         mark(e["api_rss_bytes_per_connection"] <= g["sse_rss_bytes_per_connection"])),
        ("one event to each stream, p50 / p99 (ms)", f"{e['alone']['p50_ms']} / {e['alone']['p99_ms']} ({e['alone']['missing']} missing)",
         f"{e['event_rate_per_s']:,} events/s", ""),
        ("  the same with status reads meanwhile", f"{e['with_status_reads']['p50_ms']} / {e['with_status_reads']['p99_ms']} ({e['with_status_reads']['missing']} missing)",
         f"goal p99 < {g['sse_event_p99_ms']}",
         mark((e["with_status_reads"]["p99_ms"] or 1e9) < g["sse_event_p99_ms"] and not e["with_status_reads"]["missing"])),
        ("status p99 meanwhile (ms)", f"{e['status_during']['p99_ms']}", f"goal < {g['status_p99_during_sse_ms']}",
         mark(e["status_during"]["p99_ms"] < g["status_p99_during_sse_ms"])),
        (f"kill -9 of a worker with {k['victim_sessions']:,}: readers stop seeing them (s)",
         f"{k['readers_stop_seeing_s']} (its answer {k['readers_last_live_answer_s']})",
         f"goal: by the end of the lease left, {k['lease_left_at_kill_s']} (+ {READER_LENIENCY_S})",
         mark(k["readers_stop_seeing_s"] <= (k["lease_left_at_kill_s"] or 0) + READER_LENIENCY_S
              and (k["lease_left_at_kill_s"] or 1e9) <= g["readers_stop_seeing_s"])),
        ("  every key of theirs gone (s)", f"{k['keys_gone_s']}", f"goal <= {g['died_within_s']}",
         mark((k["keys_gone_s"] or 1e9) <= g["died_within_s"])),
        ("  session_died to every SSE client following one (s)", f"{k['session_died_last_s']} ({k['sse_told']}/{k['sse_following']})",
         f"goal <= {g['died_within_s']}",
         mark((k["session_died_last_s"] or 1e9) <= g["died_within_s"] and k["sse_told"] == k["sse_following"])),
        ("  the victim's lease left at the kill (s)", f"{k['lease_left_at_kill_s']}", f"goal <= lease {g['readers_stop_seeing_s']}", ""),
        ("  survivors' longest gap between renewals (s)", f"{k['survivor_renewal_gap_max_s']}",
         f"heartbeat every {k['heartbeat_interval_s']} s", mark((k["survivor_renewal_gap_max_s"] or 1e9) < LEASE_MS / 1000 / 2)),
    ]
    lines = [f"acp-state scale bench, {result['date']}, {result['machine']}, {result['server']}", ""]
    lines += [f"  {a:66} {b:28} {c2:60} {d}" for a, b, c2, d in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sessions", type=int, default=100_000)
    parser.add_argument("--sse-clients", type=int, default=10_000)
    parser.add_argument("--event-rate", type=int, default=5000, help="events/s of the one-event-each round")
    parser.add_argument("--profile", action="store_true", help="py-spy the API during creation")
    parser.add_argument("--server", default="granian")
    parser.add_argument("--out", default=str(RESULTS / "scale.json"))
    args = parser.parse_args(argv)
    result = asyncio.run(run(args))
    print(table(result))
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
