"""`Store` over redis-py: a single server, a Redis Cluster, or the embedded fakeredis default.

`RedisStore` is its sides mixed together, one per protocol of the store interface, each in
its module: the worker's (`worker_side`: lease, transitions, commands read, replies), the
API's hand-overs (`api_side`: commands, replies awaited, creates, claims), the readers'
(`read_side`: views, listings, attention, turns, logs, the lease view) and the sweeper's
(`sweeper_side`). Beside them: the codec of stored values (`codec`), the command streams'
readers (`command_streams`), and how calls share a round trip (`batching`). Only this
package knows the key schema (`keys`), the session hash's fields and the Lua (`scripts`).
Every method is one Redis round trip unless its docstring says otherwise (on a cluster, a
pipeline that spans shards is one round trip per shard, sent concurrently).
"""

from __future__ import annotations

from . import keys
from .api_side import ApiSide
from .presence_side import PresenceSide
from .connection import MEMORY, Client, connect, is_cluster
from .read_side import ReadSide
from .sweeper_side import SweeperSide
from .types import Retention
from .worker_side import WorkerSide

# A lease script answers in well under a millisecond. A master that stalls keeps its
# connections open and silent, and on a cluster its replica may take the registry's slot
# over meanwhile: a renewal waiting on the stalled master past this gives up, and the next
# one (the cluster client having refreshed its slot map) reaches the new master within the
# lease, instead of after the 5 s default. A worker's lease clients wait up to three
# quarters of its lease (`lease_socket_timeout`): a network that adds half a lease to every
# round trip must not fail every renewal (at half the lease they all timed out, and the
# sessions' refreshes with them: tests/test_partitions.py), and a renewal lost on a dead
# connection costs nothing since renewals overlap (worker/worker.py, `_heartbeat_loop`).
LEASE_SOCKET_TIMEOUT_S = 1.0


def lease_socket_timeout(lease_ms: int | None) -> float:
    """How long a lease client waits for a reply: three quarters of the lease, at least 1 s."""
    return max(LEASE_SOCKET_TIMEOUT_S, 0.75 * (lease_ms or 0) / 1000)


class RedisStore(WorkerSide, ApiSide, PresenceSide, ReadSide, SweeperSide):
    """`Store` over redis-py. Transitions from one process are auto-pipelined in order."""

    def __init__(
        self,
        redis: Client,
        retention: Retention | None = None,
        lease_redis: Client | None = None,
        heartbeat_redis: Client | None = None,
    ) -> None:
        self.redis = redis
        # Lease decisions go out on a client of their own: a shard that stalls must not hold
        # up a heartbeat to the registry's shard behind the main client's connections and
        # slot-map refreshes.
        self.lease_redis = lease_redis or redis
        # The heartbeat has a connection of its own, kept open: were it to share the lease
        # client with the sweeper, a renewal that came while a CLAIM_DEAD was out would open
        # a second connection, and under latency a new connection's handshake is what costs
        # a lease.
        self.heartbeat_redis = heartbeat_redis or self.lease_redis
        # redis-py's cluster client resends a command whose connection broke (up to 10
        # times, also while it refreshes its slot map: it masks its own races that way). A
        # command may then have run on an attempt before the error it reports, so no error
        # proves that a command did not run (see api/outcomes.py).
        self.resends = is_cluster(redis)
        self.retention = retention or Retention()
        super().__init__()  # each side binds its scripts to these clients, and sets up its state

    @classmethod
    def from_url(
        cls, url: str, retention: Retention | None = None, lease_ms: int | None = None, reply_timeout_s: float | None = None
    ) -> RedisStore:
        """A store on `url` (see acp_state.store.connection), with its own clients for leases
        and for the heartbeat; `lease_ms`: the lease of the worker that uses it, if any;
        `reply_timeout_s`: how long any reply may take (a command line's; a server's
        clients wait, a blocking read included)."""
        if url.startswith(MEMORY):
            return cls(connect(url), retention)
        timeout = lease_socket_timeout(lease_ms)
        main = connect(url, socket_timeout=reply_timeout_s) if reply_timeout_s else connect(url)
        return cls(main, retention, connect(url, socket_timeout=timeout), connect(url, socket_timeout=timeout))

    async def close(self) -> None:
        await self._stop_readers()
        await self.redis.aclose()
        if self.lease_redis is not self.redis:
            await self.lease_redis.aclose()
        if self.heartbeat_redis is not self.lease_redis and self.heartbeat_redis is not self.redis:
            await self.heartbeat_redis.aclose()

    async def key_expiries(self) -> list[tuple[str, str, int]]:
        """Every key of the store's on its server (every master's, on a cluster), with its
        type and its TTL in ms (-1: none, -2: gone meanwhile): nothing of the runtime state
        may outlive its TTL (the chaos run's invariant h reads this after a run)."""
        found = []
        async for key in self.redis.scan_iter(match=f"{keys.PREFIX}:*", count=1000):
            pipe = self.redis.pipeline(transaction=False)
            pipe.type(key)
            pipe.pttl(key)
            key_type, pttl = await pipe.execute()
            found.append((key, key_type, pttl))
        return found
