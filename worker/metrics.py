"""The worker's Prometheus metrics: live session states read at scrape time, plus counters."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from prometheus_client import Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from acp_state.interactions import USER_QUESTION

if TYPE_CHECKING:
    from .worker import Worker

TRANSITIONS = Counter("acp_state_transitions_total", "State transitions written to Redis")
EVENTS = Counter("acp_state_events_total", "Events appended and published", ["type"])
COMMANDS = Counter("acp_state_commands_total", "Commands taken from Redis", ["type"])
TURN_ERRORS = Counter("acp_state_turn_errors_total", "Prompts that ended with turn_error", ["error_kind"])
LEASE_RENEWALS = Counter("acp_state_lease_renewals_total", "Heartbeats that renewed the lease")
LEASES_LOST = Counter("acp_state_leases_lost_total", "Heartbeats that found the lease gone")
WRITES_DROPPED = Counter(
    "acp_state_transitions_dropped_total", "Transitions given up after the store refused them for too long"
)


class WorkerCollector(Collector):
    """Gauges computed from the worker's memory when scraped, never stored."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    def collect(self) -> Iterator[GaugeMetricFamily]:
        sessions = list(self.worker.sessions.values())
        by_state = GaugeMetricFamily("acp_state_sessions", "Live sessions by state", labels=["state"])
        for state, count in self.worker.state_counts.items():
            by_state.add_metric([state], count)
        yield by_state
        pending = GaugeMetricFamily("acp_state_pending_interactions", "Pending interactions by kind", labels=["kind"])
        kinds = {"permission": 0, USER_QUESTION: 0}
        for session in sessions:
            for kind in session.pending_kinds():
                kinds[kind] = kinds.get(kind, 0) + 1
        for kind, count in kinds.items():
            pending.add_metric([kind], count)
        yield pending
        yield GaugeMetricFamily("acp_state_agent_processes", "Running ACP agent children", value=len(self.worker.agents))
        yield GaugeMetricFamily(
            "acp_state_max_sessions", "Sessions this worker accepts", value=self.worker.config.max_sessions
        )
        # (Its moves are counted where they land: the target's acp_state_events_total{type="session_moved"}.)
        yield GaugeMetricFamily("acp_state_draining", "1 while this worker drains", value=int(getattr(self.worker, "draining", False)))  # (registered before it is set)
