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

from acp_state import commands, events
from acp_state.commands import Reply
from acp_state.ids import new_id
from acp_state.store import (
    ABANDONED,
    AdmissionStatus,
    ApplyOutcome,
    CatalogRow,
    CreateKey,
    DeleteOutcome,
    EndAdmitted,
    IdClaim,
    LoadClaim,
    Mode,
    PendingInteraction,
    Presence,
    RedisStore,
    Standing,
    Transition,
    VoteOutcome,
    WorkerReport,
)
from acp_state.store import keys
from testbed.redis_server import RedisCluster, RedisServer

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

    async def create(self, store: RedisStore, **changes: object) -> None:
        meta = {"sessionId": self.sid, "workspaceCwd": "/w", "createdAt": "2020-01-01T00:00:00Z"}
        transition = Transition(
            mode=Mode.CREATE,
            meta=meta,
            epoch="e1",
            events=[update(self.sid, "hello")],
            catalog=CatalogRow(meta["createdAt"], meta["createdAt"], 1000),
            **changes,  # type: ignore[arg-type]
        )
        assert (await store.apply(self.ws, self.sid, self.inc, transition)).applied is ApplyOutcome.APPLIED
        await store.index_session(self.inc, self.ws, self.sid, True)


def update(sid: str, text: str) -> str:
    return events.body("session_update", {"sessionId": sid, "update": {"sessionUpdate": "agent_message_chunk", "content": {"type": "text", "text": text}}})


def prompt(sid: str, prompt_id: str) -> commands.Prompt:
    return commands.Prompt(sid=sid, prompt_id=prompt_id, blocks=[{"type": "text", "text": "hi"}], text="hi")


async def test_apply_then_read_back(store: RedisStore) -> None:
    s = Session()
    await s.create(store)
    applied = await store.apply(s.ws, s.sid, s.inc, Transition(active=True, events=[update(s.sid, "more")]))
    assert (applied.applied, applied.last_event_id, applied.epoch) == (ApplyOutcome.APPLIED, 2, "e1")
    view = await store.session(s.ws, s.sid)
    assert view is not None and view.owner == s.inc and view.active and view.last_event_id == 2
    assert view.meta["sessionId"] == s.sid and view.updated_at == "2020-01-01T00:00:00Z"
    envelopes, first = await store.replay(s.ws, s.sid, 0)
    assert first == 1 and [orjson.loads(e)["id"] for e in envelopes] == [1, 2]
    assert (await store.replay(s.ws, s.sid, 1))[0] == envelopes[1:]
    snapshot = await store.load_snapshot(s.ws, s.sid, 10)
    assert snapshot.view == view and len(snapshot.page) == 2 and snapshot.log == envelopes
    assert await store.locate(s.sid) == s.ws
    assert (await store.catalog_row(s.ws, s.sid)).created_at == "2020-01-01T00:00:00Z"


async def test_transitions_read_back_as_views(store: RedisStore) -> None:
    """Every part of a transition shows in the view: pending interactions in order, clients,
    the turn error and its kept event, and each is taken back again."""
    s = Session()
    asked = [PendingInteraction(rid, {"requestId": rid, "kind": "permission"}, order, ["ok"]) for rid, order in (("r2", 2), ("r1", 1))]
    await s.create(store, clients=["c1", "c2"], admitted=1, prompts_admitted=["p1"], interactions_added=asked)
    view = await store.session(s.ws, s.sid)
    assert view is not None and view.client_count == 2 and view.admitted == 1
    assert [p["requestId"] for p in view.pending] == ["r1", "r2"]
    error = {"message": "boom", "code": "E"}
    failed = Transition(
        active=False, updated_at="2020-01-02T00:00:00Z", prompts_ended=["p1"], admitted_change=-1,
        turn_error=error, interactions_removed=["r1"], events=[update(s.sid, "x"), update(s.sid, "y")],
        keep_turn_error_event=2,
    )
    assert (await store.apply(s.ws, s.sid, s.inc, failed)).applied is ApplyOutcome.APPLIED
    view = await store.session(s.ws, s.sid)
    assert view is not None and not view.active and view.admitted == 0 and view.turn_error == error
    assert view.updated_at == "2020-01-02T00:00:00Z" and [p["requestId"] for p in view.pending] == ["r2"]
    assert view.turn_error_event is not None and view.turn_error_event["id"] == 3
    await store.apply(s.ws, s.sid, s.inc, Transition(clear_turn_error=True, clear_turn_error_event=True))
    view = await store.session(s.ws, s.sid)
    assert view is not None and view.turn_error is None and view.turn_error_event is None


