"""Permission votes: the reference's vote body, read into the one vote type.

`parse` makes the `commands.Vote` that the API sends, the VOTE script decides and the
worker answers the agent with (`Vote.acp_response`): nothing is copied or rebuilt on the way.
"""

from __future__ import annotations

from typing import Any

from .commands import Vote

MALFORMED_OUTCOME = (
    '`outcome` must be `{ outcome: "cancelled" }` or `{ outcome: "selected", optionId: string }`'
)
# Keys a JavaScript client could use for prototype pollution; the reference strips them.
_POISONED_KEYS = frozenset({"__proto__", "constructor", "prototype"})


class MalformedVote(ValueError):
    """The body has no valid `outcome`; the message is the reference's 400 text."""

    def __init__(self) -> None:
        super().__init__(MALFORMED_OUTCOME)


def check(body: Any) -> None:
    """Judge a vote body alone (spec §1.4 steps 1, 6, 7), before the route reads anything
    else of its request, as the reference does. Raises MalformedVote."""
    _cast(body)


def parse(body: Any, *, sid: str, rid: str, client_id: str | None) -> Vote:
    """The vote a body casts on request `rid` of session `sid`. Raises MalformedVote."""
    selected, option_id, metadata = _cast(body)
    return Vote(sid=sid, rid=rid, selected=selected, option_id=option_id, metadata=metadata, client_id=client_id)


def _cast(body: Any) -> tuple[bool, str | None, dict[str, Any]]:
    """What the body says: selected or cancelled, the option, the metadata for the agent."""
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
    return selected, option_id, metadata
