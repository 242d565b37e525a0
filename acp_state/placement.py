"""Where a session may go: which live workers take it, and in which order to ask them.

One rule for every placement: an API's create and its load of a persisted session
(`api/placement.py`), and a draining worker's move of each of its sessions
(`worker/move.py`). A worker takes a session if it is not draining, offers the session's
agent and, for a resume, reads the agent-state store its history is in (`accepts`); those
that do are asked least loaded first (`ranked`). The reports read here are the ones workers
store with their leases (`acp_state.store.WorkerReport`); this module names only what it
reads of them (`LoadReport`), since the core never imports the store.

A worker whose agent child for the session's agent and workspace already runs (its report's
`children`, or one a drain told to start it: `commands.Warm`) is asked first among those
whose load is within WARM_PREFERENCE of it: the session then waits for no cold start of the
agent, and a worker that started cold still gets its share once the others are that much
fuller.
"""

from __future__ import annotations

import hashlib
import random
from typing import Callable, Iterable, Mapping, Protocol, Sequence, TypeVar

from .agents import DEFAULT_AGENT


class LoadReport(Protocol):
    """What placement reads of a worker's load report (`acp_state.store.WorkerReport`)."""

    @property
    def incarnation(self) -> str: ...
    @property
    def sessions(self) -> int: ...
    @property
    def max_sessions(self) -> int: ...
    @property
    def agent_names(self) -> Sequence[str]: ...
    @property
    def state_store(self) -> str | None: ...
    @property
    def draining(self) -> bool: ...
    @property
    def children(self) -> Sequence[str]: ...


Report = TypeVar("Report", bound=LoadReport)

# A report names at most this many running children: it stays small on a worker of many
# workspaces (those past it are only not preferred).
CHILDREN_REPORTED = 32
# How much fuller (of its capacity) a worker running the session's agent child may be and
# still be asked before one that would start it cold (1,000 sessions: 20 more).
WARM_PREFERENCE = 0.02


def child_key(agent: str, cwd: str) -> str:
    """A running child as a report names it: the agent, and a short digest of the workspace
    (a path may be long; 12 hex digits tell a worker's workspaces apart)."""
    return f"{agent}:{hashlib.blake2b(cwd.encode(), digest_size=6).hexdigest()}"


def runs_child(report: LoadReport, agent: str, cwd: str) -> bool:
    """Whether the worker's child for `agent` in workspace `cwd` runs (per its report)."""
    return child_key(agent, cwd) in (report.children or ())


def offers(report: LoadReport, agent: str) -> bool:
    """Whether a worker offers agent `agent` (a report without names, from a worker older
    than agent names, offers its one agent as the default)."""
    return agent in (report.agent_names or [DEFAULT_AGENT])


def accepts(report: LoadReport, agent: str | None, state_store: str | None = None) -> bool:
    """Whether a live worker takes a new session of `agent` (None: its default agent): it
    is not draining, offers the agent, and (for a resume) reads the session's agent-state
    store."""
    if report.draining or (agent is not None and not offers(report, agent)):
        return False
    return state_store is None or report.state_store == state_store


def load(report: LoadReport, more: int = 0) -> float:
    """How full a worker is: its sessions (and `more` sent to it since its report) over its
    capacity (a report without one counts as a capacity of 1)."""
    return (report.sessions + more) / max(report.max_sessions, 1)


def ranked(
    reports: Iterable[Report], sent: Mapping[str, int] | None = None, warm: Callable[[Report], bool] | None = None
) -> list[Report]:
    """The workers to ask, least loaded first, counting the sessions `sent` to each since
    its report (by incarnation); those `warm` says run the session's agent child count as
    WARM_PREFERENCE less full while they have room. Equal loads come in random order: creates from many processes
    spread instead of piling onto one worker. Reports are as old as the last heartbeat, so
    a worker that looks full is still asked, last: the worker itself is the judge of its
    capacity."""
    order = list(reports)
    random.shuffle(order)

    def key(report: Report) -> float:
        full = load(report, sent.get(report.incarnation, 0) if sent else 0)
        return full - WARM_PREFERENCE if warm is not None and full < 1 and warm(report) else full

    order.sort(key=key)
    return order