async def test_apply_is_fenced_and_a_retry_applies_once(store: RedisStore) -> None:
    s = Session()
    await s.create(store)
    assert (await store.apply(s.ws, s.sid, "w-intruder", Transition(active=True))).applied is ApplyOutcome.FOREIGN
    assert (await store.apply(s.ws, new_id(), s.inc, Transition())).applied is ApplyOutcome.MISSING
    for _ in range(2):
        assert (await store.apply(s.ws, s.sid, s.inc, Transition(op=7, admitted_change=1))).applied is ApplyOutcome.APPLIED
    view = await store.session(s.ws, s.sid)
    assert view is not None and not view.active and view.admitted == 1
    restored = Transition(mode=Mode.CREATE, meta=view.meta, epoch="e2", restore=True)
    assert (await store.apply(s.ws, s.sid, s.inc, restored)).applied is ApplyOutcome.PRESENT


async def test_concurrent_transitions_keep_their_order(store: RedisStore) -> None:
    s = Session()
    await s.create(store)
    texts = [f"chunk {i}" for i in range(50)]
    await asyncio.gather(*(store.apply(s.ws, s.sid, s.inc, Transition(events=[update(s.sid, t)])) for t in texts))
    envelopes, _ = await store.replay(s.ws, s.sid, 1)
    assert [orjson.loads(e)["data"]["update"]["content"]["text"] for e in envelopes] == texts


async def test_delete_ends_admitted_prompts(store: RedisStore) -> None:
    s = Session()
    await s.create(store)
    admitted = await store.send(s.ws, s.inc, prompt(s.sid, "p1"), admit_limit=6)
    assert admitted.status is AdmissionStatus.OK and admitted.prompt_id == "p1"
    closed = events.body("session_closed", {"sessionId": s.sid})
    last = Transition(mode=Mode.DELETE, end_admitted=EndAdmitted("session_closed", "closed"), events=[closed])
    assert (await store.apply(s.ws, s.sid, s.inc, last)).applied is ApplyOutcome.APPLIED
    assert await store.session(s.ws, s.sid) is None
    ended = [orjson.loads(e) for e in (await store.replay(s.ws, s.sid, 1))[0]]
    assert [e["type"] for e in ended] == ["turn_error", "session_closed"]
    assert ended[0]["promptId"] == ended[0]["data"]["promptId"] == "p1"


async def test_a_dead_workers_sessions_are_swept_in_batches(store: RedisStore) -> None:
    """The sweeper's batched removal (more sessions than one SWEEP call takes) ends each
    session as its own APPLY would, in order, fenced, and once."""
    from acp_state.store import SESSION_ID_SLOT
    from acp_state.store.sweeper_side import SWEEP_BATCH
    from acp_state.store.sweeper import died

    DIED = died(SESSION_ID_SLOT)

    first = Session()
    sessions = [first]
    for _ in range(SWEEP_BATCH + 4):
        other = Session()
        other.ws, other.inc = first.ws, first.inc
        sessions.append(other)
    for s in sessions:
        await s.create(store)
    busy = sessions[-1]
    assert (await store.send(busy.ws, busy.inc, prompt(busy.sid, "p1"), admit_limit=6)).status is AdmissionStatus.OK
    sids = [s.sid for s in sessions]
    assert await store.sweep(first.ws, "w-someone-else", sids, DIED) == [ApplyOutcome.FOREIGN] * len(sids)
    assert await store.sweep(first.ws, first.inc, sids, DIED) == [ApplyOutcome.APPLIED] * len(sids)
    assert await store.sweep(first.ws, first.inc, sids, DIED) == [ApplyOutcome.MISSING] * len(sids)  # once
    assert [await store.session(s.ws, s.sid) for s in sessions] == [None] * len(sessions)
    ended = [orjson.loads(e) for e in (await store.replay(busy.ws, busy.sid, 1))[0]]
    assert [(e["type"], e["data"]["sessionId"]) for e in ended] == [("turn_error", busy.sid), ("session_died", busy.sid)]
    assert ended[0]["promptId"] == "p1"


async def test_send_admits_fences_and_keeps_the_first_outcome(store: RedisStore) -> None:
    s = Session()
    await s.create(store)
    assert (await store.send(s.ws, "w-intruder", commands.Cancel(sid=s.sid))).status is AdmissionStatus.GONE
    first = await store.send(s.ws, s.inc, prompt(s.sid, "p1"), admit_limit=1, idempotency_key="k1")
    assert (first.status, first.prompt_id, first.repeated) == (AdmissionStatus.OK, "p1", False)
    again = await store.send(s.ws, s.inc, prompt(s.sid, "p2"), admit_limit=1, idempotency_key="k1")
    assert (again.status, again.prompt_id, again.repeated) == (AdmissionStatus.OK, "p1", True)
    assert (await store.send(s.ws, s.inc, prompt(s.sid, "p3"), admit_limit=1)).status is AdmissionStatus.FULL
    assert (await store.first_outcome(s.ws, s.sid, "k1")).prompt_id == "p1"
    inbox = store.inbox_feed(s.ws, s.inc)
    received = await store.read_commands({inbox: "0-0"}, 1000)
    assert [c[2].prompt_id for c in received] == ["p1"]  # type: ignore[union-attr]
    # Nothing more. (This also leaves a cluster's reader waiting inside XREAD when the store
    # closes: cancelled the instant after a read returned, redis-py's cluster client can
    # hang the cancellation; see docs/internals.md, "What is not built yet".)
    assert await store.read_commands({inbox: received[0][1]}, 200) == []


