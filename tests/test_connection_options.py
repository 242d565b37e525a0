"""Every Redis client the project makes notices a dead link by itself: TCP keepalive, a
TCP_USER_TIMEOUT and a connect timeout on each kind (single server, cluster, a cluster
node's pub/sub client, a worker's lease clients). Without them a half-open connection or a
SYN into a partition waits out the kernel (minutes); tests/test_partitions.py shows what
they buy across real hosts, this module that none of the clients goes without them."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest
from redis.asyncio.cluster import ClusterNode

from acp_state.store import RedisStore
from acp_state.store.connection import CONNECT_TIMEOUT_S, connect, node_client
from tests.helpers import eventually

pytestmark = pytest.mark.skipif(not hasattr(socket, "TCP_USER_TIMEOUT"), reason="Linux TCP options")


def options_of(client: Any) -> dict[str, Any]:
    manager = getattr(client, "nodes_manager", None)
    return manager.connection_kwargs if manager is not None else client.connection_pool.connection_kwargs


def assert_notices_dead_links(options: dict[str, Any]) -> None:
    assert options["socket_keepalive"] is True
    tcp = options["socket_keepalive_options"]
    # Idle: dead after ~4 s of unanswered probes; busy: after 5 s of unacknowledged data.
    assert tcp[socket.TCP_KEEPIDLE] + tcp[socket.TCP_KEEPINTVL] * tcp[socket.TCP_KEEPCNT] <= 5
    assert 0 < tcp[socket.TCP_USER_TIMEOUT] <= 5_000
    assert options["socket_connect_timeout"] == CONNECT_TIMEOUT_S


@pytest.mark.parametrize("url", ["redis://10.213.0.2:6390/0", "redis+cluster://10.213.0.2:7000"])
async def test_every_client_notices_a_dead_link(url: str) -> None:
    client = connect(url)
    assert_notices_dead_links(options_of(client))
    await client.aclose()


async def test_a_cluster_node_s_pub_sub_client_notices_a_dead_link() -> None:
    cluster = connect("redis+cluster://10.213.0.2:7000")
    node = node_client(ClusterNode("10.213.0.2", 7000, **options_of(cluster)))
    assert_notices_dead_links(options_of(node))
    await node.aclose()
    await cluster.aclose()


async def test_a_worker_s_lease_clients_notice_a_dead_link_and_wait_under_its_lease() -> None:
    store = RedisStore.from_url("redis://10.213.0.2:6390/0", lease_ms=4000)
    for client in (store.redis, store.lease_redis, store.heartbeat_redis):
        assert_notices_dead_links(options_of(client))
    for client in (store.lease_redis, store.heartbeat_redis):
        assert options_of(client)["socket_timeout"] == 3.0  # three quarters of the lease
    await store.close()


def test_a_write_torn_by_a_closed_connection_is_a_connection_error(redis_server) -> None:  # noqa: ANN001
    """On uvloop (the API's loop) a write into a connection closed under it raised a bare
    RuntimeError ("the handler is closed"): an API answered it as a bug of ours (500, an
    event stream dropped without its end). It is the store being away: a ConnectionError,
    which every API answers 503 (`is_transient`), never 500. Judged by the error's type and
    how the product classes it, not by its text: redis-py 8.2 wraps some such closes itself,
    in words of its own."""
    import uvloop
    from redis.exceptions import ConnectionError as RedisConnectionError

    from acp_state.store import is_transient

    async def torn() -> None:
        client = connect(redis_server.url)
        await client.ping()
        connection = await client.connection_pool.get_connection()
        connection._writer.transport.abort()  # closed under the next write, as a partition's reset does
        with pytest.raises(RedisConnectionError) as raised:
            await connection.send_packed_command(b"*1\r\n$4\r\nPING\r\n", check_health=False)
        assert is_transient(raised.value), raised.value  # an API answers it 503 store_unavailable
        await client.connection_pool.release(connection)
        assert await client.ping()  # the next command takes a new connection
        await client.aclose()

    uvloop.run(torn())


async def test_a_blocking_read_released_by_its_master_is_the_store_moving(redis_server) -> None:  # noqa: ANN001
    """An API awaits a worker's reply with BLMOVE. A master that turns replica in a failover
    releases its blocked clients with an UNBLOCKED error: the store moved, and the API answers
    503 (`outcome_unknown` after a command was sent), never 500 as a bug of ours (the chaos run
    across hosts on a cluster saw three DELETEs answered 500 so). Redis sends the same error
    to a client another releases with CLIENT UNBLOCK ... ERROR, which this test does."""
    from redis.exceptions import ResponseError

    from acp_state.store import is_transient

    blocked, other = connect(redis_server.url), connect(redis_server.url)
    try:
        waiting = asyncio.ensure_future(blocked.blmove("acp:test:src", "acp:test:dst", 30, "LEFT", "LEFT"))

        async def blocked_client() -> str | None:
            return next((c["id"] for c in await other.client_list() if c.get("cmd") == "blmove"), None)

        client_id = await eventually(blocked_client, "the BLMOVE blocking")
        await other.execute_command("CLIENT", "UNBLOCK", client_id, "ERROR")
        with pytest.raises(ResponseError) as raised:
            await waiting
        assert is_transient(raised.value), raised.value
    finally:
        await blocked.aclose()
        await other.aclose()
