"""`python -m bench.push`: the figures of push, not poll (issue 13), each against a baseline
of the same run.

1. **fanout**: a change reaches 1,000 live-feed subscribers (`GET /workspaces/:ws/sessions/
   live-state/events`) on one API process. The driver applies a worker transition (the
   worker's own APPLY script: the row's `hasActivePrompt` flips and its `updatedAt` takes a
   mark of the change's number; the workspace's change is published) every 200 ms, stamped
   just before the call; a load process of its own (`bench/push_load.py`: 1,000 raw sockets
   under one epoll) stamps every frame's arrival on the same monotonic clock. Baseline, same run, same load process and pacing: a bare
   SPUBLISH (redis-py) to 1,000 raw-socket SSUBSCRIBE connections of the bench's Redis.
2. **views**: the requests 100 open Web Shell workspace views put on the API over a window,
   in three modes run one after another while a prompt runs every 250 ms in their
   workspaces: polling the listing every 1 s (what `api/static/js/workspace-view.js` does),
   polling live state every 5 s (the reference's `sessionLiveStatePollIntervalMs`), and
   following the live feed. Counted by the API itself (`/metrics` request counters by route,
   before and after the window) and by the load process; the API's CPU seconds too.
3. **attention**: `GET /attention?size=100` over 100,000 live sessions in 10 workspaces,
   10,000 of them waiting on a `#permission` prompt (those are real: created over HTTP and
   asked by their real workers; the 90,000 idle ones are written by the bench through the
   worker's own store call, `RedisStore.apply`, under an incarnation whose lease it renews);
   `wrk -t2 -c32 -d5s`, against `GET /health` of the same API process and the bare Starlette
   hello (`bench/hello_app.py`); also under a change every 2 ms (most reads then go to Redis),
   and the Redis read behind a page, per-workspace indexes (before issue 27) against the
   deployment's index, in the same process.

Real redis-server on a free port, real worker and API processes (the API's default server).

    python -m bench.push [--quick] [--only fanout,views,attention] [--profile]

`--quick`: 200 subscribers, 10 s windows, 10,000 sessions (1,000 waiting). `--subscribers 10000`:
the fan-out to 10,000 (figure `fanout_10000`; 50 changes, one every 0.5 s). `--profile` records
the API with py-spy (`pip install py-spy`) during an extra, unmeasured round of fan-out
changes and of attention-page load (bench/results/push_fanout_profile.txt,
push_attention_profile.txt: py-spy's raw folded stacks). Results: bench/results/push.json (push_quick.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import redis.asyncio as aioredis

from acp_state.cli.serving import DEFAULT_SERVER, SERVERS
from acp_state.ids import workspace_id
from acp_state.store import CatalogRow, Mode, RedisStore, Transition, WorkerReport
from testbed.processes import ROOT, AcpProcess
from testbed.redis_server import free_port

from .__main__ import RESULTS, command_calls, create_sessions, ensure_wrk, log, run_wrk, server_stack, wait_port
from .push_load import mark
from .procs import RedisServer, api, cpu_s, percentile, worker

LOAD = [sys.executable, "-m", "bench.push_load"]


def now_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds of each thread of a process, summed by kind: the Python thread the event
    loop runs on ("loop": the hub, the server's Python-side send, uvloop), and every other
    thread by its name (granian's Rust runtime, which writes to the sockets)."""
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            text = (task / "stat").read_text()
        except OSError:
            continue  # the thread ended meanwhile
        name = "loop" if task.name == str(pid) else text[text.index("(") + 1:text.rindex(")")]
        fields = text.rsplit(")", 1)[1].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def machine_busy() -> float:
    """The share of the machine's CPU time that was busy over one second (other work on it)."""

    def sample() -> tuple[int, int]:
        ticks = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        return ticks[3] + ticks[4], sum(ticks)

    idle0, total0 = sample()
    time.sleep(1)
    idle1, total1 = sample()
    return round(1 - (idle1 - idle0) / max(total1 - total0, 1), 2)