async def test_a_session_reads_back_its_meta_and_an_idle_one_stays_small(store: RedisStore, request: pytest.FixtureRequest) -> None:
    """The meta is kept a field each (the id comes from the key), so an idle session's hash
    stays a listpack: about half the memory of a hashtable, at 100,000 sessions a shard."""
    s = Session()
    await s.create(store, clients=["client_" + new_id()])
    view = await store.session(s.ws, s.sid)
    assert view is not None
    assert view.meta == {"sessionId": s.sid, "workspaceCwd": "/w", "createdAt": "2020-01-01T00:00:00Z"}
    titled = Transition(meta={**view.meta, "displayName": "fix the build"})
    assert (await store.apply(s.ws, s.sid, s.inc, titled)).applied is ApplyOutcome.APPLIED
    view = await store.session(s.ws, s.sid)
    assert view is not None and view.meta["displayName"] == "fix the build"
    if request.node.callspec.params["store"] != "memory":  # fakeredis does not say
        assert await store.redis.object("encoding", keys.session(s.ws, s.sid)) == "listpack"


async def test_the_agent_state_reads_back_and_an_agent_that_reported_none_stores_none(store: RedisStore) -> None:
    """A session whose agent reported no modes or options holds no field for it (most idle
    sessions: their memory, docs/capacity.md) and reads as `{}`, as one that had some and
    lost them does."""
    s = Session()
    await s.create(store, agent_state={})
    view = await store.session(s.ws, s.sid)
    assert view is not None and (view.agent_state or {}) == {}
    assert await store.redis.hget(keys.session(s.ws, s.sid), keys.F.AGENT_STATE) is None
    modes = {"modes": {"currentModeId": "plan", "availableModes": [{"id": "plan", "name": "Plan"}]}}
    await store.apply(s.ws, s.sid, s.inc, Transition(approval_mode="plan", agent_state=modes))
    view = await store.session(s.ws, s.sid)
    assert view is not None and view.agent_state == modes and view.approval_mode == "plan"
    await store.apply(s.ws, s.sid, s.inc, Transition(agent_state={}))
    view = await store.session(s.ws, s.sid)
    assert view is not None and (view.agent_state or {}) == {} and view.approval_mode == "plan"

async def test_handled_commands_are_dropped_and_unread_ones_kept(store: RedisStore) -> None:
    """A worker's streams hold what is still to be read, not every command it ever had."""
    s = Session()
    await s.create(store)
    for n in range(3):
        assert (await store.send(s.ws, s.inc, commands.Cancel(sid=s.sid))).status is AdmissionStatus.OK
    inbox = store.inbox_feed(s.ws, s.inc)
    received = await store.read_commands({inbox: "0-0"}, 1000)
    assert len(received) == 3
    await store.forget_commands({inbox: received[1][1]})  # handled the first two
    # The last handled entry stays (it is the cursor); the unread one too.
    assert [entry_id for entry_id, _ in await store.redis.xrange(inbox)] == [received[1][1], received[2][1]]
    await store.forget_commands({store.inbox_feed(s.ws, "w-nobody"): received[2][1]})  # no stream: nothing made
    assert await store.redis.exists(store.inbox_feed(s.ws, "w-nobody")) == 0
    # Nothing more; and the store closes with its cluster reader waiting inside XREAD, not
    # just back from one (see test_send_admits_fences_and_keeps_the_first_outcome).
    assert await store.read_commands({inbox: received[2][1]}, 200) == []


async def test_one_vote_wins(store: RedisStore) -> None:
    s = Session()
    await s.create(store, interactions_added=[PendingInteraction("r1", {"requestId": "r1", "kind": "permission"}, 1, ["allow", "deny"])])

    async def vote(option: str) -> VoteOutcome:
        return await store.vote(s.ws, s.inc, commands.Vote(sid=s.sid, rid="r1", selected=True, option_id=option))

    assert await vote("maybe") is VoteOutcome.OPTION
    outcomes = await asyncio.gather(*(vote(o) for o in ["allow", "deny"] * 5))
    assert sorted(outcomes) == [VoteOutcome.OK] + [VoteOutcome.UNKNOWN] * 9
    view = await store.session(s.ws, s.sid)
    assert view is not None and view.pending == []


