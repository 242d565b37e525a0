"""Redis connections from a URL: a real server (`redis://`, `rediss://`, `unix://`) or the
embedded in-process default (`memory://`), which only `acp-state dev` and unit tests use."""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis

MEMORY = "memory://"
_memory_servers: dict[str, Any] = {}


def connect(url: str, **options: Any) -> aioredis.Redis:
    """A client with `decode_responses=True`; hiredis parses replies when installed."""
    if url.startswith(MEMORY):
        import fakeredis  # only the embedded default needs it

        server = _memory_servers.setdefault(url, fakeredis.FakeServer())
        return fakeredis.FakeAsyncRedis(server=server, decode_responses=True)
    options.setdefault("health_check_interval", 15)
    options.setdefault("socket_keepalive", True)
    return aioredis.Redis.from_url(url, decode_responses=True, **options)
