"""Redis ACL roles: what each kind of process runs on Redis, the users of
`deploy/redis/users.acl` that allow just that, and the check at start that the process's
user may run it (docs/api.md, "Redis ACL roles").

A command a Lua script calls is checked against the user that runs the script, so a role's
commands are the ones its code calls directly and the ones inside the scripts it runs (read
from the rendered scripts themselves, `script_commands`): the roles follow the code.

Redis 7.0 has no `ACL DRYRUN` (7.2), so `check_permissions` probes, on one connection and
with nothing written: the reads it runs on a key no acp-state process uses
(`acp:{acl-probe}:k`), a script by a digest no script has (NOSCRIPT: allowed; NOPERM: not),
writes that do nothing on that key (a DEL, a PEXPIRE, an XADD NOMKSTREAM), the other writes
it queues in a MULTI it then DISCARDs (Redis checks a queued command's ACL when
it queues it), and a sharded subscription (the connection is closed after).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from redis.exceptions import AuthenticationError, NoPermissionError, RedisError, ResponseError

from . import keys, scripts
from .connection import MEMORY, connect, is_cluster, node_client

PROBE_KEY = f"{keys.PREFIX}:{{acl-probe}}:k"
PROBE_CHANNEL = f"{keys.PREFIX}:{{acl-probe}}:inv"  # the same slot: one node answers both
NO_SUCH_SCRIPT = "0" * 40
KEY_PATTERN = f"{keys.PREFIX}:*"
# A Redis that accepts the connection and then says nothing (stalled) is not waited for here.
PROBE_TIMEOUT_S = 5.0

# The scripts each role runs (`*_side.py`: the worker also sweeps, the API also sweeps).
SWEEPER_SCRIPTS = ("CLAIM_DEAD", "SWEEP")
WORKER_SCRIPTS = ("APPLY", "MOVE", "REPLY", "RECLAIM", "CLAIM_SID", "HEARTBEAT", "RELEASE", "RESIGN", *SWEEPER_SCRIPTS)
API_SCRIPTS = ("SEND", "VOTE", "ATTACH", "TOLD", "TAKE", "ABANDON", "RELEASE_SINGLE", "CLAIM_SID", "CLAIM_LOAD",
               "DELETE_LISTED", "LIST", "VERSION", "CURRENT_TURN", "ATTENTION_PAGE", "ATTENTION_OF", "CLIENT_SEEN", "DETACH",
               "PRUNE_CLIENTS", *SWEEPER_SCRIPTS)

# What every client of a Redis runs: the health check and the version check; on a cluster
# the slot map, the command table and ASKING during a slot's migration. (AUTH and HELLO need
# no permission.)
CONNECTION = ("PING", "INFO")
CLUSTER = ("CLUSTER|SLOTS", "CLUSTER|SHARDS", "COMMAND", "ASKING")
# The commands a role's code calls itself (`*_side.py`, `command_streams`, `fanout`,
# `batching`), beside its scripts.
SCRIPTING = ("EVALSHA", "SCRIPT|LOAD")
TRANSACTIONS = ("MULTI", "EXEC", "DISCARD", "UNWATCH")  # UNWATCH: redis-py's cluster pipeline, on an error
# The sweeper (both sides run it): its index, its forgetting, the lease view.
SWEEPER_DIRECT = ("SMEMBERS", "EXISTS", "DEL", "ZREM", "TIME", "ZRANGE", "HMGET")
WORKER_DIRECT = (
    "DEL", "PEXPIRE", "EXPIRE", "SADD", "SREM", "SET", "GET", "XRANGE", "XTRIM", "XREAD", "XADD", "BLMOVE", "LREM",
    "RPUSH", "HGETALL", "HMGET", "ZRANGE", "TIME",
)
API_DIRECT = (
    "XADD", "PEXPIRE", "EXPIRE", "BLMOVE", "LREM", "RPUSH", "GET", "SET", "DEL", "HEXISTS", "HGET", "HGETALL",
    "HMGET", "SMEMBERS", "TIME", "XRANGE", "XREVRANGE", "ZRANGE", "ZRANGEBYSCORE", "ZSCORE",
)
SUBSCRIBE = ("SSUBSCRIBE", "SUNSUBSCRIBE")
# `acp-state status`: the lease view and the workers' reports. `acp-state drain`: those, and
# a command to the worker's control stream.
STATUS_DIRECT = ("ZRANGE", "HMGET", "TIME")
DRAIN_DIRECT = (*STATUS_DIRECT, "XADD", "PEXPIRE")

# The read-only dashboard (and `acp-state status`): read commands on acp keys only, the
# sharded and classic subscriptions, no write, no script.
DASHBOARD_RULES = (
    f"%R~{KEY_PATTERN} &{KEY_PATTERN} -@all +@read -@dangerous +ping +time +info "
    "+ssubscribe +sunsubscribe +subscribe +unsubscribe +psubscribe +punsubscribe "
    "+cluster|slots +cluster|shards +command"
)

_CALL = re.compile(r"""redis\.p?call\(\s*['"](\w+)['"]""")


def script_commands(source: str) -> set[str]:
    """The Redis commands a script calls (every call names its command literally)."""
    return {name.upper() for name in _CALL.findall(source)}


def _of_scripts(names: tuple[str, ...]) -> set[str]:
    found: set[str] = set()
    for name in names:
        found |= script_commands(getattr(scripts, name))
    return found


@dataclass(frozen=True)
class Role:
    """What one kind of process runs on Redis."""

    name: str
    commands: frozenset[str]
    subscribes: bool = False

    def rules(self) -> str:
        """Its ACL rules (after `reset`, before the password): acp keys and channels, and
        exactly its commands."""
        return f"~{KEY_PATTERN} &{KEY_PATTERN} -@all " + " ".join(f"+{c.lower()}" for c in sorted(self.commands))


def _role(name: str, direct: tuple[str, ...], script_names: tuple[str, ...] = (), subscribes: bool = False) -> Role:
    commands = set(direct) | set(CONNECTION) | set(CLUSTER) | set(SWEEPER_DIRECT if script_names else ())
    if script_names:
        commands |= set(SCRIPTING) | set(TRANSACTIONS) | _of_scripts(script_names)
    if subscribes:
        commands |= set(SUBSCRIBE)
    return Role(name, frozenset(commands), subscribes)


WORKER = _role("worker", WORKER_DIRECT, WORKER_SCRIPTS)
API = _role("api", API_DIRECT, API_SCRIPTS, subscribes=True)
# `acp-state drain` needs no role of its own: the API user runs it (`api` covers it).
DRAIN = Role("drain", frozenset({*DRAIN_DIRECT, *CONNECTION}))
# `acp-state status` runs as the dashboard user.
STATUS = Role("status", frozenset({*STATUS_DIRECT, *CONNECTION}))
ROLES = {"worker": WORKER, "api": API, "dev": Role("dev", WORKER.commands | API.commands, True),
         "drain": DRAIN, "status": STATUS}

PLACEHOLDER = "CHANGE-ME-{user}"


def users_acl(passwords: dict[str, str] | None = None) -> str:
    """The text of deploy/redis/users.acl: with `passwords` (user -> password), a file a
    Redis can load as is; without, the placeholders an operator replaces."""

    def password(user: str) -> str:
        return f">{(passwords or {}).get(user, PLACEHOLDER.format(user=user))}"

    # An ACL file holds `user` lines only (Redis refuses comments): what each is for is in
    # docs/api.md. The default user is off (every client names its user); `admin` is the
    # operators' (ACL LOAD, CONFIG, setting up a cluster, backups).
    return "\n".join([
        "user default off resetpass resetkeys resetchannels -@all",
        f"user admin on {password('admin')} ~* &* +@all",
        f"user worker on {password('worker')} {WORKER.rules()}",
        f"user api on {password('api')} {API.rules()}",
        f"user dashboard on {password('dashboard')} {DASHBOARD_RULES}",
        "",
    ])


# One harmless call per command: reads, and writes that do nothing there, are run on the
# probe key (which no process writes); other writes are only queued in a MULTI that is
# discarded.
_READS: dict[str, tuple[Any, ...]] = {
    "PING": ("PING",), "TIME": ("TIME",), "INFO": ("INFO", "server"),
    "GET": ("GET", PROBE_KEY), "EXISTS": ("EXISTS", PROBE_KEY), "TTL": ("TTL", PROBE_KEY), "PTTL": ("PTTL", PROBE_KEY),
    "HGET": ("HGET", PROBE_KEY, "f"), "HGETALL": ("HGETALL", PROBE_KEY), "HMGET": ("HMGET", PROBE_KEY, "f"),
    "HEXISTS": ("HEXISTS", PROBE_KEY, "f"), "HKEYS": ("HKEYS", PROBE_KEY),
    "SMEMBERS": ("SMEMBERS", PROBE_KEY), "SISMEMBER": ("SISMEMBER", PROBE_KEY, "m"),
    "XRANGE": ("XRANGE", PROBE_KEY, "-", "+", "COUNT", 1), "XREVRANGE": ("XREVRANGE", PROBE_KEY, "+", "-", "COUNT", 1),
    "XREAD": ("XREAD", "COUNT", 1, "STREAMS", PROBE_KEY, "0-0"),
    "ZRANGE": ("ZRANGE", PROBE_KEY, 0, 0), "ZRANGEBYSCORE": ("ZRANGEBYSCORE", PROBE_KEY, 0, 0),
    "ZREVRANGE": ("ZREVRANGE", PROBE_KEY, 0, 0), "ZSCORE": ("ZSCORE", PROBE_KEY, "m"), "ZCARD": ("ZCARD", PROBE_KEY),
    "LINDEX": ("LINDEX", PROBE_KEY, 0), "LLEN": ("LLEN", PROBE_KEY), "LRANGE": ("LRANGE", PROBE_KEY, 0, 0),
    "EVALSHA": ("EVALSHA", NO_SUCH_SCRIPT, 1, PROBE_KEY),
    # Writes that do nothing to a key that does not exist (or to a channel nobody follows).
    "DEL": ("DEL", PROBE_KEY), "EXPIRE": ("EXPIRE", PROBE_KEY, 1), "PEXPIRE": ("PEXPIRE", PROBE_KEY, 1),
    "XADD": ("XADD", PROBE_KEY, "NOMKSTREAM", "*", "f", "v"), "XTRIM": ("XTRIM", PROBE_KEY, "MAXLEN", 0),
    "HDEL": ("HDEL", PROBE_KEY, "f"), "SREM": ("SREM", PROBE_KEY, "m"), "ZREM": ("ZREM", PROBE_KEY, "m"),
    "LREM": ("LREM", PROBE_KEY, 0, "v"), "SPUBLISH": ("SPUBLISH", PROBE_CHANNEL, "m"),
}
_WRITES: dict[str, tuple[Any, ...]] = {
    "SET": ("SET", PROBE_KEY, "v"), "HSET": ("HSET", PROBE_KEY, "f", "v"), "HSETNX": ("HSETNX", PROBE_KEY, "f", "v"),
    "HINCRBY": ("HINCRBY", PROBE_KEY, "f", 1), "SADD": ("SADD", PROBE_KEY, "m"), "ZADD": ("ZADD", PROBE_KEY, 0, "m"),
    "ZREMRANGEBYSCORE": ("ZREMRANGEBYSCORE", PROBE_KEY, 0, 0), "ZPOPMIN": ("ZPOPMIN", PROBE_KEY),
    "LPUSH": ("LPUSH", PROBE_KEY, "v"), "RPUSH": ("RPUSH", PROBE_KEY, "v"), "LPOP": ("LPOP", PROBE_KEY),
    "LMOVE": ("LMOVE", PROBE_KEY, PROBE_KEY, "LEFT", "RIGHT"),
    "BLMOVE": ("BLMOVE", PROBE_KEY, PROBE_KEY, "LEFT", "RIGHT", 0), "SCRIPT|LOAD": ("SCRIPT", "LOAD", "return 0"),
}
# Not probed one by one: what the connection itself already did to get here (its handshake,
# a cluster client's slot map and command table), the transaction commands (the probe's own
# MULTI / EXEC / DISCARD), the subscriptions (probed by subscribing), ASKING (only valid
# before a redirected command; granted with the rest of the file).
_UNPROBED = {"ASKING", *CLUSTER, *TRANSACTIONS, *SUBSCRIBE}


class MissingPermission(RuntimeError):
    """The process's Redis user may not run what the process needs (the message names it)."""


def _label(argv: tuple[Any, ...]) -> str:
    return "SCRIPT LOAD" if argv[0] == "SCRIPT" else str(argv[0])


def _is_noperm(error: ResponseError) -> bool:
    return isinstance(error, NoPermissionError) or "no permissions" in str(error)


async def _probe(conn: Any, role: Role) -> list[tuple[str, str]]:
    """(what, Redis's answer) for each thing `role` needs that the connection's user may not do."""
    missing: list[tuple[str, str]] = []

    async def call(*argv: Any, push: bool = False) -> Any:
        await conn.send_command(*argv)
        return await conn.read_response(push_request=push)  # a subscription answers a push on RESP3

    async def attempt(argv: tuple[Any, ...], label: str | None = None) -> bool:
        """Run it: True if it ran or was refused for want of a permission (noted); False if
        Redis answered another error (loading, out of memory): the probe stops there, and
        the process goes on to meet that state as it would without a probe."""
        try:
            await call(*argv, push=argv[0] == "SSUBSCRIBE")
            return True
        except ResponseError as error:
            if _is_noperm(error):
                missing.append((label or _label(argv), str(error)))
                return True
            return False

    for name in sorted(role.commands & _READS.keys()):
        await attempt(_READS[name])
    if role.commands & {"MULTI", "EXEC"}:
        # An empty transaction: MULTI and EXEC, nothing run. Refused, the probe ends (the
        # connection may be left inside the MULTI; it is closed after).
        before = len(missing)
        if not await attempt(("MULTI",), "MULTI") or len(missing) > before:
            return missing
        if not await attempt(("EXEC",), "EXEC") or len(missing) > before:
            return missing
    writes = sorted(role.commands & _WRITES.keys())
    if writes:
        before = len(missing)
        if not await attempt(("MULTI",), "MULTI (to probe writes)") or len(missing) > before:
            return missing
        for name in writes:
            await attempt(_WRITES[name])  # QUEUED, or NOPERM now (another error: not probed)
        if not await attempt(("DISCARD",), "DISCARD"):
            return missing
    if role.subscribes:
        await attempt(("SSUBSCRIBE", PROBE_CHANNEL), "SSUBSCRIBE")  # last: the connection is closed after it
    return missing


async def check_permissions(url: str, role_name: str) -> None:
    """Raise MissingPermission, naming each command (and key or channel) the URL's user may
    not run that a process of `role_name` (api, worker, dev, drain, status) runs, or a
    refused login. An unreachable Redis passes (the process waits for it). On a cluster the
    node serving the probe's slot answers (every node loads the same ACL file)."""
    if url.startswith(MEMORY):
        return
    role = ROLES[role_name]
    unknown = role.commands - _READS.keys() - _WRITES.keys() - _UNPROBED
    assert not unknown, f"no probe for {sorted(unknown)}"
    client = connect(url, socket_timeout=PROBE_TIMEOUT_S)
    probe_client = client
    try:
        if is_cluster(client):
            await client.initialize()
            probe_client = node_client(client.get_node_from_key(PROBE_KEY))
            probe_client.connection_pool.connection_kwargs["socket_timeout"] = PROBE_TIMEOUT_S
        username = probe_client.connection_pool.connection_kwargs.get("username") or "default"
        conn = await probe_client.connection_pool.get_connection()
        try:
            missing = await _probe(conn, role)
        finally:
            await conn.disconnect()  # never handed back in a MULTI or subscribed
            await probe_client.connection_pool.release(conn)
    except AuthenticationError as error:
        raise MissingPermission(f"Redis refused the login: {error}") from None
    except ResponseError as error:  # a cluster client's slot map or command table refused
        if _is_noperm(error):
            raise MissingPermission(f"the Redis user may not set up a cluster client: {error}") from None
        return  # another state (loading, ...): the process meets it as it would without a probe
    except (RedisError, OSError):
        return  # unreachable or silent: the process waits for it
    finally:
        if probe_client is not client:
            await probe_client.aclose()
        await client.aclose()
    if missing:
        raise MissingPermission(
            f"the Redis user {username!r} may not run what acp-state {role.name} needs: "
            + ", ".join(what for what, _ in missing)
            + f" (Redis: {missing[0][1]}); see deploy/redis/users.acl"
        )


if __name__ == "__main__":
    print(users_acl(), end="")