async def test_each_command_reaches_its_owner_as_sent_by_the_call_that_carries_it(store: RedisStore) -> None:
    """What the API hands a worker arrives as the very command it sent, whichever store call
    carries it (send, vote, attach, send_control): the store takes the typed command."""
    s = Session()
    await s.create(store, interactions_added=[PendingInteraction("r1", {"requestId": "r1", "kind": "permission"}, 1, ["allow"])])
    sent: list[commands.Command] = [
        prompt(s.sid, "p1"), commands.Cancel(sid=s.sid), commands.Attach(sid=s.sid, client_id="c1"),
        commands.Vote(sid=s.sid, rid="r1", selected=True, option_id="allow", client_id="c1"),
        commands.Close(sid=s.sid, request_id="q1", reason=commands.CLOSED_BY_CLIENT),
    ]
    for command in sent:
        if isinstance(command, commands.Attach):
            assert await store.attach(s.ws, s.inc, command) is True
        elif isinstance(command, commands.Vote):
            assert await store.vote(s.ws, s.inc, command) is VoteOutcome.OK
        else:  # a prompt is admitted against its limit, as the API sends it
            limit = 1 if isinstance(command, commands.Prompt) else None
            assert (await store.send(s.ws, s.inc, command, admit_limit=limit)).status is AdmissionStatus.OK
    inbox = store.inbox_feed(s.ws, s.inc)
    received = await store.read_commands({inbox: "0-0"}, 1000)
    assert [command for _, _, command in received] == sent
    controls: list[commands.Create | commands.Drain] = [
        commands.Create(ws=s.ws, sid=new_id(), cwd="/w", scope="thread", client_id="c1", wait_ms=1000, request_id="q2"),
        commands.Drain(grace_s=5),
    ]
    await asyncio.gather(*(store.send_control(s.inc, command) for command in controls))  # one pipeline
    feed = store.control_feed(s.inc)
    assert [command for _, _, command in await store.read_commands({feed: "0-0"}, 1000)] == controls
    # Nothing more (see test_send_admits_fences_and_keeps_the_first_outcome).
    assert await store.read_commands({feed: (await store.redis.xrange(feed))[-1][0]}, 200) == []


async def test_attach_and_the_single_slot(store: RedisStore) -> None:
    s = Session()
    await s.create(store)
    assert await store.attach(s.ws, s.inc, commands.Attach(sid=s.sid, client_id="c1")) is True
    assert await store.attach(s.ws, "w-intruder", commands.Attach(sid=s.sid, client_id="c2")) is False
    view = await store.session(s.ws, s.sid)
    assert view is not None and view.client_count == 1
    assert await store.claim_single(s.ws, s.sid, 60_000) is None
    assert await store.claim_single(s.ws, "other", 60_000) == s.sid
    await store.release_single(s.ws, "other")  # not its claim: kept
    assert await store.claim_single(s.ws, "other", 60_000) == s.sid
    await store.release_single(s.ws, s.sid)
    assert await store.claim_single(s.ws, "other", 60_000) is None


async def test_presence_heartbeat_detach_and_lapse(store: RedisStore) -> None:
    """Issue 39: a client that heartbeats stays counted until its presence lapses, then the
    pruning removes it as a detach does (its owner told, the change announced); a detach is
    fenced by the owner; a client that never heartbeats is never pruned."""
    s = Session()
    await s.create(store)
    for client in ("stays", "lapses", "leaves", "silent"):
        assert await store.attach(s.ws, s.inc, commands.Attach(sid=s.sid, client_id=client))
    inbox = keys.inbox(s.ws, s.inc)
    attached = await store.read_commands({inbox: "0-0"}, 1000)
    assert await store.client_seen(s.ws, s.sid, "nobody", 60_000) == (Presence.UNKNOWN_CLIENT, 0)
    assert (await store.client_seen(s.ws, new_id(), "stays", 60_000))[0] is Presence.GONE
    seen, at = await store.client_seen(s.ws, s.sid, "stays", 60_000)
    assert seen is Presence.SEEN and at > 0
    assert (await store.client_seen(s.ws, s.sid, "lapses", 0))[0] is Presence.SEEN  # lapses at once
    assert (await store.client_seen(s.ws, s.sid, None, 60_000))[0] is Presence.SEEN  # the session alone

    version = await store.catalog_version(s.ws)
    assert not await store.detach(s.ws, "w-intruder", commands.Detach(sid=s.sid, client_id="leaves"))
    assert await store.detach(s.ws, s.inc, commands.Detach(sid=s.sid, client_id="leaves"))
    assert await store.detach(s.ws, s.inc, commands.Detach(sid=s.sid, client_id="leaves"))  # twice: nothing more
    assert await store.prune_clients(s.ws) == 1
    assert await store.prune_clients(s.ws) == 0
    view = await store.session(s.ws, s.sid)
    assert view is not None and view.client_count == 2  # "stays" and "silent"
    told = await store.read_commands({inbox: attached[-1][1]}, 1000)
    assert [command for _, _, command in told] == [
        commands.Detach(sid=s.sid, client_id="leaves"), commands.Detach(sid=s.sid, client_id="lapses"),
    ]
    assert (await store.catalog_version(s.ws)).revision == version.revision + 2  # each announced
    assert (await store.client_seen(s.ws, s.sid, "lapses", 60_000))[0] is Presence.UNKNOWN_CLIENT


