"""What every side of `RedisStore` shares: its clients and retention, and the limits more
than one side keeps.

`RedisStore` (acp_state/store/redis.py) is its sides mixed together, one per protocol of
the store interface: the worker's (`worker_side`), the API's hand-overs (`api_side`), the
readers' (`read_side`) and the sweeper's (`sweeper_side`). Each binds the scripts it runs
and keeps its own state; the clients below are set before any side's.
"""

from __future__ import annotations

from . import keys
from .connection import Client, is_cluster
from .types import Retention

# Inbox streams outlive neither their worker nor a day of silence.
INBOX_TTL_MS = 24 * 3600 * 1000
INBOX_MAXLEN = 10_000
# A reply is kept this long for its API (longer than its worker may want it back: reclaim_replies).
REPLY_TTL_S = 60
# Registry keys outlive a day without any process of the deployment.
REGISTRY_TTL_MS = 24 * 3600 * 1000


class RedisSide:
    """The clients and retention every side works with (set by `RedisStore.__init__`)."""

    # The main client: sessions, commands, replies, readers.
    redis: Client
    # Lease decisions (CLAIM_DEAD, RELEASE, RESIGN) go out on a client of their own.
    lease_redis: Client
    # The heartbeat's own connection, kept open (see RedisStore.__init__).
    heartbeat_redis: Client
    resends: bool  # the client resends a command after an error (it may have run twice)
    retention: Retention

    @property
    def locator_ttl_ms(self) -> int:
        """A session id's locator is kept the catalog's retention past its session's last
        refresh (its worker renews it with the session's TTL), so it outlives the listing
        row: an id stays its workspace's while any session of it is live or listed."""
        return self.retention.catalog_ms + self.retention.session_ttl_ms

    def attention_all_keys(self, ws: str) -> list[str]:
        """The deployment attention index (and its details) that holds the workspace's
        waits: the whole deployment's on a single Redis, its slot's on a cluster."""
        tag = keys.attention_tag(ws, is_cluster(self.redis))
        return [keys.attention_all(tag), keys.attention_all_details(tag)]
