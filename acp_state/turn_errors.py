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

    def status_view(self) -> dict[str, str]:
        """`turnError` as the status route stores it: never `loopType`."""
        view = {"message": self.message}
        if self.code is not None:
            view["code"] = self.code
        if self.error_kind is not None:
            view["errorKind"] = self.error_kind
        return view

    def event_data(self, session_id: str, prompt_id: str | None) -> dict[str, Any]:
        data: dict[str, Any] = {"sessionId": session_id, **self.status_view()}
        if self.loop_type is not None:
            data["loopType"] = self.loop_type
        if prompt_id is not None:
            data["promptId"] = prompt_id
        return data

    @property
    def structured(self) -> bool:
        """A structured errorKind rejection (e.g. loop_detected) cancels pending first."""
        return self.error_kind is not None and self.error_kind != "model_stream_interrupted"


def _message_from_data(data: Any) -> str | None:
    if isinstance(data, str):
        return data
    if isinstance(data, dict):
        for key in ("details", "message"):
            if isinstance(data.get(key), str):
                return data[key]
        error = data.get("error")
        if isinstance(error, str):
            return error
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return error["message"]
    return None


def _as_code(value: Any) -> str | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float, str)):
        return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)
    return None


def from_rpc_error(code: Any, message: Any, data: Any) -> TurnError:
    """Build a TurnError from the parts of a JSON-RPC error object."""
    text = _message_from_data(data)
    if text is None:
        text = message if isinstance(message, str) else str(message)
    error_kind = None
    if isinstance(data, dict) and isinstance(data.get("errorKind"), str) and data["errorKind"]:
        error_kind = data["errorKind"]
    elif text.strip().lower() == "terminated":
        error_kind = "model_stream_interrupted"
    turn_code = _as_code(code)
    if error_kind is not None and isinstance(data, dict) and _as_code(data.get("code")) is not None:
        turn_code = _as_code(data.get("code"))
    loop_type = data.get("loopType") if isinstance(data, dict) and isinstance(data.get("loopType"), str) else None
    return TurnError(message=text, code=turn_code, error_kind=error_kind, loop_type=loop_type)


def from_exception(error: BaseException) -> TurnError:
    """Any exception from the agent call: ACP `RequestError`s keep their code and data."""
    code = getattr(error, "code", None)
    data = getattr(error, "data", None)
    message = getattr(error, "message", None) or str(error) or type(error).__name__
    return from_rpc_error(code, message, data)