async def test_a_session_id_belongs_to_one_workspace(store: RedisStore) -> None:
    """Issue 37 item 5: a worker's index write claims the id's locator only if it is free or
    its own workspace's (it overwrote it), and so does the API's claim of a chosen id."""
    s, other = Session(), secrets.token_hex(8)
    assert await store.index_session(s.inc, s.ws, s.sid, True)
    assert await store.index_session(s.inc, s.ws, s.sid, True)  # the same workspace again (a rewrite)
    assert await store.claim_session_id(s.ws, s.sid) is IdClaim.OURS
    assert await store.claim_session_id(other, s.sid) is IdClaim.FOREIGN
    assert not await store.index_session(s.inc, other, s.sid, True)
    assert await store.locate(s.sid) == s.ws
    assert (s.ws, s.sid) in await store.worker_index(s.inc)
    assert (other, s.sid) not in await store.worker_index(s.inc)  # a refused entry is not indexed
    fresh = new_id()
    assert await store.claim_session_id(other, fresh) is IdClaim.NEW and await store.locate(fresh) == other


async def test_a_create_key_is_kept_per_workspace_and_principal(store: RedisStore) -> None:
    """Issue 37 item 5: a create's Idempotency-Key record was one per key for the whole
    deployment; now each workspace and principal has its own."""
    ws, other = secrets.token_hex(8), secrets.token_hex(8)
    mine = CreateKey(ws, "user." + ws, "k-1")
    assert await store.claim_create(mine, "sid-1", "client-1") is None
    for elsewhere in (CreateKey(other, "user." + other, "k-1"), CreateKey(ws, "admin.*", "k-1")):
        assert await store.claim_create(elsewhere, "sid-2", "client-2") is None, elsewhere
        assert (await store.create_record(elsewhere)).sid == "sid-2"
    assert (await store.claim_create(mine, "sid-3", "client-3")).sid == "sid-1"


async def test_list_pages_newest_first_with_live_summaries(store: RedisStore) -> None:
    ws, inc = secrets.token_hex(8), "w-lister"
    sids = []
    for i in range(5):
        s = Session()
        s.ws, s.inc = ws, inc
        await s.create(store)
        # Rows ordered by their updatedAt ms; the listing returns the newest first.
        await store.apply(ws, s.sid, inc, Transition(catalog=CatalogRow("t", "t", 1000 + i)))
        sids.append(s.sid)
    closed = sids[1]
    await store.apply(ws, closed, inc, Transition(mode=Mode.DELETE))
    page = await store.list_page(ws, 0, 2)
    assert [listed.sid for listed in page] == sids[::-1][:3]
    assert all(listed.view is not None and listed.view.owner == inc for listed in page)
    rest = await store.list_page(ws, 3, 10)
    assert [listed.sid for listed in rest] == [closed, sids[0]]
    assert rest[0].row is not None and rest[0].view is None  # kept in the catalog, not live
    assert rest[1].view is not None and rest[1].view.owner == inc
    fresh = RedisStore(store.redis)  # a process that never listed this workspace
    assert await fresh.list_page(ws, 0, 10) == await store.list_page(ws, 0, 10)


async def test_replies_reach_the_waiter_or_are_abandoned(store: RedisStore) -> None:
    request = new_id()
    waiting = asyncio.ensure_future(store.await_reply(request, 5))
    assert await store.reply(request, Reply(ok=True, created_at="1")) is True
    assert await waiting == Reply(ok=True, created_at="1")
    late = new_id()
    assert await store.await_reply(late, 0) is None  # gave up: the marker is left
    assert await store.reply(late, Reply(ok=True, created_at="2")) is False
    assert await store.take_reply(late) == ABANDONED
    untaken = new_id()
    await store.reply(untaken, Reply(ok=True, created_at="3"))
    assert await store.reclaim_replies([(untaken, Reply(ok=True, created_at="3"))]) == [True]
    assert await store.take_reply(untaken) is None


