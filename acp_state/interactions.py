"""Pending interactions: the render-ready form of an ACP `session/request_permission`.

Mirrors the reference bridge (spec §4): an interaction is a question iff the tool call's
`_meta.qwenInteractionKind` is exactly `"user_question"`; everything else is a permission.
"""

from __future__ import annotations

from typing import Any

from .commands import CANCEL_SENTINEL

USER_QUESTION = "user_question"
PERMISSION = "permission"
MAX_PENDING_PER_SESSION = 64


class CancelSentinelCollision(Exception):
    """The agent offered an option whose id is the cancel sentinel."""


def _js_string(value: Any) -> str:
    """JavaScript's `String(value ?? '')`, for option ids that are not strings."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def map_options(options: Any) -> list[dict[str, str]]:
    """ACP permission options -> `{optionId, label?, kind?}` (label and kind only when strings)."""
    mapped: list[dict[str, str]] = []
    for option in options if isinstance(options, list) else []:
        if not isinstance(option, dict):
            continue
        entry = {"optionId": _js_string(option.get("optionId"))}
        if isinstance(option.get("name"), str):
            entry["label"] = option["name"]
        if isinstance(option.get("kind"), str):
            entry["kind"] = option["kind"]
        mapped.append(entry)
    return mapped


def allowed_option_ids(options: list[dict[str, str]]) -> list[str]:
    """The ids a vote may select: every offered id except the empty string."""
    return [o["optionId"] for o in options if o["optionId"] != ""]


def check_sentinel(options: list[dict[str, str]]) -> None:
    if any(o["optionId"] == CANCEL_SENTINEL for o in options):
        raise CancelSentinelCollision(CANCEL_SENTINEL)


def is_user_question(tool_call: Any) -> bool:
    meta = tool_call.get("_meta") if isinstance(tool_call, dict) else None
    return isinstance(meta, dict) and meta.get("qwenInteractionKind") == USER_QUESTION


def _questions(tool_call: dict[str, Any]) -> list[dict[str, Any]]:
    meta = tool_call.get("_meta") if isinstance(tool_call.get("_meta"), dict) else {}
    source = meta.get("qwenQuestions")
    if not isinstance(source, list):
        raw_input = tool_call.get("rawInput")
        source = raw_input.get("questions") if isinstance(raw_input, dict) else None
    if not isinstance(source, list):
        return []
    # Non-object entries are dropped but still consume their index: answerKey is the
    # original position, so clients must echo it rather than recompute it.
    return [
        {**question, "answerKey": str(index)}
        for index, question in enumerate(source)
        if isinstance(question, dict)
    ]


def _action(tool_call: dict[str, Any]) -> dict[str, Any]:
    action: dict[str, Any] = {}
    if isinstance(tool_call.get("kind"), str):
        action["type"] = tool_call["kind"]
    if isinstance(tool_call.get("title"), str):
        action["title"] = tool_call["title"]
    for source, target in (("content", "content"), ("locations", "locations"), ("rawInput", "input")):
        if tool_call.get(source) is not None:
            action[target] = tool_call[source]
    return action


def normalize(request_id: str, tool_call: Any, options: Any, created_at: str) -> dict[str, Any]:
    """Build the wire `PendingInteraction` for one permission request.

    Never raises for a malformed tool call: the generic `action: {}` snapshot keeps the
    pending state truthful, as the reference does.
    """
    mapped = map_options(options)
    try:
        if is_user_question(tool_call):
            interaction: dict[str, Any] = {
                "requestId": request_id,
                "kind": USER_QUESTION,
                "createdAt": created_at,
            }
            if isinstance(tool_call.get("title"), str):
                interaction["title"] = tool_call["title"]
            interaction["questions"] = _questions(tool_call)
        else:
            interaction = {
                "requestId": request_id,
                "kind": PERMISSION,
                "createdAt": created_at,
                "action": _action(tool_call),
            }
    except (AttributeError, TypeError):
        interaction = {"requestId": request_id, "kind": PERMISSION, "createdAt": created_at, "action": {}}
    interaction["options"] = mapped
    return interaction
