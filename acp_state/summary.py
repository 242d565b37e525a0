"""Session summaries: the live status object and the persisted listing row (spec §1.2, §1.3)."""

from __future__ import annotations

from typing import Any

from .interactions import USER_QUESTION
from .store import SessionView


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


def live_summary(view: SessionView) -> dict[str, Any]:
    """Assemble `GET /session/:id/status` from a live session's view."""
    meta, pending = view.meta, view.pending
    summary: dict[str, Any] = {
        "sessionId": meta["sessionId"],
        "workspaceCwd": meta["workspaceCwd"],
        "createdAt": meta["createdAt"],
        "updatedAt": view.updated_at,
    }
    if meta.get("displayName"):
        summary["displayName"] = meta["displayName"]
    summary.update(
        clientCount=view.client_count,
        hasActivePrompt=view.active,
        activeWorkState="active" if view.active else "idle",
        hasRunningBackgroundTasks=False,
        isWaitingForPermission=any(p["kind"] != USER_QUESTION for p in pending),
        isWaitingForUserQuestion=any(p["kind"] == USER_QUESTION for p in pending),
        pendingInteractionCount=len(pending),
        hasTurnError=view.turn_error is not None,
    )
    if view.turn_error is not None:
        summary["turnError"] = view.turn_error
    summary["pendingInteractions"] = pending
    return summary


def live_state_row(view: SessionView) -> dict[str, Any]:
    """One session of `GET /workspaces/:workspace/sessions/live-state`: the status's runtime
    flags only; `updatedAt` once a turn of it ended (the reference's activity watermark)."""
    pending = view.pending
    row: dict[str, Any] = {
        "sessionId": view.meta["sessionId"],
        "clientCount": view.client_count,
        "hasActivePrompt": view.active,
        "activeWorkState": "active" if view.active else "idle",
        "hasRunningBackgroundTasks": False,
        "isWaitingForPermission": any(p["kind"] != USER_QUESTION for p in pending),
        "isWaitingForUserQuestion": any(p["kind"] == USER_QUESTION for p in pending),
    }
    if view.updated_at != view.meta["createdAt"]:
        row["updatedAt"] = view.updated_at
    return row


def persisted_row(row: dict[str, Any]) -> dict[str, Any]:
    """A catalog row as the reference lists a non-live session: no runtime fields, never idle."""
    listed: dict[str, Any] = {
        "sessionId": row["sessionId"],
        "workspaceCwd": row["workspaceCwd"],
        "createdAt": row["createdAt"],
        "updatedAt": row.get("updatedAt", row["createdAt"]),
    }
    if row.get("displayName"):
        listed["displayName"] = row["displayName"]
    listed.update(clientCount=0, hasActivePrompt=False, isArchived=False)
    return listed


def merged_row(row: dict[str, Any], live: dict[str, Any]) -> dict[str, Any]:
    """The persisted row overlaid with the live summary (`mergeLiveSessionSummary`)."""
    merged: dict[str, Any] = {}
    for key, value in live.items():
        if key == "createdAt":
            value = row.get("createdAt", value)
        elif key == "updatedAt":
            value = max(row.get("updatedAt", ""), value)
        merged[key] = value
        if key == "updatedAt" and not live.get("displayName") and row.get("displayName"):
            merged["displayName"] = row["displayName"]
        elif key == "hasActivePrompt":
            merged["isArchived"] = False  # the reference's key order
    return merged