async def test_lease_basics(store: RedisStore) -> None:
    inc = f"w-{secrets.token_hex(4)}"
    assert await store.heartbeat(inc, WorkerReport(inc), LEASE_MS) is Standing.NEW
    report = WorkerReport(inc, host="h", pid=7, sessions=1, max_sessions=4, agent_names=["default", "qwen"],
                          states={"idle": 1}, renewed_at=1234, state_store="h:/s", draining=True)
    assert await store.heartbeat(inc, report, LEASE_MS) is Standing.HELD
    view = await store.lease_view()
    assert view.live_until()[inc] > view.redis_now_ms
    assert (await store.worker_reports([inc]))[inc] == report
    assert await store.known_agents() == ["default", "qwen"]
    await store.resign(inc)
    assert inc in (await store.claim_dead_workers()).claimed
    assert await store.heartbeat(inc, WorkerReport(inc), LEASE_MS) is Standing.DEAD
    await store.forget_worker(inc, set())
    other = f"w-{secrets.token_hex(4)}"
    await store.heartbeat(other, WorkerReport(other), LEASE_MS)
    await store.release(other)
    assert other not in (await store.lease_view()).deadlines


async def test_a_session_is_told_once_an_api_took_its_answer_and_untold_rows_leave_with_a_sweep(
    store: RedisStore,
) -> None:
    s = Session()
    assert await store.was_told(s.ws, s.sid) is False  # never created
    await s.create(store, untold_request="req-1")
    assert await store.was_told(s.ws, s.sid) is False  # created, its answer not taken
    await store.mark_told(s.ws, s.sid)
    assert await store.was_told(s.ws, s.sid) is True
    swept = Transition(mode=Mode.DELETE, uncatalog_untold=True)
    assert (await store.apply(s.ws, s.sid, s.inc, swept)).applied is ApplyOutcome.APPLIED
    assert await store.catalog_row(s.ws, s.sid) is not None  # told: its row is its history

    untold = Session()
    await untold.create(store, untold_request="req-2")
    assert (await store.apply(untold.ws, untold.sid, untold.inc, swept)).applied is ApplyOutcome.APPLIED
    assert await store.catalog_row(untold.ws, untold.sid) is None  # nobody was told: no row


async def test_the_attention_index_follows_transitions_and_votes(store: RedisStore) -> None:
    """Across workspaces (shards, on a cluster): a page in the attention order, a cursor
    that resumes it, one session's entries, and entries leaving with a vote or a delete."""
    asking, failing = Session(), Session()
    question = {"requestId": "q1", "kind": "user_question", "title": "Which one?"}
    await asking.create(store, interactions_added=[
        PendingInteraction("r1", {"requestId": "r1", "kind": "permission", "action": {"title": "rm -rf"}}, 1, ["allow"]),
    ])
    await store.apply(asking.ws, asking.sid, asking.inc, Transition(interactions_added=[PendingInteraction("q1", question, 2, ["a"])]))
    await failing.create(store, turn_error={"code": "rate_limited", "message": "slow down"})
    workspaces = sorted({asking.ws, failing.ws})
    entries = await store.attention_page(workspaces, None, 10)
    assert {(e.sid, e.request_id) for e in entries} == {(asking.sid, "r1"), (asking.sid, "q1"), (failing.sid, None)}
    assert [e.cursor.order for e in entries] == sorted(e.cursor.order for e in entries)
    by_request = {e.request_id: e for e in entries}
    assert by_request["q1"].detail == question and by_request[None].detail["message"] == "slow down"
    assert {e.owner for e in entries} == {asking.inc, failing.inc}
    walked, after = [], None
    while True:  # one at a time, each page resuming after the last
        page = await store.attention_page(workspaces, after, 1)
        if not page:
            break
        walked.append(page[0])
        after = page[0].cursor
    assert walked == entries
    assert {e.request_id for e in await store.attention_of(asking.ws, asking.sid)} == {"r1", "q1"}

    vote = commands.Vote(sid=asking.sid, rid="r1", selected=True, option_id="allow")
    assert await store.vote(asking.ws, asking.inc, vote) is VoteOutcome.OK
    assert [e.request_id for e in await store.attention_of(asking.ws, asking.sid)] == ["q1"]
    await store.apply(failing.ws, failing.sid, failing.inc, Transition(mode=Mode.DELETE))
    assert [(e.sid, e.request_id) for e in await store.attention_page(workspaces, None, 10)] == [(asking.sid, "q1")]


