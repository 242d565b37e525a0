"""Acknowledged means done; refused means not done; unknown is said.

A command's effect happens inside Redis, in one script. When Redis answers, the API knows
the outcome. When the connection breaks or times out after the command may have reached
Redis (a stall, a failover, a dropped socket), the API does not: it answers 503
`outcome_unknown`, never a guess. A client that sends an `Idempotency-Key` can then retry
with the same key and get the first outcome back, never a second effect.
"""

from __future__ import annotations

import contextlib
from typing import Any, AsyncIterator

from starlette.requests import Request

from acp_state import ids
from acp_state.store import AdmissionStatus, is_transient, never_ran

from .locator import not_found
from .responses import ApiError

IDEMPOTENCY_HEADER = "idempotency-key"


def idempotency_key(request: Request) -> str | None:
    """`Idempotency-Key`: optional, 1-128 characters of `[A-Za-z0-9._:-]`."""
    value = request.headers.get(IDEMPOTENCY_HEADER)
    if value is None:
        return None
    if not ids.is_token(value):
        raise ApiError(400, "Idempotency-Key must be 1-128 characters of [A-Za-z0-9._:-]", "invalid_idempotency_key")
    return value


def outcome_unknown() -> ApiError:
    error = ApiError(
        503,
        "the state store did not confirm the outcome; retry with the same Idempotency-Key to learn it",
        "outcome_unknown",
        retryAfterMs=1000,
    )
    error.headers["Retry-After"] = "1"
    return error


@contextlib.asynccontextmanager
async def effect(resent: bool = False) -> AsyncIterator[None]:
    """Around the one store call that makes a command's effect: a broken or timed-out
    connection becomes 503 `outcome_unknown` (a refusal, or a command never sent, stays
    `store_unavailable` or `store_full`: nothing was done). With a client that `resent`
    commands after an error (`RedisStore.resends`: redis-py's cluster client), the error
    speaks only of the last attempt, so every store error is `outcome_unknown`."""
    try:
        yield
    except Exception as error:
        if not is_transient(error) or (never_ran(error) and not resent):
            raise  # a bug (500), or a refusal: the app's store error handler answers it
        raise outcome_unknown() from error


async def ask_owner(state: Any, sid: str, ref: Any, command: Any) -> Any:
    """Send `command` (one that carries a `request_id`) to the worker that owns session
    `sid` and await its reply: 404 if the session is gone, 503 `outcome_unknown` if the
    command was sent but no reply came (its effect is then unknown)."""
    async with effect(state.store.resends):
        admission = await state.locator.to_owner(
            sid, ref, lambda owner: state.store.send(ref.ws, owner, command),
            lambda sent: sent.status is AdmissionStatus.GONE,
        )
    if admission.status is not AdmissionStatus.OK:
        raise not_found(sid)
    async with effect(state.store.resends):  # sent: a lost reply leaves its outcome unknown
        reply = await state.store.await_reply(command.request_id, state.settings.close_timeout_s)
    if reply is None:
        raise outcome_unknown()
    if reply.code == "session_not_found":
        raise not_found(sid)
    return reply
