"""Prometheus metrics of the shared core (the store's round trips, the sweeper).

Each process exposes them on its own `/metrics` next to the metrics of its side.
"""

from __future__ import annotations

from typing import Iterator

from prometheus_client import REGISTRY, Counter, Histogram

from .clock import now_ms
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector


class Tally(Collector):
    """A counter of the hottest paths (every read an API process answers), by label values:
    plain ints, read when scraped. prometheus_client's Counter takes a lock and three calls
    an increment, which cost a kept status read as much as its cache lookup. Bumped only
    from the process's event loop; a scrape copies the counts first."""

    def __init__(self, name: str, documentation: str, labelnames: tuple[str, ...] = ()) -> None:
        self.name = name.removesuffix("_total")
        self.documentation = documentation
        self.labelnames = labelnames
        self.counts: dict[tuple[object, ...], int] = {}
        REGISTRY.register(self)

    def inc(self, *labels: object) -> None:
        """One more for these label values (str() of each is the label)."""
        self.counts[labels] = self.counts.get(labels, 0) + 1

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        counts = list(self.counts.items()) or ([] if self.labelnames else [((), 0)])  # as Counter: 0 from the start
        for labels, count in counts:
            family.add_metric([str(value) for value in labels], count)
        yield family


REDIS_ROUNDTRIP = Histogram(
    "acp_state_redis_roundtrip_seconds",
    "One Redis round trip, by operation",
    ["op"],
    buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0),
)
SWEEPS = Counter("acp_state_sweeps_total", "Dead worker incarnations this process swept")
SWEPT_SESSIONS = Counter("acp_state_swept_sessions_total", "Sessions of dead workers this process removed")
FANOUT_LAG = Histogram(
    "acp_state_fanout_lag_seconds",
    "From an event's making on its worker (its _meta.serverTimestamp) to its arrival in this "
    "process's fan-out, once per event whatever the streams; across hosts their clock skew adds in",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
)


def observe_fanout_lag(envelope: dict) -> None:
    """One event arrived in the fan-out: how long after its worker made it."""
    meta = envelope.get("_meta")
    sent_ms = meta.get("serverTimestamp") if isinstance(meta, dict) else None
    if isinstance(sent_ms, int):
        FANOUT_LAG.observe(max(0, now_ms() - sent_ms) / 1000)
