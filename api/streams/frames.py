"""The frames of acp-state's Server-Sent Event streams, as the reference frames them
(`retry:`, then `id:`/`event:`/`data:`), and the markers a session stream's buffer carries."""

from __future__ import annotations

import orjson

from acp_state.clock import now_ms

from ..limits import MAX_SAFE_INTEGER
from ..responses import parse_decimal

RETRY_MS = 3000
KEEPALIVE_S = 15.0
KEEPALIVE = object()  # put in a stream's buffer: send a keepalive
KEEPALIVE_FRAME = b": keepalive\n\n"
ENDING_TYPES = ("session_closed", "session_died")
RESTORED = "session_restored"  # the first event of an epoch the worker rewrote


def parse_last_event_id(value: str | None) -> int | None:
    """Decimal digits only and at most 2^53-1; anything else is ignored (a fresh stream)."""
    return parse_decimal(value, MAX_SAFE_INTEGER)


def frame(event_type: str, data: str, event_id: int | str | None = None) -> bytes:
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {event_type}\ndata: {data}\n\n".encode()


def control(event_type: str, data: dict, event_id: int | None = None) -> bytes:
    """A frame of the stream itself. Without an id it does not move the client's resume
    point; `event_id=0` resets it to the start of a new epoch."""
    envelope = {"v": 1, "type": event_type, "data": data, "_meta": {"serverTimestamp": now_ms()}}
    return frame(event_type, orjson.dumps(envelope).decode(), event_id)


def resync(reason: str, last_delivered: int, earliest: int, detail: str | None = None) -> bytes:
    """The reference's `state_resync_required` (what its SDK acts on), sent just before
    acp-state's own `history_truncated` says the same in its words: events after
    `last_delivered` are not all available; the stream goes on from `earliest`."""
    data: dict = {"reason": reason, **({"detail": detail} if detail else {})}
    data.update(lastDeliveredId=last_delivered, earliestAvailableId=earliest)
    return control("state_resync_required", data)


def event_id_and_type(raw: str) -> tuple[int, str]:
    """The id and type of a stored event envelope."""
    envelope = orjson.loads(raw)
    return int(envelope["id"]), envelope["type"]
