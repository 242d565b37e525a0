"""What a bridge worker is told at start (`acp-state worker` and `acp-state dev` fill it in)."""

from __future__ import annotations

from dataclasses import dataclass, field

from acp_state.agents import DEFAULT_AGENT

from .loop_guard import LoopLimits


@dataclass
class WorkerConfig:
    # The agents on offer, name -> ACP agent command, the default first (`acp-state`
    # offers the scripted test double as `default` when given no --agent).
    agents: dict[str, str]
    max_sessions: int = 1000
    lease_ms: int = 10_000
    child_per: str = "workspace"  # or "session"
    session_modes: dict[str, str] = field(default_factory=dict)  # agent name -> mode after session/new
    agent_stderr: str | None = None
    name: str | None = None
    loop_limits: LoopLimits = field(default_factory=LoopLimits)
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    # The agent-state store its agents keep their history in (acp_state.moves): a session
    # is resumed only on a worker that reads the same one.
    state_store: str = ""
    state_dir: str | None = None  # the agents' HOME, where they keep their history; None: ours
    # How long a drain (SIGTERM, `acp-state drain`) lets running turns finish before its
    # sessions move; 0: a stop closes the sessions at once, as before drains.
    drain_grace_s: float = 30.0
    # How a session that moves here is taken: `eager`, owned at once and its agent's session
    # brought up after (worker/bring_up.py); `paced`, its agent loads it first and the
    # session is taken over then (the client's stream waits for the load).
    handoff: str = "eager"

    @property
    def default_agent(self) -> str:
        """The agent a create that names none gets: `default` if offered, else the first."""
        return DEFAULT_AGENT if DEFAULT_AGENT in self.agents else next(iter(self.agents))
