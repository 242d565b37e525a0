"""What the Lua scripts' own tests share (tests/test_lua.py, tests/test_lua_commands.py): a
redis-server per module and an empty Redis for each test (the fixtures `server` and `r`,
which each module imports), one session's keys, a script run by name (`run`), the APPLY
calls that make a session (`apply`, `created`), and the attention index read back
(`attention`, with the deployment's index checked against it). tests/conftest.py runs the modules that use these fixtures on one runner.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Iterator

import orjson
import pytest
import redis.asyncio as aioredis

from acp_state import events
from acp_state.store import keys, scripts
from acp_state.store.batching import Script
from acp_state.store.keys import F
from testbed.redis_server import RedisServer

WS = "0123456789abcdef"
SID = "11111111-1111-4111-8111-111111111111"
INC = "w-1"
OTHER = "w-2"
TTL = 60_000
CHANNEL = keys.invalidations(WS)
SESSION = keys.session(WS, SID)
VERSION = keys.catalog_version(WS)
CHANGES = keys.change_log(WS)
TURNS, ENDED = keys.turns(WS, SID), keys.turns_ended(WS, SID)
ATTENTION, ATTENTION_DETAILS = keys.attention(WS), keys.attention_details(WS)
# The deployment's attention index as one Redis holds it (a cluster's slot has its own tag).
DEPLOYMENT = keys.attention_all(keys.attention_tag(WS, per_slot=False))
DEPLOYMENT_DETAILS = keys.attention_all_details(keys.attention_tag(WS, per_slot=False))
APPLY_KEYS = [
    SESSION, keys.events(WS, SID), keys.live(WS), keys.catalog(WS), keys.catalog_order(WS),
    keys.single(WS), keys.transcript(WS, SID), CHANNEL, VERSION, TURNS, ENDED, ATTENTION, ATTENTION_DETAILS,
    DEPLOYMENT, DEPLOYMENT_DETAILS, CHANGES,
]


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    """A redis-server for the module that imports this fixture (each gets its own)."""
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture
async def r(server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    """A client of the module's server, which holds nothing yet."""
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


async def attention(r: aioredis.Redis) -> dict[str, tuple[int, str]]:
    """The workspace's index as {member: (since, details)}, after checking that the
    deployment's holds the very same entries (members prefixed with the workspace id)."""
    index = await r.zrange(ATTENTION, 0, -1, withscores=True)
    found = {member: (int(since), await r.hget(ATTENTION_DETAILS, member)) for member, since in index}
    whole = await r.zrange(DEPLOYMENT, 0, -1, withscores=True)
    mirrored = {m: (int(since), await r.hget(DEPLOYMENT_DETAILS, m)) for m, since in whole if m.startswith(WS + "/")}
    assert mirrored == {f"{WS}/{member}": value for member, value in found.items()}
    assert len([m for m in await r.hkeys(DEPLOYMENT_DETAILS) if m.startswith(WS + "/")]) == len(mirrored)
    return found
