"""Every Lua script driven directly, with explicit KEYS and ARGV, on a real redis-server.

Each test names the keys and arguments as the script's header (acp_state/store/lua/*.lua)
documents them, and checks what the script answers and leaves in Redis. The store's own
tests go through RedisStore; these hold each script to its contract on its own.

Here: the templates, a session's transitions (APPLY, SWEEP), the catalog version and turns,
listings, TOLD, RELEASE_SINGLE, CLAIM_SID (a session id's locator) and the registry; the scripts that hand commands to an owner
and answer them are in tests/test_lua_commands.py.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import orjson
import pytest
import redis.asyncio as aioredis

from acp_state import events
from acp_state.store import keys, scripts
from acp_state.store.keys import F
from acp_state.store.keys import VersionField as VER
from acp_state.turns import TurnRecord, TurnState
from tests.lua_helpers import (  # noqa: F401  (server, r: fixtures, each module's own)
    APPLY_KEYS, ATTENTION, ATTENTION_DETAILS, CHANGES, CHANNEL, DEPLOYMENT, DEPLOYMENT_DETAILS, ENDED, INC, OTHER, SESSION, SID, TTL,
    TURNS, VERSION, WS, apply, apply_ops, attention, created, r, run, server, update,
)


# ---- the templates ---------------------------------------------------------------------


FIELD_NAMES = {
    v for cls in scripts.FIELD_CLASSES.values() for k, v in vars(cls).items() if not k.startswith("_")
}


@pytest.mark.parametrize("name", sorted(p.stem for p in scripts.resources.files("acp_state.store").joinpath("lua").iterdir()))
def test_a_template_names_no_field_by_hand(name: str) -> None:
    template = scripts.template(name)
    code = "\n".join(line.split("--", 1)[0] for line in template.splitlines())  # not comments
    quoted = set(re.findall(r"'([^']*)'", code)) | set(re.findall(r'"([^"]*)"', code))
    assert not quoted & FIELD_NAMES, f"{name}.lua spells field names itself: {quoted & FIELD_NAMES}"


@pytest.mark.parametrize("name", sorted(scripts.ALL))
def test_a_script_touches_only_keys_it_declares(name: str) -> None:
    """Every command's key (or shard channel) is a KEYS entry, never a name built in Lua."""
    code = "\n".join(line.split("--", 1)[0] for line in scripts.ALL[name].splitlines())
    calls = re.findall(r"redis\.call\('(\w+)'(?:, ([^,)]+))?", code)
    assert calls
    # Locals bound to KEYS entries alone (`local hash, log = KEYS[k[1]], KEYS[k[2]]`) name keys too.
    named = set()
    for names, values in re.findall(r"local ([\w, ]+) = ([^\n]+)", code):
        if all(re.fullmatch(r"KEYS\[[^\]]+\]\]?", v.strip()) for v in values.split(",")):
            named |= {n.strip() for n in names.split(",")}
    for command, key in calls:
        if command == "TIME":
            continue
        assert re.fullmatch(r"KEYS\[[^\]]+\]\]?|declared\[id\]", key) or key in named, f"{name}: {command} {key}"


def test_placeholders_render_from_keys_and_unknown_ones_fail() -> None:
    assert scripts.render("HGET x {{F.OWNER}} {{CLOCK.TICK}}") == f"HGET x '{F.OWNER}' '{keys.ClockField.TICK}'"
    with pytest.raises(AttributeError):
        scripts.render("{{F.NO_SUCH_FIELD}}")
    assert all("{{" not in source for source in scripts.ALL.values())


# ---- APPLY -----------------------------------------------------------------------------


async def test_apply_create_publishes_the_session_everywhere(r: aioredis.Redis) -> None:
    row = orjson.dumps({"createdAt": "t0"}).decode()
    applied = await apply(
        r, mode="create", set={F.META: "{}", F.EPOCH: "e1"}, single=True, events=[update("hi")],
        catalog=row, score="5", retention=TTL, cutoff="0",
    )
    assert applied == [1, 1, "e1"]
    assert await r.hget(SESSION, F.OWNER) == INC and await r.hget(SESSION, F.SEQ) == "1"
    assert await r.smembers(keys.live(WS)) == {SID}
    assert await r.get(keys.single(WS)) == SID
    assert await r.hget(keys.catalog(WS), SID) == row and await r.zscore(keys.catalog_order(WS), SID) == 5
    [(entry_id, fields)] = await r.xrange(keys.events(WS, SID))
    assert entry_id == "1-0" and orjson.loads(fields["e"])["id"] == 1
    assert len(await r.xrange(keys.transcript(WS, SID))) == 1  # a session_update is transcript
    assert 0 < await r.pttl(SESSION) <= TTL


