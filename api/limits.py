"""Every limit a client meets: what the routes enforce, what `GET /capabilities` announces
(`routes/discovery.py`) and what the OpenAPI document names (`routes/openapi.py`), in one
place, so that none of them imports a route to read another's."""

from __future__ import annotations

# A request body (JSON): larger is refused 413 `body_too_large`.
MAX_BODY_BYTES = 1024 * 1024
# An event id a client sends back (`Last-Event-ID`): decimal digits up to JavaScript's
# largest safe integer; anything else opens a fresh stream.
MAX_SAFE_INTEGER = 2**53 - 1

# `GET /session/:id/events?maxQueued=`: live events buffered for a slow reader, clamped to
# MIN..MAX; DEFAULT without it.
STREAM_BUFFER_MIN = 16
STREAM_BUFFER_MAX = 2048
STREAM_BUFFER_DEFAULT = 256

# `POST /stream-tickets {path}`: the stream path a ticket names.
MAX_STREAM_PATH = 2048

# A session's `sourceId` (on create, and a listing's filter).
MAX_SOURCE_ID = 256

# `POST /session/:id/prompt`: prompts waiting behind the running one (the reference's 5).
MAX_QUEUED_PROMPTS = 5

# `GET /workspace/:id/sessions`: its page size, clamped to 1..MAX as the reference clamps it.
LISTING_DEFAULT_SIZE = 20
LISTING_MAX_SIZE = 100

# `POST /sessions/live-state` and `POST /sessions/catalog`: workspaces one request may name.
LIVE_STATE_MAX_WORKSPACES = 20
CATALOG_MAX_WORKSPACES = 20

# `GET /attention`: its page size.
ATTENTION_DEFAULT_SIZE = 50
ATTENTION_MAX_SIZE = 500

# `GET /session/:id/transcript` (`limit`) and `POST /session/:id/load` (`historyPageSize`).
TRANSCRIPT_DEFAULT_PAGE = 100
TRANSCRIPT_MAX_PAGE = 500
