"""The worker lease: crash detection, the sweeper, and the constant cost of a heartbeat."""

from __future__ import annotations

import asyncio

from acp_state import keys
from acp_state.clock import now_ms
from acp_state.ids import workspace_id
import redis.asyncio as aioredis

from tests.conftest import free_port
from tests.harness import Harness
from tests.test_runtime_status import create, prompt

LEASE_MS = 1500


async def test_kill9_worker_leaves_live_status_within_its_lease(harness: Harness, redis_client, workspace: str) -> None:
    events = await harness.events()
    victim = await harness.worker("--lease-ms", str(LEASE_MS))
    api = await harness.api()
    sids = [(await create(api, workspace))["sessionId"] for _ in range(3)]
    waiting = await prompt(api, sids[0], "#permission")
    await events.wait_type(sids[0], "permission_request", promptId=waiting["promptId"])
    survivor = await harness.worker("--lease-ms", str(LEASE_MS))

    await victim.kill9()
    deadline = int(await redis_client.zscore(keys.WORKERS, victim.incarnation))
    # Right up to the lease deadline the sessions are live; once it has passed, no reader
    # may show them, whether or not a sweeper has run yet.
    await asyncio.sleep(max(0, deadline - now_ms()) / 1000 + 0.01)
    for sid in sids:
        gone = await api.client.get(f"/session/{sid}/status")
        assert gone.status_code == 404, gone.text
    ws = workspace_id(workspace)
    rows = (await api.client.get(f"/workspace/{ws}/sessions")).json()["sessions"]
    assert {r["sessionId"] for r in rows} == set(sids)
    assert all("pendingInteractions" not in r and r["hasActivePrompt"] is False for r in rows)

    for sid in sids:
        died = await events.wait_type(sid, "session_died")
        assert died["data"] == {"sessionId": sid, "reason": "worker_lost"}
    leftovers = [k async for k in redis_client.scan_iter(match=f"*{victim.incarnation}*")]
    assert leftovers == []
    assert await redis_client.zscore(keys.WORKERS, victim.incarnation) is None
    for sid in sids:
        assert not await redis_client.exists(keys.session(ws, sid))
    assert await redis_client.smembers(keys.live(ws)) == set()
    assert sum(1 for e in events.events if e["type"] == "session_died") == len(sids)

    # New sessions land on the survivor.
    fresh = (await create(api, workspace))["sessionId"]
    assert await redis_client.hget(keys.session(ws, fresh), "inc") == survivor.incarnation


async def _heartbeat_cost(redis_client, beats: int = 4) -> float:
    """Redis commands per heartbeat while the deployment is otherwise idle."""

    async def stats() -> dict[str, int]:
        info = await redis_client.info("commandstats")
        return {name.removeprefix("cmdstat_"): value["calls"] for name, value in info.items()}

    # Background commands that are not the heartbeat: the command reader's blocking XREAD,
    # the sweepers' registry scan, a connection's handshake and health-check PINGs, our INFO.
    def other(command: str) -> bool:
        return command in {"xread", "zrangebyscore", "ping", "info", "hello"} or command.startswith("client")

    async def next_beat(since: dict[str, int], count: int) -> dict[str, int]:
        # Snapshots are taken just after a beat completed, never between its two commands.
        while True:
            await asyncio.sleep(0.02)
            now = await stats()
            if now.get("zadd", 0) - since.get("zadd", 0) >= count:
                return now

    before = await next_beat(await stats(), 1)
    after = await next_beat(before, beats)
    zadds = after["zadd"] - before["zadd"]
    spent = sum(after[c] - before.get(c, 0) for c in after if not other(c))
    return spent / zadds


async def test_heartbeat_costs_the_same_with_0_and_1000_sessions(own_redis, workspace: str) -> None:
    harness = Harness(own_redis.url, workspace, free_port)
    redis_client = aioredis.Redis.from_url(own_redis.url, decode_responses=True)
    try:
        await _measure_heartbeats(harness, redis_client, workspace)
    finally:
        await harness.stop_all()
        await redis_client.aclose()


async def _measure_heartbeats(harness: Harness, redis_client, workspace: str) -> None:
    await harness.worker("--lease-ms", "1200", "--max-sessions", "2000")
    api = await harness.api()
    empty = await _heartbeat_cost(redis_client)

    semaphore = asyncio.Semaphore(16)

    async def one() -> None:
        async with semaphore:
            await create(api, workspace)

    await asyncio.gather(*(one() for _ in range(1000)))
    ws = workspace_id(workspace)
    assert await redis_client.scard(keys.live(ws)) == 1000
    loaded = await _heartbeat_cost(redis_client)
    assert empty == loaded == 2.0, (empty, loaded)
