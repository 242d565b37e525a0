"""The bridge's loop protection, for agents that lack their own.

It watches one turn's tool calls and trips once, on the first of: N consecutive identical
tool calls (`consecutive_identical_tool_calls`) or more than M tool calls in the turn
(`turn_tool_call_cap`). A fresh guard is made for every turn.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

CONSECUTIVE_IDENTICAL = "consecutive_identical_tool_calls"
TURN_TOOL_CALL_CAP = "turn_tool_call_cap"
# Fields of a tool call's rawInput that name the call itself, not what it does (codex puts
# its call, turn and process ids and a start time there): two calls that differ only in
# these are the same call again.
PER_CALL_INPUT_KEYS = frozenset({"call_id", "turn_id", "process_id", "started_at_ms", "completed_at_ms"})

SKIPPED_TEXT = "Skipped because loop detection stopped the current turn before this tool could run."


@dataclass
class LoopLimits:
    """0 disables a limit. The defaults sit above Qwen Code's own thresholds (6 duplicates,
    100 calls), so an agent that detects loops itself always stops first."""

    identical: int = 10
    max_tool_calls: int = 150


@dataclass
class LoopGuard:
    limits: LoopLimits
    calls: int = 0
    streak: int = 0
    tripped: str | None = None
    _last: bytes | None = None
    _unfinished: dict[str, None] = field(default_factory=dict)

    def observe(self, update: dict[str, Any]) -> str | None:
        """Feed one ACP update; returns the loop type the first time the guard trips."""
        kind = update.get("sessionUpdate")
        call_id = update.get("toolCallId")
        status = update.get("status")
        if kind == "tool_call_update" and status in ("completed", "failed"):
            self._unfinished.pop(call_id, None)
            return None
        if kind != "tool_call":
            return None
        if status not in ("completed", "failed") and isinstance(call_id, str):
            self._unfinished[call_id] = None
        meta = update.get("_meta") if isinstance(update.get("_meta"), dict) else {}
        raw_input = update.get("rawInput")
        if isinstance(raw_input, dict):
            raw_input = {k: v for k, v in raw_input.items() if k not in PER_CALL_INPUT_KEYS}
        signature = orjson.dumps(
            [update.get("kind"), update.get("title"), meta.get("toolName"), raw_input],
            option=orjson.OPT_SORT_KEYS,
        )
        self.streak = self.streak + 1 if signature == self._last else 1
        self._last = signature
        self.calls += 1
        if self.tripped is not None:
            return None
        if self.limits.identical and self.streak >= self.limits.identical:
            self.tripped = CONSECUTIVE_IDENTICAL
        elif self.limits.max_tool_calls and self.calls > self.limits.max_tool_calls:
            self.tripped = TURN_TOOL_CALL_CAP
        return self.tripped

    def unfinished(self) -> list[str]:
        """Tool calls the agent started and never finished: they get a failed update."""
        return list(self._unfinished)


def skipped_update(call_id: str) -> dict[str, Any]:
    return {
        "sessionUpdate": "tool_call_update",
        "toolCallId": call_id,
        "status": "failed",
        "content": [{"type": "content", "content": {"type": "text", "text": SKIPPED_TEXT}}],
    }