async def test_apply_update_numbers_events_and_keeps_the_turn_error_event(r: aioredis.Redis) -> None:
    await created(r)
    error = events.body("turn_error", {"sessionId": SID, "message": "no"})
    assert await apply(r, mode="update", set={F.ACTIVE: "1"}, incr={F.ADMITTED: 2}, events=[update("a"), error], tev=2) == [1, 2, "e1"]
    assert await r.hget(SESSION, F.ADMITTED) == "2" and await r.hget(SESSION, F.ACTIVE) == "1"
    assert orjson.loads(await r.hget(SESSION, F.TURN_ERROR_EVENT))["id"] == 2
    assert await apply(r, mode="update", **{"del": [F.ACTIVE]}) == [1, 2, "e1"]
    assert not await r.hexists(SESSION, F.ACTIVE)


async def test_apply_is_fenced_by_the_owner(r: aioredis.Redis) -> None:
    await created(r, **{F.ADMITTED: "1"})
    before = await r.hgetall(SESSION)
    assert await apply(r, OTHER, mode="update", set={F.ADMITTED: "5"}, events=[update("x")]) == [-1, 0, ""]
    assert await apply(r, OTHER, mode="create", set={F.META: "{}"}) == [-1, 0, ""]
    assert await apply(r, OTHER, mode="delete", events=[update("x")]) == [-1, 0, ""]
    assert await r.hgetall(SESSION) == before
    assert await r.xlen(keys.events(WS, SID)) == 0
    assert await r.smembers(keys.live(WS)) == {SID}


async def test_apply_on_a_missing_session_applies_nothing(r: aioredis.Redis) -> None:
    assert await apply(r, mode="update", set={F.ACTIVE: "1"}, events=[update("x")]) == [0, 0, ""]
    assert not await r.exists(SESSION, keys.events(WS, SID))


async def test_apply_retried_under_its_running_number_applies_once(r: aioredis.Redis) -> None:
    await created(r)
    assert await apply(r, mode="update", op=1, incr={F.ADMITTED: 1}, events=[update("a")]) == [1, 1, "e1"]
    assert await apply(r, mode="update", op=1, incr={F.ADMITTED: 1}, events=[update("a")]) == [1, 1, "e1"]
    assert await r.hget(SESSION, F.ADMITTED) == "1" and await r.hget(SESSION, F.OP) == "1"
    assert await r.xlen(keys.events(WS, SID)) == 1


async def test_apply_rewrite_of_a_present_session_answers_2(r: aioredis.Redis) -> None:
    await created(r)
    assert await apply(r, mode="create", missing_only=True, set={F.EPOCH: "e2"}) == [2, 0, "e1"]
    assert await r.hget(SESSION, F.EPOCH) == "e1"


async def test_apply_delete_ends_every_admitted_prompt_first(r: aioredis.Redis) -> None:
    await created(r, **{F.PROMPT + "p1": "1"})
    await r.set(keys.single(WS), SID)
    orphan = events.body("turn_error", {"promptId": "@PID@"})
    closed = events.body("session_closed", {"sessionId": SID})
    assert (await apply(r, mode="delete", orphan=orphan, events=[closed], uncatalog=True))[:2] == [1, 2]
    logged = [orjson.loads(f["e"]) for _, f in await r.xrange(keys.events(WS, SID))]
    assert [(e["type"], e["data"]) for e in logged] == [("turn_error", {"promptId": "p1"}), ("session_closed", {"sessionId": SID})]
    assert not await r.exists(SESSION, keys.single(WS))
    assert await r.smembers(keys.live(WS)) == set()


async def test_apply_tells_caches_before_it_publishes_the_event(r: aioredis.Redis) -> None:
    """The change channel's message comes first, so a process drops its cached status
    before any of its SSE listeners gets the event (a cache told late serves stale state)."""
    await created(r)
    pubsub = r.pubsub()
    await pubsub.ssubscribe(CHANNEL, keys.events(WS, SID))
    for _ in range(2):  # the two confirmations
        assert (await pubsub.get_message(timeout=5))["type"] == "ssubscribe"
    await apply(r, mode="update", events=[update("a"), update("b")])
    order = [(await pubsub.get_message(timeout=5))["channel"] for _ in range(3)]
    assert order == [CHANNEL, keys.events(WS, SID), keys.events(WS, SID)]
    await pubsub.aclose()


# ---- SWEEP -----------------------------------------------------------------------------