class Load:
    """A `bench.push_load` process, talked to by lines."""

    def __init__(self, *argv: str) -> None:
        self.out = Path(tempfile.mkstemp(prefix="acp-push-load-", suffix=".json")[1])
        self.proc = subprocess.Popen(
            [*LOAD, *argv, "--out", str(self.out)], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            env=dict(os.environ, PYTHONPATH=str(ROOT)), text=True,
        )

    async def expect(self, line: str, timeout: float = 120) -> None:
        assert self.proc.stdout is not None
        got = await asyncio.wait_for(asyncio.to_thread(self.proc.stdout.readline), timeout)
        if got.strip() != line:
            raise RuntimeError(f"load process said {got!r}, expected {line!r} (exit {self.proc.poll()})")

    async def finish(self) -> dict[str, Any]:
        assert self.proc.stdin is not None
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("stop\n")
                self.proc.stdin.flush()
            except BrokenPipeError:
                pass
        await self.expect("done")
        await asyncio.to_thread(self.proc.wait, 30)
        result = json.loads(self.out.read_text())
        self.out.unlink()
        return result

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {"samples": 0}
    return {"p50_ms": round(percentile(values, 50), 2), "p99_ms": round(percentile(values, 99), 2),
            "max_ms": round(max(values), 2), "samples": len(values)}


def latencies(starts: dict[int, int], load: dict[str, Any]) -> dict[str, Any]:
    """Every (change, subscriber) arrival, and per change its last subscriber's."""
    every, last = [], []
    missing = 0
    for seq, t0 in starts.items():
        arrived = load["arrivals"].get(str(seq), [])
        missing += load["clients"] - len(arrived)
        ms = [(t - t0) / 1e6 for t in arrived]
        every.extend(ms)
        if ms:
            last.append(max(ms))
    return {"every_delivery": summary(every), "last_subscriber": summary(last), "missing": missing}


# ---- 1. fan-out -----------------------------------------------------------------------------


