"""The store's behaviours, the same tests on every backend the product supports.

`store` is parametrized over a factory of URLs: the embedded fakeredis (`memory://`, what
`acp-state dev` runs on), a real redis-server, and a 3-master Redis Cluster, each opened
with `RedisStore.from_url` exactly as the processes open it. A backend's servers start on
first use, once per module (`-k memory` starts none).
"""

from __future__ import annotations

import asyncio
import secrets
from typing import AsyncIterator, Callable, Iterator

import orjson
import pytest

from acp_state import events, keys
from acp_state.ids import new_id
from acp_state.keys import F
from acp_state.store import ABANDONED, RedisStore, Standing
from tests.redis_server import RedisCluster, RedisServer

BACKENDS = ["memory", "redis", "cluster"]
LEASE_MS = 60_000


@pytest.fixture(scope="module")
def backend_url() -> Iterator[Callable[[str], str]]:
    """The URL of a backend, its servers started on first use and stopped with the module."""
    started: dict[str, RedisServer | RedisCluster] = {}

    def url(kind: str) -> str:
        if kind == "memory":
            return f"memory://conformance-{secrets.token_hex(4)}"  # a fresh in-process store
        if kind not in started:
            started[kind] = RedisServer().start() if kind == "redis" else RedisCluster(masters=3).start()
        return started[kind].url

    yield url
    for server in started.values():
        server.stop()


@pytest.fixture(params=BACKENDS)
async def store(request: pytest.FixtureRequest, backend_url: Callable[[str], str]) -> AsyncIterator[RedisStore]:
    store = RedisStore.from_url(backend_url(request.param))
    yield store
    await store.close()


class Session:
    """A fresh workspace and session id, owned by `inc`."""

    def __init__(self) -> None:
        self.ws = secrets.token_hex(8)
        self.sid = new_id()
        self.inc = f"w-{secrets.token_hex(4)}"

    async def create(self, store: RedisStore, **fields: str) -> None:
        meta = {"sessionId": self.sid, "workspaceCwd": "/w", "createdAt": "2020-01-01T00:00:00Z"}
        ops = {
            "mode": "create",
            "set": {F.META: orjson.dumps(meta).decode(), F.EPOCH: "e1", **fields},
            "events": [update(self.sid, "hello")],
            "catalog": {"createdAt": meta["createdAt"], "updatedAt": meta["createdAt"]},
        }
        assert (await store.apply(self.ws, self.sid, self.inc, ops)).applied == 1
        await store.index_session(self.inc, self.ws, self.sid, True)


def update(sid: str, text: str) -> str:
    return events.body("session_update", {"sessionId": sid, "update": {"sessionUpdate": "agent_message_chunk", "content": {"type": "text", "text": text}}})


async def test_apply_then_read_back(store: RedisStore) -> None:
    s = Session()
    await s.create(store)
    applied = await store.apply(s.ws, s.sid, s.inc, {"mode": "update", "set": {F.ACTIVE: "1"}, "events": [update(s.sid, "more")]})
    assert (applied.applied, applied.last_event_id, applied.epoch) == (1, 2, "e1")
    fields = await store.session_fields(s.ws, s.sid)
    assert fields[F.OWNER] == s.inc and fields[F.ACTIVE] == "1" and fields[F.SEQ] == "2"
    envelopes, first = await store.replay(s.ws, s.sid, 0)
    assert first == 1 and [orjson.loads(e)["id"] for e in envelopes] == [1, 2]
    assert (await store.replay(s.ws, s.sid, 1))[0] == envelopes[1:]
    snapshot, transcript, log = await store.load_snapshot(s.ws, s.sid, 10)
    assert snapshot == fields and len(transcript) == 2 and log == envelopes
    assert await store.locate(s.sid) == s.ws
    assert (await store.catalog_row(s.ws, s.sid))["createdAt"] == "2020-01-01T00:00:00Z"


