"""Wall-clock helpers: the ISO strings of the wire and the millisecond stamps of Redis."""

from __future__ import annotations

import time
from datetime import datetime, timezone


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def iso(ms: int | None = None) -> str:
    """An ISO-8601 UTC string with milliseconds and a `Z`, as the reference writes them."""
    if ms is None:
        ms = now_ms()
    dt = datetime.fromtimestamp(ms / 1000, tz=timezone.utc)
    return dt.strftime("%Y-%m-%dT%H:%M:%S.") + f"{ms % 1000:03d}Z"
