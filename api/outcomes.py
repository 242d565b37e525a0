"""Acknowledged means done; refused means not done; unknown is said.

A command's effect happens inside Redis, in one script. When Redis answers, the API knows
the outcome. When the connection breaks or times out after the command may have reached
Redis (a stall, a failover, a dropped socket), the API does not: it answers 503
`outcome_unknown`, never a guess. A client that sends an `Idempotency-Key` can then retry
with the same key and get the first outcome back, never a second effect.

Every command a route hands to a session's owner goes through `to_owner` (and, when the
route awaits the owner's answer, `reply_to`; `ask_owner` is both): a prompt, a cancel, a
vote, a close, an approval mode, a prompt taken out of the queue.
"""

from __future__ import annotations

import contextlib
from typing import AsyncIterator, Awaitable, Callable, TypeVar

from starlette.requests import Request

from acp_state import ids
from acp_state.commands import Command, Reply
from acp_state.store import Admission, AdmissionStatus, is_transient, never_ran

from .locator import not_found
from .reads.cache import CachedSession
from .responses import ApiError
from .state import AppState

IDEMPOTENCY_HEADER = "idempotency-key"
T = TypeVar("T")


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


def gone(admission: Admission) -> bool:
    """SEND refused the command: the session is not its owner's (any more)."""
    return admission.status is AdmissionStatus.GONE


async def to_owner(
    state: AppState, sid: str, ref: CachedSession, deliver: Callable[[str], Awaitable[T]],
    refused: Callable[[T], bool] | None = None,
) -> T:
    """Hand something to the worker that owns session `sid`: `deliver(owner)`, the one store
    call that puts a command in that owner's inbox (deciding in the same script what it can,
    as a vote's winner), inside `effect`: a connection lost under it is 503 `outcome_unknown`.
    With `refused` (the store's answer that the owner no longer holds the session), a refusal
    follows a drain's move to the new owner (`SessionLocator.to_owner`); without it, the
    answer is the route's (a vote goes only to the owner that asked it)."""
    async with effect(state.store.resends):
        if refused is None:
            return await deliver(ref.owner)
        return await state.locator.to_owner(sid, ref, deliver, refused)


async def reply_to(state: AppState, request_id: str) -> Reply:
    """The owner's reply to the command `request_id` sent by `to_owner`: 503
    `outcome_unknown` if none came in time (the command stays queued for the worker: done
    later, or its death is told), or the connection was lost while waiting."""
    async with effect(state.store.resends):  # sent: a lost reply leaves its outcome unknown
        reply = await state.store.await_reply(request_id, state.settings.close_timeout_s)
    if reply is None:
        raise outcome_unknown()
    return reply


async def ask_owner(state: AppState, sid: str, ref: CachedSession, command: Command) -> Reply:
    """Send `command` (one that carries a `request_id`) to the worker that owns session
    `sid` and await its reply: 404 if the session is gone, 503 `outcome_unknown` if the
    command was sent but no reply came (its effect is then unknown)."""
    admission = await to_owner(state, sid, ref, lambda owner: state.store.send(ref.ws, owner, command), gone)
    if admission.status is not AdmissionStatus.OK:
        raise not_found(sid)
    reply = await reply_to(state, command.request_id)  # type: ignore[attr-defined]
    if reply.code == "session_not_found":
        raise not_found(sid)
    return reply
