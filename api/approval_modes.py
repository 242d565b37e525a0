"""The reference's approval mode names, as a create's `approvalMode` and `POST
/session/:id/approval-mode` (`routes/approval_mode.py`) check them."""

from __future__ import annotations

from typing import Any

from .responses import ApiError

APPROVAL_MODES = ["plan", "default", "auto-edit", "auto", "yolo"]  # the reference's names


def invalid_mode(allowed: list[str]) -> ApiError:
    return ApiError(400, "`mode` is required and must be one of the allowed values", "invalid_approval_mode",
                    allowed=allowed)


def on_create(body: dict[str, Any]) -> str | None:
    """A create's `approvalMode`, checked as the reference does (a mode the agent does not
    offer leaves the session in the worker's --session-mode or the agent's default)."""
    mode = body.get("approvalMode")
    if mode is not None and (not isinstance(mode, str) or mode not in APPROVAL_MODES):
        raise ApiError(400, "`approvalMode` must be a known approval mode when provided", "invalid_approval_mode",
                       allowed=APPROVAL_MODES)
    return mode