def sweep_keys(sids: list[str]) -> list[str]:
    shared = [
        keys.live(WS), keys.catalog(WS), keys.catalog_order(WS), keys.single(WS), CHANNEL, VERSION,
        ATTENTION, ATTENTION_DETAILS, DEPLOYMENT, DEPLOYMENT_DETAILS, CHANGES,
    ]
    for sid in sids:
        shared += [keys.session(WS, sid), keys.events(WS, sid), keys.transcript(WS, sid), keys.turns(WS, sid),
                   keys.turns_ended(WS, sid)]
    return shared


async def test_sweep_gives_each_session_what_apply_would(r: aioredis.Redis) -> None:
    """Many sessions of a dead incarnation in one call, each fenced and ended as one APPLY
    would end it: its admitted prompts' turn errors, then its own last event, all naming it."""
    idle, busy, foreign, missing = (f"{n}1111111-1111-4111-8111-111111111111" for n in "2345")

    async def make(sid: str, owner: str, **fields: str) -> None:
        key_list = [keys.session(WS, sid), *APPLY_KEYS[1:]]
        key_list[1], key_list[6] = keys.events(WS, sid), keys.transcript(WS, sid)
        key_list[9], key_list[10] = keys.turns(WS, sid), keys.turns_ended(WS, sid)
        ops = apply_ops(sid=sid, mode="create", set={F.EPOCH: "e1", **fields},
                        catalog=orjson.dumps({"sessionId": sid}).decode(), score=1, retention=TTL, cutoff=0)
        assert (await run(r, "APPLY", key_list, [owner, ops, TTL]))[0] == 1

    await make(idle, INC)
    await make(busy, INC, **{F.PROMPT + "p1": "1", F.REQUEST: "req-1", F.INTERACTION + "r1": '{"kind":"permission"}'})
    await make(foreign, OTHER)
    revision = int(await r.hget(VERSION, VER.REVISION))
    died = events.body("session_died", {"sessionId": "@SID@", "reason": "worker_lost"})
    ops = apply_ops(sid="@SID@", mode="delete", uncatalog_untold=True, events=[died],
                    orphan=events.body("turn_error", {"sessionId": "@SID@", "promptId": "@PID@"}, "@PID@"))
    sids = [idle, busy, foreign, missing]
    await r.set(keys.single(WS), busy)  # the workspace's single-scope session
    assert await run(r, "SWEEP", sweep_keys(sids), [INC, ops, TTL, *sids]) == [1, 1, -1, 0]
    assert not await r.exists(keys.single(WS))

    def logged(sid: str) -> Any:
        return r.xrange(keys.events(WS, sid))

    assert [orjson.loads(f["e"])["data"] for _, f in await logged(idle)] == [{"sessionId": idle, "reason": "worker_lost"}]
    ended = [orjson.loads(f["e"]) for _, f in await logged(busy)]
    assert [(e["type"], e.get("promptId"), e["data"]["sessionId"]) for e in ended] == [
        ("turn_error", "p1", busy), ("session_died", None, busy)]
    assert await r.smembers(keys.live(WS)) == {foreign}  # the other incarnation's stays
    assert await r.exists(keys.session(WS, idle), keys.session(WS, busy)) == 0
    assert set(await r.hkeys(keys.catalog(WS))) == {idle, foreign}  # the untold one leaves no row
    assert await attention(r) == {}  # what the swept session waited for is no longer waited for
    assert int(await r.hget(VERSION, VER.REVISION)) == revision + 2  # readers told of each change


async def test_sweep_tells_caches_of_its_whole_batch_in_one_message_before_any_event(r: aioredis.Redis) -> None:
    """One change message names every session the call removes (a revision each), ahead of
    their events: 25,000 messages had loaded every API process as much as the sweep did."""
    sids = [f"{n}1111111-1111-4111-8111-111111111111" for n in "234"]
    for sid in sids[:2]:
        key_list = [keys.session(WS, sid), *APPLY_KEYS[1:]]
        key_list[1], key_list[6] = keys.events(WS, sid), keys.transcript(WS, sid)
        assert (await run(r, "APPLY", key_list, [INC, apply_ops(sid=sid, mode="create", set={F.EPOCH: "e1"}), TTL]))[0] == 1
    generation, revision = await r.hmget(VERSION, [VER.GENERATION, VER.REVISION])
    pubsub = r.pubsub()
    await pubsub.ssubscribe(CHANNEL, *(keys.events(WS, sid) for sid in sids[:2]))
    for _ in range(3):
        assert (await pubsub.get_message(timeout=5))["type"] == "ssubscribe"
    died = events.body("session_died", {"sessionId": "@SID@", "reason": "worker_lost"})
    ops = apply_ops(sid="@SID@", mode="delete", events=[died])
    assert await run(r, "SWEEP", sweep_keys(sids), [INC, ops, TTL, *sids]) == [1, 1, 0]
    heard = [await pubsub.get_message(timeout=5) for _ in range(3)]
    assert [(m["channel"], m["data"]) for m in heard[:1]] == [(CHANNEL, f"{sids[0]},{sids[1]} {int(revision) + 2} {generation}")]
    assert [m["channel"] for m in heard[1:]] == [keys.events(WS, sid) for sid in sids[:2]]
    await pubsub.aclose()


