"""Every Lua script driven directly, with explicit KEYS and ARGV, on a real redis-server.

Each test names the keys and arguments as the script's header (acp_state/store/lua/*.lua)
documents them, and checks what the script answers and leaves in Redis. The store's own
tests go through RedisStore; these hold each script to its contract on its own.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any, AsyncIterator, Iterator

import orjson
import pytest
import redis.asyncio as aioredis

from acp_state import commands, events
from acp_state.store import keys, scripts
from acp_state.store.keys import F
from acp_state.store.keys import VersionField as VER
from acp_state.turns import TurnRecord, TurnState
from acp_state.store.batching import Script
from bench.redis_server import RedisServer

WS = "0123456789abcdef"
SID = "11111111-1111-4111-8111-111111111111"
INC = "w-1"
OTHER = "w-2"
TTL = 60_000
CHANNEL = keys.invalidations(WS)
SESSION = keys.session(WS, SID)
VERSION = keys.catalog_version(WS)
TURNS, ENDED = keys.turns(WS, SID), keys.turns_ended(WS, SID)
ATTENTION, ATTENTION_DETAILS = keys.attention(WS), keys.attention_details(WS)
APPLY_KEYS = [
    SESSION, keys.events(WS, SID), keys.live(WS), keys.catalog(WS), keys.catalog_order(WS),
    keys.single(WS), keys.transcript(WS, SID), CHANNEL, VERSION, TURNS, ENDED, ATTENTION, ATTENTION_DETAILS,
]


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture
async def r(server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(server.url, decode_responses=True)
    await client.flushall()
    yield client
    await client.aclose()


async def run(r: aioredis.Redis, name: str, key_list: list[str], args: list[Any]) -> Any:
    return await Script(r, scripts.ALL[name])(key_list, args)


def apply_ops(**ops: Any) -> str:
    ops.setdefault("sid", SID)
    ops.setdefault("verttl", TTL)
    if ops.get("events") or ops.get("orphan"):
        ops.update(evmax=100, evttl=TTL, trmax=100, trttl=TTL)
        ops.setdefault("tr", [i + 1 for i, b in enumerate(ops.get("events", [])) if events.in_transcript(b)])
    return orjson.dumps(ops).decode()


async def apply(r: aioredis.Redis, incarnation: str = INC, **ops: Any) -> list[Any]:
    return await run(r, "APPLY", APPLY_KEYS, [incarnation, apply_ops(**ops), TTL])


async def created(r: aioredis.Redis, **fields: str) -> None:
    meta = orjson.dumps({"sessionId": SID, "workspaceCwd": "/w", "createdAt": "t0"}).decode()
    assert (await apply(r, mode="create", set={F.META: meta, F.EPOCH: "e1", **fields}))[0] == 1


def update(text: str) -> str:
    return events.body("session_update", {"sessionId": SID, "update": {"sessionUpdate": "agent_message_chunk", "text": text}})


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
        ATTENTION, ATTENTION_DETAILS,
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


MOVE_KEYS = [SESSION, keys.inbox(WS, INC), PARKED, CHANNEL, VERSION]
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
    # The new owner's running number starts again; a retry of the takeover applies once.
    assert (await apply(r, OTHER, mode="takeover", **{"from": INC}, events=[moved], op=1))[:2] == [1, 2]
    assert (await apply(r, INC, mode="update", events=[update("late")], op=8))[0] == -1  # the old owner is fenced
    assert (await apply(r, OTHER, mode="update", events=[update("after")], op=2))[:2] == [1, 3]


# ---- VOTE ------------------------------------------------------------------------------


VOTE_KEYS = [SESSION, keys.inbox(WS, INC), CHANNEL, VERSION, ATTENTION, ATTENTION_DETAILS]


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
    key_list = [SESSION, keys.inbox(WS, INC), CHANNEL, VERSION]
    attach = commands.Attach(sid=SID, client_id="c1")
    assert await run(r, "ATTACH", key_list, [OTHER, commands.encode(attach), TTL, 100, TTL]) == 0
    assert not await r.hexists(SESSION, F.CLIENT + "c1")
    revision = int(await r.hget(VERSION, VER.REVISION))
    assert await run(r, "ATTACH", key_list, [INC, commands.encode(attach), TTL, 100, TTL]) == 1
    assert await r.hget(SESSION, F.CLIENT + "c1") == "1" and await r.xlen(keys.inbox(WS, INC)) == 1
    [(_, entry)] = await r.xrange(keys.inbox(WS, INC))
    assert commands.decode(entry["c"]) == attach  # the client it registered is the one enqueued
    assert int(await r.hget(VERSION, VER.REVISION)) == revision + 1  # the client count changed


# ---- catalog version and turns -----------------------------------------------------------


async def test_every_change_moves_the_revision_and_a_lost_version_starts_a_new_generation(r: aioredis.Redis) -> None:
    generation, revision = await run(r, "VERSION", [VERSION], [TTL])
    assert revision == "0" and 0 < await r.pttl(VERSION) <= TTL
    assert await run(r, "VERSION", [VERSION], [TTL]) == [generation, "0"]  # a read changes nothing
    await created(r)
    await apply(r, events=[update("x")])
    assert await run(r, "VERSION", [VERSION], [TTL]) == [generation, "2"]
    assert await apply(r, incarnation=OTHER, events=[update("y")]) == [-1, 0, ""]
    assert (await run(r, "VERSION", [VERSION], [TTL]))[1] == "2"  # a fenced write moved nothing
    await r.delete(VERSION)  # Redis lost it
    await apply(r, events=[update("z")])
    assert (await r.hget(VERSION, VER.GENERATION)) != generation and await r.hget(VERSION, VER.REVISION) == "1"


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


# ---- RELEASE_SINGLE --------------------------------------------------------------------


async def test_release_single_deletes_only_its_own_claim(r: aioredis.Redis) -> None:
    await r.set(keys.single(WS), SID)
    assert await run(r, "RELEASE_SINGLE", [keys.single(WS)], ["someone-else"]) == 0
    assert await r.get(keys.single(WS)) == SID
    assert await run(r, "RELEASE_SINGLE", [keys.single(WS)], [SID]) == 1
    assert not await r.exists(keys.single(WS))


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


async def attention(r: aioredis.Redis) -> dict[str, tuple[int, str]]:
    """The index as {member: (since, details)}."""
    index = await r.zrange(ATTENTION, 0, -1, withscores=True)
    return {member: (int(since), await r.hget(ATTENTION_DETAILS, member)) for member, since in index}


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


# ---- TOLD ------------------------------------------------------------------------------


async def test_told_shows_an_untold_session_once_and_announces_it(r: aioredis.Redis) -> None:
    await created(r, **{F.REQUEST: "req-1"})
    pubsub = r.pubsub()
    await pubsub.ssubscribe(CHANNEL)
    assert (await pubsub.get_message(timeout=5))["type"] == "ssubscribe"
    revision = int(await r.hget(VERSION, VER.REVISION))
    assert await run(r, "TOLD", [SESSION, CHANNEL, VERSION], [SID, TTL]) == 1
    assert not await r.hexists(SESSION, F.REQUEST)
    message = await pubsub.get_message(timeout=5)
    assert message["data"] == f"{SID} {revision + 1} {await r.hget(VERSION, VER.GENERATION)}"  # now shown
    assert await run(r, "TOLD", [SESSION, CHANNEL, VERSION], [SID, TTL]) == 0  # told already: no news
    assert int(await r.hget(VERSION, VER.REVISION)) == revision + 1
    await pubsub.aclose()