async def test_apply_is_fenced_and_a_retry_applies_once(store: RedisStore) -> None:
    s = Session()
    await s.create(store)
    assert (await store.apply(s.ws, s.sid, "w-intruder", {"mode": "update", "set": {F.ACTIVE: "1"}})).applied == -1
    assert (await store.apply(s.ws, new_id(), s.inc, {"mode": "update"})).applied == 0
    for _ in range(2):
        assert (await store.apply(s.ws, s.sid, s.inc, {"mode": "update", "op": 7, "incr": {F.ADMITTED: 1}})).applied == 1
    fields = await store.session_fields(s.ws, s.sid)
    assert F.ACTIVE not in fields and fields[F.ADMITTED] == "1"


async def test_concurrent_transitions_keep_their_order(store: RedisStore) -> None:
    s = Session()
    await s.create(store)
    texts = [f"chunk {i}" for i in range(50)]
    await asyncio.gather(*(store.apply(s.ws, s.sid, s.inc, {"mode": "update", "events": [update(s.sid, t)]}) for t in texts))
    envelopes, _ = await store.replay(s.ws, s.sid, 1)
    assert [orjson.loads(e)["data"]["update"]["content"]["text"] for e in envelopes] == texts


async def test_delete_ends_admitted_prompts(store: RedisStore) -> None:
    s = Session()
    await s.create(store)
    admitted = await store.send(s.ws, s.sid, s.inc, {"t": "prompt", "promptId": "p1"}, admit_limit=6)
    assert admitted.status == "ok" and admitted.prompt_id == "p1"
    orphan = events.body("turn_error", {"promptId": "@PID@"}, prompt_id="@PID@")
    closed = events.body("session_closed", {"sessionId": s.sid})
    assert (await store.apply(s.ws, s.sid, s.inc, {"mode": "delete", "orphan": orphan, "events": [closed]})).applied == 1
    assert await store.session_fields(s.ws, s.sid) == {}
    types = [orjson.loads(e)["type"] for e in (await store.replay(s.ws, s.sid, 1))[0]]
    assert types == ["turn_error", "session_closed"]


async def test_send_admits_fences_and_keeps_the_first_outcome(store: RedisStore) -> None:
    s = Session()
    await s.create(store)
    assert (await store.send(s.ws, s.sid, "w-intruder", {"t": "cancel"})).status == "gone"
    first = await store.send(s.ws, s.sid, s.inc, {"t": "prompt", "promptId": "p1"}, admit_limit=1, idempotency_key="k1")
    assert (first.status, first.prompt_id, first.repeated) == ("ok", "p1", False)
    again = await store.send(s.ws, s.sid, s.inc, {"t": "prompt", "promptId": "p2"}, admit_limit=1, idempotency_key="k1")
    assert (again.status, again.prompt_id, again.repeated) == ("ok", "p1", True)
    assert (await store.send(s.ws, s.sid, s.inc, {"t": "prompt", "promptId": "p3"}, admit_limit=1)).status == "full"
    assert (await store.first_outcome(s.ws, s.sid, "k1")).prompt_id == "p1"
    inbox = keys.inbox(s.ws, s.inc)
    commands = await store.read_commands({inbox: "0-0"}, 1000)
    assert [c[2]["promptId"] for c in commands] == ["p1"]
    # Nothing more. (This also leaves a cluster's reader waiting inside XREAD when the store
    # closes: cancelled the instant after a read returned, redis-py's cluster client can
    # hang the cancellation; see docs/architecture.md, "What is not built yet".)
    assert await store.read_commands({inbox: commands[0][1]}, 200) == []


async def test_one_vote_wins(store: RedisStore) -> None:
    s = Session()
    await s.create(store, **{F.INTERACTION + "r1": "{}", F.VOTABLE + "r1": '[1, ["allow", "deny"]]'})

    async def vote(option: str) -> str:
        return await store.vote(s.ws, s.sid, s.inc, "r1", True, option, "", {"t": "vote", "requestId": "r1"})

    assert await vote("maybe") == "option"
    outcomes = await asyncio.gather(*(vote(o) for o in ["allow", "deny"] * 5))
    assert sorted(outcomes) == ["ok"] + ["unknown"] * 9
    fields = await store.session_fields(s.ws, s.sid)
    assert F.INTERACTION + "r1" not in fields and F.VOTABLE + "r1" not in fields