# ---- catalog version and turns -----------------------------------------------------------


async def test_every_change_moves_the_revision_and_a_lost_version_starts_a_new_generation(r: aioredis.Redis) -> None:
    generation, revision = await run(r, "VERSION", [VERSION, CHANGES], [TTL])
    assert revision == "0" and 0 < await r.pttl(VERSION) <= TTL
    assert await run(r, "VERSION", [VERSION, CHANGES], [TTL]) == [generation, "0"]  # a read changes nothing
    await created(r)
    await apply(r, events=[update("x")])
    assert await run(r, "VERSION", [VERSION, CHANGES], [TTL]) == [generation, "2"]
    assert await apply(r, incarnation=OTHER, events=[update("y")]) == [-1, 0, ""]
    assert (await run(r, "VERSION", [VERSION, CHANGES], [TTL]))[1] == "2"  # a fenced write moved nothing
    await r.delete(VERSION)  # Redis lost it
    await apply(r, events=[update("z")])
    assert (await r.hget(VERSION, VER.GENERATION)) != generation and await r.hget(VERSION, VER.REVISION) == "1"


FLOOR = keys.CHANGE_LOG_FLOOR
# changes.lua's CHANGE_LOG_MAX: the sessions the change log keeps.
CHANGE_LOG_MAX = 1_000


async def change_log(r: aioredis.Redis) -> dict[str, int]:
    return {member: int(score) for member, score in await r.zrange(CHANGES, 0, -1, withscores=True)}


async def test_the_change_log_keeps_each_sessions_last_change_revision_from_a_floor(r: aioredis.Redis) -> None:
    """Whatever moves the revision logs the session at the revision it moved to (a sweep each
    of its batch), so a process that did not follow the workspace can tell what changed since
    a revision; a new generation's log answers from 0, with the catalog version's TTL."""
    await created(r)  # revision 1
    await apply(r, events=[update("x")])  # 2
    assert await change_log(r) == {FLOOR: 0, SID: 2}
    assert 0 < await r.pttl(CHANGES) <= TTL
    assert await run(r, "TOLD", [SESSION, CHANNEL, VERSION, CHANGES], [SID, TTL]) == 0  # no news: not logged
    others = [f"{n}1111111-1111-4111-8111-111111111111" for n in "23"]
    for sid in others:
        key_list = [keys.session(WS, sid), *APPLY_KEYS[1:]]
        key_list[1], key_list[6] = keys.events(WS, sid), keys.transcript(WS, sid)
        key_list[9], key_list[10] = keys.turns(WS, sid), keys.turns_ended(WS, sid)
        assert (await run(r, "APPLY", key_list, [INC, apply_ops(sid=sid, mode="create", set={F.EPOCH: "e1"}), TTL]))[0] == 1
    assert await change_log(r) == {FLOOR: 0, SID: 2, others[0]: 3, others[1]: 4}
    died = events.body("session_died", {"sessionId": "@SID@", "reason": "worker_lost"})
    ops = apply_ops(sid="@SID@", mode="delete", events=[died])
    assert await run(r, "SWEEP", sweep_keys([SID, *others]), [INC, ops, TTL, SID, *others]) == [1, 1, 1]
    # The batch's message names revisions 5, 6, 7 in this order; a removed session stays logged.
    assert await change_log(r) == {FLOOR: 0, SID: 5, others[0]: 6, others[1]: 7}
    assert int(await r.hget(VERSION, VER.REVISION)) == 7


async def test_a_change_log_made_anew_answers_only_from_its_first_change(r: aioredis.Redis) -> None:
    """A log that is missing while the version stays (lost, or written before it existed) knows
    nothing of the changes before: its floor is the revision before its first change. A new
    generation (VERSION or a change finding the version gone) drops the old generation's log."""
    await created(r)
    await apply(r, events=[update("x")])
    await r.delete(CHANGES)
    await apply(r, events=[update("y")])  # revision 3
    assert await change_log(r) == {FLOOR: 2, SID: 3}
    await r.delete(VERSION)
    await run(r, "VERSION", [VERSION, CHANGES], [TTL])
    assert await r.exists(CHANGES) == 0
    await r.zadd(CHANGES, {FLOOR: 0, "stale": 40})  # the old generation's, left where VERSION did not run
    await r.delete(VERSION)
    await apply(r, events=[update("z")])  # a new generation at revision 1
    assert await change_log(r) == {FLOOR: 0, SID: 1}