async def bench_fanout(args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    clients = args.subscribers or (200 if args.quick else 1000)
    # Past 1,000 subscribers a change costs the API and the load process more than 200 ms of
    # CPU together on 2 cores: changes come further apart, so each is measured on its own.
    changes = 40 if args.quick else 100 if clients <= 1000 else 50
    gap_s = max(0.2, clients / 20_000)
    server = RedisServer()
    workspace = logs / "fanout"
    workspace.mkdir()
    processes: list[AcpProcess] = []
    try:
        processes.append(await worker(server.url, logs))
        api_process, port = await api(server.url, str(workspace), logs, server=args.server)
        processes.append(api_process)
        ws = workspace_id(str(workspace))
        redis = aioredis.Redis.from_url(server.url, decode_responses=True)
        await redis.config_set("maxclients", clients + 1000)  # the baseline's subscribers are Redis clients
        store = RedisStore(redis)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            sid = (await create_sessions(client, str(workspace), 1))[0]
            owner = (await store.session(ws, sid)).owner  # type: ignore[union-attr]
            busy = machine_busy()

            # Baseline: bare SPUBLISH -> `clients` raw SSUBSCRIBE connections, same load process.
            log(f"fanout baseline: SPUBLISH to {clients} subscribers")
            load = Load("fanout-redis", "--port", str(server.port), "--channel", "bench:fan", "--clients", str(clients))
            try:
                await load.expect("ready")
                publisher = aioredis.Redis.from_url(server.url)
                payload = b"x" * 280
                starts = {}
                for n in range(changes):
                    starts[n] = now_ns()
                    await publisher.spublish("bench:fan", b"seq%dx" % n + payload)
                    await asyncio.sleep(gap_s)
                await asyncio.sleep(1)
                await publisher.aclose()
                bare_load = await load.finish()
            finally:
                load.kill()
            bare = latencies(starts, bare_load)

            log(f"fanout: {clients} live-feed subscribers on one API process")
            path = f"/workspaces/{ws}/sessions/live-state/events"
            load = Load("fanout-sse", "--port", str(port), "--path", path, "--clients", str(clients))
            try:
                await load.expect("ready")
                for n in range(5):  # warm-up, unmeasured
                    await store.apply(ws, sid, owner, Transition(active=n % 2 == 1, updated_at=mark(n)))
                    await asyncio.sleep(gap_s)
                starts, apply_ms = {}, []
                api_cpu0, threads0 = cpu_s(api_process.pid), thread_cpu_s(api_process.pid)
                for seq in range(5, 5 + changes):
                    t0 = now_ns()
                    await store.apply(ws, sid, owner, Transition(active=seq % 2 == 1, updated_at=mark(seq)))
                    apply_ms.append((now_ns() - t0) / 1e6)
                    starts[seq] = t0
                    await asyncio.sleep(gap_s)
                await asyncio.sleep(1)
                api_cpu = cpu_s(api_process.pid) - api_cpu0
                threads = {name: round((cpu - threads0.get(name, 0.0)) * 1000 / changes, 2)
                           for name, cpu in thread_cpu_s(api_process.pid).items()}
                profile = None
                if args.profile:
                    profile = await profile_fanout(api_process.pid, store, ws, sid, owner, gap_s, 5 + changes, clients, args.server)
                feed_load = await load.finish()
            finally:
                load.kill()
            feed = latencies(starts, feed_load)
        await redis.aclose()
    finally:
        for process in reversed(processes):
            await process.terminate(30)
        server.stop()

    def load_side(result: dict[str, Any], n: int) -> dict[str, Any]:
        return {"attach_s": result["attach_s"], "reads": result["reads"], "cpu_s": result["load_cpu_s"],
                "cpu_ms_per_change": round(result["load_cpu_s"] * 1000 / n, 2),
                "snapshots_after_ready": result.get("snapshots_after_ready", 0), "open_at_end": result["open_at_end"]}

    out = {
        "subscribers": clients,
        "changes": changes,
        "gap_s": gap_s,
        "machine_busy_before": busy,
        "feed": {**feed, "apply_call_ms": summary(apply_ms), "api_cpu_ms_per_change": round(api_cpu * 1000 / changes, 2),
                 # by thread: "loop" is the Python thread (acp-state, the server's send, uvloop)
                 "api_cpu_ms_per_change_by_thread": {k: v for k, v in threads.items() if v},
                 "load_process": load_side(feed_load, changes)},
        "baseline_bare_spublish": {**bare, "load_process": load_side(bare_load, len(starts))},
    }
    for key in ("p50_ms", "p99_ms"):
        out[f"ratio_{key.removesuffix('_ms')}"] = round(
            feed["every_delivery"][key] / max(bare["every_delivery"][key], 0.001), 1)
    if profile:
        out["profile"] = profile
    return out


async def profile_fanout(
    pid: int, store: RedisStore, ws: str, sid: str, owner: str, gap_s: float, first_seq: int, clients: int,
    server: str = DEFAULT_SERVER,
) -> str | None:
    """py-spy on the API during 8 s of the same changes (not measured: py-spy stops the
    process to sample it)."""
    name = "push_fanout" + ("" if clients == 1000 else f"_{clients}") + ("" if server == DEFAULT_SERVER else f"_{server}")
    target = RESULTS / f"{name}_profile.txt"  # e.g. push_fanout_10000_uvicorn_profile.txt
    spy = [str(Path(sys.executable).parent / "py-spy")]
    if not Path(spy[0]).exists():
        log("py-spy not installed; no profile")
        return None
    # --native: the frames below Python too (granian's Rust send, uvloop), so what the
    # server and the loop do is told apart from acp-state's own Python.
    proc = subprocess.Popen([*spy, "record", "-p", str(pid), "-d", "8", "-r", "200", "-f", "raw", "--native", "-o", str(target)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    await asyncio.sleep(1)
    n = first_seq
    while proc.poll() is None:
        await store.apply(ws, sid, owner, Transition(active=n % 2 == 1, updated_at=mark(n)))
        n += 1
        await asyncio.sleep(gap_s)
    return str(target.relative_to(ROOT)) if target.exists() else None


# ---- 2. views: polling against the feed ---------------------------------------------------------


async def route_counts(client: httpx.AsyncClient) -> dict[str, float]:
    text = (await client.get("/metrics")).text
    counts: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("acp_state_http_requests_total{"):
            labels, value = line.rsplit(" ", 1)
            route = labels.split('route="', 1)[1].split('"', 1)[0]
            counts[route] = counts.get(route, 0) + float(value)
    return counts


async def bench_views(args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    view_count, window_s = 100, 10 if args.quick else 30
    n_workspaces, per_workspace, prompt_every_s = 5, 20, 0.25
    server = RedisServer()
    cwds = [logs / f"views{n}" for n in range(n_workspaces)]
    for cwd in cwds:
        cwd.mkdir()
    processes: list[AcpProcess] = []
    modes: dict[str, Any] = {}
    try:
        processes.append(await worker(server.url, logs))
        extra = [a for cwd in cwds for a in ("--workspace", str(cwd))]
        api_process, port = await api(server.url, str(cwds[0]), logs, *extra, server=args.server)
        processes.append(api_process)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            sids = [sid for cwd in cwds for sid in await create_sessions(client, str(cwd), per_workspace)]
            wss = ",".join(workspace_id(str(cwd)) for cwd in cwds)
            for mode, interval in (("listing", 1.0), ("live-state", 5.0), ("feed", 1.0)):
                log(f"views: 100 views, {mode}, {window_s} s window")
                load = Load("views", "--port", str(port), "--mode", mode, "--workspaces", wss, "--views", str(view_count),
                            "--interval-s", str(interval), "--seconds", str(window_s))
                prompts = 0

                async def churn() -> None:
                    nonlocal prompts
                    while True:
                        sid = random.choice(sids)
                        response = await client.post(f"/session/{sid}/prompt", json={"prompt": [{"type": "text", "text": "hello"}]})
                        prompts += response.status_code == 202
                        await asyncio.sleep(prompt_every_s)

                churner = asyncio.ensure_future(churn())
                try:
                    await load.expect("ready")
                    await load.expect("window start")
                    before, cpu0, t0 = await route_counts(client), cpu_s(api_process.pid), time.monotonic()
                    prompts = 0
                    await load.expect("window end", window_s + 30)
                    after, cpu1, elapsed = await route_counts(client), cpu_s(api_process.pid), time.monotonic() - t0
                    changes = prompts
                    churner.cancel()
                    result = await load.finish()
                finally:
                    churner.cancel()
                    load.kill()
                served = {route: round(after.get(route, 0) - before.get(route, 0)) for route in after}
                served = {route: n for route, n in served.items() if n and route != "metrics"}
                view_routes = {k: v for k, v in served.items() if k != "prompt"}
                modes[mode] = {
                    "interval_s": interval if mode != "feed" else None,
                    "api_requests_by_route": served,
                    "api_view_requests_per_s": round(sum(view_routes.values()) / elapsed, 2),
                    "api_cpu_s_per_s": round((cpu1 - cpu0) / elapsed, 3),
                    "prompts_in_window": changes,
                    "load_process": result,
                }
                await asyncio.sleep(1)
    finally:
        for process in reversed(processes):
            await process.terminate(30)
        server.stop()
    return {"views": view_count, "workspaces": n_workspaces, "sessions_per_workspace": per_workspace,
            "window_s": window_s, "prompt_every_s": prompt_every_s, "modes": modes}


# ---- 3. attention inbox ---------------------------------------------------------------------


BENCH_OWNER = "w-bench-idle"  # the incarnation that holds the sessions written by the store's own calls
BENCH_LEASE_MS = 10_000


async def hold_lease(store: RedisStore, stop: asyncio.Event) -> None:
    """Renew the bench owner's lease as a worker does (a third of a lease apart), reported as
    draining with no room, so that no create is placed on it."""
    report = WorkerReport(BENCH_OWNER, host="bench", pid=os.getpid(), agents=0, lease_ms=BENCH_LEASE_MS, draining=True)
    while not stop.is_set():
        await store.heartbeat(BENCH_OWNER, report, BENCH_LEASE_MS)
        try:
            await asyncio.wait_for(stop.wait(), BENCH_LEASE_MS / 3000)
        except asyncio.TimeoutError:
            pass


async def write_idle(store: RedisStore, workspaces: list[tuple[str, str]], count: int) -> list[tuple[str, str]]:
    """`count` idle live sessions spread over the workspaces, each published with the
    worker's own create transition (`RedisStore.apply`, auto-pipelined, 1,000 at a time)."""
    at = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.000Z")
    written = [(workspaces[n % len(workspaces)], str(uuid.uuid4())) for n in range(count)]
    for first in range(0, count, 1000):
        await asyncio.gather(*(
            store.apply(ws, sid, BENCH_OWNER, Transition(
                mode=Mode.CREATE, meta={"sessionId": sid, "workspaceCwd": cwd, "createdAt": at}, epoch="e1",
                catalog=CatalogRow(at, at, 1000),
            ))
            for (ws, cwd), sid in written[first : first + 1000]
        ))
    return [(ws, sid) for (ws, _), sid in written]


async def read_cost(store: RedisStore, workspaces: list[str], rounds: int) -> dict[str, Any]:
    """The Redis read behind one page of 100 (101 asked), old and new, one after another in
    this process: each workspace's index (the read before issue 27) against the
    deployment's; ms a read, sequential, and the entries each decodes."""
    out: dict[str, Any] = {}
    for name, read in (("per_workspace_indexes", lambda: store.attention_page(workspaces, None, 101)),
                       ("deployment_index", lambda: store.deployment_attention_page(workspaces, None, 101))):
        await read()
        t0 = time.perf_counter()
        for _ in range(rounds):
            found = await read()
        entries = found if isinstance(found, list) else found[0]
        out[name] = {"ms_per_read": round((time.perf_counter() - t0) * 1000 / rounds, 3), "entries_decoded": len(entries)}
    out["speedup"] = round(out["per_workspace_indexes"]["ms_per_read"] / out["deployment_index"]["ms_per_read"], 1)
    return out


async def bench_attention(args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    """`waiting` real sessions (created over HTTP, each asked a `#permission` by its real
    worker) plus `total - waiting` idle live sessions written through the worker's own store
    call by the bench (a real worker creates about 280 sessions/s here: 100,000 would take
    six minutes of both cores; idle sessions hold no attention entry, so what a page reads
    is the same whoever wrote them)."""
    total, waiting, n_workspaces, n_workers = (10_000, 1000, 10, 2) if args.quick else (100_000, 10_000, 10, 4)
    ensure_wrk()
    server = RedisServer()
    cwds = [logs / f"attn{n}" for n in range(n_workspaces)]
    for cwd in cwds:
        cwd.mkdir()
    processes: list[AcpProcess] = []
    hello: subprocess.Popen[bytes] | None = None
    rows: list[dict[str, Any]] = []
    profile = None
    stop = asyncio.Event()
    lease: asyncio.Task[None] | None = None
    try:
        for _ in range(n_workers):
            processes.append(await worker(server.url, logs, "--max-sessions", str(waiting // n_workers + 500)))
        extra = [a for cwd in cwds for a in ("--workspace", str(cwd))]
        api_process, port = await api(server.url, str(cwds[0]), logs, *extra, server=args.server)
        processes.append(api_process)
        base = f"http://127.0.0.1:{port}"
        setup0 = time.monotonic()
        async with httpx.AsyncClient(base_url=base, timeout=120) as client:
            per = waiting // n_workspaces
            sids: list[list[str]] = []
            for cwd in cwds:
                sids.append(await create_sessions(client, str(cwd), per, concurrency=32))
            create_s = time.monotonic() - setup0
            log(f"attention: {waiting} real sessions in {create_s:.0f} s; {waiting} #permission prompts")
            semaphore = asyncio.Semaphore(32)

            async def ask(sid: str) -> None:
                async with semaphore:
                    response = await client.post(f"/session/{sid}/prompt", json={"prompt": [{"type": "text", "text": "#permission"}]})
                    response.raise_for_status()

            await asyncio.gather(*(ask(sid) for group in sids for sid in group))
            redis = aioredis.Redis.from_url(server.url, decode_responses=True)
            store = RedisStore(redis)
            lease = asyncio.ensure_future(hold_lease(store, stop))
            idle0 = time.monotonic()
            await write_idle(store, [(workspace_id(str(cwd)), str(cwd)) for cwd in cwds], total - waiting)
            idle_s = time.monotonic() - idle0
            log(f"attention: {total - waiting} idle sessions written in {idle_s:.0f} s")
            count = 0
            while True:
                count, cursor = 0, None
                while True:
                    page = (await client.get("/attention", params={"size": 500, **({"cursor": cursor} if cursor else {})})).json()
                    count += len(page["items"])
                    cursor = page["nextCursor"]
                    if not cursor:
                        break
                if count >= waiting or time.monotonic() - setup0 > 900:
                    break
                await asyncio.sleep(0.5)
            setup_s = time.monotonic() - setup0
            live = sum([await redis.scard(f"acp:{{{workspace_id(str(cwd))}}}:live") for cwd in cwds])
            log(f"attention: {count} waiting of {live} live after {setup_s:.0f} s of setup")
            page = (await client.get("/attention", params={"size": 100})).json()
            second = (await client.get("/attention", params={"size": 100, "cursor": page["nextCursor"]})).json()
            assert len(page["items"]) == 100 and len(second["items"]) == 100, (len(page["items"]), len(second["items"]))
        hello_port = free_port()
        hello = subprocess.Popen([sys.executable, "-m", "bench.hello_app", "--port", str(hello_port), "--server", args.server],
                                 cwd=ROOT, stdout=subprocess.DEVNULL)
        await wait_port(hello_port)
        busy = machine_busy()
        load_before = os.getloadavg()
        # The workers' and the API's own scripts (heartbeats, sweeps) go on meanwhile: counted
        # over as long a quiet spell first, and taken off.
        quiet0 = await command_calls(redis)
        await asyncio.sleep(5)
        quiet = (await command_calls(redis)).get("evalsha", 0) - quiet0.get("evalsha", 0)
        before = await command_calls(redis)
        ours = await asyncio.to_thread(run_wrk, f"{base}/attention?size=100")
        after = await command_calls(redis)
        scripts = (after.get("evalsha", 0) - before.get("evalsha", 0) - max(quiet, 0)) / max(ours["requests"], 1)
        rows.append({"figure": f"GET /attention?size=100, {live} live sessions, {count} waiting", **ours,
                     "redis_scripts_per_request": round(max(scripts, 0.0), 2)})
        log(f"attention page: {ours['rps']} req/s")
        cursor_url = f"{base}/attention?size=100&cursor={page['nextCursor']}"
        rows.append({"figure": "GET /attention?size=100&cursor= (second page)", **(await asyncio.to_thread(run_wrk, cursor_url))})
        # Every read a miss: a change announced every 2 ms in one workspace (an idle session's
        # updatedAt moves) drops the kept pages, so most reads go to Redis.
        churned = (workspace_id(str(cwds[0])), (await redis.srandmember(f"acp:{{{workspace_id(str(cwds[0]))}}}:live")))

        churn_stop = asyncio.Event()

        async def churn() -> int:
            n = 0
            while not churn_stop.is_set():
                await store.apply(churned[0], churned[1], BENCH_OWNER, Transition(active=n % 2 == 0))
                n += 1
                await asyncio.sleep(0.002)
            return n

        churning = asyncio.ensure_future(churn())
        hits0 = await page_counts(base)
        under_churn = await asyncio.to_thread(run_wrk, f"{base}/attention?size=100")
        hits1 = await page_counts(base)
        churn_stop.set()
        changes = await churning
        read = hits1["misses"] - hits0["misses"]
        rows.append({"figure": "GET /attention?size=100 under a change every 2 ms", **under_churn,
                     "read_from_redis": round(read / max(hits1["hits"] + read - hits0["hits"], 1), 3),
                     "changes": changes})
        rows.append({"figure": "baseline: GET /health, same API process", **(await asyncio.to_thread(run_wrk, f"{base}/health"))})
        rows.append({"figure": "baseline: Starlette JSON hello", **(await asyncio.to_thread(run_wrk, f"http://127.0.0.1:{hello_port}/"))})
        cost = await read_cost(store, [workspace_id(str(cwd)) for cwd in cwds], 200)
        load_after = os.getloadavg()
        if args.profile:
            profile = await asyncio.to_thread(profile_attention, api_process.pid, f"{base}/attention?size=100")
        stop.set()
        await lease
        lease = None
        await redis.aclose()
    finally:
        stop.set()
        if lease is not None:
            lease.cancel()
        if hello is not None:
            hello.terminate()
            hello.wait(10)
        for process in reversed(processes):
            await process.terminate(30)
        server.stop()
    first = rows[0]["rps"]
    for row in rows[3:]:
        row["attention_vs_this"] = round(first / row["rps"], 3)
    return {"sessions": live, "waiting": count, "workspaces": n_workspaces, "workers": n_workers,
            "real_sessions": waiting, "idle_sessions_written_by_store": total - waiting,
            "create_s": round(create_s, 1), "idle_write_s": round(idle_s, 1), "setup_s": round(setup_s, 1),
            "create_rate_per_s": round(waiting / create_s), "machine_busy_before": busy,
            "loadavg_before": [round(x, 2) for x in load_before], "loadavg_after": [round(x, 2) for x in load_after],
            "redis_read_of_a_page": cost,
            "load": "wrk -t2 -c32 -d5s", "rows": rows, **({"profile": profile} if profile else {})}


async def page_counts(base: str) -> dict[str, float]:
    """The API's kept-page hits and misses (its /metrics)."""
    async with httpx.AsyncClient(base_url=base) as client:
        text = (await client.get("/metrics")).text
    found = {}
    for line in text.splitlines():
        for name in ("hits", "misses"):
            if line.startswith(f"acp_state_attention_page_{name}_total "):
                found[name] = float(line.split()[-1])
    return found


def profile_attention(pid: int, url: str) -> str | None:
    """py-spy on the API during 8 s of the same wrk load (not measured)."""
    target = RESULTS / "push_attention_profile.txt"
    spy = Path(sys.executable).parent / "py-spy"
    if not spy.exists():
        return None
    proc = subprocess.Popen([str(spy), "record", "-p", str(pid), "-d", "8", "-r", "200", "-f", "raw", "-o", str(target)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1)
    run_wrk(url, seconds=6)
    proc.wait(30)
    return str(target.relative_to(ROOT)) if target.exists() else None


# ---- the run --------------------------------------------------------------------------------


FIGURES = {"fanout": bench_fanout, "views": bench_views, "attention": bench_attention}


def table(result: dict[str, Any]) -> str:
    lines = [f"acp-state push bench, {result['date']}, {result['machine']}, API on {result['server']}"]
    f = result["figures"]
    for name in [name for name in f if name.startswith("fanout")]:
        r = f[name]
        e, b = r["feed"]["every_delivery"], r["baseline_bare_spublish"]["every_delivery"]
        last, blast = r["feed"]["last_subscriber"], r["baseline_bare_spublish"]["last_subscriber"]
        lines += [f"## fanout: {r['subscribers']} subscribers, {r['changes']} changes",
                  f"  APPLY -> live-feed SSE client     p50 {e['p50_ms']} ms  p99 {e['p99_ms']} ms  (last subscriber p50 {last['p50_ms']} / p99 {last['p99_ms']} ms; missing {r['feed']['missing']})",
                  f"  baseline: SPUBLISH -> SSUBSCRIBE  p50 {b['p50_ms']} ms  p99 {b['p99_ms']} ms  (last subscriber p50 {blast['p50_ms']} / p99 {blast['p99_ms']} ms; missing {r['baseline_bare_spublish']['missing']})",
                  f"  ratio p50 {r['ratio_p50']}x, p99 {r['ratio_p99']}x; API CPU {r['feed']['api_cpu_ms_per_change']} ms/change; "
                  f"load process CPU {r['feed']['load_process']['cpu_ms_per_change']} ms/change (baseline {r['baseline_bare_spublish']['load_process']['cpu_ms_per_change']})",
                  f"  API CPU by thread, ms/change: {r['feed'].get('api_cpu_ms_per_change_by_thread')}"]
    if "views" in f:
        r = f["views"]
        lines.append(f"## views: {r['views']} open workspace views, {r['window_s']} s window, a prompt every {r['prompt_every_s']} s")
        for mode, m in r["modes"].items():
            lines.append(f"  {mode:11} API served {m['api_view_requests_per_s']:7} view requests/s  {m['api_requests_by_route']}  "
                         f"API CPU {m['api_cpu_s_per_s']} s/s  load: {m['load_process']['requests_per_s']} req/s, "
                         f"{m['load_process']['frames']} frames, {m['load_process']['bytes_per_s']} B/s")
    if "attention" in f:
        r = f["attention"]
        lines.append(f"## attention: {r['sessions']} sessions, {r['waiting']} waiting; setup {r['setup_s']} s "
                     f"(creates {r['create_s']} s, {r['create_rate_per_s']}/s)")
        for row in r["rows"]:
            figures = ", ".join(f"{k} {v}" for k, v in row.items() if k != "figure")
            lines.append(f"  {row['figure']:58} {figures}")
        if "redis_read_of_a_page" in r:
            c = r["redis_read_of_a_page"]
            lines.append(f"  Redis read of a page: per-workspace indexes {c['per_workspace_indexes']}, "
                         f"deployment index {c['deployment_index']} ({c['speedup']}x)")
    return "\n".join(lines)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    logs = Path(tempfile.mkdtemp(prefix="acp-bench-push-"))
    figures: dict[str, Any] = {}
    for figure in args.only:
        started, at = time.monotonic(), datetime.now(timezone.utc).strftime("%H:%M:%S UTC")
        # A fan-out to other than the usual 1,000 subscribers is a figure of its own (fanout_10000).
        name = f"fanout_{args.subscribers}" if figure == "fanout" and args.subscribers not in (None, 1000) else figure
        figures[name] = await FIGURES[figure](args, logs)
        figures[name]["started"] = at
        figures[name]["run_s"] = round(time.monotonic() - started, 1)
        log(f"{name} took {figures[name]['run_s']} s")
    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "server": server_stack(args.server),
        "figures": figures,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--only", default=",".join(FIGURES), help="comma-separated: fanout,views,attention")
    parser.add_argument("--profile", action="store_true", help="py-spy the API during extra fan-out changes")
    parser.add_argument("--subscribers", type=int, help="fan-out subscribers (default 1,000; 200 with --quick); "
                        "past 1,000 the figure is fanout_N, its changes 0.5 s apart at 10,000 (raise ulimit -n)")
    parser.add_argument("--server", choices=SERVERS, default=DEFAULT_SERVER)
    parser.add_argument("--out", type=Path, help="the JSON file to merge into (default: bench/results/push.json, push_quick.json)")
    args = parser.parse_args()
    args.only = [name for name in args.only.split(",") if name]
    result = asyncio.run(run(args))
    print(table(result))
    RESULTS.mkdir(exist_ok=True)
    target = args.out or RESULTS / ("push_quick.json" if args.quick else "push.json")
    merged = json.loads(target.read_text()) if target.exists() else {}
    merged.setdefault("figures", {})
    # Figures may be run one at a time (--only): each keeps its own date and machine load.
    for name, figure in result["figures"].items():
        merged["figures"][name] = {"date": result["date"], **figure}
    merged.update({k: v for k, v in result.items() if k != "figures"})
    for figure in merged["figures"].values():
        if "feed" in figure:  # raw arrivals are large: keep them out of the file
            figure["feed"].pop("arrivals", None)
    target.write_text(json.dumps(merged, indent=2) + "\n")


if __name__ == "__main__":
    main()
