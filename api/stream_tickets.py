"""Stream tickets: how a browser opens an event stream without its token in the URL.

A browser's `EventSource` cannot send `Authorization`, and a token in a URL is kept in
history, proxy and server logs and `Referer`s. So the Web Shell asks, with its token in the
header, `POST /stream-tickets {path}` and opens the stream with `?ticket=`: a ticket opens
one stream, the one at `path`, once, within 60 s, as the principal (role and workspace
scope) that asked for it.

API processes are many and keep nothing of their own, so a ticket is verified by any of
them: it is `<payload>.<mac>`, the payload the principal, the expiry and a random nonce, the
MAC an HMAC-SHA256 over the payload and the stream's path, keyed by a key every process
derives alike from the configured tokens (PBKDF2: a ticket seen in a log is no cheap oracle
for guessing a weak token). The path is in the MAC, not the ticket: presented on another
path, the MAC does not match. Single use is Redis's: the first use `SET acp:ticket:<nonce>
NX PX <life left>`; a second finds the key. Changing the tokens changes the key: tickets
then outstanding (a minute's) no longer open anything.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets
import time
from typing import Sequence
from urllib.parse import unquote

import orjson
from starlette.types import Scope

from acp_state.store import Store

from .auth import Principal, Token
from .responses import OrjsonResponse

TICKET_LIFE_MS = 60_000
# The event streams a ticket may open (their paths as the server sees them, decoded).
STREAM_PATHS = re.compile(r"/session/[^/]+/events|/workspaces/.+/sessions/live-state/events|/attention/events")
_KDF_SALT = b"acp-state stream tickets v1"
_KDF_ROUNDS = 100_000


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class TicketError(Exception):
    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code

    def response(self) -> OrjsonResponse:
        return OrjsonResponse({"error": str(self), "code": self.code}, status_code=401,
                              headers={"WWW-Authenticate": "Bearer"})


class Tickets:
    """Issues and verifies the tickets of a deployment whose tokens are `tokens`."""

    def __init__(self, tokens: Sequence[Token]) -> None:
        secrets_joined = b"\0".join(sorted(t.secret.encode() for t in tokens))
        self.key = hashlib.pbkdf2_hmac("sha256", secrets_joined, _KDF_SALT, _KDF_ROUNDS)

    def _mac(self, payload: str, path: str) -> str:
        return _b64(hmac.new(self.key, f"{payload}\n{path}".encode(), hashlib.sha256).digest())

    def issue(self, principal: Principal, path: str, now_ms: int | None = None) -> tuple[str, int]:
        """A ticket for `principal` to open the stream at `path` once; (ticket, expiresAt ms)."""
        expires = (now_ms if now_ms is not None else _now_ms()) + TICKET_LIFE_MS
        scope = None if principal.workspaces is None else sorted(principal.workspaces)
        payload = _b64(orjson.dumps([principal.role, scope, expires, secrets.token_urlsafe(16)]))
        return f"{payload}.{self._mac(payload, path)}", expires

    def verify(self, ticket: str, path: str, now_ms: int | None = None) -> tuple[Principal, str, int]:
        """The ticket's (principal, nonce, expiresAt) if it was issued for `path` and has not
        expired; TicketError otherwise. Single use is `redeem`'s."""
        payload, dot, mac = ticket.partition(".")
        if not dot or not hmac.compare_digest(mac.encode(), self._mac(payload, path).encode()):
            raise TicketError("the stream ticket is not valid for this stream", "ticket_invalid")
        try:
            role, scope, expires, nonce = orjson.loads(_unb64(payload))
        except (ValueError, TypeError):  # cannot be: the MAC matched; still, no 500
            raise TicketError("the stream ticket is not valid for this stream", "ticket_invalid") from None
        if (now_ms if now_ms is not None else _now_ms()) >= expires:
            raise TicketError("the stream ticket has expired; ask for a new one", "ticket_expired")
        return Principal(role, None if scope is None else frozenset(scope)), nonce, expires


def _now_ms() -> int:
    return int(time.time() * 1000)


def presented(scope: Scope) -> str | None:
    """The `?ticket=` of a GET of an event stream, if any."""
    if scope["method"] != "GET" or not scope["path"].endswith("/events"):
        return None
    query: bytes = scope.get("query_string", b"")
    if b"ticket=" not in query:
        return None
    for pair in query.split(b"&"):
        name, _, value = pair.partition(b"=")
        if name == b"ticket":
            return unquote(value.decode("latin-1"))
    return None


async def redeem(tickets: Tickets, store: Store, scope: Scope, ticket: str) -> Principal:
    """Verify the ticket for the scope's path and spend it (Redis, so on every API process
    at once); its principal, or TicketError. A store error propagates."""
    principal, nonce, expires = tickets.verify(ticket, scope["path"])
    ttl_ms = max(1, expires - _now_ms()) + 1000  # kept a little past the ticket's own life
    if not await store.spend_ticket(nonce, ttl_ms):
        raise TicketError("the stream ticket was used already; ask for a new one", "ticket_used")
    return principal
