"""Redis connections from a URL.

- `redis://`, `rediss://`, `unix://`: a single Redis server;
- `redis+cluster://host:port` (or `rediss+cluster://`): a Redis Cluster, found from that seed
  node;
- `memory://`: the embedded in-process default (fakeredis), which only `acp-state dev` and
  unit tests use.

The rest of acp-state runs unchanged on each: keys are hash-tagged per workspace and per
worker, so every script and transaction stays inside one slot.
"""

from __future__ import annotations

import socket
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError

from .faults import torn_under_write

MEMORY = "memory://"
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
# Pub/sub connections ping when idle this often, so a dead one is noticed and replaced.
HEALTH_CHECK_S = 15
# Connections per process (per node on a cluster). redis-py's default pool raises once 100
# are in use, which a burst of concurrent requests (or a sweep of 1,000 sessions) reaches;
# this pool instead makes the next caller wait for a free connection, up to POOL_WAIT_S.
POOL_SIZE = 512
POOL_WAIT_S = 10
_memory_servers: dict[str, Any] = {}
# A link that dies without a FIN or an RST (a partition, a host gone, a black hole) must be
# noticed by the process itself, within a worker's lease, on every connection: an idle one
# by TCP keepalive (probes after 1 s idle, 1 s apart, dead after 3 unanswered: ~4 s), a
# busy one by TCP_USER_TIMEOUT (data unacknowledged that long ends the connection), and a
# connect by its own timeout (a SYN into a partition otherwise waits out the kernel's 2
# minutes of retries). A Redis that is stalled but up (DEBUG SLEEP, CLIENT PAUSE) still
# acknowledges at the TCP level, so none of these mistake a stall for a death.
CONNECT_TIMEOUT_S = 2.0
KEEPALIVE_OPTIONS: dict[int, int] = {}
if hasattr(socket, "TCP_KEEPIDLE"):  # Linux; elsewhere the system's keepalive defaults
    KEEPALIVE_OPTIONS = {socket.TCP_KEEPIDLE: 1, socket.TCP_KEEPINTVL: 1, socket.TCP_KEEPCNT: 3}
    if hasattr(socket, "TCP_USER_TIMEOUT"):
        KEEPALIVE_OPTIONS[socket.TCP_USER_TIMEOUT] = 5_000  # milliseconds



def _as_connection_error(error: BaseException) -> BaseException:
    """A write torn by a concurrent close (uvloop's "the handler is closed") is what it is, a
    connection error, so every caller answers it as the store being away (an API: 503)
    rather than as a bug of ours (a 500, an SSE stream dropped without its end)."""
    if torn_under_write(error):
        return RedisConnectionError(f"the connection closed under a write ({error})")
    return error


class _Connection(aioredis.Connection):
    """redis-py's TCP connection, raising a torn write as a ConnectionError."""

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        try:
            await super().send_packed_command(command, check_health)
        except (RuntimeError, AttributeError) as error:
            raise _as_connection_error(error) from error


class _Cluster(RedisCluster):
    """redis-py's cluster client, learning the slot map before its first command runs.

    redis-py 8.1 lets commands that arrive while the client learns the slot map race on one
    connection: on a fresh process a burst of concurrent requests met "Connection closed by
    server" and a writer torn from under another command (tests/test_cluster.py's concurrent
    votes failed about one run in seven). Waiting for the slot map first closes that race;
    afterwards this is one attribute test per command."""

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        if self._initialize:
            await self.initialize()
        try:
            return await super().execute_command(*args, **kwargs)
        except (RuntimeError, AttributeError) as error:
            raise _as_connection_error(error) from error


Client = aioredis.Redis | RedisCluster


def connect(url: str, **options: Any) -> Client:
    """A client with `decode_responses=True`; hiredis parses replies when installed."""
    if url.startswith(MEMORY):
        import fakeredis  # only the embedded default needs it

        server = _memory_servers.setdefault(url, fakeredis.FakeServer())
        return fakeredis.FakeAsyncRedis(server=server, decode_responses=True)
    options.setdefault("socket_keepalive", True)
    options.setdefault("socket_keepalive_options", KEEPALIVE_OPTIONS)
    options.setdefault("socket_connect_timeout", CONNECT_TIMEOUT_S)
    scheme, sep, rest = url.partition("://")
    if scheme in CLUSTER_SCHEMES:
        options.setdefault("max_connections", POOL_SIZE)
        return _Cluster.from_url(f"{CLUSTER_SCHEMES[scheme]}{sep}{rest}", decode_responses=True, **options)
    options.setdefault("health_check_interval", HEALTH_CHECK_S)
    if scheme == "redis":
        options.setdefault("connection_class", _Connection)
    pool = aioredis.BlockingConnectionPool.from_url(
        url, max_connections=POOL_SIZE, timeout=POOL_WAIT_S, decode_responses=True, **options
    )
    return aioredis.Redis(connection_pool=pool)


def is_cluster(redis: Any) -> bool:
    return isinstance(redis, RedisCluster)


def node_client(node: ClusterNode) -> aioredis.Redis:
    """A plain client of one cluster node (same credentials and TLS settings), for the
    connections that must stay on that node: sharded pub/sub."""
    options = {
        key: value
        for key, value in node.connection_kwargs.items()
        if key in ("username", "password", "credential_provider", "client_name", "socket_connect_timeout",
                   "socket_keepalive", "socket_keepalive_options")
        or key.startswith("ssl")
    }
    pool = aioredis.ConnectionPool(
        connection_class=node.connection_class,
        host=node.host,
        port=node.port,
        decode_responses=True,
        health_check_interval=HEALTH_CHECK_S,
        **options,
    )
    return aioredis.Redis(connection_pool=pool)


class UnsuitableRedis(RuntimeError):
    """The URL reaches a Redis acp-state cannot run on, or runs on only by another URL."""


async def verify(redis: Client) -> None:
    """Refuse, with the reason, a Redis older than 7.0 (no sharded pub/sub) and a cluster
    node given by a single-node URL (every command of another slot would fail with MOVED)."""
    if not isinstance(redis, aioredis.Redis) or type(redis).__module__.startswith("fakeredis"):
        return  # a cluster client checked its nodes itself; the embedded default is fine
    info = await redis.info()
    major = int(str(info.get("redis_version", "0")).split(".")[0])
    if major < 7:
        raise UnsuitableRedis(f"Redis {info.get('redis_version')} is too old: acp-state needs Redis >= 7.0")
    if info.get("cluster_enabled"):
        raise UnsuitableRedis("this Redis is a cluster node: give it as redis+cluster://host:port")


async def check(url: str) -> None:
    """Raise UnsuitableRedis for a Redis acp-state cannot use as given (too old, or a cluster
    node behind a single-node URL); an unreachable one passes (the process waits for it)."""
    client = connect(url)
    try:
        await verify(client)
    except UnsuitableRedis:
        raise
    except Exception:
        pass
    finally:
        await client.aclose()
