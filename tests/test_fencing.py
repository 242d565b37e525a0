"""Lease semantics under faults: dead stays dead, a stalled store kills nobody, and every
acknowledged command has its effect (issue: acknowledged means done).

Real processes and a real redis-server of the test's own; faults are a worker frozen with
SIGSTOP past its lease, Redis stalled with DEBUG SLEEP or CLIENT PAUSE, and Redis out of
memory.
"""

from __future__ import annotations

import asyncio
import os
import signal
import uuid

import pytest
import redis.asyncio as aioredis

from acp_state import commands
from acp_state.store import keys
from acp_state.ids import workspace_id
from acp_state.store import SESSION_ID_SLOT, CreateKey, RedisStore
from acp_state.store.sweeper import died
from acp_state.worker.creates import RECLAIM_MARGIN_S
from testbed.processes import ApiProcess
from tests.conftest import RedisServer, free_port
from tests.harness import EventWatcher, Harness
from tests.helpers import create, eventually, prompt, status

LEASE_MS = 1500
TERMINALS = ("turn_complete", "turn_error")


def text(value: str) -> dict:
    return {"prompt": [{"type": "text", "text": value}]}


async def registered(redis_client: aioredis.Redis) -> set[str]:
    return set(await redis_client.zrange(keys.WORKERS, 0, -1))


async def incarnation_of(redis_client: aioredis.Redis, workspace: str, sid: str) -> str:
    return await redis_client.hget(keys.session(workspace_id(workspace), sid), keys.F.OWNER)


def terminals_of(events: EventWatcher, sid: str, prompt_id: str) -> list[dict]:
    return [e for e in events.of(sid) if e["type"] in TERMINALS and e.get("promptId") == prompt_id]


async def turn_done(api: ApiProcess, events: EventWatcher, sid: str, value: str = "hello") -> dict:
    """A prompt that runs to its terminal: proof that the session works end to end."""
    accepted = await prompt(api, sid, value)
    return await events.wait_for(
        lambda e: e["type"] in TERMINALS and e.get("promptId") == accepted["promptId"], timeout=20
    )


# ---- dead stays dead -----------------------------------------------------------------------


async def test_a_worker_frozen_past_its_lease_stays_dead_when_it_wakes(
    own_harness: Harness, own_client: aioredis.Redis, workspace: str
) -> None:
    harness, redis_client = own_harness, own_client
    events = await harness.events()
    victim = await harness.worker("--lease-ms", str(LEASE_MS))
    api = await harness.api()
    running = (await create(api, workspace))["sessionId"]
    waiting = (await create(api, workspace))["sessionId"]
    idle = (await create(api, workspace))["sessionId"]
    survivor = await harness.worker("--lease-ms", str(LEASE_MS))

    slow = await prompt(api, running, "#slow 30")
    await events.wait_type(running, "session_update", promptId=slow["promptId"])
    queued = await prompt(api, running, "after the slow one")
    asked = await prompt(api, waiting, "#permission")
    request = await events.wait_type(waiting, "permission_request", promptId=asked["promptId"])

    os.kill(victim.pid, signal.SIGSTOP)
    try:
        for sid in (running, waiting, idle):
            await events.wait_type(sid, "session_died", timeout=10 * LEASE_MS / 1000)
    finally:
        os.kill(victim.pid, signal.SIGCONT)

    # Every prompt the API acknowledged got its one terminal, before the session died.
    for accepted in (slow, queued, asked):
        sid = running if accepted is not asked else waiting
        ends = terminals_of(events, sid, accepted["promptId"])
        assert [e["data"]["code"] for e in ends] == ["worker_lost"], ends
    died = {e["_channel"]: e["id"] for e in events.events if e["type"] == "session_died"}

    # The woken worker finds out, ends what it hosted and joins again as a new incarnation.
    old = victim.incarnation
    fresh = await eventually(lambda: _new_incarnation_of(redis_client, victim.pid, old), "the woken worker's rejoin")
    assert old not in await registered(redis_client)

    # Nothing of the dead incarnation came back: status and prompt agree, and a DELETE finds
    # only the listed row it left (which it deletes: docs/api.md, "Deleting a session").
    for sid in (running, waiting, idle):
        assert (await api.client.get(f"/session/{sid}/status")).status_code == 404
        assert (await api.client.post(f"/session/{sid}/prompt", json=text("x"))).status_code == 404
        assert not await redis_client.exists(keys.session(workspace_id(workspace), sid))
    vote = await api.client.post(
        f"/session/{waiting}/permission/{request['data']['requestId']}",
        json={"outcome": {"outcome": "selected", "optionId": "proceed_once"}},
    )
    assert vote.status_code == 404

    # The rejoined worker serves new sessions (a barrier: its old sessions had every
    # chance to write again by now), and no event of a dead session followed its death.
    await victim.terminate()
    newest = (await create(api, workspace))["sessionId"]
    assert await incarnation_of(redis_client, workspace, newest) == survivor.incarnation
    await turn_done(api, events, newest)
    for channel, last in died.items():
        assert max(e["id"] for e in events.events if e["_channel"] == channel) == last
    assert fresh not in await registered(redis_client), "SIGTERM releases the new incarnation"
    leftovers = [k async for k in redis_client.scan_iter(match=f"*{old}*")]
    assert leftovers == []


