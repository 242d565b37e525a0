"""Event envelopes, as the reference frames them: `{id, v, type, promptId?, data, _meta}`.

The `id` is allotted inside Redis by the transition script (one counter per session), so a
worker builds the envelope without it: `body()` returns the JSON members after `"id":N,`.
"""

from __future__ import annotations

from typing import Any

import orjson

from .clock import now_ms

# Session updates that are not turn content: they never supersede a stored turn error.
BOOKKEEPING_UPDATES = frozenset({"available_commands_update", "current_mode_update", "session_info_update"})


def body(
    event_type: str,
    data: Any,
    prompt_id: str | None = None,
    originator_client_id: str | None = None,
) -> str:
    """The envelope minus its id, as the members of a JSON object without the braces."""
    envelope: dict[str, Any] = {"v": 1, "type": event_type}
    if prompt_id is not None:
        envelope["promptId"] = prompt_id
    envelope["data"] = data
    if originator_client_id is not None:
        envelope["originatorClientId"] = originator_client_id
    envelope["_meta"] = {"serverTimestamp": now_ms()}
    return orjson.dumps(envelope)[1:-1].decode()


def in_transcript(envelope_body: str) -> bool:
    """Whether an envelope body (from `body()`) belongs in the durable transcript.

    Transcript records are session updates only (the user's prompt is recorded as
    `user_message_chunk` updates, as agents replay it); terminals and bookkeeping are not,
    so a reload can append the stored `turn_error` itself.
    """
    return event_type(envelope_body) == "session_update"


def is_turn_content(update: dict[str, Any]) -> bool:
    """An ACP update that counts as newer turn content (spec §2.2)."""
    if update.get("sessionUpdate") in BOOKKEEPING_UPDATES:
        return False
    meta = update.get("_meta")
    return not (isinstance(meta, dict) and meta.get("source") == "user-shell")


def event_type(envelope_body: str) -> str:
    """The `type` of an envelope body from `body()` (it always follows `"v":1,"type":"`)."""
    start = len('"v":1,"type":"')
    return envelope_body[start : envelope_body.index('"', start)]


def message_text(update: dict[str, Any]) -> str:
    """The text an `agent_message_chunk` update adds to the turn's result ('' for others)."""
    content = update.get("content")
    if update.get("sessionUpdate") != "agent_message_chunk" or not isinstance(content, dict):
        return ""
    text = content.get("text")
    return text if content.get("type") == "text" and isinstance(text, str) else ""
