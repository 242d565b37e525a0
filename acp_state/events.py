"""Event envelopes, as the reference frames them: `{id, v, type, promptId?, data, _meta}`.

The `id` is allotted inside Redis by the transition script (one counter per session), so a
worker builds the envelope without it: `body()` returns the JSON members after `"id":N,`.
"""

from __future__ import annotations

from typing import Any

import orjson

from .clock import now_ms


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
