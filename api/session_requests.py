"""What a request about one session carries, read the same way by every route on a session
(sessions, permissions, turns, history): the caller's client id (`X-Qwen-Client-Id`), and the
live session it names or, for a repeated `Idempotency-Key`, the first outcome of that key.
"""

from __future__ import annotations

from starlette.requests import Request

from acp_state import ids
from acp_state.store import Admission

from .auth import principal_of
from .reads.cache import CachedSession
from .responses import ApiError
from .state import app_state


def client_id_header(request: Request) -> str | None:
    """`X-Qwen-Client-Id`: optional, at most 128 chars of `[A-Za-z0-9._:-]`."""
    value = request.headers.get("x-qwen-client-id")
    if value is None:
        return None
    if not ids.is_token(value):
        raise ApiError(400, "X-Qwen-Client-Id must be 1-128 characters of [A-Za-z0-9._:-]", "invalid_client_id")
    return value


async def live_or_first(
    request: Request, sid: str, key: str | None
) -> tuple[CachedSession | None, Admission | None]:
    """The live session, or, for a repeated Idempotency-Key, the first outcome even if the
    session has gone since (a retry must not turn a success into a 404)."""
    state = app_state(request)
    principal = principal_of(request)
    try:
        return await state.locator.live(sid, principal), None
    except ApiError:
        if key is None:
            raise
        ws = await state.locator.workspace_of(sid, principal)
        first = await state.store.first_outcome(ws, sid, key) if ws is not None else None
        if first is None:
            raise
        return None, first
