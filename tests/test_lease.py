"""The worker lease: crash detection, the sweeper, and the constant cost of a heartbeat."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from acp_state.store import keys
from acp_state.store.connection import connect
from acp_state.ids import workspace_id
from acp_state.store import RedisStore, WorkerReport
from tests.harness import Harness
from tests.helpers import create, past_lease, prompt

# A 1.5 s lease (renewed every half second) once lapsed before the test's first prompt on a
# loaded machine (a full suite at load 19 on 2 cores).
LEASE_MS = 3000


async def test_kill9_worker_leaves_live_status_within_its_lease(harness: Harness, redis_client, workspace: str) -> None:
    events = await harness.events()
    victim = await harness.worker("--lease-ms", str(LEASE_MS))
    api = await harness.api()
    sids = [(await create(api, workspace))["sessionId"] for _ in range(3)]
    waiting = await prompt(api, sids[0], "#permission")
    await events.wait_type(sids[0], "permission_request", promptId=waiting["promptId"])
    survivor = await harness.worker("--lease-ms", str(LEASE_MS))

    await victim.kill9()
    # Right up to the lease deadline the sessions are live; once it has passed, no reader
    # may show them, whether or not a sweeper has run yet.
    await past_lease(redis_client, victim.incarnation)
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
    # The sweeper forgets the worker's index once its last session's terminal is written,
    # which SSE clients may see first: wait for the sweep to end, then nothing may be left.
    for _ in range(200):
        leftovers = [k async for k in redis_client.scan_iter(match=f"*{victim.incarnation}*")]
        if not leftovers:
            break
        await asyncio.sleep(0.05)
    assert leftovers == []
    assert await redis_client.zscore(keys.WORKERS, victim.incarnation) is None
    for sid in sids:
        assert not await redis_client.exists(keys.session(ws, sid))
    assert await redis_client.smembers(keys.live(ws)) == set()
    assert sum(1 for e in events.events if e["type"] == "session_died") == len(sids)

    # New sessions land on the survivor.
    fresh = (await create(api, workspace))["sessionId"]
    assert await redis_client.hget(keys.session(ws, fresh), "inc") == survivor.incarnation


async def _commands_of(redis_client, call) -> dict[str, int]:
    """The Redis commands (by name, inner script calls included) that one call costs."""

    async def stats() -> dict[str, int]:
        info = await redis_client.info("commandstats")
        return {name.removeprefix("cmdstat_"): value["calls"] for name, value in info.items()}

    before = await stats()
    await call()
    after = await stats()
    spent = {c: after[c] - before.get(c, 0) for c in after if after[c] != before.get(c, 0)}
    spent["info"] = spent.get("info", 0) - 1  # our own first INFO
    return {c: n for c, n in spent.items() if n}


async def test_heartbeat_is_one_script_whose_cost_does_not_grow_with_sessions(own_redis) -> None:
    """A heartbeat is one round trip (one EVALSHA) of the same commands at 0 and at 1,000
    sessions: the script takes nothing that grows with the worker's sessions."""
    store = RedisStore(connect(own_redis.url))
    redis_client = aioredis.Redis.from_url(own_redis.url, decode_responses=True)
    try:
        report = WorkerReport("w-1")
        await store.heartbeat("w-1", report, LEASE_MS)  # loads the script
        empty = await _commands_of(redis_client, lambda: store.heartbeat("w-1", report, LEASE_MS))
        ws = workspace_id("/tmp/heartbeat-cost")
        for first in range(0, 1000, 250):
            pipe = redis_client.pipeline(transaction=False)
            for n in range(first, first + 250):
                pipe.sadd(keys.worker_sessions("w-1"), f"{ws}/s{n}")
                pipe.hset(keys.session(ws, f"s{n}"), mapping={"inc": "w-1", "meta": "{}"})
            await pipe.execute()
        loaded = await _commands_of(redis_client, lambda: store.heartbeat("w-1", WorkerReport("w-1", sessions=1000), LEASE_MS))
    finally:
        await store.close()
        await redis_client.aclose()
    # The store's clock (acp_state/store/lua/registry.lua) writes one or two HSETs depending on
    # time alone (whether a millisecond passed, whether the store was silent): not on sessions.
    clock = {"hset"}
    assert {c: n for c, n in empty.items() if c not in clock} == {c: n for c, n in loaded.items() if c not in clock}
    assert empty.get("hset", 0) <= 3 and loaded.get("hset", 0) <= 3, (empty, loaded)
    assert empty["evalsha"] == 1
    assert sum(empty.values()) < 20, empty


async def test_a_session_a_rewrite_could_not_index_is_indexed_at_the_next_heartbeat(monkeypatch) -> None:
    """Redis came back empty and the worker rewrote its sessions, but a session's index
    write failed (a pooled connection to the old server). Seen in a chaos run: that session
    stayed unfindable by the API processes that had not cached its workspace, and unknown
    to the sweeper, so a prompt acknowledged on it had no terminal once its worker died.
    The rewrite indexes first and writes the session only then; the next heartbeat tries
    again. (The store is the embedded one: the fault is injected in its client.)"""
    from prometheus_client import CollectorRegistry
    from redis.exceptions import ConnectionError as RedisConnectionError

    from acp_state.agents import DEFAULT_AGENT
    from acp_state.store import RedisStore, keys
    from acp_state.store.connection import connect
    from acp_state.worker import worker as worker_module
    from acp_state.worker.worker import Worker, WorkerConfig

    monkeypatch.setattr(worker_module, "REGISTRY", CollectorRegistry())  # its gauges, apart from other tests' workers
    store = RedisStore(connect("memory://rewrite-index"))
    bridge = Worker(store, WorkerConfig(agents={DEFAULT_AGENT: "x"}))

    class Held:
        """What a rewrite uses of a LiveSession."""

        closed = False
        moving = False

        def __init__(self) -> None:
            self.incarnation, self.ws, self.sid = bridge.incarnation, "ws1", "s1"
            self.republished = 0

        async def republish(self) -> None:
            self.republished += 1

    session = Held()
    bridge.sessions[session.sid] = session  # type: ignore[assignment]
    failures = [RedisConnectionError("Connection closed by server.")]
    index_session = store.index_session

    async def flaky_index(*args: object) -> bool:
        if failures:
            raise failures.pop()
        return await index_session(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(store, "index_session", flaky_index)
    await bridge._rewrite([session])  # type: ignore[list-item]
    assert session.republished == 0, "not written where the sweeper could not find it"
    assert await store.locate(session.sid) is None

    await bridge._renew()
    assert session.republished == 1
    assert await store.locate(session.sid) == session.ws
    assert f"{session.ws}/{session.sid}" in await store.redis.smembers(keys.worker_sessions(bridge.incarnation))
    await bridge._renew()
    assert session.republished == 1, "once indexed, never again"
