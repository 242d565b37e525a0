"""How fast a dead worker's sessions are swept: the batched `SWEEP` against one `APPLY` per
session (the sweeper's way before it), on a redis-server of its own, in the same process.

Each round creates N idle sessions of one incarnation in one workspace, then removes them
with the very transition the sweeper writes (`sweeper.died`: every admitted prompt's
`turn_error`, then `session_died`), first as N concurrent `APPLY`s (auto-pipelined, 500 at a
time, as the sweeper did), then as one `RedisStore.sweep`. Prints the wall time and Redis's
own CPU per session of each, and their ratio.

    python -m bench.sweep [--sessions 10000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

from acp_state.ids import new_id
from acp_state.store import SESSION_ID_SLOT, ApplyOutcome, CatalogRow, Mode, RedisStore, Transition
from acp_state.store.sweeper import died

from .procs import RedisServer

RESULTS = Path(__file__).resolve().parent / "results"
WS = "0123456789abcdef"
INCARNATION = "w-bench"


async def redis_cpu_s(store: RedisStore) -> float:
    cpu = await store.redis.info("cpu")
    return float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"])


async def create(store: RedisStore, sids: list[str]) -> None:
    at = "2026-12-01T00:00:00.000Z"
    for first in range(0, len(sids), 1000):
        await asyncio.gather(*(
            store.apply(WS, sid, INCARNATION, Transition(
                mode=Mode.CREATE, meta={"sessionId": sid, "workspaceCwd": "/w", "createdAt": at}, epoch="e1",
                catalog=CatalogRow(at, at, 1000),
            ))
            for sid in sids[first : first + 1000]
        ))


async def one_apply_each(store: RedisStore, sids: list[str]) -> list[ApplyOutcome]:
    outcomes = []
    for first in range(0, len(sids), 500):
        applied = await asyncio.gather(*(store.apply(WS, sid, INCARNATION, died(sid)) for sid in sids[first : first + 500]))
        outcomes += [a.applied for a in applied]
    return outcomes


async def batched(store: RedisStore, sids: list[str]) -> list[ApplyOutcome]:
    return await store.sweep(WS, INCARNATION, sids, died(SESSION_ID_SLOT))


async def run(sessions: int) -> dict[str, Any]:
    server = RedisServer()
    store = RedisStore.from_url(server.url)
    result: dict[str, Any] = {"sessions": sessions}
    try:
        for name, remove in (("one_apply_each", one_apply_each), ("sweep", batched)):
            sids = [new_id() for _ in range(sessions)]
            await create(store, sids)
            cpu0, started = await redis_cpu_s(store), time.perf_counter()
            outcomes = await remove(store, sids)
            wall, cpu = time.perf_counter() - started, await redis_cpu_s(store) - cpu0
            assert outcomes == [ApplyOutcome.APPLIED] * sessions, set(outcomes)
            result[name] = {"wall_s": round(wall, 3), "wall_us_per_session": round(wall / sessions * 1e6, 1),
                            "redis_cpu_us_per_session": round(cpu / sessions * 1e6, 1)}
    finally:
        await store.close()
        server.stop()
    result["wall_ratio_sweep_to_apply"] = round(result["sweep"]["wall_s"] / result["one_apply_each"]["wall_s"], 2)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=10_000)
    args = parser.parse_args()
    result = asyncio.run(run(args.sessions))
    for name in ("one_apply_each", "sweep"):
        r = result[name]
        print(f"{name:>15}: {args.sessions:,} sessions in {r['wall_s']} s "
              f"({r['wall_us_per_session']} us each, Redis CPU {r['redis_cpu_us_per_session']} us each)")
    print(f"sweep / one APPLY each, wall: {result['wall_ratio_sweep_to_apply']}")
    (RESULTS / "sweep.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
