"""The pub/sub fan-out against a real Redis: subscriptions that churn, and delivery order."""

from __future__ import annotations

import asyncio
import signal
import time
from typing import AsyncIterator

import orjson
import pytest
from redis.exceptions import ConnectionError

from acp_state.store import keys
from acp_state.store.connection import connect
from acp_state.store.fanout import Fanout
from testbed.redis_server import RedisCluster, RedisServer
from tests.helpers import SAFETY_STOP_S, eventually


@pytest.fixture
async def fanout(redis_server: RedisServer) -> AsyncIterator[Fanout]:
    fanout = Fanout(connect(redis_server.url))
    yield fanout
    await fanout.stop()


async def test_a_listener_arriving_while_the_last_one_leaves_is_subscribed(
    fanout: Fanout, redis_server: RedisServer
) -> None:
    """The last SSE client of a session leaves as the next one arrives: Redis confirms our
    SUNSUBSCRIBE and then the new SSUBSCRIBE; the first must not pass for a moved slot."""
    publisher = connect(redis_server.url)
    channel = "acp:{fanout-test}:ev:s1"
    for n in range(1, 21):
        leaving = await fanout.subscribe(channel)
        goodbye = asyncio.ensure_future(fanout.unsubscribe(leaving))
        arriving = await asyncio.wait_for(fanout.subscribe(channel), 10)
        await goodbye
        await publisher.execute_command("SPUBLISH", channel, orjson.dumps({"id": n, "type": "ping"}))
        delivery = await asyncio.wait_for(arriving.queue.get(), 10)
        assert delivery is not None and delivery.event_id == n
        await fanout.unsubscribe(arriving)
    await publisher.aclose()


async def test_changes_reach_the_cache_before_the_events_they_announce(
    fanout: Fanout, redis_server: RedisServer
) -> None:
    seen: list[str] = []
    fanout.on_change = lambda change: seen.append(f"change {change.sid} at {change.revision} of {change.generation}")
    publisher = connect(redis_server.url)
    assert await fanout.watch("fanout-test2")
    listener = await fanout.subscribe("acp:{fanout-test2}:ev:s1")
    # What the APPLY script does: announce on the change channel, then publish the event;
    # then what SWEEP does: announce a batch of sessions in one message (a revision each).
    for announced, event_id in (("s1 7 g1", 1), ("s0,s1 9 g1", 2)):
        await publisher.eval(
            "redis.call('SPUBLISH', KEYS[1], ARGV[1]) return redis.call('SPUBLISH', KEYS[2], ARGV[2])",
            2, "acp:{fanout-test2}:inv", "acp:{fanout-test2}:ev:s1", announced,
            orjson.dumps({"id": event_id, "type": "ping"}),
        )
        delivery = await asyncio.wait_for(listener.queue.get(), 10)
        seen.append(f"event {delivery.event_id}")
    assert seen == ["change s1 at 7 of g1", "event 1", "change s0 at 8 of g1", "change s1 at 9 of g1", "event 2"]
    await publisher.aclose()


async def test_a_watch_refused_while_redis_is_away_is_made_when_it_returns(own_redis: RedisServer) -> None:
    """The first status read of a workspace during an outage cannot subscribe; once Redis is
    back the next read must subscribe, not wait on the subscription that never went out."""
    fanout = Fanout(connect(own_redis.url))
    own_redis.process.kill()
    own_redis.process.wait()
    with pytest.raises(ConnectionError):
        await fanout.watch("fanout-test3")
    assert not fanout.watching("fanout-test3")
    own_redis.process = RedisServer(port=own_redis.port, folder=own_redis.dir).start().process
    assert await asyncio.wait_for(fanout.watch("fanout-test3"), 10)
    assert fanout.watching("fanout-test3")
    await fanout.stop()


