"""The lease scripts driven directly (HEARTBEAT, CLAIM_DEAD, RESIGN), on a Redis of their
own: each rule of the lease is one assertion about what the registry answers."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

import pytest
import redis.asyncio as aioredis

from acp_state.commands import Reply
from acp_state.store import keys
from acp_state.store.connection import connect
from acp_state.store import RedisStore, ReplyFate, Standing, WorkerReport, is_transient
from tests.conftest import RedisServer

LEASE = 1000


@pytest.fixture
async def store(own_redis: RedisServer) -> AsyncIterator[RedisStore]:
    store = RedisStore(connect(own_redis.url))
    yield store
    await store.close()


@pytest.fixture
def raw(own_client: aioredis.Redis) -> aioredis.Redis:
    """The test's own Redis, read and written directly (conftest's own_client)."""
    return own_client


async def redis_ms(raw: aioredis.Redis) -> int:
    seconds, micros = await raw.time()
    return seconds * 1000 + micros // 1000


async def lapse(raw: aioredis.Redis, incarnation: str, *, store_served_for_ms: int) -> None:
    """Put a worker's deadline in the past, with the store seen serving (ticks) throughout the
    last `store_served_for_ms` and its last silence before that."""
    now = await redis_ms(raw)
    await raw.zadd(keys.WORKERS, {incarnation: now - 1})
    await raw.hset(keys.CLOCK, mapping={"tick": now, "stall": now - store_served_for_ms})


async def test_a_first_heartbeat_registers_and_the_next_holds(store: RedisStore, raw: aioredis.Redis) -> None:
    assert await store.heartbeat("w-1", WorkerReport("w-1", sessions=0), LEASE) is Standing.NEW
    assert await store.heartbeat("w-1", WorkerReport("w-1", sessions=0), LEASE) is Standing.HELD
    deadline = await raw.zscore(keys.WORKERS, "w-1")
    assert 0 < deadline - await redis_ms(raw) <= LEASE  # on Redis's clock
    for key in keys.REGISTRY_KEYS:
        if await raw.exists(key):
            assert await raw.pttl(key) > 0, key


async def test_a_lapsed_worker_is_claimed_once_and_tombstoned(store: RedisStore, raw: aioredis.Redis) -> None:
    await store.heartbeat("w-1", WorkerReport("w-1"), LEASE)
    await lapse(raw, "w-1", store_served_for_ms=10 * LEASE)
    claims = await store.claim_dead_workers()
    assert (claims.shortest_lease_ms, claims.claimed, claims.next_lapse_ms) == (LEASE, ["w-1"], None)
    assert (await store.claim_dead_workers()).claimed == []  # exactly one sweeper gets it
    assert await raw.zscore(keys.DEAD, "w-1") is not None
    assert await store.heartbeat("w-1", WorkerReport("w-1"), LEASE) is Standing.DEAD  # dead stays dead
    assert await raw.zscore(keys.WORKERS, "w-1") is None


async def test_a_claim_says_when_the_soonest_live_lease_lapses(store: RedisStore, raw: aioredis.Redis) -> None:
    """So a sweeper can wait for a dead worker's deadline instead of finding it up to a round late."""
    assert (await store.claim_dead_workers()).next_lapse_ms is None
    await store.heartbeat("w-1", WorkerReport("w-1"), 4 * LEASE)
    await store.heartbeat("w-2", WorkerReport("w-2"), LEASE)
    assert 0 < (await store.claim_dead_workers()).next_lapse_ms <= LEASE
    await lapse(raw, "w-2", store_served_for_ms=10 * LEASE)
    claims = await store.claim_dead_workers()
    assert claims.claimed == ["w-2"] and LEASE < claims.next_lapse_ms <= 4 * LEASE