async def test_the_change_log_forgets_its_oldest_sessions_and_raises_its_floor(r: aioredis.Redis) -> None:
    """Bounded: past CHANGE_LOG_MAX sessions the oldest changes are forgotten, and the floor
    moves to the newest forgotten revision (a resume from before it gets a snapshot)."""
    await created(r)  # revision 1
    await r.zadd(CHANGES, {f"old-{i}": i for i in range(2, CHANGE_LOG_MAX + 1)})  # SID's entry plus these: full
    await r.hset(VERSION, VER.REVISION, CHANGE_LOG_MAX)
    await apply(r, events=[update("x")])  # SID again: nothing to forget
    log = await change_log(r)
    assert len(log) == CHANGE_LOG_MAX + 1 and log[FLOOR] == 0 and log[SID] == CHANGE_LOG_MAX + 1
    second = "21111111-1111-4111-8111-111111111111"
    key_list = [keys.session(WS, second), *APPLY_KEYS[1:]]
    key_list[1], key_list[6] = keys.events(WS, second), keys.transcript(WS, second)
    key_list[9], key_list[10] = keys.turns(WS, second), keys.turns_ended(WS, second)
    assert (await run(r, "APPLY", key_list, [INC, apply_ops(sid=second, mode="create", set={F.EPOCH: "e1"}), TTL]))[0] == 1
    log = await change_log(r)
    assert len(log) == CHANGE_LOG_MAX + 1 and "old-2" not in log and log[FLOOR] == 2 and log[second] == CHANGE_LOG_MAX + 2



async def test_a_change_log_an_older_release_filled_past_the_bound_shrinks_to_it(r: aioredis.Redis) -> None:
    """During a rolling deploy an older writer kept up to 10,000 sessions: the next session to
    join the log takes it down to the newest CHANGE_LOG_MAX at once, and the floor says the
    resumes it can no longer answer (they get a snapshot)."""
    await created(r)  # revision 1
    older = 10 * CHANGE_LOG_MAX
    await r.zadd(CHANGES, {f"old-{i}": i for i in range(2, older + 1)})
    await r.hset(VERSION, VER.REVISION, older)
    second = "21111111-1111-4111-8111-111111111111"
    key_list = [keys.session(WS, second), *APPLY_KEYS[1:]]
    key_list[1], key_list[6] = keys.events(WS, second), keys.transcript(WS, second)
    key_list[9], key_list[10] = keys.turns(WS, second), keys.turns_ended(WS, second)
    assert (await run(r, "APPLY", key_list, [INC, apply_ops(sid=second, mode="create", set={F.EPOCH: "e1"}), TTL]))[0] == 1
    log = await change_log(r)
    assert len(log) == CHANGE_LOG_MAX + 1 and log[second] == older + 1
    # The newest CHANGE_LOG_MAX - 1 of the older writer's stay, the floor at the newest forgotten.
    assert log[FLOOR] == older + 1 - CHANGE_LOG_MAX and f"old-{older + 2 - CHANGE_LOG_MAX}" in log
    assert SID not in log and f"old-{older + 1 - CHANGE_LOG_MAX}" not in log

def turn_ops(*records: TurnRecord) -> dict[str, Any]:
    return {"turns": [[t.prompt_id, t.pack(), 1 if t.ended else 0] for t in records], "turnkeep": 2, "turnttl": TTL}


