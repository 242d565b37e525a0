"""Agent names: which ACP agent a worker offers under which name, and how `--agent` says so.

A worker offers one or more agents. `--agent NAME=COMMAND` (repeatable) offers COMMAND
under NAME; a bare `--agent COMMAND` is the default agent, named `default`. A create names
the agent it wants (`agent`), or takes its worker's default.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

DEFAULT_AGENT = "default"
# Telemetry and update checks off, for every preset (each agent honours some of these).
_QUIET = "env DO_NOT_TRACK=1 DISABLE_TELEMETRY=1 NO_UPDATE_NOTIFIER=1"


@dataclass(frozen=True)
class Preset:
    """A known agent's ACP command line (its executable on PATH, as a global npm install
    leaves it) and the session mode it needs, if any. See docs/agents.md."""

    command: str
    session_mode: str | None = None


# `--agent-preset NAME`: the launch lines of docs/agents.md, less the endpoint and key, which
# are the operator's (in the worker's environment, or `env` in an `--agent` line).
PRESETS: dict[str, Preset] = {
    # QWEN_CODE_NO_RELAUNCH: as the reference spawns its ACP children. Without it qwen starts a
    # second node process (more heap) and hands its stdio over: two startups per agent.
    "qwen": Preset(f"{_QUIET} QWEN_CODE_NO_RELAUNCH=true qwen --acp", session_mode="default"),
    "gemini": Preset(f"{_QUIET} GEMINI_TELEMETRY_ENABLED=false gemini --acp"),
    "codex": Preset(f"{_QUIET} codex-acp"),
    "claude": Preset(f"{_QUIET} CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 DISABLE_AUTOUPDATER=1 "
                     "DISABLE_ERROR_REPORTING=1 claude-agent-acp"),
    "opencode": Preset(f"{_QUIET} OPENCODE_DISABLE_AUTOUPDATE=1 opencode acp"),
    "copilot": Preset(f"{_QUIET} copilot --acp"),
    "cline": Preset(f"{_QUIET} cline --acp"),
}
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


def with_presets(agents: list[str], presets: list[str], modes: list[str]) -> tuple[list[str], list[str]]:
    """`--agent-preset NAME` as the `--agent NAME=COMMAND` and `--session-mode NAME=MODE` it
    stands for (a mode given for NAME wins). Raises ValueError for an unknown preset."""
    agents, modes = list(agents), list(modes)
    for name in presets:
        preset = PRESETS.get(name)
        if preset is None:
            raise ValueError(f"--agent-preset {name!r}: known presets are {', '.join(PRESETS)}")
        agents.append(f"{name}={preset.command}")
        if preset.session_mode and not any(m.startswith(f"{name}=") for m in modes):
            modes.append(f"{name}={preset.session_mode}")
    return agents, modes
