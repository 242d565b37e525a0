"""Prometheus metrics of the shared core (the store's round trips, the sweeper).

Each process exposes them on its own `/metrics` next to the metrics of its side.
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

REDIS_ROUNDTRIP = Histogram(
    "acp_state_redis_roundtrip_seconds",
    "One Redis round trip, by operation",
    ["op"],
    buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0),
)
SWEEPS = Counter("acp_state_sweeps_total", "Dead worker incarnations this process swept")
SWEPT_SESSIONS = Counter("acp_state_swept_sessions_total", "Sessions of dead workers this process removed")
