"""Turn status: one record per prompt, from admission to its end (the reference's
`GET /session/:id/turns/current` and `GET /session/:id/turns/:promptId`).

A record is written when the prompt is admitted (queued), when it starts (running) and when
it ends (completed, cancelled or error), each time whole, in the same store step as the
session's own transition; readers never merge partial records.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import orjson

# The reference's bounds (TURN_RESULT_TEXT_MAX_CHARS and its terminal-status overlay).
TEXT_MAX_CHARS = 32768
TEXT_TRUNCATED = "RESULT_TEXT_TRUNCATED"
KEPT_ENDED_TURNS = 64


class TurnState(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    COMPLETED = "completed"
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclass(frozen=True)
class TurnRecord:
    prompt_id: str
    prompt_text: str
    queued_at: int  # epoch ms
    state: TurnState = TurnState.QUEUED
    started_at: int | None = None
    ended_at: int | None = None
    stop_reason: str | None = None
    error: dict[str, Any] | None = None  # {message, code?}
    result_text: str | None = None
    originator_client_id: str | None = None
    prompt_text_truncated: bool = False
    result_truncated: bool = False

    @classmethod
    def queued(cls, prompt_id: str, text: str, at: int, client_id: str | None) -> TurnRecord:
        """An admitted prompt's first record (texts are kept bounded, as the reference's)."""
        prompt, cut = _bounded(text)
        return cls(prompt_id, prompt, at, originator_client_id=client_id, prompt_text_truncated=cut)

    @property
    def ended(self) -> bool:
        return self.state not in (TurnState.QUEUED, TurnState.RUNNING)

    def started(self, at: int) -> TurnRecord:
        return dataclasses.replace(self, state=TurnState.RUNNING, started_at=at)

    def finished(self, at: int, stop_reason: str, result_text: str) -> TurnRecord:
        """Ended by the agent's stop reason (`cancelled` is a state of its own)."""
        state = TurnState.CANCELLED if stop_reason == "cancelled" else TurnState.COMPLETED
        result, cut = _bounded(result_text)
        return dataclasses.replace(
            self, state=state, ended_at=at, stop_reason=stop_reason, result_text=result or None, result_truncated=cut
        )

    def failed(self, at: int, message: str, code: str | None) -> TurnRecord:
        error = {"message": message, **({"code": code} if code else {})}
        return dataclasses.replace(self, state=TurnState.ERROR, ended_at=at, error=error)

    def pack(self) -> str:
        return orjson.dumps(dataclasses.asdict(self)).decode()

    @classmethod
    def unpack(cls, packed: str | bytes) -> TurnRecord:
        fields = orjson.loads(packed)
        fields["state"] = TurnState(fields["state"])
        return cls(**fields)

    def wire(self, sid: str) -> dict[str, Any]:
        """The reference's body: live turns (queued, running) and ended ones differ in
        which fields they carry; absent values are left out, never null."""
        body: dict[str, Any] = {"sessionId": sid, "state": self.state.value, "promptId": self.prompt_id,
                                "promptText": self.prompt_text}
        if self.prompt_text_truncated:
            body["promptTextTruncated"] = True
        body["queuedAt"] = self.queued_at
        if self.started_at is not None:
            body["startedAt"] = self.started_at
        if self.ended_at is not None:
            body["endedAt"] = self.ended_at
        if self.stop_reason is not None:
            body["stopReason"] = self.stop_reason
        if self.error is not None:
            body["error"] = self.error
        if self.result_text is not None:
            body["resultText"] = self.result_text
            if self.result_truncated:
                body["resultTruncated"] = True
                body["resultCode"] = TEXT_TRUNCATED
        if self.originator_client_id is not None:
            body["originatorClientId"] = self.originator_client_id
        return body


def idle(sid: str) -> dict[str, Any]:
    """`turns/current` of a session that never ran a turn."""
    return {"sessionId": sid, "state": "idle"}


def _bounded(text: str) -> tuple[str, bool]:
    return (text[:TEXT_MAX_CHARS], True) if len(text) > TEXT_MAX_CHARS else (text, False)
