"""`python -m bench`: acp-state's performance, each figure beside a baseline of the same run.

Starts its own redis-server, API and worker processes (and `qwen serve`, the reference, when
`qwen` is installed); load comes from `wrk` in separate processes. Prints a table and writes
it to bench/results/latest.json. `--quick` shrinks the session counts for a smoke run.
`--scale` runs the scale figures instead (bench/scale.py: 100,000 sessions, 10,000 streams).
`--server granian|uvicorn` picks the ASGI server of the API and of the Starlette baselines
alike (default: the API's default), so every ratio compares like with like; the JSON records it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import redis.asyncio as aioredis

from acp_state import events
from acp_state.store import keys
from acp_state.cli.serving import DEFAULT_SERVER, SERVERS
from acp_state.store.connection import connect
from acp_state.ids import workspace_id
from acp_state.store import Mode, RedisStore, Transition, WorkerReport
from testbed.processes import ROOT, AcpProcess
from testbed.redis_server import free_port

from . import sse_latency
from .procs import RedisServer, api, worker

RESULTS = Path(__file__).resolve().parent / "results"
WRK_SECONDS = 5
CONNECTIONS = 32


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def ensure_wrk() -> str:
    wrk = shutil.which("wrk")
    if wrk is None and os.geteuid() == 0:
        log("installing wrk (Debian package)")
        subprocess.run(["apt-get", "install", "-y", "-qq", "wrk"], check=False, capture_output=True)
        wrk = shutil.which("wrk")
    if wrk is None:
        raise SystemExit("wrk is needed for the HTTP figures: apt-get install wrk")
    return wrk


def _ms(text: str) -> float:
    number, unit = re.match(r"([\d.]+)(\w+)", text).groups()  # type: ignore[union-attr]
    return float(number) * {"us": 0.001, "ms": 1.0, "s": 1000.0, "m": 60000.0}[unit]


def run_wrk(url: str, seconds: int = WRK_SECONDS, connections: int = CONNECTIONS) -> dict[str, float]:
    """wrk -t2 -c32: requests/s and latency percentiles (a separate process)."""
    out = subprocess.run(
        ["wrk", "-t2", f"-c{connections}", f"-d{seconds}s", "--latency", url],
        capture_output=True, text=True, check=True,
    ).stdout
    rate = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    total = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    latency = dict(re.findall(r"^\s+(50|99)%\s+(\S+)", out, re.M))
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return {
        "rps": round(rate),
        "p50_ms": round(_ms(latency["50"]), 2),
        "p99_ms": round(_ms(latency["99"]), 2),
        "requests": total,
        "errors": int(non2xx.group(1)) if non2xx else 0,
    }


async def command_calls(redis: aioredis.Redis) -> dict[str, int]:
    info = await redis.info("commandstats")
    return {name.removeprefix("cmdstat_"): value["calls"] for name, value in info.items()}


def delta(after: dict[str, int], before: dict[str, int], skip: tuple[str, ...] = ()) -> int:
    return sum(v - before.get(k, 0) for k, v in after.items() if k not in skip)


async def wait_port(port: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


async def create_sessions(client: httpx.AsyncClient, cwd: str, count: int, concurrency: int = 16) -> list[str]:
    semaphore = asyncio.Semaphore(concurrency)
    sids: list[str] = []

    async def one() -> None:
        async with semaphore:
            response = await client.post("/session", json={"cwd": cwd, "sessionScope": "thread"})
            response.raise_for_status()
            sids.append(response.json()["sessionId"])
            if len(sids) % 1000 == 0:
                log(f"  {len(sids)}/{count} sessions in {cwd}")

    await asyncio.gather(*(one() for _ in range(count)))
    return sids


# ---- sections ------------------------------------------------------------------------------


async def bench_status(ctx: dict[str, Any]) -> list[dict[str, Any]]:
    """GET /session/:id/status against a bare hello and a one-HGETALL handler, same stack
    (the baselines run on the API's ASGI server, through the same serving code)."""
    redis, base, sid, ws = ctx["redis"], ctx["base"], ctx["sid"], ctx["ws"]
    rows = []
    log("status route")
    before = await command_calls(redis)
    ours = run_wrk(f"{base}/session/{sid}/status")
    after = await command_calls(redis)
    per_request = delta(after, before, skip=("xread", "zrangebyscore", "info", "set", "zadd", "zrange")) / max(ours["requests"], 1)
    rows.append({"figure": "status route (1 live session)", **ours, "redis_round_trips_per_request": round(per_request, 3)})
    hello_port, hgetall_port = free_port(), free_port()
    hello = [sys.executable, "-m", "bench.hello_app", "--server", ctx["server"]]
    baselines = [
        subprocess.Popen([*hello, "--port", str(hello_port)], cwd=ROOT, stdout=subprocess.DEVNULL),
        subprocess.Popen(
            [*hello, "--port", str(hgetall_port), "--redis-url", ctx["redis_url"], "--key", keys.session(ws, sid)],
            cwd=ROOT, stdout=subprocess.DEVNULL,
        ),
    ]
    try:
        await wait_port(hello_port)
        await wait_port(hgetall_port)
        log("baselines: bare hello, one HGETALL")
        rows.append({"figure": "baseline: Starlette JSON hello", **run_wrk(f"http://127.0.0.1:{hello_port}/")})
        rows.append({"figure": "baseline: Starlette + one HGETALL", **run_wrk(f"http://127.0.0.1:{hgetall_port}/")})
    finally:
        for process in baselines:
            process.terminate()
            process.wait(10)
    rows.extend(await bench_reference(ctx))
    return rows


async def bench_reference(ctx: dict[str, Any]) -> list[dict[str, Any]]:
    """The reference daemon (`qwen serve`), when installed: its status and listing routes."""
    from testbed.model_endpoint import ModelEndpoint
    from testbed.qwen import find_qwen, qwen_env

    qwen = find_qwen()
    if qwen is None:
        return [{"figure": "reference qwen serve", "skipped": "qwen not installed (npm install @qwen-code/qwen-code@0.24.4)"}]
    log("reference: qwen serve")
    home = Path(tempfile.mkdtemp(prefix="acp-bench-qwen-"))
    workspace = home / "ws"
    workspace.mkdir()
    fake = ModelEndpoint().start()
    port = free_port()
    env = dict(qwen_env(home, fake.openai_url), TMPDIR=str(home))
    process = subprocess.Popen(
        [qwen, "serve", "--port", str(port), "--workspace", str(workspace), "--no-web"],
        cwd=workspace, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        await wait_port(port, 60)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
            sid = (await client.post("/session", json={"cwd": str(workspace)})).json()["sessionId"]
        ws = workspace_id(str(workspace))
        return [
            {"figure": "reference: status route", **run_wrk(f"http://127.0.0.1:{port}/session/{sid}/status")},
            {"figure": "reference: listing of 1 session", **run_wrk(f"http://127.0.0.1:{port}/workspace/{ws}/sessions")},
        ]
    finally:
        os.killpg(process.pid, 15)
        process.wait(20)
        fake.stop()
        shutil.rmtree(home, ignore_errors=True)


async def bench_listing(ctx: dict[str, Any], sizes: list[int]) -> list[dict[str, Any]]:
    rows = []
    async with httpx.AsyncClient(base_url=ctx["base"], timeout=60) as client:
        for size, cwd in zip(sizes, ctx["list_workspaces"], strict=True):
            await create_sessions(client, cwd, size)
            redis = ctx["redis"]
            before = await command_calls(redis)
            result = run_wrk(f"{ctx['base']}/workspace/{workspace_id(cwd)}/sessions?size=100")
            after = await command_calls(redis)
            calls = (after.get("evalsha", 0) - before.get("evalsha", 0)) / max(result["requests"], 1)
            rows.append({"figure": f"listing, workspace of {size} live sessions (page of 100)", **result,
                         "redis_round_trips_per_request": round(calls, 3)})
            log(f"listing of {size}: {result['rps']} req/s")
    return rows


async def bench_transitions(ctx: dict[str, Any], sessions: int = 200, per_session: int = 50) -> list[dict[str, Any]]:
    """Worker transitions (APPLY) per second with auto-pipelining, vs bare HSET round trips."""
    redis: aioredis.Redis = ctx["redis"]
    store = RedisStore(aioredis.Redis.from_url(ctx["redis_url"], decode_responses=True))
    ws, owner = "benchbenchbench0", "bench-owner"
    for n in range(sessions):
        await store.apply(ws, f"s{n}", owner, Transition(mode=Mode.CREATE, meta={}))
    before = await command_calls(redis)
    started = time.perf_counter()

    async def churn(n: int) -> None:
        for i in range(per_session):
            await store.apply(ws, f"s{n}", owner, Transition(active=bool(i % 2), events=[events.body("bench", {"i": i})]))

    await asyncio.gather(*(churn(n) for n in range(sessions)))
    elapsed = time.perf_counter() - started
    after = await command_calls(redis)
    transitions = sessions * per_session
    scripts = after.get("evalsha", 0) - before.get("evalsha", 0)

    bare = aioredis.Redis.from_url(ctx["redis_url"])
    started_bare = time.perf_counter()
    for i in range(5000):
        await bare.hset("bench:bare", "f", i)
    bare_rate = 5000 / (time.perf_counter() - started_bare)
    sequential_started = time.perf_counter()
    for i in range(2000):
        await store.apply(ws, "s0", owner, Transition(active=bool(i % 2), events=[events.body("bench", {"i": i})]))
    sequential_rate = 2000 / (time.perf_counter() - sequential_started)
    await bare.aclose()
    await store.redis.aclose()
    return [
        {"figure": "transitions/s, 200 sessions concurrently (auto-pipelined)", "rps": round(transitions / elapsed),
         "redis_scripts_per_transition": round(scripts / transitions, 3)},
        {"figure": "transitions/s, one after another (1 round trip each)", "rps": round(sequential_rate)},
        {"figure": "baseline: bare HSET round trips/s, one after another", "rps": round(bare_rate)},
    ]


async def heartbeat_cost(sessions: int) -> float:
    """Redis commands (inner script calls included) of one heartbeat of a worker whose index
    holds `sessions` sessions, on a Redis of its own so that nothing else is counted."""
    server = RedisServer()
    redis = aioredis.Redis.from_url(server.url, decode_responses=True)
    store = RedisStore(connect(server.url))
    try:
        ws = workspace_id("/bench/heartbeat")
        for first in range(0, sessions, 1000):
            pipe = redis.pipeline(transaction=False)
            for n in range(first, min(first + 1000, sessions)):
                pipe.sadd(keys.worker_sessions("bench-1"), f"{ws}/s{n}")
                pipe.hset(keys.session(ws, f"s{n}"), mapping={"inc": "bench-1", "meta": "{}"})
            await pipe.execute()
        await store.heartbeat("bench-1", WorkerReport("bench-1", sessions=sessions), 3000)  # loads the script
        beats = 10
        before = await command_calls(redis)
        for _ in range(beats):
            await store.heartbeat("bench-1", WorkerReport("bench-1", sessions=sessions), 3000)
        after = await command_calls(redis)
        return (delta(after, before) - 1) / beats  # less our own INFO
    finally:
        await store.close()
        await redis.aclose()
        server.stop()


async def bench_capacity(ctx: dict[str, Any], total: int, workers: int = 4) -> list[dict[str, Any]]:
    """4 workers, `total` idle live sessions: heartbeat cost, Redis memory per session, RSS."""
    redis: aioredis.Redis = ctx["redis"]
    log(f"capacity: {workers} workers, {total} sessions")
    for process in ctx["workers"]:
        await process.terminate(30)
    ctx["workers"] = [
        await worker(ctx["redis_url"], ctx["logs"], "--max-sessions", str(total), "--lease-ms", "3000")
        for _ in range(workers)
    ]
    rows = [{"figure": "heartbeat: Redis commands per beat, 0 sessions", "commands": await heartbeat_cost(0)}]
    memory_before = (await redis.info("memory"))["used_memory"]
    async with httpx.AsyncClient(base_url=ctx["base"], timeout=60) as client:
        created = 0
        for step in (1000, total - 1000):
            await create_sessions(client, ctx["capacity_workspace"], step)
            created += step
            rows.append({"figure": f"heartbeat: Redis commands per beat, {created} sessions",
                         "commands": await heartbeat_cost(created)})
    memory_after = (await redis.info("memory"))["used_memory"]
    per_session = (memory_after - memory_before) / total
    rss = [int(Path(f"/proc/{p.pid}/status").read_text().split("VmRSS:")[1].split()[0]) for p in ctx["workers"]]
    rows.append({"figure": "Redis memory per idle live session (bytes)", "bytes": round(per_session)})
    rows.append({"figure": f"live sessions held ({workers} workers)", "sessions": total,
                 "worker_rss_mb": [round(r / 1024) for r in rss]})
    return rows


async def run(args: argparse.Namespace) -> dict[str, Any]:
    ensure_wrk()
    server = RedisServer()
    logs = Path(tempfile.mkdtemp(prefix="acp-bench-"))
    cwds = {name: str(logs / name) for name in ("status", "l1", "l100", "l1000", "capacity")}
    for path in cwds.values():
        Path(path).mkdir()
    ctx: dict[str, Any] = {"redis_url": server.url, "logs": logs, "workers": [], "server": args.server}
    processes: list[AcpProcess] = []
    sections: dict[str, Any] = {}
    try:
        ctx["redis"] = aioredis.Redis.from_url(server.url, decode_responses=True)
        ctx["workers"] = [await worker(server.url, logs, "--max-sessions", "5000")]
        extra = [a for cwd in cwds.values() for a in ("--workspace", cwd)]
        api_process, port = await api(server.url, cwds["status"], logs, *extra, server=args.server)
        processes.append(api_process)
        ctx["base"] = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(base_url=ctx["base"], timeout=60) as client:
            ctx["sid"] = (await create_sessions(client, cwds["status"], 1))[0]
        ctx["ws"] = workspace_id(cwds["status"])
        ctx["list_workspaces"] = [cwds["l1"], cwds["l100"], cwds["l1000"]]
        ctx["capacity_workspace"] = cwds["capacity"]
        quick = args.quick
        sections["status"] = await bench_status(ctx)
        sections["listing"] = await bench_listing(ctx, [1, 100, 200 if quick else 1000])
        sections["transitions"] = await bench_transitions(ctx)
        log("publish -> SSE latency")
        sections["sse"] = await sse_latency.run(300 if quick else 2000, args.server)
        sections["capacity"] = await bench_capacity(ctx, 2000 if quick else 10_000)
    finally:
        for process in ctx.get("workers", []):
            await process.terminate(30)
        for process in processes:
            await process.terminate(30)
        if "redis" in ctx:
            await ctx["redis"].aclose()
        server.stop()
    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "server": server_stack(args.server),
        "sections": sections,
    }


def server_stack(name: str) -> str:
    """The ASGI server with its version, and the event loop: e.g. `granian 2.8.9, uvloop 0.23.0`."""
    from importlib.metadata import PackageNotFoundError, version

    def of(package: str) -> str:
        try:
            return f"{package} {version(package)}"
        except PackageNotFoundError:
            return f"{package} (not installed)"

    return f"{of(name)}, {of('uvloop')}" + (f", {of('httptools')}" if name == "uvicorn" else "")


def table(result: dict[str, Any]) -> str:
    lines = [f"acp-state bench, {result['date']}, {result['machine']}, API and baselines on {result['server']}", ""]
    for name, rows in result["sections"].items():
        lines.append(f"## {name}")
        if isinstance(rows, dict):  # the SSE latency section
            lines.append(f"  worker publish -> SSE client      p50 {rows['publish_to_sse']['p50_ms']} ms   p99 {rows['publish_to_sse']['p99_ms']} ms")
            lines.append(f"  baseline: bare SPUBLISH -> sub    p50 {rows['baseline_bare_publish']['p50_ms']} ms   p99 {rows['baseline_bare_publish']['p99_ms']} ms")
            continue
        for row in rows:
            figures = ", ".join(f"{k} {v}" for k, v in row.items() if k != "figure")
            lines.append(f"  {row['figure']:58} {figures}")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    if "--scale" in sys.argv[1:]:  # issue 14's figures: bench/scale.py, with its own options
        argv = [sys.executable, "-m", "bench.scale", *(a for a in sys.argv[1:] if a != "--scale")]
        os.execv(sys.executable, argv)
    parser.add_argument("--quick", action="store_true", help="smaller session counts (a smoke run)")
    parser.add_argument("--server", choices=SERVERS, default=DEFAULT_SERVER,
                        help="the ASGI server of the API and of the Starlette baselines (acp-state api --server)")
    args = parser.parse_args()
    result = asyncio.run(run(args))
    print(table(result))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / ("quick.json" if args.quick else "latest.json")).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