async def test_a_worker_that_learns_of_its_death_before_the_sweep_leaves_its_sessions_to_the_sweeper(
    own_harness: Harness, own_client: aioredis.Redis, workspace: str
) -> None:
    """A death is declared (CLAIM_DEAD) and its sessions swept (SWEEP, from the dead
    incarnation's index) in two steps. A worker that wakes between them learns it is dead
    and rejoins; its old sessions stay in the index, so the sweep still ends each for its
    clients. (A chaos run on a cluster found nine sessions left without `session_died` or
    their prompts' ends: the woken worker had taken them out of the index first.)"""
    harness, redis_client = own_harness, own_client
    events = await harness.events()
    victim = await harness.worker("--lease-ms", str(LEASE_MS))
    api = await harness.api()
    sid = (await create(api, workspace))["sessionId"]
    slow = await prompt(api, sid, "#slow 30")
    await events.wait_type(sid, "session_update", promptId=slow["promptId"])
    await api.terminate()  # no other sweeper: the test sweeps, one step at a time
    old = victim.incarnation
    store = RedisStore.from_url(harness.redis_url)
    try:
        os.kill(victim.pid, signal.SIGSTOP)
        try:
            async def claimed() -> bool:
                return old in (await store.claim_dead_workers()).claimed  # the sweep's first step

            await eventually(claimed, "the stopped worker's lease lapsing")
        finally:
            os.kill(victim.pid, signal.SIGCONT)
        # It learns that it is dead, and joins again as a new incarnation.
        await eventually(lambda: _new_incarnation_of(redis_client, victim.pid, old), "the woken worker's rejoin")
        assert (workspace_id(workspace), sid) in await store.worker_index(old), "left for the sweeper"
        # The sweep's second step: the session ends for its clients, its turn `worker_lost`.
        await store.sweep(workspace_id(workspace), old, [sid], died(SESSION_ID_SLOT))
        await events.wait_type(sid, "session_died")
        ends = terminals_of(events, sid, slow["promptId"])
        assert [e["data"]["code"] for e in ends] == ["worker_lost"], ends
    finally:
        await store.close()


async def _new_incarnation_of(redis_client: aioredis.Redis, pid: int, old: str) -> str | None:
    for member in await registered(redis_client):
        if f"-{pid}-" in member and member != old:
            return member
    return None


# ---- a stall of the store is not a death ---------------------------------------------------


