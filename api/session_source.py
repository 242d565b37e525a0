"""A session's source (the reference's `session_source_metadata`): `sourceType` and
`sourceId` given on create, kept in the session's catalog row, listed, and filtered on
(`GET /workspace/:id/sessions?sourceType=&sourceId=`), checked as the reference checks
them (`packages/acp-bridge/src/session-source.ts`)."""

from __future__ import annotations

import re
from typing import Any

from .limits import MAX_SOURCE_ID
from .responses import ApiError

SOURCE_TYPE = re.compile(r"[a-z][a-z0-9_-]{0,63}")
# Reserved by the reference for sessions its daemon makes itself (standalone, Live Voice).
STANDALONE = "standalone"
LIVE_PREFIX = "realtime_voice:"


def parse(source_type: Any, source_id: Any) -> tuple[str | None, str | None]:
    """(sourceType, sourceId), or a 400 `invalid_session_source` with the reference's words."""
    if source_type is None and source_id is None:
        return None, None
    if not isinstance(source_type, str) or SOURCE_TYPE.fullmatch(source_type) is None:
        raise ApiError(400, "`sourceType` must match [a-z][a-z0-9_-]{0,63} when provided", "invalid_session_source")
    if source_id is None:
        return source_type, None
    if (not isinstance(source_id, str) or not source_id or len(source_id) > MAX_SOURCE_ID
            or any(ord(c) <= 31 or ord(c) == 127 for c in source_id)):
        raise ApiError(400, f"`sourceId` must be a non-empty string of at most {MAX_SOURCE_ID} characters "
                            "without control characters", "invalid_session_source")
    return source_type, source_id


def requested(body: dict[str, Any]) -> tuple[str | None, str | None]:
    """The source a create asks for; the reference's reserved sources answer 400
    `reserved_session_source`, as there."""
    if body.get("sourceType") == STANDALONE:
        raise ApiError(400, "The requested session source is reserved for daemon-owned standalone sessions.",
                       "reserved_session_source")
    source_type, source_id = parse(body.get("sourceType"), body.get("sourceId"))
    if source_type == "default" and source_id is not None and source_id.startswith(LIVE_PREFIX):
        raise ApiError(400, "The requested session source is reserved for daemon-owned Live Voice sessions.",
                       "reserved_session_source")
    return source_type, source_id


def echoed(source_type: str | None, source_id: str | None) -> dict[str, Any]:
    """What a create's answer adds, as the reference's: the source, and `sourcePersisted`
    (true: it is in the catalog row the worker wrote before it answered)."""
    if source_type is None:
        return {}
    return {"sourceType": source_type, **({"sourceId": source_id} if source_id is not None else {}),
            "sourcePersisted": True}


def matches(row: dict[str, Any], source_type: str, source_id: str | None) -> bool:
    """The reference's `matchesSessionMetadataSource`: the type (`default` also takes a
    session created without one), and the id exactly when one is asked for."""
    kept = row.get("sourceType")
    type_matches = kept == source_type or (source_type == "default" and kept in (None, "qwen-live"))
    return type_matches and (source_id is None or row.get("sourceId") == source_id)