async def test_the_deployment_attention_index_pages_every_workspace_in_one_order(store: RedisStore) -> None:
    """The deployment's index (one on a single Redis, one per slot on a cluster) holds what
    the workspaces' indexes hold, pages it in the same order, and loses a wait with its vote."""
    asking, failing = Session(), Session()
    await asking.create(store, interactions_added=[
        PendingInteraction("r1", {"requestId": "r1", "kind": "permission", "action": {"title": "rm -rf"}}, 1, ["allow"]),
    ])
    await failing.create(store, turn_error={"code": "rate_limited", "message": "slow down"})
    workspaces = sorted({asking.ws, failing.ws})
    ours = [e for e in await store.attention_page(workspaces, None, 10)]
    entries, horizon = await store.deployment_attention_page(workspaces, None, 10)
    assert [e for e in entries if e.ws in workspaces] == ours and horizon is None
    first, horizon = await store.deployment_attention_page(workspaces, None, 1)
    assert horizon is not None and horizon.order == first[0].order  # the earliest index that filled its share
    walked, after = [], None
    while True:  # one entry an index at a time: up to the horizon, the read is complete
        page, horizon = await store.deployment_attention_page(workspaces, after, 1)
        walked += [e for e in page if e.ws in workspaces and (horizon is None or e.order <= horizon.order)]
        if horizon is None:
            break
        after = horizon
    assert walked == ours
    vote = commands.Vote(sid=asking.sid, rid="r1", selected=True, option_id="allow")
    assert await store.vote(asking.ws, asking.inc, vote) is VoteOutcome.OK
    entries, _ = await store.deployment_attention_page(workspaces, None, 10)
    assert [(e.sid, e.request_id) for e in entries if e.ws in workspaces] == [(failing.sid, None)]


# ---- resumes and moves ---------------------------------------------------------------------


async def test_a_moving_session_parks_its_commands_for_the_owner_that_takes_it_over(store: RedisStore) -> None:
    s = Session()
    await s.create(store)
    row = CatalogRow("2020-01-01T00:00:00Z", "2020-01-01T00:00:00Z", 1000, agent="default", state_store="host:/state",
                     agent_sid="a-1", resumable=True)
    await store.apply(s.ws, s.sid, s.inc, Transition(catalog=row))
    row = await store.catalog_row(s.ws, s.sid)
    assert row is not None and (row.agent, row.state_store, row.agent_sid, row.resumable) == (
        "default", "host:/state", "a-1", True)
    target = f"w-{secrets.token_hex(4)}"
    inbox = store.inbox_feed(s.ws, s.inc)
    before = commands.Prompt(sid=s.sid, prompt_id="p1", blocks=[], text="before")
    assert (await store.send(s.ws, s.inc, before, admit_limit=6)).status is AdmissionStatus.OK
    assert await store.mark_moving(s.ws, s.sid, s.inc, target)
    assert not await store.mark_moving(s.ws, s.sid, target, s.inc)  # only the owner moves it
    view = await store.session(s.ws, s.sid)
    assert view is not None and view.moving and view.owner == s.inc
    after = commands.Prompt(sid=s.sid, prompt_id="p2", blocks=[], text="after")
    assert (await store.send(s.ws, s.inc, after, admit_limit=6)).status is AdmissionStatus.OK
    read = [c for _, _, c in await store.read_commands({inbox: "0"}, block_ms=100)]
    assert read == [before, commands.Moving(sid=s.sid, target=target)]  # the marker closes the inbox
    moved = Transition(mode=Mode.TAKEOVER, takeover_from=s.inc, events=[update(s.sid, "moved")], op=1)
    applied = await store.apply(s.ws, s.sid, target, moved)
    assert applied.applied is ApplyOutcome.APPLIED and applied.epoch == "e1"
    assert await store.take_parked(s.ws, s.sid) == [after]
    assert await store.take_parked(s.ws, s.sid) == []
    view = await store.session(s.ws, s.sid)
    assert view is not None and view.owner == target and not view.moving and view.admitted == 2


async def listed(store: RedisStore, s: Session) -> None:
    """`s` as a listed session that is not live (closed, its row kept)."""
    await s.create(store)
    closed = Transition(mode=Mode.DELETE, catalog=CatalogRow("2020-01-01T00:00:00Z", "2020-01-01T00:00:00Z", 2000),
                        events=[events.body("session_closed", {"sessionId": s.sid})])
    assert (await store.apply(s.ws, s.sid, s.inc, closed)).applied is ApplyOutcome.APPLIED


async def test_one_load_claims_a_persisted_session(store: RedisStore) -> None:
    s = Session()
    assert await store.claim_load(s.ws, s.sid, "r0", 10_000) is LoadClaim.GONE  # no row: nothing to resume
    await listed(store, s)
    assert await store.claim_load(s.ws, s.sid, "r1", 10_000) is LoadClaim.OK
    assert await store.claim_load(s.ws, s.sid, "r2", 10_000) is LoadClaim.HELD
    await store.release_load(s.ws, s.sid, "r2")  # not its claim: kept
    assert await store.claim_load(s.ws, s.sid, "r3", 10_000) is LoadClaim.HELD
    await store.release_load(s.ws, s.sid, "r1")
    assert await store.claim_load(s.ws, s.sid, "r3", 10_000) is LoadClaim.OK