async def test_apply_keeps_the_newest_ended_turns_and_current_turn_picks_running_queued_then_last(r: aioredis.Redis) -> None:
    await created(r)
    current = [SESSION, TURNS, ENDED]
    assert await run(r, "CURRENT_TURN", current, []) is None
    first = TurnRecord.queued("p1", "one", 10, None)
    second = TurnRecord.queued("p2", "two", 20, "c1")
    await r.hset(SESSION, mapping={F.PROMPT + "p1": "1", F.PROMPT + "p2": "1"})
    await apply(r, **turn_ops(second, first))
    assert TurnRecord.unpack(await run(r, "CURRENT_TURN", current, [])).prompt_id == "p1"  # the oldest queued
    await apply(r, **turn_ops(second.started(30)))
    assert TurnRecord.unpack(await run(r, "CURRENT_TURN", current, [])).state is TurnState.RUNNING
    ended = [first.finished(40, "end_turn", "a"), second.started(30).failed(50, "boom", None),
             TurnRecord.queued("p3", "three", 60, None).finished(70, "cancelled", "")]
    await r.hdel(SESSION, F.PROMPT + "p1", F.PROMPT + "p2")
    for record in ended:
        await apply(r, **turn_ops(record))
    assert await r.lrange(ENDED, 0, -1) == ["p2", "p3"] and sorted(await r.hkeys(TURNS)) == ["p2", "p3"]
    last = TurnRecord.unpack(await run(r, "CURRENT_TURN", current, []))
    assert (last.prompt_id, last.state, last.stop_reason) == ("p3", TurnState.CANCELLED, "cancelled")
    await apply(r, mode="delete", uncatalog=True)
    assert not await r.exists(TURNS, ENDED)  # a session that leaves no row takes its turns along


async def test_a_listed_session_keeps_its_ended_turns_for_a_resume_which_drops_the_unended(r: aioredis.Redis) -> None:
    await created(r)
    await r.hset(keys.catalog(WS), SID, "{}")  # listed
    done, running = TurnRecord.queued("p1", "one", 10, None).finished(20, "end_turn", "a"), TurnRecord.queued("p2", "two", 30, None).started(40)
    await r.hset(SESSION, F.PROMPT + "p2", "1")
    await apply(r, **turn_ops(done, running))
    await apply(r, mode="delete")  # its worker died (or it was closed): the row stays
    assert not await r.exists(SESSION) and await r.exists(TURNS, ENDED) == 2
    assert sorted(await r.hkeys(TURNS)) == ["p1", "p2"]
    meta = orjson.dumps({"sessionId": SID, "workspaceCwd": "/w", "createdAt": "t0"}).decode()
    assert (await apply(r, mode="create", resumed=True, set={F.META: meta, F.EPOCH: "e2"}))[0] == 1
    assert await r.hkeys(TURNS) == ["p1"]  # the turn that never ended is no turn of the new life
    last = TurnRecord.unpack(await run(r, "CURRENT_TURN", [SESSION, TURNS, ENDED], []))
    assert (last.prompt_id, last.state) == ("p1", TurnState.COMPLETED)


async def test_a_delete_ends_the_turn_records_of_the_prompts_it_ends_and_a_resume_keeps_them(r: aioredis.Redis) -> None:
    """The sweeper's `worker_lost` (or a close's end) reaches each admitted prompt's turn
    record, running or queued, in the step that deletes the session; an ended record stays."""
    await created(r)
    await r.hset(keys.catalog(WS), SID, "{}")
    done = TurnRecord.queued("p1", "one", 10, None).finished(20, "end_turn", "a")
    running, queued = TurnRecord.queued("p2", "two", 30, "c1").started(40), TurnRecord.queued("p3", "thr\u00e9e/3", 1796120194490, None)
    await r.hset(SESSION, mapping={F.PROMPT + "p2": "1", F.PROMPT + "p3": "1"})
    await apply(r, **turn_ops(done, running, queued))
    end = {"message": "lost", "code": "worker_lost", "at": "1796120194999", "keep": 64, "ttl": TTL}
    await apply(r, mode="delete", endturn=end, orphan=events.body("turn_error", {"promptId": "@PID@"}, "@PID@"))
    assert await r.lrange(ENDED, 0, -1) == ["p1", "p2", "p3"]
    meta = orjson.dumps({"sessionId": SID, "workspaceCwd": "/w", "createdAt": "t0"}).decode()
    assert (await apply(r, mode="create", resumed=True, set={F.META: meta, F.EPOCH: "e2"}))[0] == 1
    records = {pid: TurnRecord.unpack(await r.hget(TURNS, pid)) for pid in ("p1", "p2", "p3")}
    assert records["p1"] == done
    assert records["p2"] == running.failed(1796120194999, "lost", "worker_lost")
    assert records["p3"] == queued.failed(1796120194999, "lost", "worker_lost")
    last = TurnRecord.unpack(await run(r, "CURRENT_TURN", [SESSION, TURNS, ENDED], []))
    assert (last.prompt_id, last.state) == ("p3", TurnState.ERROR)


