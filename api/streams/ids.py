"""Event ids that carry all a resume needs: `<position>-<epoch>`.

A browser's `EventSource` reconnects by itself and sends back only the last `id:` it saw
(`Last-Event-ID`), never the query parameters a client learnt from the stream. A stream
whose positions count within an epoch (the live feed's revisions within a generation, the
attention stream's changes within its hub) therefore names both in each id, as
Centrifugo's recovery carries offset and epoch together: a bare reconnect resumes with the
changes it missed, not a whole snapshot. A bare decimal id (the form before) is still read,
with the epoch the client sends beside it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, Hashable, TypeVar

from ..responses import parse_decimal

MAX_POSITION = 2**53 - 1
MAX_EPOCH_CHARS = 64
# Changes remembered for resumes beyond the present keys' own (removals, mostly).
REMEMBERED_CHANGES = 10_000

K = TypeVar("K", bound=Hashable)


def compose(position: int, epoch: str) -> str:
    return f"{position}-{epoch}"


def parse(text: str | None) -> tuple[int, str | None] | None:
    """`<position>-<epoch>` -> (position, epoch); a bare `<position>` -> (position, None);
    anything else -> None (ignored, as an unknown id is: the stream starts afresh)."""
    if not text:
        return None
    digits, dash, epoch = text.partition("-")
    position = parse_decimal(digits, MAX_POSITION)
    if position is None:
        return None
    if not dash:
        return position, None
    if not (0 < len(epoch) <= MAX_EPOCH_CHARS and epoch.isascii() and epoch.isalnum()):
        return None
    return position, epoch


class ChangeMemory(Generic[K]):
    """The position at which each key (a session, an inbox item) last changed, oldest change
    first: what a resume from an earlier position missed. It holds the present keys and up to
    `REMEMBERED_CHANGES` more (those that left); a resume from before the oldest change it
    forgot cannot be told (`since`)."""

    def __init__(self, since: int = 0) -> None:
        self.at: OrderedDict[K, float] = OrderedDict()
        self.since = since  # the oldest position a resume can be answered from

    def note(self, key: K, at: float, present: int) -> None:
        """`key` changed at position `at`; `present` keys are live now."""
        self.at[key] = at
        self.at.move_to_end(key)
        while len(self.at) > present + REMEMBERED_CHANGES:
            _, oldest = self.at.popitem(last=False)
            self.since = max(self.since, int(oldest))  # resumes from before it: a snapshot

    def covers(self, position: int, current: int) -> bool:
        return self.since <= position <= current

    def after(self, position: int) -> list[K]:
        """The keys that changed after `position`, in the order of their last change."""
        return [key for key, at in self.at.items() if at > position]
