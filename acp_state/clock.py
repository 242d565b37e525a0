"""Wall-clock helpers: the ISO strings of the wire and the millisecond stamps of Redis."""

from __future__ import annotations

import time


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def iso(ms: int | None = None) -> str:
    """An ISO-8601 UTC string with milliseconds and a `Z`, as the reference writes them."""
    if ms is None:
        ms = now_ms()
    t = time.gmtime(ms // 1000)  # whole seconds: no float rounding, and a third of strftime's cost
    return (f"{t.tm_year:04d}-{t.tm_mon:02d}-{t.tm_mday:02d}T"
            f"{t.tm_hour:02d}:{t.tm_min:02d}:{t.tm_sec:02d}.{ms % 1000:03d}Z")


def from_iso(value: str) -> int:
    """Epoch ms of an ISO-8601 string as `iso` writes it (any offset is read, `Z` too)."""
    from datetime import datetime

    return int(datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp() * 1000)