async def test_no_worker_is_declared_dead_within_a_lease_of_a_store_stall(store: RedisStore, raw: aioredis.Redis) -> None:
    await store.heartbeat("w-1", WorkerReport("w-1"), LEASE)
    await lapse(raw, "w-1", store_served_for_ms=LEASE // 2)
    assert (await store.claim_dead_workers()).claimed == []
    # The worker renews in that grace: it was late, not dead.
    assert await store.heartbeat("w-1", WorkerReport("w-1"), LEASE) is Standing.LATE


async def test_a_silence_of_the_store_is_recorded_as_a_stall(store: RedisStore, raw: aioredis.Redis) -> None:
    await store.heartbeat("w-1", WorkerReport("w-1"), LEASE)
    now = await redis_ms(raw)
    # Nothing reached the store for a whole lease (it slept, was paused, or was full),
    # and the worker's deadline passed meanwhile: the next lease decision sees the silence.
    await raw.zadd(keys.WORKERS, {"w-1": now - 1})
    await raw.hset(keys.CLOCK, mapping={"tick": now - LEASE, "stall": now - 100 * LEASE})
    assert (await store.claim_dead_workers()).claimed == []
    assert int(await raw.hget(keys.CLOCK, "stall")) >= now


async def test_a_restarted_empty_store_counts_as_a_stall(store: RedisStore, raw: aioredis.Redis) -> None:
    await raw.zadd(keys.WORKERS, {"w-1": await redis_ms(raw) - 1})
    await raw.zadd(keys.LEASES, {"w-1": LEASE})
    assert (await store.claim_dead_workers()).claimed == []  # no clock at all: it just came back


async def test_a_claim_whose_sweeper_died_is_handed_out_again(store: RedisStore, raw: aioredis.Redis) -> None:
    await store.heartbeat("w-1", WorkerReport("w-1"), LEASE)
    await lapse(raw, "w-1", store_served_for_ms=10 * LEASE)
    assert (await store.claim_dead_workers()).claimed == ["w-1"]
    await raw.zadd(keys.SWEEPS, {"w-1": await redis_ms(raw) - 1})  # its claim lapsed
    assert (await store.claim_dead_workers()).claimed == ["w-1"]
    await store.forget_worker("w-1", set())
    assert (await store.claim_dead_workers()).claimed == []
    assert await raw.zscore(keys.DEAD, "w-1") is not None  # the tombstone stays


async def test_a_resigned_incarnation_is_swept_at_once(store: RedisStore, raw: aioredis.Redis) -> None:
    await store.heartbeat("w-1", WorkerReport("w-1"), LEASE)
    await store.resign("w-1")
    assert (await store.claim_dead_workers()).claimed == ["w-1"]
    assert await store.heartbeat("w-1", WorkerReport("w-1"), LEASE) is Standing.DEAD


async def test_the_lease_view_extends_liveness_over_a_stall(store: RedisStore, raw: aioredis.Redis) -> None:
    await store.heartbeat("w-1", WorkerReport("w-1"), LEASE)
    now = await redis_ms(raw)
    await raw.zadd(keys.WORKERS, {"w-1": now - 1})
    await raw.hset(keys.CLOCK, mapping={"tick": now, "stall": now - 10 * LEASE})
    assert (await store.lease_view()).live_until()["w-1"] < now  # a real lapse: hidden
    await raw.hset(keys.CLOCK, "tick", now - LEASE)  # the store has been silent
    view = await store.lease_view()
    assert view.live_until()["w-1"] >= view.redis_now_ms + LEASE - 50


async def test_a_background_task_survives_an_error_and_counts_it() -> None:
    from acp_state.tasks import BACKGROUND_ERRORS, survive

    before = BACKGROUND_ERRORS.labels("test task")._value.get()

    async def fails() -> None:
        raise RuntimeError("the store said no")

    async def works() -> None: ...

    assert await survive("test task", fails) is False
    assert await survive("test task", works) is True
    assert BACKGROUND_ERRORS.labels("test task")._value.get() == before + 1


async def test_a_sweep_tells_each_session_of_its_death_as_of_the_sweep(store: RedisStore, raw: aioredis.Redis) -> None:
    """The sweeper ends each session of a dead worker with a `session_died` that names it and
    carries the time it was written (a chaos run caught every sweep's events stamped with
    the sweeper process's start, as if the sessions had died before their worker did)."""
    import orjson

    from acp_state.clock import now_ms
    from acp_state.ids import new_id
    from acp_state.store import Mode, Transition
    from acp_state.store.sweeper import sweep_once

    await store.heartbeat("w-1", WorkerReport("w-1"), LEASE)
    sids = [new_id() for _ in range(3)]
    for sid in sids:
        created = Transition(mode=Mode.CREATE, meta={"sessionId": sid, "workspaceCwd": "/w"}, epoch="e1")
        await store.apply("0123456789abcdef", sid, "w-1", created)
        await store.index_session("w-1", "0123456789abcdef", sid, True)
    await asyncio.sleep(0.05)  # a sweep made at import time would now lie in the past
    await lapse(raw, "w-1", store_served_for_ms=10 * LEASE)
    before = now_ms()
    assert (await sweep_once(store))[0] == 3
    for sid in sids:
        [died] = [orjson.loads(e) for e in (await store.replay("0123456789abcdef", sid, 0))[0]]
        assert (died["type"], died["data"]["sessionId"]) == ("session_died", sid)
        assert died["_meta"]["serverTimestamp"] >= before


async def test_a_retried_reply_gives_nothing_twice(store: RedisStore, raw: aioredis.Redis) -> None:
    """A worker retries a reply whose answer it did not get back. A second copy would be left
    unread once the API took the first, and later be taken back as if nobody had been told."""
    answer = Reply(ok=True, created_at="2026-12-01T00:00:00.000Z")
    assert await store.reply("req-1", answer) is True
    assert await store.reply("req-1", answer) is True  # the retry
    assert await raw.llen(keys.reply("req-1")) == 1
    assert await store.take_reply("req-1") == answer  # the API took it
    assert await store.reply("req-1", answer) is True  # a late retry: still given, nothing pushed
    assert await store.reclaim_replies([("req-1", answer)]) == [ReplyFate.TAKEN]
    for key in (keys.reply("req-1"), keys.reply_given("req-1")):
        if await raw.exists(key):
            assert await raw.ttl(key) > 0, key


async def test_a_reply_nobody_took_is_taken_back_once(store: RedisStore) -> None:
    answer = Reply(ok=True, created_at="2026-12-01T00:00:00.000Z")
    assert await store.reply("req-2", answer) is True
    assert await store.reclaim_replies([("req-2", answer)]) == [ReplyFate.UNTAKEN]
    assert await store.take_reply("req-2") is None  # the API, too late, finds nothing
    assert await store.reclaim_replies([("req-2", answer)]) == [ReplyFate.LOST]  # nothing twice
    assert await store.abandon_reply("req-2") is None  # an API gave up: it says the create failed
    assert await store.reclaim_replies([("req-2", answer)]) == [ReplyFate.UNTAKEN]
    assert await store.abandon_reply("req-4") is None  # an API gave up first: the reply says so
    assert await store.reply("req-4", answer) is False


async def test_an_answer_lost_on_its_way_to_the_api_is_still_the_apis(own_redis: RedisServer, store: RedisStore,
                                                                       raw: aioredis.Redis) -> None:
    """The API's take reached Redis while Redis slept (DEBUG SLEEP in the chaos run); its
    client timed out and dropped the connection, and Redis, awake, took the answer and sent it
    nowhere. The API then said the create was undone, while its worker, finding the answer
    gone, counted it as taken and kept the session: a session its client was told did not
    exist (cluster seed 2002, 2026-12-01). The take now leaves a record the API's abandon reads."""
    answer = Reply(ok=True, created_at="2026-12-01T00:00:00.000Z")
    assert await store.reply("req-5", answer) is True
    impatient = RedisStore(connect(own_redis.url, socket_timeout=0.3))
    sleeper = aioredis.Redis.from_url(own_redis.url)
    await impatient.take_reply("req-0")  # its connection is made (a handshake would time out instead)
    try:
        asleep = asyncio.ensure_future(sleeper.execute_command("DEBUG", "SLEEP", "1"))
        await _until_asleep(own_redis)
        with pytest.raises(Exception) as raised:
            await impatient.await_reply("req-5", 5)
        assert is_transient(raised.value), raised.value
        await asyncio.wait_for(asleep, 5)
        assert await raw.llen(keys.reply("req-5")) == 0  # Redis, awake, took it and sent it nowhere
    finally:
        await sleeper.aclose()
        await impatient.close()
    assert await store.abandon_reply("req-5") == answer  # the API's answer after all
    assert await store.reclaim_replies([("req-5", answer)]) == [ReplyFate.TAKEN]  # and the worker agrees

async def _until_asleep(server: RedisServer) -> None:
    """Return once Redis no longer answers: a ping that times out was queued behind the sleep."""
    probe = aioredis.Redis.from_url(server.url, socket_timeout=0.1)
    try:
        while True:
            try:
                await probe.ping()
            except aioredis.RedisError:
                return
    finally:
        await probe.aclose()


async def test_a_slow_read_of_the_leases_never_makes_a_live_worker_look_dead() -> None:
    """A reader's lease read waited 0.5 s in a busy Redis, which then read its clock and
    answered at once: the worker's deadline, 0.2 s ahead of Redis's clock, still lies ahead.
    Judging Redis's clock as of the middle of the round trip put it 0.25 s later, past the
    deadline, and the sessions of a live worker answered 404 (seen opening 10,000 streams)."""
    import time

    from acp_state.store import WorkerRegistry
    from acp_state.store import LeaseView

    class BusyRedis:
        async def lease_view(self) -> LeaseView:
            await asyncio.sleep(0.5)  # queued behind a burst
            now = time.monotonic_ns() // 1_000_000 + 10_000_000  # Redis's clock, read last
            return LeaseView({"w-1": now + 200}, {"w-1": 3000}, now, now, 0)

    registry = WorkerRegistry(BusyRedis())  # type: ignore[arg-type]
    await registry.refresh()
    assert await registry.is_live("w-1")
