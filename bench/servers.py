"""`python -m bench.servers`: the API's server stack, compared like for like.

For each ASGI server `acp-state api --server` offers: a bare Starlette JSON hello
(`bench/hello_app.py`, served by the same code that serves the API) and the real
`GET /session/:id/status` of an API process on that server (real redis-server and worker, one
live scripted session, answered from the API's cache); `--rounds` alternating rounds of
`wrk -t2 -c32 -d5s` (a separate process), medians. Also the reference's status route
(`qwen serve`) once per round when `qwen` is installed, and with `--granian-cli` the hello
on granian's own command line (a worker process) in its runtime modes. Each wrk run waits
for a quiet machine first. Writes bench/results/servers.json; docs/performance.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx

from acp_state.cli.serving import SERVERS
from testbed.processes import ROOT
from testbed.redis_server import free_port

from .__main__ import RESULTS, server_stack, bench_reference, create_sessions, ensure_wrk, log, run_wrk, wait_port
from .procs import RedisServer, api, worker

GRANIAN_CLI = {  # name -> extra granian options (always: ASGI, 1 worker, uvloop)
    "granian CLI, default": [],
    "granian CLI, --runtime-mode st": ["--runtime-mode", "st"],
    "granian CLI, --http 1": ["--http", "1"],
    "granian CLI, --runtime-mode st --http 1": ["--runtime-mode", "st", "--http", "1"],
}


def wait_quiet(idle: float = 0.9, timeout_s: float = 120) -> None:
    """Until the machine's CPUs were at least `idle` idle over one second (other load skews wrk)."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as stat:
            ticks = [int(v) for v in stat.readline().split()[1:]]
        return ticks[3] + ticks[4], sum(ticks)

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        idle0, total0 = sample()
        time.sleep(1)
        idle1, total1 = sample()
        if (idle1 - idle0) / max(total1 - total0, 1) >= idle:
            return
    log("the machine stayed busy; measuring anyway")


def start_hello(argv: list[str]) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    ensure_wrk()
    redis = RedisServer()
    logs = Path(tempfile.mkdtemp(prefix="acp-bench-servers-"))
    workspace = logs / "ws"
    workspace.mkdir()
    targets: dict[str, str] = {}  # figure -> URL
    hellos: list[subprocess.Popen[bytes]] = []
    apis = []
    workers = []
    try:
        workers.append(await worker(redis.url, logs))
        for name in args.server:
            port = free_port()
            hellos.append(start_hello([sys.executable, "-m", "bench.hello_app", "--port", str(port), "--server", name]))
            await wait_port(port)
            targets[f"{name}: hello"] = f"http://127.0.0.1:{port}/"
        if args.granian_cli:
            for figure, extra in GRANIAN_CLI.items():
                port = free_port()
                argv = ["granian", "--interface", "asgi", "--workers", "1", "--loop", "uvloop", "--no-access-log",
                        "--log-level", "warning", "--port", str(port), *extra, "--factory", "bench.hello_app:hello"]
                hellos.append(start_hello(argv))
                await wait_port(port)
                targets[f"{figure}: hello"] = f"http://127.0.0.1:{port}/"
        sid = None
        for name in args.server:
            process, port = await api(redis.url, str(workspace), logs, server=name)
            apis.append(process)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
                if sid is None:
                    sid = (await create_sessions(client, str(workspace), 1))[0]
                (await client.get(f"/session/{sid}/status")).raise_for_status()  # warms this API's cache
            targets[f"{name}: status"] = f"http://127.0.0.1:{port}/session/{sid}/status"
        runs: dict[str, list[dict[str, Any]]] = {figure: [] for figure in targets}
        for round_ in range(args.rounds):
            for figure, url in targets.items():
                wait_quiet()
                runs[figure].append(run_wrk(url))
                log(f"round {round_ + 1}: {figure} {runs[figure][-1]['rps']} req/s")
            if not args.no_reference:
                wait_quiet()
                for row in await bench_reference({}):
                    if "rps" in row and "status" in row["figure"]:
                        runs.setdefault("reference (qwen serve): status", []).append(row)
                        log(f"round {round_ + 1}: reference status {row['rps']} req/s")
    finally:
        for process in hellos:
            process.terminate()
            process.wait(10)
        for process in apis + workers:
            await process.terminate(30)
        redis.stop()
    figures = {
        figure: {
            "rps_median": round(statistics.median(r["rps"] for r in rows)),
            "rps_runs": [r["rps"] for r in rows],
            "p50_ms_median": statistics.median(r["p50_ms"] for r in rows),
            "p99_ms_median": statistics.median(r["p99_ms"] for r in rows),
            "errors": sum(r["errors"] for r in rows),
        }
        for figure, rows in runs.items()
    }
    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "load": f"wrk -t2 -c32 -d5s, {args.rounds} alternating rounds, medians",
        "servers": {name: server_stack(name) for name in args.server},
        "figures": figures,
    }


def table(result: dict[str, Any]) -> str:
    lines = [f"acp-state server stack, {result['date']}, {result['machine']}; {result['load']}", ""]
    for figure, row in result["figures"].items():
        lines.append(f"  {figure:50} {row['rps_median']:>7} req/s  (runs {row['rps_runs']}, "
                     f"p50 {row['p50_ms_median']} ms, p99 {row['p99_ms_median']} ms)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", action="append", choices=SERVERS, help="(repeatable; default: all)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--granian-cli", action="store_true", help="also the hello on granian's own CLI")
    parser.add_argument("--no-reference", action="store_true", help="skip qwen serve")
    args = parser.parse_args()
    args.server = args.server or list(SERVERS)
    result = asyncio.run(run(args))
    print(table(result))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "servers.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
