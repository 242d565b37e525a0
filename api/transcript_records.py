"""A session's transcript records as the routes hand them out: a page's size as asked, a
record as the transcript pages it (`GET /session/:id/transcript`) and as a load replays it
(`POST /session/:id/load`)."""

from __future__ import annotations

from typing import Any

import orjson

from .limits import TRANSCRIPT_DEFAULT_PAGE, TRANSCRIPT_MAX_PAGE
from .responses import ApiError, parse_decimal


def asked_page_size(value: Any, default: int = TRANSCRIPT_DEFAULT_PAGE) -> int:
    if value is None:
        return default
    if isinstance(value, str):
        value = parse_decimal(value, TRANSCRIPT_MAX_PAGE)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= TRANSCRIPT_MAX_PAGE:
        raise ApiError(400, f"page size must be an integer from 1 to {TRANSCRIPT_MAX_PAGE}", "invalid_limit")
    return value


def record(raw: str) -> dict[str, Any]:
    """A transcript record as the reference pages them: `{v, type, data}`."""
    envelope = orjson.loads(raw)
    return {"v": 1, "type": envelope["type"], "data": envelope["data"]}


def replayed(entry_id: str, raw: str) -> dict[str, Any]:
    """A transcript record as a load replays it: with its time, `_meta.serverTimestamp`
    (epoch ms, when the worker recorded it; a record kept without one takes its entry id's
    time, the same moment), which the reference's Web Shell shows as the message's time and
    measures a turn's length by. The reference stamps its replayed entries so too."""
    envelope = orjson.loads(raw)
    meta = envelope.get("_meta")
    stamp = meta.get("serverTimestamp") if isinstance(meta, dict) else None
    if not isinstance(stamp, int):
        stamp = int(entry_id.partition("-")[0])
    return {"v": 1, "type": envelope["type"], "data": envelope["data"], "_meta": {"serverTimestamp": stamp}}
