"""The Lua scripts that hand commands to a session's owner and answer them, driven directly
with explicit KEYS and ARGV on a real redis-server (see tests/test_lua.py): SEND, MOVE and
the takeover, VOTE with the attention index it keeps (and ATTENTION_PAGE, ATTENTION_OF),
ATTACH, and the replies (REPLY, ABANDON, TAKE, RECLAIM).
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import redis.asyncio as aioredis

from acp_state import commands, events
from acp_state.store import keys
from acp_state.store.keys import F
from acp_state.store.keys import VersionField as VER
from acp_state.turns import TurnRecord, TurnState
from tests.lua_helpers import (  # noqa: F401  (server, r: fixtures, each module's own)
    ATTENTION, ATTENTION_DETAILS, CHANGES, CHANNEL, DEPLOYMENT, DEPLOYMENT_DETAILS, INC, OTHER, SESSION, SID, TTL, TURNS, VERSION, WS, apply,
    attention, created, r, run, server, update,
)


# ---- SEND ------------------------------------------------------------------------------


PARKED = keys.parked(WS, SID)
SEND_KEYS = [SESSION, keys.inbox(WS, INC), TURNS, PARKED]


async def send(r: aioredis.Redis, limit: Any = "", pid: str = "", idem: str | None = None, incarnation: str = INC) -> list[Any]:
    key_list = SEND_KEYS + ([keys.idempotency(WS, SID, idem)] if idem else [])
    turn = TurnRecord.queued(pid, "hi", 1, None).pack() if pid else ""
    return await run(r, "SEND", key_list, [incarnation, '{"t":"prompt"}', limit, TTL, 100, pid, TTL, turn, TTL])


async def test_send_admits_within_the_limit_and_records_the_prompt(r: aioredis.Redis) -> None:
    await created(r)
    assert await send(r, 2, "p1") == ["ok", "0", "e1", "p1"]
    assert await send(r, 2, "p2") == ["ok", "0", "e1", "p2"]
    assert await send(r, 2, "p3") == ["full"]
    assert await r.hget(SESSION, F.ADMITTED) == "2"
    assert await r.hget(SESSION, F.PROMPT + "p1") == "1" and not await r.hexists(SESSION, F.PROMPT + "p3")
    # The admitted prompts' turn records are queued in the same step; the refused one has none.
    assert TurnRecord.unpack(await r.hget(TURNS, "p1")).state is TurnState.QUEUED
    assert sorted(await r.hkeys(TURNS)) == ["p1", "p2"] and 0 < await r.pttl(TURNS) <= TTL
    assert await r.xlen(keys.inbox(WS, INC)) == 2 and 0 < await r.pttl(keys.inbox(WS, INC)) <= TTL


async def test_send_is_fenced_and_keeps_its_first_outcome(r: aioredis.Redis) -> None:
    await created(r)
    assert await send(r, incarnation=OTHER) == ["gone"]
    assert await send(r, "", "p1", idem="k") == ["ok", "0", "e1", "p1"]
    assert await send(r, "", "p9", idem="k") == ["ok", "0", "e1", "p1", "repeat"]
    assert await r.xlen(keys.inbox(WS, INC)) == 1


# ---- MOVE and the takeover ---------------------------------------------------------------


MOVE_KEYS = [SESSION, keys.inbox(WS, INC), PARKED, CHANNEL, VERSION, CHANGES]
MARKER = '{"t":"moving","sid":"%s","target":"%s"}'


async def move(r: aioredis.Redis, target: str = OTHER, incarnation: str = INC) -> int:
    return await run(r, "MOVE", MOVE_KEYS, [incarnation, target, MARKER % (SID, target), TTL, 100, SID, TTL])


async def test_move_marks_the_session_closes_the_owners_inbox_and_parks_what_follows(r: aioredis.Redis) -> None:
    await created(r)
    assert await send(r, 6, "p1") == ["ok", "0", "e1", "p1"]  # before the move: the owner's inbox
    assert await move(r, incarnation=OTHER) == 0  # only the owner moves its session
    await r.xadd(PARKED, {"c": "left by a move that ended otherwise"})
    async with r.pubsub() as pubsub:
        await pubsub.execute_command("SSUBSCRIBE", CHANNEL)
        assert await move(r) == 1
        message = await pubsub.get_message(timeout=5)
        while message is None or message["type"] != "smessage":
            message = await pubsub.get_message(timeout=5)
        assert message["data"].startswith(SID + " ")  # readers see it moving at once
    assert await r.hget(SESSION, F.MOVING) == OTHER
    inbox = [fields["c"] for _, fields in await r.xrange(keys.inbox(WS, INC))]
    assert inbox == ['{"t":"prompt"}', MARKER % (SID, OTHER)]  # the marker follows what came before
    assert await r.xlen(PARKED) == 0  # a stale parked stream is gone
    assert await send(r, 6, "p2") == ["ok", "0", "e1", "p2"]  # after: parked, still admitted
    assert await r.xlen(keys.inbox(WS, INC)) == 2 and await r.xlen(PARKED) == 1
    assert await r.hget(SESSION, F.ADMITTED) == "2" and await r.hget(SESSION, F.PROMPT + "p2") == "1"
    assert await move(r, target="w-3") == 2  # a new target: no second marker, the parked stay
    assert await r.hget(SESSION, F.MOVING) == "w-3" and await r.xlen(PARKED) == 1
    assert await r.xlen(keys.inbox(WS, INC)) == 2


async def test_takeover_passes_the_session_to_the_named_target_only(r: aioredis.Redis) -> None:
    await created(r, **{F.TURN_ERROR: '{"message":"boom"}'})
    await r.zadd(ATTENTION, {SID + "/!": 5})
    await r.hset(ATTENTION_DETAILS, SID + "/!", INC + '\n{"message":"boom"}')
    assert (await apply(r, mode="update", events=[update("before")], op=7))[:2] == [1, 1]
    moved = events.body("session_moved", {"sessionId": SID, "reason": "worker_draining"})
    # Not moving yet, or moving to someone else: refused as another owner's.
    assert (await apply(r, "w-3", mode="takeover", **{"from": INC}, events=[moved], op=1))[0] == -1
    assert await move(r) == 1
    assert (await apply(r, "w-3", mode="takeover", **{"from": INC}, events=[moved], op=1))[0] == -1
    taken = await apply(r, OTHER, mode="takeover", **{"from": INC}, events=[moved], op=1)
    assert taken == [1, 2, "e1"]  # the same log and epoch, its id next
    assert await r.hget(SESSION, F.OWNER) == OTHER and not await r.hexists(SESSION, F.MOVING)
    assert await r.hget(SESSION, F.TURN_ERROR) == '{"message":"boom"}'  # its runtime state stays
    assert await r.hget(ATTENTION_DETAILS, SID + "/!") == OTHER + '\n{"message":"boom"}'
    assert await r.zscore(ATTENTION, SID + "/!") == 5  # still waiting since it began
    # Only the workspace's index held it (written before the deployment's existed): now both do.
    assert (await attention(r))[SID + "/!"] == (5, OTHER + '\n{"message":"boom"}')
    assert 0 < await r.pttl(DEPLOYMENT) <= TTL
    # The new owner's running number starts again; a retry of the takeover applies once.
    assert (await apply(r, OTHER, mode="takeover", **{"from": INC}, events=[moved], op=1))[:2] == [1, 2]
    assert (await apply(r, INC, mode="update", events=[update("late")], op=8))[0] == -1  # the old owner is fenced
    assert (await apply(r, OTHER, mode="update", events=[update("after")], op=2))[:2] == [1, 3]


# ---- VOTE ------------------------------------------------------------------------------


VOTE_KEYS = [SESSION, keys.inbox(WS, INC), CHANNEL, VERSION, ATTENTION, ATTENTION_DETAILS, DEPLOYMENT, DEPLOYMENT_DETAILS, CHANGES]


def vote_command(option: str = "allow", client: str = "", kind: str = "selected") -> commands.Vote:
    return commands.Vote(sid=SID, rid="r1", selected=kind == "selected", option_id=option, client_id=client or None)


async def vote(r: aioredis.Redis, option: str = "allow", client: str = "", kind: str = "selected", idem: str | None = None, incarnation: str = INC) -> str:
    key_list = VOTE_KEYS + ([keys.idempotency(WS, SID, idem)] if idem else [])
    args = [incarnation, commands.encode(vote_command(option, client, kind)), TTL, 100, "__cancelled__", TTL, TTL]
    return await run(r, "VOTE", key_list, args)


async def pending(r: aioredis.Redis) -> None:
    await created(r, **{F.INTERACTION + "r1": "{}", F.VOTABLE + "r1": '[1, ["allow", "deny"]]', F.CLIENT + "c1": "1"})


async def test_vote_checks_in_the_reference_order(r: aioredis.Redis) -> None:
    await pending(r)
    assert await vote(r, incarnation=OTHER) == "gone"
    assert await vote(r, client="stranger") == "client"
    assert await vote(r, option="__cancelled__") == "option"
    assert await vote(r, option="maybe") == "option"
    assert await r.hexists(SESSION, F.VOTABLE + "r1") and await r.xlen(keys.inbox(WS, INC)) == 0


async def test_exactly_one_vote_wins_a_request(r: aioredis.Redis) -> None:
    await pending(r)
    assert await vote(r, client="c1") == "ok"
    assert await vote(r, option="deny") == "unknown"  # the request is closed by the winner
    assert await vote(r, kind="cancelled") == "unknown"
    assert not await r.hexists(SESSION, F.INTERACTION + "r1") and not await r.hexists(SESSION, F.VOTABLE + "r1")
    assert await r.xlen(keys.inbox(WS, INC)) == 1
    [(_, entry)] = await r.xrange(keys.inbox(WS, INC))
    assert commands.decode(entry["c"]) == vote_command(client="c1")  # the vote it decided is the one enqueued


async def test_concurrent_votes_have_one_winner(r: aioredis.Redis) -> None:
    await pending(r)
    outcomes = await asyncio.gather(*(vote(r, option=o) for o in ["allow", "deny"] * 8))
    assert sorted(outcomes) == ["ok"] + ["unknown"] * 15


async def test_a_won_vote_is_kept_for_its_retry_and_announced(r: aioredis.Redis) -> None:
    await pending(r)
    pubsub = r.pubsub()
    await pubsub.ssubscribe(CHANNEL)
    assert (await pubsub.get_message(timeout=5))["type"] == "ssubscribe"
    assert await vote(r, idem="k") == "ok"
    assert await vote(r, idem="k") == "ok"  # the retry, not a 404
    assert await r.xlen(keys.inbox(WS, INC)) == 1
    message = await pubsub.get_message(timeout=5)
    version = await r.hmget(VERSION, [VER.REVISION, VER.GENERATION])
    assert (message["channel"], message["data"]) == (CHANNEL, f"{SID} {version[0]} {version[1]}")
    await pubsub.aclose()


# ---- ATTACH ----------------------------------------------------------------------------


async def test_attach_registers_the_client_fenced_by_the_owner(r: aioredis.Redis) -> None:
    await created(r)
    key_list = [SESSION, keys.inbox(WS, INC), CHANNEL, VERSION, CHANGES]
    attach = commands.Attach(sid=SID, client_id="c1")
    assert await run(r, "ATTACH", key_list, [OTHER, commands.encode(attach), TTL, 100, TTL]) == 0
    assert not await r.hexists(SESSION, F.CLIENT + "c1")
    revision = int(await r.hget(VERSION, VER.REVISION))
    assert await run(r, "ATTACH", key_list, [INC, commands.encode(attach), TTL, 100, TTL]) == 1
    assert await r.hget(SESSION, F.CLIENT + "c1") == "1" and await r.xlen(keys.inbox(WS, INC)) == 1
    [(_, entry)] = await r.xrange(keys.inbox(WS, INC))
    assert commands.decode(entry["c"]) == attach  # the client it registered is the one enqueued
    assert int(await r.hget(VERSION, VER.REVISION)) == revision + 1  # the client count changed


# ---- replies ---------------------------------------------------------------------------


async def test_reply_abandon_take_and_reclaim(r: aioredis.Redis) -> None:
    def reply(request: str) -> list[str]:
        return [keys.reply(request), keys.reply_given(request)]

    def given(request: str) -> Any:
        return r.lrange(keys.reply_given(request), 0, -1)

    m = "abandoned"  # the abandoned marker
    assert await run(r, "REPLY", reply("q1"), ['{"ok":1}', 60, m, "given"]) == 1
    assert await run(r, "REPLY", reply("q1"), ['{"ok":1}', 60, m, "given"]) == 1  # a retry: one copy
    assert await r.llen(keys.reply("q1")) == 1 and await given("q1") == ["given"]
    assert 0 < await r.ttl(keys.reply_given("q1")) <= 60  # the record of its taking has the reply's TTL
    assert await run(r, "ABANDON", reply("q1"), [60, m, "given"]) == '{"ok":1}'  # taken after all
    assert await given("q1") == ['{"ok":1}', "given"]  # and the taking is recorded
    assert await run(r, "ABANDON", reply("q1"), [60, m, "given"]) == '{"ok":1}'  # asked again: the same answer
    assert await run(r, "REPLY", reply("q1"), ['{"ok":1}', 60, m, "given"]) == 1  # a late retry pushes nothing
    assert await r.llen(keys.reply("q1")) == 0
    assert await run(r, "RECLAIM", reply("q1"), ['{"ok":1}', "given", m]) == 0  # taken: the worker keeps it

    assert await run(r, "ABANDON", reply("q3"), [60, m, "given"]) is None  # nothing yet: the marker
    assert await run(r, "REPLY", reply("q3"), ['{"late":1}', 60, m, "given"]) == 0
    assert not await r.exists(keys.reply_given("q3"))  # nothing was given
    assert await run(r, "TAKE", reply("q3"), [60, m, "given"]) == m
    assert await r.lrange(keys.reply("q3"), 0, -1) == [m]  # the marker stays
    assert await r.ttl(keys.reply("q3")) > 0  # and so does its TTL

    await run(r, "REPLY", reply("q2"), ['{"ok":2}', 60, m, "given"])
    assert await run(r, "TAKE", reply("q2"), [60, m, "given"]) == '{"ok":2}'
    assert await run(r, "TAKE", reply("q2"), [60, m, "given"]) == '{"ok":2}'  # its taker may never have answered
    assert await r.llen(keys.reply("q2")) == 0

    await run(r, "REPLY", reply("q4"), ['{"ok":4}', 60, m, "given"])
    assert await run(r, "RECLAIM", reply("q4"), ['{"ok":4}', "given", m]) == 1  # nobody took it: taken back
    assert await run(r, "RECLAIM", reply("q4"), ['{"ok":4}', "given", m]) == -1  # once
    assert await run(r, "TAKE", reply("q4"), [60, m, "given"]) is None  # too late for an API
    assert await run(r, "RECLAIM", reply("q5"), ['{"ok":5}', "given", m]) == -1  # lost with its keys
    assert await run(r, "ABANDON", reply("q5"), [60, m, "given"]) is None  # and its API gave up since:
    assert await run(r, "RECLAIM", reply("q5"), ['{"ok":5}', "given", m]) == 1  # it said the create failed


# ---- the attention index (APPLY, VOTE, ATTENTION_PAGE, ATTENTION_OF) ---------------------


QUESTION = '{"requestId":"r2","kind":"user_question","title":"Which one?"}'


async def test_apply_indexes_what_a_session_waits_for_in_the_same_step(r: aioredis.Redis) -> None:
    await created(r)
    assert await attention(r) == {}
    await apply(r, mode="update", set={F.INTERACTION + "r1": '{"kind":"permission"}', F.INTERACTION + "r2": QUESTION})
    index = await attention(r)
    assert index[f"{SID}/r1"][1] == INC + '\n{"kind":"permission"}' and index[f"{SID}/r2"][1] == INC + "\n" + QUESTION
    since = index[f"{SID}/r1"][0]
    redis_now = (await r.time())[0] * 1000
    assert redis_now - 5_000 < since <= redis_now + 1_000  # Redis's clock, in ms
    assert 0 < await r.pttl(ATTENTION) <= TTL and 0 < await r.pttl(ATTENTION_DETAILS) <= TTL
    await apply(r, mode="update", set={F.TURN_ERROR: '{"message":"boom"}'}, **{"del": [F.INTERACTION + "r1"]})
    index = await attention(r)
    assert set(index) == {f"{SID}/r2", f"{SID}/!"} and index[f"{SID}/!"][1] == INC + '\n{"message":"boom"}'
    await apply(r, mode="update", **{"del": [F.TURN_ERROR]})
    assert set(await attention(r)) == {f"{SID}/r2"}


async def test_a_rewrite_keeps_a_wait_it_still_holds_and_drops_the_rest(r: aioredis.Redis) -> None:
    await created(r, **{F.INTERACTION + "r1": "{}", F.INTERACTION + "r2": QUESTION})
    before = await attention(r)
    await r.zadd(ATTENTION, {f"{SID}/r1": 1000})  # an old wait: a rewrite must not restart it
    meta = orjson.dumps({"sessionId": SID, "workspaceCwd": "/w", "createdAt": "t0"}).decode()
    await apply(r, mode="create", set={F.META: meta, F.EPOCH: "e2", F.INTERACTION + "r1": "{}"})
    after = await attention(r)
    assert set(after) == {f"{SID}/r1"} and after[f"{SID}/r1"][0] == 1000 and f"{SID}/r2" in before


async def test_a_deleted_session_leaves_the_index_and_a_vote_removes_its_request(r: aioredis.Redis) -> None:
    await pending(r)
    await apply(r, mode="update", set={F.TURN_ERROR: "{}"})
    assert set(await attention(r)) == {f"{SID}/r1", f"{SID}/!"}
    assert await vote(r, client="c1") == "ok"
    assert set(await attention(r)) == {f"{SID}/!"}
    await apply(r, mode="delete")
    assert await attention(r) == {} and not await r.exists(ATTENTION_DETAILS)


async def test_a_fenced_out_transition_indexes_nothing(r: aioredis.Redis) -> None:
    await created(r)
    assert (await apply(r, OTHER, mode="update", set={F.INTERACTION + "r1": "{}"}))[0] == -1
    assert await attention(r) == {}


async def page(r: aioredis.Redis, after: tuple[str, str, str], limit: int) -> list[tuple[str, int]]:
    flat = await run(r, "ATTENTION_PAGE", [ATTENTION, ATTENTION_DETAILS], [*after, limit])
    return [(flat[i], int(flat[i + 1])) for i in range(0, len(flat), 3)]


async def test_attention_page_walks_the_index_oldest_first_past_a_cursor(r: aioredis.Redis) -> None:
    waits = {"a/1": 10, "b/1": 20, "c/1": 20, "d/1": 20, "e/!": 30}
    await r.zadd(ATTENTION, waits)
    await r.hset(ATTENTION_DETAILS, mapping={m: "w\n{}" for m in waits})
    assert await page(r, ("", "gt", ""), 10) == sorted(waits.items(), key=lambda kv: (kv[1], kv[0]))
    assert await page(r, ("", "gt", ""), 2) == [("a/1", 10), ("b/1", 20)]
    assert await page(r, ("20", "ge", "b/1"), 2) == [("c/1", 20), ("d/1", 20)]  # ties, by member
    assert await page(r, ("20", "gt", ""), 5) == [("e/!", 30)]  # strictly after that wait
    assert await page(r, ("30", "ge", "e/!"), 5) == []


async def test_attention_of_answers_one_sessions_waits(r: aioredis.Redis) -> None:
    await created(r, **{F.INTERACTION + "r2": QUESTION, F.TURN_ERROR: '{"message":"x"}'})
    flat = await run(r, "ATTENTION_OF", [SESSION, ATTENTION, ATTENTION_DETAILS], [SID])
    found = {flat[i]: flat[i + 2] for i in range(0, len(flat), 3)}
    assert found == {f"{SID}/r2": INC + "\n" + QUESTION, f"{SID}/!": INC + '\n{"message":"x"}'}


# ---- the deployment's attention index (APPLY, VOTE, SWEEP keep it beside the workspace's) ----


def apply_keys_of(ws: str, sid: str) -> list[str]:
    tag = keys.attention_tag(ws, per_slot=False)
    return [
        keys.session(ws, sid), keys.events(ws, sid), keys.live(ws), keys.catalog(ws), keys.catalog_order(ws),
        keys.single(ws), keys.transcript(ws, sid), keys.invalidations(ws), keys.catalog_version(ws),
        keys.turns(ws, sid), keys.turns_ended(ws, sid), keys.attention(ws), keys.attention_details(ws),
        keys.attention_all(tag), keys.attention_all_details(tag), keys.change_log(ws),
    ]


async def test_the_deployment_index_holds_every_workspaces_waits_in_one_order(r: aioredis.Redis) -> None:
    """Two workspaces' waits land in the one deployment index (a single Redis), with the
    workspace's since, and one ATTENTION_PAGE walks them oldest first, ties by workspace."""
    other_ws, other_sid = "fedcba9876543210", "22222222-2222-4222-8222-222222222222"
    meta = orjson.dumps({"sessionId": other_sid, "workspaceCwd": "/v", "createdAt": "t0"}).decode()
    ops = {"sid": other_sid, "verttl": TTL, "mode": "create", "set": {F.META: meta, F.EPOCH: "e1", F.INTERACTION + "r9": "{}"}}
    assert (await run(r, "APPLY", apply_keys_of(other_ws, other_sid), [OTHER, orjson.dumps(ops).decode(), TTL]))[0] == 1
    await created(r, **{F.INTERACTION + "r1": "{}"})
    await apply(r, mode="update", set={F.TURN_ERROR: '{"message":"x"}'})
    assert set(await attention(r)) == {f"{SID}/r1", f"{SID}/!"}  # and mirrored in the deployment's
    since = {m: int(s) for m, s in await r.zrange(DEPLOYMENT, 0, -1, withscores=True)}
    assert set(since) == {f"{WS}/{SID}/r1", f"{WS}/{SID}/!", f"{other_ws}/{other_sid}/r9"}
    assert await r.hget(DEPLOYMENT_DETAILS, f"{other_ws}/{other_sid}/r9") == OTHER + "\n{}"
    assert 0 < await r.pttl(DEPLOYMENT) <= TTL and 0 < await r.pttl(DEPLOYMENT_DETAILS) <= TTL
    # Equal waits, as a busy second gives many: workspace first, then session and request.
    await r.zadd(DEPLOYMENT, {member: 50 for member in since})
    flat = await run(r, "ATTENTION_PAGE", [DEPLOYMENT, DEPLOYMENT_DETAILS], ["", "gt", "", 2])
    assert [flat[i] for i in range(0, len(flat), 3)] == [f"{WS}/{SID}/!", f"{WS}/{SID}/r1"]
    flat = await run(r, "ATTENTION_PAGE", [DEPLOYMENT, DEPLOYMENT_DETAILS], ["50", "ge", f"{WS}/{SID}/r1", 2])
    assert [flat[i] for i in range(0, len(flat), 3)] == [f"{other_ws}/{other_sid}/r9"]
    # The other workspace's session goes: its wait leaves the deployment's index, ours stay.
    ops = {"sid": other_sid, "verttl": TTL, "mode": "delete", "uncatalog": True}
    assert (await run(r, "APPLY", apply_keys_of(other_ws, other_sid), [OTHER, orjson.dumps(ops).decode(), TTL]))[0] == 1
    assert set(await r.zrange(DEPLOYMENT, 0, -1)) == {f"{WS}/{SID}/r1", f"{WS}/{SID}/!"}


async def test_a_takeover_reowns_the_deployment_index_entry_too(r: aioredis.Redis) -> None:
    await created(r, **{F.TURN_ERROR: '{"message":"boom"}'})
    assert await move(r) == 1
    moved = events.body("session_moved", {"sessionId": SID, "reason": "worker_draining"})
    assert (await apply(r, OTHER, mode="takeover", **{"from": INC}, events=[moved], op=1))[0] == 1
    assert (await attention(r))[f"{SID}/!"][1] == OTHER + '\n{"message":"boom"}'  # both indexes


def test_a_slot_tag_shares_the_slot_of_its_workspaces() -> None:
    """On a cluster each slot has its own deployment index, in that slot: the script that
    changes a workspace names keys of one slot only."""
    from redis.crc import key_slot

    for ws in ("0123456789abcdef", "fedcba9876543210", "00000000000000ff"):
        tag = keys.attention_tag(ws, per_slot=True)
        assert key_slot(keys.attention_all(tag).encode()) == key_slot(keys.session(ws, SID).encode())
        assert key_slot(keys.attention_all_details(tag).encode()) == key_slot(keys.attention(ws).encode())
    assert keys.attention_tag(WS, per_slot=False) == keys.attention_tag("fedcba9876543210", per_slot=False)
