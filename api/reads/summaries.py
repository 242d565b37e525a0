"""Session summaries: the live status object and the persisted listing row (spec §1.2, §1.3),
each made from the store's view of a session (`SessionView`) or its catalog row; and a kept
session's status answer, made once (`status_answer`)."""

from __future__ import annotations

from typing import Any

import orjson

from acp_state.interactions import USER_QUESTION
from acp_state.store import SessionView

from .cache import CachedSession
from .etag import weak_etag


def turn_ended(view: SessionView) -> bool:
    """A turn of the session reached its terminal (`updatedAt` moved past `createdAt`):
    the reference reports `updatedAt` and `hasRunningBackgroundTasks` only from then on."""
    return view.updated_at != view.meta["createdAt"]


def live_summary(view: SessionView) -> dict[str, Any]:
    """Assemble `GET /session/:id/status` from a live session's view. (`displayName` is the
    listing's: the reference's status never carries it.)"""
    meta, pending = view.meta, view.pending
    ended = turn_ended(view)
    summary: dict[str, Any] = {
        "sessionId": meta["sessionId"],
        "workspaceCwd": meta["workspaceCwd"],
        "createdAt": meta["createdAt"],
    }
    if ended:
        summary["updatedAt"] = view.updated_at
    summary.update(
        clientCount=view.client_count,
        hasActivePrompt=view.active,
        activeWorkState="active" if view.active else "idle",
    )
    if ended:
        summary["hasRunningBackgroundTasks"] = False
    summary.update(
        isWaitingForPermission=any(p["kind"] != USER_QUESTION for p in pending),
        isWaitingForUserQuestion=any(p["kind"] == USER_QUESTION for p in pending),
        pendingInteractionCount=len(pending),
        hasTurnError=view.turn_error is not None,
    )
    if view.turn_error is not None:
        summary["turnError"] = view.turn_error
    summary["pendingInteractions"] = pending
    if view.moving:  # acp-state's own: a drain is handing it to another worker
        summary["moving"] = True
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
    }
    if turn_ended(view):
        row["hasRunningBackgroundTasks"] = False
    row["isWaitingForPermission"] = any(p["kind"] != USER_QUESTION for p in pending)
    row["isWaitingForUserQuestion"] = any(p["kind"] == USER_QUESTION for p in pending)
    if turn_ended(view):
        row["updatedAt"] = view.updated_at
    if view.moving:
        row["moving"] = True
    return row


def source_of(row: dict[str, Any]) -> dict[str, Any]:
    """The session's source as the reference lists it (`sourceType`, `sourceId`), from its row."""
    source = {"sourceType": row["sourceType"]} if row.get("sourceType") else {}
    if source and isinstance(row.get("sourceId"), str):
        source["sourceId"] = row["sourceId"]
    return source


def persisted_row(row: dict[str, Any]) -> dict[str, Any]:
    """A catalog row as the reference lists a non-live session: no runtime fields, never idle."""
    listed: dict[str, Any] = {
        "sessionId": row["sessionId"],
        "workspaceCwd": row["workspaceCwd"],
        "createdAt": row["createdAt"],
        "updatedAt": row.get("updatedAt", row["createdAt"]),
    }
    # The reference lists its chat file's first prompt: "" for a session never prompted.
    listed["displayName"] = row.get("displayName") or ""
    listed.update(source_of(row))
    listed.update(clientCount=0, hasActivePrompt=False, isArchived=False)
    if isinstance(row.get("resumable"), bool):  # acp-state's own: whether a load can resume it
        listed["resumable"] = row["resumable"]
    return listed


def merged_row(row: dict[str, Any], live: dict[str, Any], meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """The persisted row overlaid with the live summary (`mergeLiveSessionSummary`): the
    row's `createdAt`; the later `updatedAt`, or the row's alone once a prompt was recorded
    (the row has its title: the reference lists the persisted `updatedAt` before its status
    has one); and the live session's `displayName` (its meta's), else the row's."""
    merged: dict[str, Any] = {}
    display_name = (meta or {}).get("displayName") or row.get("displayName")
    for key, value in live.items():
        if key == "createdAt":
            merged[key] = row.get("createdAt", value)
            if "updatedAt" not in live and row.get("displayName") and row.get("updatedAt"):
                merged["updatedAt"] = row["updatedAt"]
            continue
        if key == "updatedAt":
            value = max(row.get("updatedAt", ""), value)
        elif key == "clientCount":
            if display_name:
                merged["displayName"] = display_name
            merged.update(source_of(row))
        merged[key] = value
        if key == "hasActivePrompt":
            merged["isArchived"] = False  # the reference's key order
    return merged


def status_answer(ref: CachedSession) -> tuple[bytes, str]:
    """The status answer of a kept session and its ETag, made on its first read: a poller's
    reads hash nothing again, as a listing page's do not."""
    if ref.status_body is None:
        summary = live_summary(ref.view)
        if ref.view.approval_mode is not None:  # the agent's session mode (api/approval_mode.py)
            summary["approvalMode"] = ref.view.approval_mode
        ref.status_body = orjson.dumps(summary)
        ref.status_etag = weak_etag(ref.status_body)
    return ref.status_body, ref.status_etag
