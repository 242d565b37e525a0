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

from .responses import parse_decimal

MAX_POSITION = 2**53 - 1
MAX_EPOCH_CHARS = 64


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
