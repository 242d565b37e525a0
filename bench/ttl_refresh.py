"""The command rate that keeping session TTLs fresh adds, against the session count.

Every live session's hash carries a TTL (the bound for readers that skip the lease), which
its worker refreshes once per half TTL, a slice each second. This runs one worker with N idle
sessions and a short TTL (so a whole refresh period fits in the run), counts the PEXPIRE
commands Redis served, and prints the rate beside the formula, then what it is at the
default TTL: the fraction of the session count refreshed per minute.

    python -m bench.ttl_refresh [--sessions 2000] [--ttl-ms 60000]
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

from acp_state.store import Retention

from .procs import RedisServer, api, worker

RESULTS = Path(__file__).resolve().parent / "results"


async def pexpire_calls(redis: aioredis.Redis) -> int:
    info = await redis.info("commandstats")
    return int(info.get("cmdstat_pexpire", {}).get("calls", 0))


async def run(sessions: int, ttl_ms: int) -> dict[str, object]:
    server = RedisServer()
    logs = Path(tempfile.mkdtemp(prefix="acp-ttl-"))
    workspace = logs / "ws"
    workspace.mkdir()
    redis = aioredis.Redis.from_url(server.url, decode_responses=True)
    the_worker = await worker(server.url, logs, "--max-sessions", str(sessions), "--session-ttl-ms", str(ttl_ms))
    the_api, port = await api(server.url, str(workspace), logs)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            gate = asyncio.Semaphore(32)

            async def one() -> None:
                async with gate:
                    answer = await client.post("/session", json={"cwd": str(workspace), "sessionScope": "thread"})
                    answer.raise_for_status()

            await asyncio.gather(*(one() for _ in range(sessions)))
        period_s = ttl_ms / 1000 / 2
        await asyncio.sleep(2)  # past the creates' own PEXPIREs
        before, started = await pexpire_calls(redis), time.monotonic()
        await asyncio.sleep(period_s)
        after, elapsed = await pexpire_calls(redis), time.monotonic() - started
    finally:
        await the_api.terminate(30)
        await the_worker.terminate(30)
        await redis.aclose()
        server.stop()
    measured = (after - before) / elapsed
    default_period_s = Retention().session_ttl_ms / 1000 / 2
    return {
        "sessions": sessions,
        "ttl_ms": ttl_ms,
        "pexpire_per_s": round(measured, 2),
        "formula_per_s": round(sessions / period_s, 2),
        "measured_over_formula": round(measured / (sessions / period_s), 3),
        "per_minute_fraction_of_sessions": round(measured * 60 / sessions, 3),
        "at_default_ttl_per_minute_fraction": round(60 / default_period_s, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=2000)
    parser.add_argument("--ttl-ms", type=int, default=60_000)
    args = parser.parse_args()
    result = asyncio.run(run(args.sessions, args.ttl_ms))
    print(
        f"{result['sessions']} idle sessions, TTL {result['ttl_ms']} ms: {result['pexpire_per_s']} PEXPIRE/s "
        f"(formula {result['formula_per_s']}/s, ratio {result['measured_over_formula']}), "
        f"{result['per_minute_fraction_of_sessions']} x the session count per minute; "
        f"at the default TTL: {result['at_default_ttl_per_minute_fraction']} x per minute"
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "ttl_refresh.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
