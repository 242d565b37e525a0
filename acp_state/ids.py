"""Identifier rules: what a session id, request id, client id and workspace id may look like.

Every id that reaches a Redis key name passes through here first, so no request can smuggle
a hash tag (`{`/`}`), a separator or an unbounded string into the key space.
"""

from __future__ import annotations

import hashlib
import re
import uuid

# The reference admits RFC 4122 UUIDs of versions 1-5 as caller-supplied session ids.
_SESSION_ID = re.compile(
    r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[1-5][0-9a-fA-F]{3}-[89abAB][0-9a-fA-F]{3}-[0-9a-fA-F]{12}$"
)
# Client ids and request ids share the reference's header charset.
_TOKEN = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_WORKSPACE_ID = re.compile(r"^[0-9a-f]{16}$")


def new_id() -> str:
    """A fresh random id (UUID v4) for sessions, prompts and requests."""
    return str(uuid.uuid4())


def new_client_id() -> str:
    """A client id the daemon assigns, in the reference's form `client_<uuid>`."""
    return f"client_{uuid.uuid4()}"


def is_session_id(value: object) -> bool:
    return isinstance(value, str) and bool(_SESSION_ID.fullmatch(value))


def is_token(value: object) -> bool:
    """True for a client id or request id the reference would accept."""
    return isinstance(value, str) and bool(_TOKEN.fullmatch(value))


def is_workspace_id(value: object) -> bool:
    return isinstance(value, str) and bool(_WORKSPACE_ID.fullmatch(value))


def workspace_id(cwd: str) -> str:
    """The reference's workspace id: the first 16 hex chars of sha256 of the cwd string."""
    return hashlib.sha256(cwd.encode("utf-8")).hexdigest()[:16]