async def test_a_resume_of_a_session_deleted_meanwhile_is_refused(r: aioredis.Redis) -> None:
    """A resumed CREATE publishes only while the session's row stands: a DELETE of the
    listed session that won against the load leaves it deleted."""
    meta = orjson.dumps({"sessionId": SID, "workspaceCwd": "/w", "createdAt": "t0"}).decode()
    assert (await apply(r, mode="create", resumed=True, set={F.META: meta, F.EPOCH: "e2"}))[0] == -1
    assert not await r.exists(SESSION) and not await r.sismember(keys.live(WS), SID)
    await r.hset(keys.catalog(WS), SID, "{}")
    assert (await apply(r, mode="create", resumed=True, set={F.META: meta, F.EPOCH: "e2"}))[0] == 1
    # A rewrite after a loss (which may have taken the row too) is no resume of a deleted one.
    await r.delete(keys.catalog(WS))
    assert (await apply(r, mode="create", resumed=True, missing_only=True, set={F.META: meta, F.EPOCH: "e3"}))[0] == 2


# ---- LIST ------------------------------------------------------------------------------


async def test_list_answers_declared_live_hashes_and_flags_undeclared_ones(r: aioredis.Redis) -> None:
    live, gone = "22222222-2222-4222-8222-222222222222", "33333333-3333-4333-8333-333333333333"
    await r.zadd(keys.catalog_order(WS), {gone: 1, live: 2})
    await r.hset(keys.catalog(WS), mapping={gone: '{"g":1}', live: '{"l":1}'})
    await r.sadd(keys.live(WS), live)
    await r.hset(keys.session(WS, live), mapping={F.OWNER: INC})
    base = [keys.live(WS), keys.catalog(WS), keys.catalog_order(WS)]
    assert await run(r, "LIST", base, [0, 10]) == [live, '{"l":1}', None, gone, '{"g":1}', []]
    declared = await run(r, "LIST", [*base, keys.session(WS, live)], [0, 10, live])
    assert declared == [live, '{"l":1}', [F.OWNER, INC], gone, '{"g":1}', []]
    assert await run(r, "LIST", base, [1, 0]) == [gone, '{"g":1}', []]  # offset 1, size 0: 1 row


# ---- TOLD ------------------------------------------------------------------------------


async def test_told_shows_an_untold_session_once_and_announces_it(r: aioredis.Redis) -> None:
    await created(r, **{F.REQUEST: "req-1"})
    pubsub = r.pubsub()
    await pubsub.ssubscribe(CHANNEL)
    assert (await pubsub.get_message(timeout=5))["type"] == "ssubscribe"
    revision = int(await r.hget(VERSION, VER.REVISION))
    assert await run(r, "TOLD", [SESSION, CHANNEL, VERSION, CHANGES], [SID, TTL]) == 1
    assert not await r.hexists(SESSION, F.REQUEST)
    message = await pubsub.get_message(timeout=5)
    assert message["data"] == f"{SID} {revision + 1} {await r.hget(VERSION, VER.GENERATION)}"  # now shown
    assert await run(r, "TOLD", [SESSION, CHANNEL, VERSION, CHANGES], [SID, TTL]) == 0  # told already: no news
    assert int(await r.hget(VERSION, VER.REVISION)) == revision + 1
    await pubsub.aclose()
# ---- RELEASE_SINGLE --------------------------------------------------------------------


async def test_release_single_deletes_only_its_own_claim(r: aioredis.Redis) -> None:
    await r.set(keys.single(WS), SID)
    assert await run(r, "RELEASE_SINGLE", [keys.single(WS)], ["someone-else"]) == 0
    assert await r.get(keys.single(WS)) == SID
    assert await run(r, "RELEASE_SINGLE", [keys.single(WS)], [SID]) == 1
    assert not await r.exists(keys.single(WS))


# ---- CLAIM_SID -------------------------------------------------------------------------


async def test_claim_sid_takes_a_free_id_and_renews_its_own(r: aioredis.Redis) -> None:
    """A free id becomes the workspace's (1); the same workspace claims it again (2), which
    renews the locator's TTL but never shortens it."""
    locator = keys.locator(SID)
    assert await run(r, "CLAIM_SID", [locator], [WS, TTL]) == 1
    assert await r.get(locator) == WS and 0 < await r.pttl(locator) <= TTL
    await r.pexpire(locator, 1000)
    assert await run(r, "CLAIM_SID", [locator], [WS, TTL]) == 2
    assert TTL - 5000 < await r.pttl(locator) <= TTL  # renewed
    assert await run(r, "CLAIM_SID", [locator], [WS, 1000]) == 2
    assert await r.pttl(locator) > 1000  # a shorter TTL does not cut it