async def test_a_listed_session_is_deleted_unless_a_load_claimed_it_first(store: RedisStore) -> None:
    """DELETE_LISTED and CLAIM_LOAD decide a delete's race with a load in one slot: exactly
    one wins; a deleted session leaves no row, turns or transcript, and is resumed by no
    late publish."""
    s = Session()
    await s.create(store)
    assert await store.delete_listed(s.ws, s.sid) is DeleteOutcome.LIVE  # a live one is closed, not deleted
    sent = await store.send(s.ws, s.inc, prompt(s.sid, "p1"), admit_limit=6)
    assert sent.status is AdmissionStatus.OK
    closed = Transition(mode=Mode.DELETE, end_admitted=EndAdmitted("session_closed", "closed"),
                        catalog=CatalogRow("2020-01-01T00:00:00Z", "2020-01-01T00:00:00Z", 2000),
                        events=[events.body("session_closed", {"sessionId": s.sid})])
    assert (await store.apply(s.ws, s.sid, s.inc, closed)).applied is ApplyOutcome.APPLIED
    assert await store.catalog_row(s.ws, s.sid) is not None
    assert await store.claim_load(s.ws, s.sid, "r1", 10_000) is LoadClaim.OK
    assert await store.delete_listed(s.ws, s.sid) is DeleteOutcome.LOADING  # the load claimed it first: it wins
    await store.release_load(s.ws, s.sid, "r1")
    before = await store.catalog_version(s.ws)
    assert await store.delete_listed(s.ws, s.sid, "k1") is DeleteOutcome.DELETED
    assert (await store.catalog_version(s.ws)).revision == before.revision + 1  # readers are told
    assert await store.delete_listed(s.ws, s.sid, "k1") is DeleteOutcome.REPEAT
    assert (await store.first_outcome(s.ws, s.sid, "k1")) is not None
    assert await store.delete_listed(s.ws, s.sid) is DeleteOutcome.MISSING
    assert await store.catalog_row(s.ws, s.sid) is None
    assert [row.sid for row in await store.list_page(s.ws, 0, 10)] == []
    assert await store.turn(s.ws, s.sid, "p1") is None
    assert await store.transcript_page(s.ws, s.sid, None, 10) == ([], None)
    assert await store.claim_load(s.ws, s.sid, "r2", 10_000) is LoadClaim.GONE  # the delete won: no load
    # A resume whose claim lapsed before its publish is not revived by it.
    resumed = Transition(mode=Mode.CREATE, meta={"sessionId": s.sid, "workspaceCwd": "/w", "createdAt": "2020-01-01T00:00:00Z"},
                         epoch="e2", resumed=True, catalog=CatalogRow("2020-01-01T00:00:00Z", "2020-01-01T00:00:00Z", 3000))
    assert (await store.apply(s.ws, s.sid, "w-resumer", resumed)).applied is ApplyOutcome.FOREIGN
    assert await store.session(s.ws, s.sid) is None and await store.catalog_row(s.ws, s.sid) is None


async def test_a_turn_the_sweeper_ended_answers_its_worker_lost_end_after_a_resume(store: RedisStore) -> None:
    """A swept session keeps its row and its turn records: each turn the sweep ended
    (running or queued) is recorded ended `worker_lost`, and a resume keeps it."""
    from acp_state.store import SESSION_ID_SLOT
    from acp_state.store.sweeper import died
    from acp_state.turns import TurnRecord, TurnState

    s = Session()
    await s.create(store)
    for pid in ("p1", "p2"):
        assert (await store.send(s.ws, s.inc, prompt(s.sid, pid), admit_limit=6)).status is AdmissionStatus.OK
    running = (await store.turn(s.ws, s.sid, "p1")).started(5000)  # type: ignore[union-attr]
    assert (await store.apply(s.ws, s.sid, s.inc, Transition(active=True, turns=[running]))).applied is ApplyOutcome.APPLIED
    await store.mark_told(s.ws, s.sid)
    assert await store.sweep(s.ws, s.inc, [s.sid], died(SESSION_ID_SLOT)) == [ApplyOutcome.APPLIED]
    resumed = Transition(mode=Mode.CREATE, meta={"sessionId": s.sid, "workspaceCwd": "/w", "createdAt": "2020-01-01T00:00:00Z"},
                         epoch="e2", resumed=True, catalog=CatalogRow("2020-01-01T00:00:00Z", "2020-01-01T00:00:00Z", 3000))
    assert (await store.apply(s.ws, s.sid, "w-resumer", resumed)).applied is ApplyOutcome.APPLIED
    for pid, started in (("p1", 5000), ("p2", None)):
        record = await store.turn(s.ws, s.sid, pid)
        assert isinstance(record, TurnRecord) and record.state is TurnState.ERROR, record
        assert record.error is not None and record.error["code"] == "worker_lost"
        assert record.started_at == started and record.ended_at is not None and record.ended_at >= record.queued_at
        assert record.prompt_text == "hi"
    current = await store.current_turn(s.ws, s.sid)
    assert current is not None and current.prompt_id == "p2" and current.state is TurnState.ERROR
