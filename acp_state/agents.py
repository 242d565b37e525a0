"""Agent names: which ACP agent a worker offers under which name, and how `--agent` says so.

A worker offers one or more agents. `--agent NAME=COMMAND` (repeatable) offers COMMAND
under NAME; a bare `--agent COMMAND` is the default agent, named `default`. A create names
the agent it wants (`agent`), or takes its worker's default.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

DEFAULT_AGENT = "default"
# Short, and safe in a JSON report, a log line and a URL alike.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_NAMED = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]{0,63})=(.*)", re.DOTALL)


def is_agent_name(value: object) -> bool:
    """1-64 characters of `[A-Za-z0-9._-]`, starting with a letter or digit."""
    return isinstance(value, str) and _NAME.fullmatch(value) is not None


@dataclass(frozen=True)
class AgentSpec:
    """One agent a worker offers: its name and the command that starts it."""

    name: str
    command: str


def parse_agent_option(value: str) -> AgentSpec:
    """`NAME=COMMAND` or a bare `COMMAND` (the default agent). Raises ValueError."""
    named = _NAMED.fullmatch(value)
    name, command = (named.group(1), named.group(2)) if named else (DEFAULT_AGENT, value)
    if not command.strip():
        raise ValueError(f"--agent {value!r}: the command is empty")
    return AgentSpec(name, command)


def offered_agents(options: list[str], fallback: str) -> dict[str, str]:
    """The agents a worker offers (name -> command), in the order given; `fallback` is the
    default agent when no `--agent` is given. Raises ValueError on a name given twice."""
    if not options:
        return {DEFAULT_AGENT: fallback}
    agents: dict[str, str] = {}
    for option in options:
        spec = parse_agent_option(option)
        if spec.name in agents:
            raise ValueError(f"--agent: the name {spec.name!r} is given twice")
        agents[spec.name] = spec.command
    return agents


def offers(report: dict[str, Any], agent: str) -> bool:
    """Whether a worker's load report offers agent `agent` (a report without names, from a
    worker older than agent names, offers its one agent as the default)."""
    return agent in (report.get("agentNames") or [DEFAULT_AGENT])


def session_modes(options: list[str], agents: dict[str, str]) -> dict[str, str]:
    """`--session-mode [NAME=]MODE` (repeatable) as agent name -> ACP session mode to set
    after `session/new`. `NAME=MODE` is one agent's; a bare MODE every other agent's (Qwen
    needs `default`, codex has no such mode: one worker may offer both). Raises ValueError
    for a NAME the worker does not offer."""
    every: str | None = None
    modes: dict[str, str] = {}
    for option in options:
        named = _NAMED.fullmatch(option)
        if named is None:
            every = option
        elif named.group(1) not in agents:
            raise ValueError(f"--session-mode {option!r}: no agent is named {named.group(1)!r}")
        else:
            modes[named.group(1)] = named.group(2)
    if every is not None:
        modes = {**dict.fromkeys(agents, every), **modes}
    return {name: mode for name, mode in modes.items() if mode}