async def test_attach_and_the_single_slot(store: RedisStore) -> None:
    s = Session()
    await s.create(store)
    assert await store.attach(s.ws, s.sid, s.inc, "c1") is True
    assert await store.attach(s.ws, s.sid, "w-intruder", "c2") is False
    fields = await store.session_fields(s.ws, s.sid)
    assert F.CLIENT + "c1" in fields and F.CLIENT + "c2" not in fields
    assert await store.claim_single(s.ws, s.sid, 60_000) is None
    assert await store.claim_single(s.ws, "other", 60_000) == s.sid
    await store.release_single(s.ws, "other")  # not its claim: kept
    assert await store.claim_single(s.ws, "other", 60_000) == s.sid
    await store.release_single(s.ws, s.sid)
    assert await store.claim_single(s.ws, "other", 60_000) is None


async def test_list_pages_newest_first_with_live_summaries(store: RedisStore) -> None:
    ws, inc = secrets.token_hex(8), "w-lister"
    sids = []
    for i in range(5):
        s = Session()
        s.ws, s.inc = ws, inc
        await s.create(store)
        # Rows ordered by updatedAtMs; the listing returns the newest first.
        ops = {"mode": "update", "catalog": {"createdAt": "t", "updatedAt": "t", "updatedAtMs": 1000 + i}}
        await store.apply(ws, s.sid, inc, ops)
        sids.append(s.sid)
    closed = sids[1]
    await store.apply(ws, closed, inc, {"mode": "delete"})
    page = await store.list_page(ws, 0, 2)
    assert [sid for sid, _, _ in page] == sids[::-1][:3]
    assert all(fields[F.OWNER] == inc for _, _, fields in page)
    rest = await store.list_page(ws, 3, 10)
    assert [sid for sid, _, _ in rest] == [closed, sids[0]]
    assert rest[0][1] is not None and rest[0][2] == {}  # kept in the catalog, not live
    assert rest[1][2][F.OWNER] == inc
    fresh = RedisStore(store.redis)  # a process that never listed this workspace
    assert await fresh.list_page(ws, 0, 10) == await store.list_page(ws, 0, 10)


async def test_replies_reach_the_waiter_or_are_abandoned(store: RedisStore) -> None:
    request = new_id()
    waiting = asyncio.ensure_future(store.await_reply(request, 5))
    assert await store.reply(request, {"ok": 1}) is True
    assert await waiting == {"ok": 1}
    late = new_id()
    assert await store.await_reply(late, 0) is None  # gave up: the marker is left
    assert await store.reply(late, {"ok": 2}) is False
    assert await store.take_reply(late) == ABANDONED
    untaken = new_id()
    await store.reply(untaken, {"ok": 3})
    assert await store.reclaim_replies([(untaken, {"ok": 3})]) == [True]
    assert await store.take_reply(untaken) is None


async def test_lease_basics(store: RedisStore) -> None:
    inc = f"w-{secrets.token_hex(4)}"
    assert await store.heartbeat(inc, {"sessions": 0}, LEASE_MS) is Standing.NEW
    assert await store.heartbeat(inc, {"sessions": 1}, LEASE_MS) is Standing.HELD
    view = await store.lease_view()
    assert view.live_until()[inc] > view.redis_now_ms
    assert (await store.worker_reports([inc]))[inc] == {"sessions": 1}
    await store.resign(inc)
    _, claimed = await store.claim_dead_workers()
    assert inc in claimed
    assert await store.heartbeat(inc, {}, LEASE_MS) is Standing.DEAD
    await store.forget_worker(inc, set())
    other = f"w-{secrets.token_hex(4)}"
    await store.heartbeat(other, {}, LEASE_MS)
    await store.release(other)
    assert other not in (await store.lease_view()).deadlines