@pytest.mark.parametrize("how", ["debug-sleep-2x", "debug-sleep-5x", "client-pause-5x"])
async def test_a_store_stall_past_the_lease_sweeps_no_healthy_worker(
    own_redis: RedisServer, workspace: str, how: str
) -> None:
    lease_ms = 1000
    harness = Harness(own_redis.url, workspace, free_port)
    redis_client = aioredis.Redis.from_url(own_redis.url, decode_responses=True)
    staller = aioredis.Redis.from_url(own_redis.url, decode_responses=True, socket_timeout=60)
    try:
        events = await harness.events()
        first = await harness.worker("--lease-ms", str(lease_ms))
        api = await harness.api()
        sids = [(await create(api, workspace))["sessionId"] for _ in range(2)]
        second = await harness.worker("--lease-ms", str(lease_ms))
        sids += [(await create(api, workspace))["sessionId"] for _ in range(4)]

        async def on_both() -> bool:
            """The API places by the reports it read within the last 100 ms: creates that
            come right after a worker started may all go to the one it knew."""
            owners = {await incarnation_of(redis_client, workspace, sid) for sid in sids}
            if second.incarnation not in owners:
                sids.append((await create(api, workspace))["sessionId"])
            return owners == {first.incarnation, second.incarnation}

        await eventually(on_both, "a session on each worker")
        asked = await prompt(api, sids[0], "#permission")
        request = await events.wait_type(sids[0], "permission_request", promptId=asked["promptId"])
        rid = request["data"]["requestId"]

        factor = 2 if how.endswith("2x") else 5
        stall_ms = factor * lease_ms
        if how.startswith("debug-sleep"):
            stall = asyncio.ensure_future(staller.execute_command("DEBUG", "SLEEP", stall_ms / 1000))
        else:
            await staller.execute_command("CLIENT", "PAUSE", stall_ms, "ALL")
            stall = asyncio.ensure_future(asyncio.sleep(stall_ms / 1000))
        await asyncio.sleep(0.1)  # the stall has begun (DEBUG SLEEP answers only after it)
        key = str(uuid.uuid4())
        url = f"/session/{sids[0]}/permission/{rid}"
        vote = {"outcome": {"outcome": "selected", "optionId": "proceed_once"}}
        during = await api.client.post(url, json=vote, headers={"Idempotency-Key": key}, timeout=60)
        await stall
        # The outcome is known, or said to be unknown; the same key then tells it.
        assert during.status_code in (200, 503), during.text
        if during.status_code == 503:
            assert during.json()["code"] in ("outcome_unknown", "store_unavailable"), during.text
        again = await api.client.post(url, json=vote, headers={"Idempotency-Key": key})
        assert again.status_code == 200, again.text
        await events.wait_type(sids[0], "permission_resolved", requestId=rid)

        # Every session still works after the stall: no sweeper took a healthy worker.
        for sid in sids:
            await turn_done(api, events, sid)
            assert (await status(api, sid))["sessionId"] == sid
        assert not [e for e in events.events if e["type"] == "session_died"]
        assert {first.incarnation, second.incarnation} <= await registered(redis_client)
    finally:
        await harness.stop_all()
        await redis_client.aclose()
        await staller.aclose()


