"""Who is watching a live session: the presence of the clients that heartbeat, their
detach, and the pruning of those whose presence lapsed (`POST /session/:id/heartbeat` and
`/detach`, issue 39).

A client is registered on a session by its create or attach (field `c:<clientId>` of the
session hash: `clientCount`, and who may vote). One that heartbeats also gets an entry in
its workspace's presence ZSET (`keys.presence`), lapsing a TTL after its last heartbeat;
`prune_clients`, run by every API process for its workspaces, removes a lapsed client from
its session as a detach would, so `clientCount` drops on every API process (the change is
announced) once a client vanished without a word. A client that never heartbeats (the
reference's SDK) stays registered until it detaches or the session ends, as in the
reference.
"""

from __future__ import annotations

from ..clock import now_ms
from ..commands import Detach
from .. import commands
from . import keys, scripts
from .batching import Script
from .keys import F
from .side import INBOX_MAXLEN, INBOX_TTL_MS, RedisSide
from .types import Presence

# Lapsed clients removed per script call (one workspace's slot).
PRUNE_BATCH = 100


class PresenceSide(RedisSide):
    """An API process's presence calls (see the module)."""

    def __init__(self) -> None:
        super().__init__()
        self._client_seen = Script(self.redis, scripts.CLIENT_SEEN)
        self._detach = Script(self.redis, scripts.DETACH)
        self._prune_clients = Script(self.redis, scripts.PRUNE_CLIENTS)

    async def client_seen(self, ws: str, sid: str, client_id: str | None, ttl_ms: int) -> tuple[Presence, int]:
        """A heartbeat: the client's presence lasts `ttl_ms` from now; with the time of Redis's
        clock it was recorded at (epoch ms). Without a client id only the session is checked."""
        status, at = await self._client_seen(
            [keys.session(ws, sid), keys.presence(ws)], [sid, client_id or "", ttl_ms]
        )
        seen = {1: Presence.SEEN, 0: Presence.GONE, -1: Presence.UNKNOWN_CLIENT}[int(status)]
        return seen, int(at) if seen is Presence.SEEN else 0

    async def detach(self, ws: str, incarnation: str, command: Detach) -> bool:
        """The client leaves the live session (its owner is told); False if the session is
        gone (not `incarnation`'s)."""
        key_list = [
            keys.session(ws, command.sid), keys.presence(ws), keys.inbox(ws, incarnation), keys.invalidations(ws),
            keys.catalog_version(ws), keys.change_log(ws),
        ]
        args = [incarnation, commands.encode(command), INBOX_TTL_MS, INBOX_MAXLEN, self.retention.catalog_ms]
        return bool(await self._detach(key_list, args))

    async def prune_clients(self, ws: str) -> int:
        """Remove up to PRUNE_BATCH clients of the workspace whose presence lapsed; how many
        were removed. Candidates are read by this process's clock and checked again by
        Redis's in the script (a heartbeat since keeps a client)."""
        lapsed = await self.redis.zrangebyscore(keys.presence(ws), "-inf", now_ms(), start=0, num=PRUNE_BATCH)
        if not lapsed:
            return 0
        members = [m.decode() if isinstance(m, bytes) else m for m in lapsed]
        sids = [member.split(" ", 1)[0] for member in members]
        pipe = self.redis.pipeline(transaction=False)
        for sid in sids:
            pipe.hget(keys.session(ws, sid), F.OWNER)
        owners = [o.decode() if isinstance(o, bytes) else (o or "") for o in await pipe.execute()]
        key_list = [keys.presence(ws), keys.invalidations(ws), keys.catalog_version(ws), keys.change_log(ws)]
        args: list[object] = [INBOX_TTL_MS, INBOX_MAXLEN, self.retention.catalog_ms]
        for member, sid, owner in zip(members, sids, owners, strict=True):
            # A session that left has no owner: its entry is dropped, nothing is told.
            key_list += [keys.session(ws, sid), keys.inbox(ws, owner or "-")]
            args += [member, owner]
        return int(await self._prune_clients(key_list, args))
