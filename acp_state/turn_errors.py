"""Turn errors: how a failed `session/prompt` becomes `turnError` and a `turn_error` event.

The extraction chain is the reference's (spec §7): it strips JSON-RPC wrapping, nothing more.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

LOOP_DETECTED_MESSAGE = (
    "Tool-call loop protection stopped this turn. The session is still available; "
    "send a more specific instruction to continue."
)


@dataclass(frozen=True)
class TurnError:
    """The status-route error plus the SSE-only `loopType`."""

    message: str
    code: str | None = None
    error_kind: str | None = None
    loop_type: str | None = None
    # True when the agent itself named the kind (`data.errorKind`): such a rejection
    # cancels pending interactions first. A kind inferred from the message is not one.
    structured: bool = False

    def status_view(self) -> dict[str, str]:
        """`turnError` as the status route stores it: never `loopType`."""
        view = {"message": self.message}
        if self.code:
            view["code"] = self.code
        if self.error_kind:
            view["errorKind"] = self.error_kind
        return view

    def event_data(self, session_id: str, prompt_id: str | None) -> dict[str, Any]:
        data: dict[str, Any] = {"sessionId": session_id, **self.status_view()}
        if self.loop_type:
            data["loopType"] = self.loop_type
        if prompt_id is not None:
            data["promptId"] = prompt_id
        return data


def _text(value: Any) -> str | None:
    """A non-empty string, or None: empty strings fall through to the next source."""
    return value if isinstance(value, str) and value else None


def _message_from_data(data: Any) -> str | None:
    if isinstance(data, str):
        return _text(data)
    if not isinstance(data, dict):
        return None
    error = data.get("error")
    nested = error.get("message") if isinstance(error, dict) else error
    return _text(data.get("details")) or _text(data.get("message")) or _text(nested)


def _as_code(value: Any) -> str | None:
    """Numbers are stringified (-32603 -> "-32603"); empty or other values are no code."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, (int, float)):
        return str(value)
    return _text(value)


def from_rpc_error(code: Any, message: Any, data: Any) -> TurnError:
    """Build a TurnError from the parts of a JSON-RPC error object (spec §7)."""
    text = _message_from_data(data)
    if text is None:
        text = message if isinstance(message, str) else str(message)
    data_kind = _text(data.get("errorKind")) if isinstance(data, dict) else None
    if data_kind is not None:
        error_kind: str | None = data_kind
        turn_code = _text(data.get("code")) or _as_code(code)
    else:
        error_kind = "model_stream_interrupted" if text.strip().lower() == "terminated" else None
        turn_code = _as_code(code)
    loop_type = _text(data.get("loopType")) if isinstance(data, dict) else None
    return TurnError(
        message=text, code=turn_code, error_kind=error_kind, loop_type=loop_type, structured=data_kind is not None
    )
def from_exception(error: BaseException) -> TurnError:
    """Any exception from the agent call: ACP `RequestError`s keep their code and data."""
    code = getattr(error, "code", None)
    data = getattr(error, "data", None)
    message = getattr(error, "message", None) or str(error) or type(error).__name__
    return from_rpc_error(code, message, data)
