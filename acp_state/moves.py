"""What passes between workers when a session is resumed elsewhere: placement and the carry.

A session is resumed on another worker in two ways, both through ACP `session/load`: an API
process loads a persisted session that is not live (its worker died or left), or a draining
worker moves each of its sessions to another (`worker/move.py`). Either way the new owner
must be a live worker that is not draining, offers the session's agent, and reads the
agent-state store the session's history lives in (`acp_state.placement`); and it goes on
from the state carried in the `create` command (`Carry`), not from scratch.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from . import commands


def default_state_store(state_dir: str) -> str:
    """A worker's agent-state store when none is declared: its host and the directory its
    agents keep their history in. Workers on one host with one directory share it; workers
    on several hosts that mount one volume declare one name (`--state-store`)."""
    return f"{socket.gethostname()}:{Path(state_dir).expanduser().resolve()}"


@dataclass
class Carry:
    """The session state a resumed session goes on from. A load carries the catalog row's
    times and title; a move also the attached clients, the prompts admitted and not yet
    started (in order, as `Prompt` commands) and the turn error, which are runtime state
    that a move, unlike a worker's death, does not lose."""

    created_at: str
    updated_at: str
    display_name: str | None = None
    clients: list[str] = field(default_factory=list)
    prompts: list[commands.Prompt] = field(default_factory=list)
    turn_error: dict[str, Any] | None = None
    turn_error_event: bool = False
    # The agent was sent a prompt of the session: it has a history to load. A session that
    # never had one moves as a new agent session (an agent keeps nothing of it to load).
    history: bool = True

    def pack(self) -> dict[str, Any]:
        packed: dict[str, Any] = {"createdAt": self.created_at, "updatedAt": self.updated_at}
        if self.display_name:
            packed["displayName"] = self.display_name
        if self.clients:
            packed["clients"] = self.clients
        if self.prompts:
            packed["prompts"] = [orjson.loads(commands.encode(prompt)) for prompt in self.prompts]
        if self.turn_error is not None:
            packed["turnError"] = self.turn_error
            packed["turnErrorEvent"] = self.turn_error_event
        if not self.history:
            packed["history"] = False
        return packed

    @classmethod
    def unpack(cls, packed: dict[str, Any]) -> Carry:
        """Raises ValueError (a `MalformedCommand`) on a carry this module did not pack."""
        prompts = [commands.decode(orjson.dumps(wire)) for wire in packed.get("prompts", [])]
        if not all(isinstance(prompt, commands.Prompt) for prompt in prompts):
            raise commands.MalformedCommand("a carried prompt is not a prompt command", commands.Create.TYPE)
        try:
            return cls(
                created_at=str(packed["createdAt"]),
                updated_at=str(packed.get("updatedAt") or packed["createdAt"]),
                display_name=packed.get("displayName"),
                clients=[str(client) for client in packed.get("clients", [])],
                prompts=prompts,  # type: ignore[arg-type]
                turn_error=packed.get("turnError"),
                turn_error_event=bool(packed.get("turnErrorEvent")),
                history=packed.get("history", True) is not False,
            )
        except (KeyError, TypeError) as error:
            raise commands.MalformedCommand(f"create command has a malformed carry ({error})", commands.Create.TYPE) from None

    @classmethod
    def of_row(cls, created_at: str, updated_at: str | None, display_name: str | None) -> Carry:
        """What a load of a persisted session carries: its catalog row's times and title.
        A row with neither a title nor a turn that ended was never prompted: nothing to load."""
        updated = updated_at or created_at
        history = bool(display_name) or updated != created_at
        return cls(created_at, updated, display_name, history=history)