async def test_out_of_memory_sweeps_nobody_and_the_lease_holds(
    own_harness: Harness, own_client: aioredis.Redis, workspace: str
) -> None:
    lease_ms = 1000
    harness, redis_client = own_harness, own_client
    events = await harness.events()
    worker = await harness.worker("--lease-ms", str(lease_ms))
    api = await harness.api()
    sids = [(await create(api, workspace))["sessionId"] for _ in range(3)]
    # Ballast made inside Redis: a big SET would count its own query buffer, which Redis
    # frees a moment later, and the limit below would no longer be exceeded.
    await redis_client.execute_command("DEBUG", "POPULATE", 2000, "ballast", 2048)
    used = int((await redis_client.info("memory"))["used_memory"])
    await redis_client.config_set("maxmemory-policy", "noeviction")
    await redis_client.config_set("maxmemory", str(used // 2))  # far over it: every write refused
    try:
        answer = await api.client.post("/session", json={"cwd": workspace, "sessionScope": "thread"}, timeout=30)
        assert answer.status_code == 503, answer.text
        assert answer.json()["code"] in ("store_full", "store_unavailable"), answer.text
        answer = await api.client.post(f"/session/{sids[0]}/prompt", json=text("x"))
        assert answer.status_code == 503 and answer.headers["content-type"] == "application/json; charset=utf-8"
        # Several leases pass with Redis refusing every write but the lease's own (its
        # scripts may run out of memory): the worker keeps renewing all along.
        renewed = float(await redis_client.zscore(keys.WORKERS, worker.incarnation))
        await eventually(
            lambda: _renewed_after(redis_client, worker.incarnation, renewed + 3 * lease_ms), "three leases renewed"
        )
    finally:
        await redis_client.config_set("maxmemory", "0")
        async for key in redis_client.scan_iter(match="ballast:*", count=1000):
            await redis_client.delete(key)
    before = float(await redis_client.zscore(keys.WORKERS, worker.incarnation) or 0)
    await eventually(lambda: _renewed_after(redis_client, worker.incarnation, before), "a renewal")
    for sid in sids:
        await turn_done(api, events, sid)
    assert not [e for e in events.events if e["type"] == "session_died"]
    assert (await create(api, workspace))["sessionId"]


async def _renewed_after(redis_client: aioredis.Redis, incarnation: str, before: float) -> bool:
    return float(await redis_client.zscore(keys.WORKERS, incarnation) or 0) > before


# ---- acknowledged means done ---------------------------------------------------------------


class _QuietAgent:
    """The agent side of a LiveSession, for driving its state machine directly."""

    modes: dict = {}  # the agent's session modes by agent session id (none here)
    reported: dict = {}  # what its session/new answered of each session (none here)

    async def cancel(self, agent_sid: str) -> None: ...
    async def forget(self, agent_sid: str) -> None: ...


async def test_an_update_that_races_the_first_snapshot_waits_for_it(redis_server: RedisServer) -> None:
    """The race forced: the agent's update is handed to the session before its first
    snapshot was even queued. It must be written after the snapshot, not fenced off (which
    left a ghost: closed here, live and idle in the store, its prompts never run)."""
    from acp_state.store.connection import connect
    from acp_state.store import RedisStore
    from acp_state.worker.session import LiveSession

    store = RedisStore(connect(redis_server.url))
    fenced: list[int] = []
    ws, sid = workspace_id("/tmp/race"), str(uuid.uuid4())

    async def on_fenced(_: LiveSession, applied: int) -> None:
        fenced.append(applied)

    async def on_gone(_: LiveSession) -> None: ...

    session = LiveSession(
        store=store, incarnation="w-race", ws=ws, sid=sid, cwd="/tmp/race", agent=_QuietAgent(),  # type: ignore[arg-type]
        agent_sid="a-1", single=False, on_gone=on_gone, on_fenced=on_fenced,
    )
    try:
        early = asyncio.ensure_future(
            session.on_update({"sessionUpdate": "available_commands_update", "availableCommands": []})
        )
        await asyncio.sleep(0)  # the update is in flight first
        created = await session.publish_created(None)
        await early
        assert created is not None and created.applied == 1
        assert not fenced and not session.closed
        view = await store.session(ws, sid)
        assert view is not None and view.owner == "w-race" and view.last_event_id == 1
        logged, _ = await store.replay(ws, sid, 0)
        assert '"available_commands_update"' in logged[0]
    finally:
        await store.close()


async def test_sessions_survive_an_update_sent_right_after_session_new(harness: Harness, workspace: str) -> None:
    """Agents such as Claude Code and Copilot send an update right behind their answer to
    `session/new`; it must wait for the session's first snapshot, not fence the session off."""
    events = await harness.events()
    await harness.worker(env={"ACP_SCRIPTED_EAGER_UPDATE": "1"})
    api = await harness.api()
    sids = [(await create(api, workspace))["sessionId"] for _ in range(12)]
    for sid in sids:
        await events.wait_type(sid, "session_update")
        done = await turn_done(api, events, sid)
        assert done["type"] == "turn_complete"


async def test_an_update_sent_before_session_new_answers_reaches_the_session(harness: Harness, workspace: str) -> None:
    """Copilot announces a new session's commands before its `session/new` answer names the
    session: the worker keeps the update and relays it once the session is published."""
    events = await harness.events()
    await harness.worker(env={"ACP_SCRIPTED_EAGER_UPDATE": "before"})
    api = await harness.api()
    sids = [(await create(api, workspace))["sessionId"] for _ in range(4)]
    for sid in sids:
        first = await events.wait_type(sid, "session_update")
        assert first["data"]["update"]["sessionUpdate"] == "available_commands_update"
        assert "promptId" not in first
        done = await turn_done(api, events, sid)
        assert done["type"] == "turn_complete"


async def test_a_close_racing_prompts_ends_every_accepted_prompt_once(harness: Harness, workspace: str) -> None:
    events = await harness.events()
    await harness.worker()
    api = await harness.api()
    for _ in range(3):
        sid = (await create(api, workspace))["sessionId"]
        first = await prompt(api, sid, "#slow 5")
        await events.wait_type(sid, "session_update", promptId=first["promptId"])
        sends = [api.client.post(f"/session/{sid}/prompt", json=text(f"p{n}")) for n in range(12)]
        answers = await asyncio.gather(*sends[:6], api.client.delete(f"/session/{sid}"), *sends[6:])
        accepted = [first["promptId"]] + [a.json()["promptId"] for a in answers if a.status_code == 202]
        assert answers[6].status_code == 204
        await events.wait_type(sid, "session_closed")
        for prompt_id in accepted:
            ends = await events.wait_for(lambda e, p=prompt_id: e["type"] in TERMINALS and e.get("promptId") == p)
            assert ends and len(terminals_of(events, sid, prompt_id)) == 1, prompt_id
        closed_id = next(e["id"] for e in events.of(sid) if e["type"] == "session_closed")
        assert all(e["id"] < closed_id for e in events.of(sid) if e["type"] in TERMINALS)


async def test_a_repeated_idempotency_key_returns_the_first_outcome(harness: Harness, workspace: str) -> None:
    events = await harness.events()
    await harness.worker()
    api = await harness.api()
    sid = (await create(api, workspace))["sessionId"]

    key = {"Idempotency-Key": "prompt-1"}
    one = await api.client.post(f"/session/{sid}/prompt", json=text("#permission"), headers=key)
    two = await api.client.post(f"/session/{sid}/prompt", json=text("#permission"), headers=key)
    assert one.status_code == two.status_code == 202
    assert one.json() == two.json()
    request = await events.wait_type(sid, "permission_request", promptId=one.json()["promptId"])

    url = f"/session/{sid}/permission/{request['data']['requestId']}"
    vote = {"outcome": {"outcome": "selected", "optionId": "proceed_once"}}
    votes = [await api.client.post(url, json=vote, headers={"Idempotency-Key": "vote-1"}) for _ in range(2)]
    assert [v.status_code for v in votes] == [200, 200]
    other = await api.client.post(url, json=vote, headers={"Idempotency-Key": "vote-2"})
    assert other.status_code == 404  # a different vote: the request is no longer pending
    legacy = await api.client.post(
        f"/permission/{request['data']['requestId']}", json=vote, headers={"Idempotency-Key": "vote-1"}
    )
    assert legacy.status_code == 200
    await events.wait_type(sid, "turn_complete", promptId=one.json()["promptId"])
    assert len([e for e in events.of(sid) if e["type"] == "permission_resolved"]) == 1
    assert len([e for e in events.of(sid) if e["type"] == "pending_prompt_added"]) == 0

    bad = await api.client.post(f"/session/{sid}/prompt", json=text("x"), headers={"Idempotency-Key": "a b"})
    assert bad.status_code == 400 and bad.json()["code"] == "invalid_idempotency_key"

    close = {"Idempotency-Key": "close-1"}
    assert (await api.client.delete(f"/session/{sid}", headers=close)).status_code == 204
    assert (await api.client.delete(f"/session/{sid}", headers=close)).status_code == 204  # the close, once
    assert (await api.client.get(f"/session/{sid}/status")).status_code == 404
    # The closed session is listed: a DELETE with another key deletes it, and its retry is
    # answered the same, once the session is gone.
    delete = {"Idempotency-Key": "delete-1"}
    assert (await api.client.delete(f"/session/{sid}", headers=delete)).status_code == 204
    assert (await api.client.delete(f"/session/{sid}", headers=delete)).status_code == 204
    assert (await api.client.delete(f"/session/{sid}")).status_code == 404
    repeated = await api.client.post(f"/session/{sid}/prompt", json=text("#permission"), headers=key)
    assert repeated.json() == one.json()

    created = [
        await api.client.post("/session", json={"cwd": workspace, "sessionScope": "thread"},
                              headers={"Idempotency-Key": "create-1"})
        for _ in range(2)
    ]
    assert created[0].status_code == created[1].status_code == 200
    assert created[0].json()["sessionId"] == created[1].json()["sessionId"]


# ---- readiness -------------------------------------------------------------------------------


async def test_a_create_before_any_worker_waits_for_one(harness: Harness, workspace: str) -> None:
    api = await harness.api()
    assert (await api.client.get("/health")).json() == {"status": "ok"}
    ready = await api.client.get("/health/ready")
    assert ready.status_code == 503 and ready.json()["code"] == "no_worker"
    creating = asyncio.ensure_future(
        api.client.post("/session", json={"cwd": workspace, "sessionScope": "thread"}, timeout=60)
    )
    await asyncio.sleep(0.3)  # the create is in flight, with no worker anywhere
    assert not creating.done()
    await harness.worker()
    created = await creating
    assert created.status_code == 200, created.text
    ready = await api.client.get("/health/ready")
    assert ready.status_code == 200 and ready.json()["workers"] == 1


# ---- the session hash's TTL --------------------------------------------------------------------


async def test_session_hashes_expire_when_no_process_is_left_to_sweep(own_redis: RedisServer, workspace: str) -> None:
    ttl_ms = 3000
    harness = Harness(own_redis.url, workspace, free_port)
    redis_client = aioredis.Redis.from_url(own_redis.url, decode_responses=True)
    listener = aioredis.Redis.from_url(own_redis.url, decode_responses=True)
    pubsub = listener.pubsub()
    try:
        await redis_client.config_set("notify-keyspace-events", "Exg")
        await pubsub.psubscribe("__keyevent@0__:*")
        worker = await harness.worker("--lease-ms", "1000", "--session-ttl-ms", str(ttl_ms))
        api = await harness.api()
        ws = workspace_id(workspace)
        sids = [(await create(api, workspace))["sessionId"] for _ in range(3)]
        for sid in sids:
            assert 0 < await redis_client.pttl(keys.session(ws, sid)) <= ttl_ms

        # While the worker lives, it refreshes them (an `expire` event per refresh).
        refreshed: set[str] = set()
        async with asyncio.timeout(3 * ttl_ms / 1000):
            async for message in pubsub.listen():
                if message["type"] == "pmessage" and message["channel"].endswith(":expire"):
                    refreshed.add(message["data"])
                    if {keys.session(ws, sid) for sid in sids} <= refreshed:
                        break

        # With every process gone (no sweeper anywhere), they expire within the TTL.
        await api.kill9()
        await worker.kill9()
        expired: set[str] = set()
        async with asyncio.timeout(2 * ttl_ms / 1000 + 5):
            async for message in pubsub.listen():
                if message["type"] == "pmessage" and message["channel"].endswith(":expired"):
                    expired.add(message["data"])
                    if {keys.session(ws, sid) for sid in sids} <= expired:
                        break
    finally:
        await pubsub.aclose()
        await listener.aclose()
        await harness.stop_all()
        await redis_client.aclose()


# ---- creates nobody was told of ---------------------------------------------------------------


async def _send_create(store: RedisStore, incarnation: str, workspace: str, wait_ms: int) -> tuple[str, str]:
    """What an API sends to a worker for a create; returns (session id, request id)."""
    sid, request = str(uuid.uuid4()), f"req-{uuid.uuid4().hex[:8]}"
    await store.send_control(incarnation, commands.Create(
        ws=workspace_id(workspace), sid=sid, cwd=workspace, scope="thread",
        client_id="client-1", wait_ms=wait_ms, request_id=request,
    ))
    return sid, request


async def test_a_create_answer_nobody_took_is_taken_back_and_the_session_undone(
    harness: Harness, workspace: str
) -> None:
    """The API gave up on a create without being able to say so (Redis was away when it
    stopped waiting, or restarted empty and lost its marker): once the API's wait is over,
    the worker takes its answer back and undoes the session nobody was told of."""
    events = await harness.events()
    worker = await harness.worker()
    api = await harness.api()
    store = RedisStore.from_url(harness.redis_url)
    try:
        sid, request = await _send_create(store, worker.incarnation, workspace, wait_ms=300)
        await events.wait_type(sid, "session_closed", timeout=30)
        assert await events.redis.llen(keys.reply(request)) == 0, "the answer was taken back"
        assert await store.catalog_row(workspace_id(workspace), sid) is None, "no catalog row left behind"
        assert (await api.client.get(f"/session/{sid}/status")).status_code == 404
    finally:
        await store.close()


async def test_a_retried_create_delivers_the_answer_its_first_api_left(harness: Harness, workspace: str) -> None:
    """The first API sent the create and gave up (its process died): a retry with the same
    Idempotency-Key takes the answer and tells it, and the session stays."""
    worker = await harness.worker()
    api = await harness.api()
    store = RedisStore.from_url(harness.redis_url)
    try:
        sid, request = await _send_create(store, worker.incarnation, workspace, wait_ms=300)
        # The record a tokenless API keeps for this key (its one caller: `admin.*`).
        key = CreateKey(workspace_id(workspace), "admin.*", "create-left")
        assert await store.claim_create(key, sid, "client-1") is None
        await store.note_create_request(key, sid, "client-1", request)
        retried = await api.client.post("/session", json={"cwd": workspace, "sessionScope": "thread"},
                                        headers={"Idempotency-Key": "create-left"})
        assert retried.status_code == 200, retried.text
        assert retried.json()["sessionId"] == sid and retried.json()["clientId"] == "client-1"
        # An absence to check: past the first API's wait and the worker's margin (plus a
        # tick of its loop), the session is still there.
        await asyncio.sleep(0.3 + RECLAIM_MARGIN_S + 1.5)
        assert (await api.client.get(f"/session/{sid}/status")).status_code == 200
    finally:
        await store.close()


async def test_a_session_nobody_was_told_of_leaves_no_row_when_its_worker_dies(
    own_harness: Harness, workspace: str
) -> None:
    """A worker dies between creating a session and any API taking its answer: nobody was
    told of that session, so its sweep leaves no catalog row. A session whose creator was
    told keeps its row (its history) when the same worker dies."""
    events = await own_harness.events()
    worker = await own_harness.worker("--lease-ms", "1000")
    api = await own_harness.api()
    store = RedisStore.from_url(own_harness.redis_url)
    ws = workspace_id(workspace)
    try:
        told = (await create(api, workspace))["sessionId"]
        untold, _ = await _send_create(store, worker.incarnation, workspace, wait_ms=60_000)

        async def listed() -> bool:
            return await store.catalog_row(ws, untold) is not None

        await eventually(listed, "the untold session listed")
        await worker.kill9()
        await events.wait_type(untold, "session_died", timeout=30)
        await events.wait_type(told, "session_died", timeout=30)
        assert await store.catalog_row(ws, untold) is None
        assert await store.catalog_row(ws, told) is not None
    finally:
        await store.close()