async def test_a_silent_cluster_node_stops_the_cache_until_it_answers_again() -> None:
    """A master that stalls keeps its connections open and silent, while its replica may take
    its slots over and the changes go out there. The process stops trusting the change link
    of that node within FRESH_S, and once the node answers again its caches start over."""
    cluster = RedisCluster(masters=3).start()
    fanout = Fanout(connect(cluster.url))
    resets: list[float] = []
    fanout.on_reset = lambda: resets.append(time.monotonic())
    try:
        ws = "fanout-test4"
        assert await fanout.watch(ws)
        assert fanout.watching(ws)
        node = next(n for n in cluster.nodes if n.port == cluster.owner_of(keys.invalidations(ws)))
        node.process.send_signal(signal.SIGSTOP)
        try:
            # (`watching` compares the loop's clock with the last answer: FRESH_S is exact.)
            await eventually(lambda: not fanout.watching(ws), "the silent node's link given up")
            assert not resets
        finally:
            node.process.send_signal(signal.SIGCONT)
        await eventually(lambda: fanout.watching(ws), "the link watched again")
        assert len(resets) == 1, "the caches start over once, when the node answers again"
    finally:
        await fanout.stop()
        cluster.stop()


async def test_a_cached_read_after_a_change_acknowledged_elsewhere_never_misses_it(
    fanout: Fanout, redis_server: RedisServer
) -> None:
    """A close acknowledged through another API process, then a status read here: the read
    must not be answered from the cache while the change's announcement is still on its way
    (in Redis's output buffer, the kernel's, or this process's unread socket)."""
    from acp_state.api.reads.cache import CachedSession, StateCache
    from redis import Redis

    cache = StateCache(fanout)
    ws, sid = "fanout-test5", "s1"
    fanout.on_change = lambda change: cache.changed(change.ws, change.sid)
    token = await cache.begin_read(ws, sid)
    cache.keep_session(sid, token, CachedSession(ws, "worker-1", None))  # type: ignore[arg-type]
    assert await cache.session(sid) is not None, "kept while nothing changed"

    # The other process's change, made while this event loop cannot run: its announcement
    # is unread here when the read below begins, as when a client is faster than pub/sub.
    other = Redis.from_url(redis_server.url)
    other.execute_command("SPUBLISH", keys.invalidations(ws), f"{sid} 2 g1")
    other.close()
    assert await cache.session(sid) is None


async def test_cached_reads_that_arrive_together_share_one_ping(fanout: Fanout) -> None:
    from acp_state.api.reads.cache import CachedSession, StateCache

    cache = StateCache(fanout)
    ws = "fanout-test6"
    token = await cache.begin_read(ws, "s1")
    cache.keep_session("s1", token, CachedSession(ws, "worker-1", None))  # type: ignore[arg-type]
    link = fanout._link_of[keys.invalidations(ws)]
    before = link.pings_sent
    served = await asyncio.gather(*(cache.session("s1") for _ in range(200)))
    assert all(entry is not None for entry in served)
    assert link.pings_sent - before <= 2, "one ping for the reads that arrived together (and one for late ones)"


