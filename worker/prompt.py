"""One prompt admitted on a worker: the command that brought it and its turn's state here."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from acp_state import commands, tracing
from acp_state.commands import CRON, FOREGROUND, NOTIFICATION
from acp_state.clock import now_ms
from acp_state.turns import TEXT_MAX_CHARS, TurnRecord

# Automatic turns wait in their own queues and run before the next queued foreground prompt.
AUTOMATIC_KINDS = (CRON, NOTIFICATION)
# Only an interactive user prompt is rejected by loop protection and clears a turn error.
INTERACTIVE_KINDS = (FOREGROUND,)

@dataclass
class Prompt:
    """One admitted prompt here: the command that brought it, as the API sent it (carried as
    is when the session moves), and its turn's state. `ended` is the terminal latch (exactly
    one terminal event)."""

    command: commands.Prompt
    queued: bool = False  # waited behind another prompt (gets pending_prompt_started)
    started: bool = False
    sent: bool = False  # session/prompt went to the agent
    cancel_requested: bool = False
    ended: bool = False
    result: list[str] = field(default_factory=list)  # the agent's message text of this turn
    result_chars: int = 0
    turn: TurnRecord = field(init=False)
    # Its trace (acp_state.tracing), when on: what its turn starts under, and the turn's span.
    trace_parent: Any = field(default=None, repr=False)
    trace_turn: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.turn = TurnRecord.queued(self.prompt_id, self.text, self.queued_at, self.client_id)

    @classmethod
    def of(cls, command: commands.Prompt) -> Prompt:
        """The prompt a command admitted (read from an inbox, parked, or carried). One sent
        without its admission time (`queuedAt` 0: not by an API) is stamped on arrival."""
        if not command.queued_at:
            command = dataclasses.replace(command, queued_at=now_ms())
        return cls(command, trace_parent=tracing.parent_of(command.trace))

    @property
    def prompt_id(self) -> str:
        return self.command.prompt_id

    @property
    def blocks(self) -> list[dict[str, Any]]:
        return self.command.blocks

    @property
    def text(self) -> str:
        return self.command.text

    @property
    def meta(self) -> dict[str, Any] | None:
        return self.command.meta

    @property
    def client_id(self) -> str | None:
        return self.command.client_id

    @property
    def kind(self) -> str:
        return self.command.kind

    @property
    def queued_at(self) -> int:
        return self.command.queued_at

    def add_result(self, text: str) -> None:
        """Keep the agent's text up to just past what a turn record holds."""
        if text and self.result_chars <= TEXT_MAX_CHARS:
            self.result.append(text)
            self.result_chars += len(text)

    def result_text(self) -> str:
        return "".join(self.result)
