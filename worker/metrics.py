"""The worker's Prometheus metrics: live session states read at scrape time, plus counters."""

from __future__ import annotations

from typing import Iterator, Mapping, Protocol, Sized

from prometheus_client import Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from acp_state.interactions import USER_QUESTION

TRANSITIONS = Counter("acp_state_transitions_total", "State transitions written to Redis")
EVENTS = Counter("acp_state_events_total", "Events appended and published", ["type"])
COMMANDS = Counter("acp_state_commands_total", "Commands taken from Redis", ["type"])
TURN_ERRORS = Counter("acp_state_turn_errors_total", "Prompts that ended with turn_error", ["error_kind"])
LEASE_RENEWALS = Counter("acp_state_lease_renewals_total", "Heartbeats that renewed the lease")
LEASES_LOST = Counter("acp_state_leases_lost_total", "Heartbeats that found the lease gone")
WRITES_DROPPED = Counter(
    "acp_state_transitions_dropped_total", "Transitions given up after the store refused them for too long"
)


class Counted(Protocol):
    """What the gauges read of a live session (worker/session.py)."""

    def pending_kinds(self) -> list[str]: ...


class WorkerCollector(Collector):
    """Gauges computed from the worker's memory when scraped, never stored: given its live
    sessions, their counts by state, its running agent children and its capacity."""

    def __init__(
        self, *, sessions: Mapping[str, Counted], state_counts: Mapping[str, int], agents: Sized, max_sessions: int
    ) -> None:
        self.sessions = sessions
        self.state_counts = state_counts
        self.agents = agents
        self.max_sessions = max_sessions

    def collect(self) -> Iterator[GaugeMetricFamily]:
        sessions = list(self.sessions.values())
        by_state = GaugeMetricFamily("acp_state_sessions", "Live sessions by state", labels=["state"])
        for state, count in self.state_counts.items():
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
        yield GaugeMetricFamily("acp_state_agent_processes", "Running ACP agent children", value=len(self.agents))
        yield GaugeMetricFamily("acp_state_max_sessions", "Sessions this worker accepts", value=self.max_sessions)