async def test_claim_sid_never_takes_another_workspaces_id(r: aioredis.Redis) -> None:
    """Issue 37 item 5: the locator was overwritten unconditionally (a W2 create took a live
    W1 session's id). Now a claim of an id another workspace holds writes nothing."""
    locator, other = keys.locator(SID), "fedcba9876543210"
    assert await run(r, "CLAIM_SID", [locator], [WS, TTL]) == 1
    ttl = await r.pttl(locator)
    assert await run(r, "CLAIM_SID", [locator], [other, 10 * TTL]) == 0
    assert await r.get(locator) == WS and await r.pttl(locator) <= ttl  # neither the owner nor its TTL changed
    await r.delete(locator)  # the id's last session left long ago (the locator lapsed)
    assert await run(r, "CLAIM_SID", [locator], [other, TTL]) == 1
    assert await r.get(locator) == other


async def test_concurrent_claims_of_one_id_have_one_winner(r: aioredis.Redis) -> None:
    workspaces = [f"{i:016x}" for i in range(20)]
    answers = await asyncio.gather(*(run(r, "CLAIM_SID", [keys.locator(SID)], [ws, TTL]) for ws in workspaces))
    assert sorted(answers) == [0] * 19 + [1]
    assert await r.get(keys.locator(SID)) == workspaces[answers.index(1)]


# ---- the registry ----------------------------------------------------------------------


async def test_heartbeat_claim_resign_and_release(r: aioredis.Redis) -> None:
    reg = keys.REGISTRY_KEYS
    assert (await run(r, "HEARTBEAT", reg, ["w-1", 1000, "{}", TTL]))[0] == "new"
    assert (await run(r, "HEARTBEAT", reg, ["w-1", 1000, "{}", TTL]))[0] == "held"
    assert await r.hget(keys.CLOCK, keys.ClockField.TICK)
    shortest, next_lapse, *claimed = await run(r, "CLAIM_DEAD", reg, [30_000, TTL, TTL, 64])
    assert (shortest, claimed) == ("1000", []) and 0 < int(next_lapse) <= 1000  # none dead; when one might be
    assert await run(r, "RESIGN", reg, ["w-1", TTL]) == 1
    assert await run(r, "CLAIM_DEAD", reg, [30_000, TTL, TTL, 64]) == ["0", "-1", "w-1"]
    assert (await run(r, "HEARTBEAT", reg, ["w-1", 1000, "{}", TTL]))[0] == "dead"
    assert (await run(r, "HEARTBEAT", reg, ["w-2", 1000, "{}", TTL]))[0] == "new"
    assert await run(r, "RELEASE", reg, ["w-2"]) == 1
    assert await r.zscore(keys.WORKERS, "w-2") is None and await r.hget(keys.REPORTS, "w-2") is None


async def test_heartbeat_records_the_agent_names_on_offer(r: aioredis.Redis) -> None:
    reg = keys.REGISTRY_KEYS
    await run(r, "HEARTBEAT", reg, ["w-1", 1000, "{}", TTL, '["qwen","default"]'])
    await run(r, "HEARTBEAT", reg, ["w-2", 1000, "{}", TTL])  # no names: nothing recorded
    assert await r.zrange(keys.AGENTS, 0, -1) == ["default", "qwen"]
    assert 0 < await r.pttl(keys.AGENTS) <= TTL
    # A name nobody offered for a registry TTL is forgotten by the next heartbeat.
    await r.zadd(keys.AGENTS, {"stale": 1})
    await run(r, "HEARTBEAT", reg, ["w-1", 1000, "{}", TTL, '["qwen"]'])
    assert await r.zrange(keys.AGENTS, 0, -1) == ["default", "qwen"]
    await run(r, "RELEASE", reg, ["w-1"])  # names outlive their workers (a 503, not a 400)
    assert await r.zrange(keys.AGENTS, 0, -1) == ["default", "qwen"]


async def test_claim_dead_tombstones_a_lapsed_worker_once(r: aioredis.Redis) -> None:
    reg = keys.REGISTRY_KEYS
    await run(r, "HEARTBEAT", reg, ["w-1", 1000, "{}", TTL])
    seconds, micros = await r.time()
    now = seconds * 1000 + micros // 1000
    await r.zadd(keys.WORKERS, {"w-1": now - 1})
    await r.hset(keys.CLOCK, mapping={keys.ClockField.TICK: now, keys.ClockField.STALL: now - 10_000})
    assert await run(r, "CLAIM_DEAD", reg, [30_000, TTL, TTL, 64]) == ["1000", "-1", "w-1"]
    assert await run(r, "CLAIM_DEAD", reg, [30_000, TTL, TTL, 64]) == ["0", "-1"]  # once
    assert await r.zscore(keys.DEAD, "w-1") is not None