async def test_a_read_waits_for_its_own_ping_not_for_one_already_out(
    own_redis: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reads that begin in later turns of the loop each have their ping written at once,
    while earlier pings are still out (a read waits one round trip, not two), up to
    MAX_PINGS_OUT; the reads held back past that get theirs as the oldest comes back."""
    import acp_state.store.fanout as fanout_module
    from acp_state.store.fanout import MAX_PINGS_OUT

    # No ping may give up while Redis is stopped, however slowly this machine begins the reads.
    monkeypatch.setattr(fanout_module, "SYNC_TIMEOUT_S", SAFETY_STOP_S)
    fanout = Fanout(connect(own_redis.url))
    ws = "fanout-test9"
    assert await fanout.watch(ws)
    link = fanout._link_of[keys.invalidations(ws)]
    before = link.pings_sent
    own_redis.process.send_signal(signal.SIGSTOP)  # nothing comes back while the reads begin
    try:
        reads = []
        for n in range(MAX_PINGS_OUT + 2):
            reads.append(asyncio.ensure_future(fanout.sync(ws)))
            if n < MAX_PINGS_OUT:
                await eventually(lambda: link.pings_sent == before + n + 1, f"ping {n + 1} written")
            else:
                await eventually(lambda: len(link.next_round) == n + 1 - MAX_PINGS_OUT and not link.round_due, f"read {n + 1} held back")
        assert link.pings_sent == before + MAX_PINGS_OUT, "one ping per turn, while earlier ones are out"
        assert len(link.next_round) == 2, "the reads past the limit wait for a ping to come back"
    finally:
        own_redis.process.send_signal(signal.SIGCONT)
    assert await asyncio.wait_for(asyncio.gather(*reads), 10) == [True] * len(reads)
    assert link.pings_sent == before + MAX_PINGS_OUT + 1, "the held-back reads shared one more ping"
    await fanout.stop()


async def test_an_idle_link_on_one_server_is_pinged(redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pump reads its connection past redis-py's health check, so the fan-out pings an
    idle link itself: a dead connection is noticed (its write or read fails) and replaced."""
    import acp_state.store.fanout as fanout_module

    monkeypatch.setattr(fanout_module, "HEALTH_CHECK_S", 0.05)
    fanout = Fanout(connect(redis_server.url))
    ws = "fanout-test10"
    assert await fanout.watch(ws)
    link = fanout._link_of[keys.invalidations(ws)]
    sent, heard = link.pings_sent, link.heard
    await eventually(lambda: link.pings_sent >= sent + 2 and link.heard > heard, "two idle pings, one answered")
    await fanout.stop()


async def test_an_idle_link_on_one_server_keeps_the_caches(redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """On one server a silent link means a silent server, which takes no change either: its
    idle pings must not count as a node coming back from a stall. They did, and every
    API process on one Redis emptied its caches each HEALTH_CHECK_S (a listing poller's p99
    then met dozens of concurrent rebuilds of its page)."""
    import acp_state.store.fanout as fanout_module

    monkeypatch.setattr(fanout_module, "HEALTH_CHECK_S", 0.3)
    monkeypatch.setattr(fanout_module, "FRESH_S", 0.1)  # idle between pings far longer than this
    resets: list[float] = []
    fanout = Fanout(connect(redis_server.url), on_reset=lambda: resets.append(time.monotonic()))
    ws = "fanout-test11"
    assert await fanout.watch(ws)
    link = fanout._link_of[keys.invalidations(ws)]
    sent = link.pings_sent
    await eventually(lambda: link.pings_sent >= sent + 3, "three idle pings")
    heard = link.heard
    await eventually(lambda: link.heard > heard, "an idle ping answered")  # an idle ping's answer came back
    assert resets == [], "an idle ping's answer emptied the caches"
    assert fanout.watching(ws)
    await fanout.stop()


async def test_a_stalled_redis_stops_cached_reads(own_redis: RedisServer) -> None:
    """While Redis does not answer, nothing can say the cache is current: the read goes to
    Redis (and waits or fails there) instead of being answered from memory."""
    from acp_state.api.reads.cache import CachedSession, StateCache

    fanout = Fanout(connect(own_redis.url))
    cache = StateCache(fanout)
    ws = "fanout-test7"
    token = await cache.begin_read(ws, "s1")
    cache.keep_session("s1", token, CachedSession(ws, "worker-1", None))  # type: ignore[arg-type]
    own_redis.process.send_signal(signal.SIGSTOP)
    try:
        # Not answered from memory, and not left hanging either: the ping gives up
        # (SYNC_TIMEOUT_S) and says nothing is known (the wait's limit is a safety stop).
        assert await asyncio.wait_for(cache.session("s1"), SAFETY_STOP_S) is None
    finally:
        own_redis.process.send_signal(signal.SIGCONT)
    assert await asyncio.wait_for(cache.session("s1"), 10) is not None, "current again once Redis answers"
    await fanout.stop()


async def test_a_subscription_redis_does_not_confirm_is_a_store_fault(own_redis: RedisServer) -> None:
    """An event stream opened while Redis stalls: the unconfirmed subscription is a store
    error (the API answers 503 `store_unavailable`), not an unhandled timeout (a 500)."""
    from redis.exceptions import RedisError

    fanout = Fanout(connect(own_redis.url))
    assert await fanout.watch("fanout-test8")  # the connection is up
    own_redis.process.send_signal(signal.SIGSTOP)
    try:
        with pytest.raises(RedisError):
            await fanout.subscribe("acp:{fanout-test8}:ev:s1")
    finally:
        own_redis.process.send_signal(signal.SIGCONT)
    await fanout.stop()
