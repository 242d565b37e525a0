"""Permission votes: parsing the reference's vote body and shaping the ACP response."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .commands import CANCEL_SENTINEL

MALFORMED_OUTCOME = (
    '`outcome` must be `{ outcome: "cancelled" }` or `{ outcome: "selected", optionId: string }`'
)
# Keys a JavaScript client could use for prototype pollution; the reference strips them.
_POISONED_KEYS = frozenset({"__proto__", "constructor", "prototype"})


class MalformedVote(ValueError):
    """The body has no valid `outcome`; the message is the reference's 400 text."""

    def __init__(self) -> None:
        super().__init__(MALFORMED_OUTCOME)


@dataclass(frozen=True)
class Vote:
    """One parsed vote: the outcome plus metadata that passes through to the agent."""

    selected: bool
    option_id: str | None
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def is_sentinel(self) -> bool:
        return self.selected and self.option_id == CANCEL_SENTINEL

    def acp_response(self) -> dict[str, Any]:
        """The `session/request_permission` result; `answers` sits at the root, as Qwen reads it."""
        if not self.selected:
            return {"outcome": {"outcome": "cancelled"}}
        return {"outcome": {"outcome": "selected", "optionId": self.option_id}, **self.metadata}


def parse(body: Any) -> Vote:
    """Validate a vote body (spec §1.4 steps 1, 6, 7). Raises MalformedVote."""
    if not isinstance(body, dict):
        raise MalformedVote()
    outcome = body.get("outcome")
    if not isinstance(outcome, dict):
        raise MalformedVote()
    kind = outcome.get("outcome")
    if kind == "cancelled":
        selected, option_id = False, None
    elif kind == "selected" and isinstance(outcome.get("optionId"), str) and outcome["optionId"]:
        selected, option_id = True, outcome["optionId"]
    else:
        raise MalformedVote()
    metadata = {k: v for k, v in body.items() if k != "outcome" and k not in _POISONED_KEYS}
    answers = metadata.get("answers")
    if "answers" in metadata and not (
        isinstance(answers, dict) and all(isinstance(v, str) for v in answers.values())
    ):
        # Not a plain string-valued object: dropped silently, the vote still counts.
        del metadata["answers"]
    return Vote(selected=selected, option_id=option_id, metadata=metadata)
