"""The states of a live session, as a dashboard sorts them (most urgent first), and which one
a live summary is in. Workers count their sessions by these in their reports (`acp-state
status` sums them); the API's summaries themselves are `acp_state.api.reads.summaries`."""

from __future__ import annotations

from typing import Any


# The one state a dashboard sorts live sessions by, most urgent first.
SESSION_STATES = ("waiting_permission", "waiting_question", "running", "failed", "idle")


def state_of(summary: dict[str, Any]) -> str:
    """A live summary's state in SESSION_STATES, from the status route's own fields."""
    if summary["isWaitingForPermission"]:
        return "waiting_permission"
    if summary["isWaitingForUserQuestion"]:
        return "waiting_question"
    if summary["hasActivePrompt"]:
        return "running"
    return "failed" if summary["hasTurnError"] else "idle"
