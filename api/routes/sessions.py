"""Session routes: create or attach, prompt, cancel, close, status.

What these share with the other routes on a session is in `session_requests` (the client
id, the session a request names), where a create goes in `placement`, and the summaries
they answer in `summaries`."""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

from acp_state import commands, ids
from acp_state.commands import Reply
from acp_state.agents import is_agent_name
from acp_state.ids import workspace_id
from acp_state.clock import iso, now_ms
from acp_state.store import ABANDONED, AdmissionStatus, CreateKey, CreateRecord, DeleteOutcome, IdClaim

from .. import approval_modes, session_source, workspace_ref
from ..auth import principal_of
from ..limits import MAX_QUEUED_PROMPTS
from ..locator import not_found
from ..outcomes import effect, gone, idempotency_key, reply_to, to_owner
from ..placement import SESSION_ID_CONFLICT, note_told, place, session_id_conflict, unknown_agent
from ..reads.summaries import live_summary, status_answer
from ..responses import ApiError, JSON_TYPE, OrjsonResponse, json_body, unavailable
from ..session_requests import client_id_header, live_or_first
from ..state import AppState, app_state

log = logging.getLogger("api.sessions")

SINGLE_WAIT_STEP_S = 0.05
# How often a repeated close or create checks whether the first one's effect has landed.
WAIT_STEP_S = 0.1
CHANNEL_PROMPT_META_KEY = "qwen.channel.prompt"


async def _keep(state: AppState, key: CreateKey, sid: str, client_id: str, attached: bool) -> None:
    """Keep a create's outcome under its key. The create is done and its answer taken: a
    store that cannot keep the outcome now must not turn that success into a refusal (a
    retry then follows the first create's request instead, as if its API had gone)."""
    try:
        await state.store.keep_create(key, sid, client_id, attached)
    except Exception:
        log.warning("could not keep the outcome of create %s under its key", sid, exc_info=True)


async def _join_single(state: AppState, ws: str, holder: str, client_id: str) -> dict[str, Any] | None:
    """Attach to the workspace's shared session, waiting while another caller creates it."""
    deadline = asyncio.get_running_loop().time() + state.settings.create_timeout_s
    while asyncio.get_running_loop().time() < deadline:
        view = await state.store.session(ws, holder)
        if view is not None:
            attach = commands.Attach(sid=holder, client_id=client_id)
            if not await state.registry.is_live(view.owner) or not await state.store.attach(ws, view.owner, attach):
                return None
            state.locator.remember(holder, ws)
            return live_summary(view)
        await asyncio.sleep(SINGLE_WAIT_STEP_S)  # the creator is still starting the agent
    return None


async def create_session(request: Request) -> Response:
    state = app_state(request)
    body = await json_body(request)
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", "invalid_request")
    header_client = client_id_header(request)
    cwd = body.get("workspaceCwd", body.get("cwd"))
    if cwd is None:  # the first workspace the caller may see (the primary, if it may)
        cwd = next(iter(workspace_ref.visible(request).values()), None)
    # The reference canonicalizes the cwd (resolve + realpath) before matching it. A
    # workspace the caller may not see is matched by none: answered as an unknown one.
    found = workspace_ref.find(request, cwd) if isinstance(cwd, str) and os.path.isabs(cwd) else None
    if found is None:
        raise workspace_ref.mismatch(request, cwd if isinstance(cwd, str) else "", "id")
    cwd = state.workspaces[found]
    scope = body.get("sessionScope", "single")
    if scope not in ("single", "thread"):
        raise ApiError(400, "sessionScope must be 'single' or 'thread'", "invalid_session_scope")
    requested = body.get("sessionId")
    if requested is not None and not ids.is_session_id(requested):
        raise ApiError(400, "sessionId must be an RFC 4122 UUID (versions 1-5)", "invalid_session_id")
    agent = body.get("agent")
    if agent is not None and not is_agent_name(agent):
        raise unknown_agent(agent)
    source = session_source.requested(body)
    mode = approval_modes.on_create(body)
    ws = workspace_id(cwd)
    client_id = header_client or ids.new_client_id()
    sid = requested or ids.new_id()
    given_key = idempotency_key(request)
    if given_key is None:
        return OrjsonResponse(
            await _create_or_attach(state, ws, cwd, scope, sid, client_id, requested, agent=agent, source=source,
                                   mode=mode))
    # Kept per workspace and per caller: another tenant's (or principal's) same key is
    # another create, and never learns the first one's session or client id.
    key = CreateKey(ws, principal_of(request).name, given_key)
    claim_ms = int(state.settings.create_timeout_s * 1000) + 10_000
    first = await state.store.claim_create(key, sid, client_id, claim_ms)
    if first is not None:
        return await _repeated_create(state, key, ws, cwd, first)
    sent: list[str] = []

    async def note(request_id: str) -> None:  # before the create goes out, so a retry can stop it
        await state.store.note_create_request(key, sid, client_id, request_id)
        sent.append(request_id)

    try:
        body = await _create_or_attach(state, ws, cwd, scope, sid, client_id, requested, note, agent=agent,
                                       source=source, mode=mode)
    except BaseException as error:
        if not (isinstance(error, ApiError) and error.body.get("code") == "outcome_unknown"):
            await state.store.forget_create(key, sid)  # it did not happen: the key is free
            raise
        if not sent:  # nothing went out: it did not happen
            await state.store.forget_create(key, sid)
            raise unavailable("the state store is unavailable; retry shortly", "store_unavailable") from error
        # The create went out and its answer did not come back: stop waiting for it, and
        # learn how it ended (or keep the key, and the retry finds out).
        try:
            late = await state.store.abandon_reply(sent[-1])
        except Exception:
            raise error from None
        if late is None or not late.ok:
            await state.store.forget_create(key, sid)  # abandoned: the worker undoes it
            raise unavailable("the create was not confirmed and is undone; retry", "create_undone") from error
        await note_told(state, ws, sid)
        body = {"sessionId": sid, "workspaceCwd": cwd, "attached": False, "clientId": client_id,
                "createdAt": late.created_at, **session_source.echoed(*source)}
    await _keep(state, key, body["sessionId"], client_id, body["attached"])
    return OrjsonResponse(body)


async def _create_or_attach(
    state: AppState,
    ws: str,
    cwd: str,
    scope: str,
    sid: str,
    client_id: str,
    requested: str | None,
    before_send: Callable[[str], Awaitable[None]] | None = None,
    *,
    agent: str | None = None,
    source: tuple[str | None, str | None] = (None, None),
    mode: str | None = None,
) -> dict[str, Any]:
    """Create the session on a worker offering `agent`, or attach to the workspace's shared
    one (whichever agent it runs)."""
    if requested is not None:
        existing = await state.store.session(ws, sid)
        if existing is not None and await state.registry.is_live(existing.owner):
            raise ApiError(409, f'Session "{sid}" is already live', "session_exists", sessionId=sid)
        # A session id is unique across workspaces: claimed for this one before anything
        # else (a claim that then fails leaves the id this workspace's, which costs no
        # other caller anything: the id was this caller's choice). The worker claims it
        # again as it indexes the session, which also covers the ids it is given unchosen.
        if await state.store.claim_session_id(ws, sid) is IdClaim.FOREIGN:
            raise session_id_conflict(sid)

    claimed = False
    if scope == "single":
        for _ in range(2):
            holder = await state.store.claim_single(ws, sid, int(state.settings.create_timeout_s * 1000) + 5000)
            if holder is None:
                claimed = True
                break
            joined = await _join_single(state, ws, holder, client_id)
            if joined is not None:
                return {
                    "sessionId": holder,
                    "workspaceCwd": joined["workspaceCwd"],
                    "attached": True,
                    "clientId": client_id,
                    "createdAt": joined["createdAt"],
                }
            await state.store.release_single(ws, holder)  # a stale claim: take it over
        else:
            raise unavailable("the workspace's shared session is being replaced; retry", "session_busy")

    def create(request_id: str) -> commands.Create:
        return commands.Create(
            ws=ws, sid=sid, cwd=cwd, scope=scope, client_id=client_id,
            wait_ms=int(state.settings.create_timeout_s * 1000), request_id=request_id, agent=agent,
            source_type=source[0], source_id=source[1], mode=mode,
        )

    try:
        async with effect(state.store.resends):  # a create sent to a worker may have happened
            reply = await place(state, create, before_send, agent, cwd=cwd)
    except BaseException:
        if claimed:
            await state.store.release_single(ws, sid)
        raise
    state.locator.remember(sid, ws)
    return {"sessionId": sid, "workspaceCwd": cwd, "attached": False, "clientId": client_id, "createdAt": reply.created_at,
            **session_source.echoed(*source)}


async def _repeated_create(state: AppState, key: CreateKey, ws: str, cwd: str, first: CreateRecord) -> Response:
    """The same create again (same Idempotency-Key): the first one's outcome.

    A kept outcome is answered at once. A first create still under way (or whose API gave
    up on it) is followed: its answer, if nobody took it, is taken here and told; when it
    takes too long, its request is abandoned, so the worker undoes it if it finishes later,
    and the key is free for a create that is new."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + state.settings.create_timeout_s
    record: CreateRecord | None = first
    created_at = None
    while record is not None and not record.kept:
        answer = await state.store.take_reply(record.request) if record.request else None
        if answer == ABANDONED:
            await state.store.forget_create(key, record.sid)
            raise unavailable("the create was not confirmed and is undone; retry", "create_undone")
        if answer is None and loop.time() >= deadline:
            if record.request and await state.store.was_told(ws, record.sid):
                # Its answer was taken, by an API that could not keep the outcome (or died
                # before answering): the session stands.
                await _keep(state, key, record.sid, record.client_id, record.attached)
                break
            answer = await state.store.abandon_reply(record.request) if record.request else None
            if answer is None:
                await state.store.forget_create(key, record.sid)
                raise ApiError(504, "the worker did not start the session in time", "agent_init_timeout")
        if isinstance(answer, Reply):
            if not answer.ok:
                await state.store.forget_create(key, record.sid)
                if answer.code == SESSION_ID_CONFLICT:
                    raise session_id_conflict(record.sid)
                raise ApiError(503, answer.error or "the agent could not start", answer.code or "agent_unavailable")
            await note_told(state, ws, record.sid)
            await _keep(state, key, record.sid, record.client_id, record.attached)
            created_at = answer.created_at
            break
        await asyncio.sleep(WAIT_STEP_S)
        record = await state.store.create_record(key)
    if record is None and first.request:
        # The key's record lapsed while the first create's outcome was followed (a long
        # outage): the first create's answer and session say how it ended, not the lapse.
        record = await first_create_outcome(state, key, ws, first)
    if record is None or record.sid != first.sid:  # the first create failed and said so
        raise unavailable("the first create with this key failed; retry", "create_undone")
    row = await state.store.catalog_row(ws, record.sid)
    state.locator.remember(record.sid, ws)
    body = {"sessionId": record.sid, "workspaceCwd": cwd, "attached": record.attached, "clientId": record.client_id}
    answer = dict(body, createdAt=row.created_at if row else created_at or iso(now_ms()))
    if row is not None and not record.attached:
        answer.update(session_source.echoed(row.source_type, row.source_id))
    return OrjsonResponse(answer)


async def first_create_outcome(state: AppState, key: CreateKey, ws: str, first: CreateRecord) -> CreateRecord | None:
    """How a create whose key record lapsed ended: its answer taken here (told, kept), or
    taken by an API that told the session and died before keeping it (kept), or unknown yet
    (the record is written again, so the next retry follows this same create, and the
    caller is told the outcome is unknown). None: it failed, or was abandoned (undone)."""
    assert first.request is not None
    answer = await state.store.take_reply(first.request)
    if isinstance(answer, Reply):
        if not answer.ok:
            return None
        await note_told(state, ws, first.sid)
    elif answer == ABANDONED or not await state.store.was_told(ws, first.sid):
        if answer != ABANDONED and await state.store.catalog_row(ws, first.sid) is not None:
            claim_ms = int(state.settings.create_timeout_s * 1000) + 10_000
            if await state.store.claim_create(key, first.sid, first.client_id, claim_ms) is None:
                await state.store.note_create_request(key, first.sid, first.client_id, first.request)
            raise unavailable("the create's outcome is not known yet; retry with the same key", "outcome_unknown")
        return None
    await _keep(state, key, first.sid, first.client_id, first.attached)
    return first


def _prompt_blocks(body: Any) -> tuple[list[dict[str, Any]], str]:
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", "invalid_request")
    blocks = body.get("prompt")
    if not isinstance(blocks, list) or not blocks:
        raise ApiError(400, "`prompt` is required and must be a non-empty array of content blocks", "invalid_prompt")
    for block in blocks:
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise ApiError(400, "every content block needs a string `type`", "invalid_prompt")
        if block["type"] == "text" and not isinstance(block.get("text"), str):
            raise ApiError(400, "a text block needs a string `text`", "invalid_prompt")
    text = "".join(b["text"] for b in blocks if b["type"] == "text")
    return blocks, text


def _turn_kind(request: Request, body: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """The prompt's `_meta` (the channel marker stripped from untrusted callers) and its kind.

    Only an authenticated channel caller makes a channel prompt; the delivery meta
    (`qwen.daemon.channelDelivery`) passes through but never changes the kind.
    """
    meta = dict(body["_meta"]) if isinstance(body.get("_meta"), dict) else None
    kind = body.get("turnKind", commands.FOREGROUND)
    if kind not in commands.CALLER_TURN_KINDS:
        raise ApiError(400, f"turnKind must be one of {', '.join(commands.CALLER_TURN_KINDS)}", "invalid_turn_kind")
    if meta is not None and CHANNEL_PROMPT_META_KEY in meta:
        if meta[CHANNEL_PROMPT_META_KEY] is True and principal_of(request).role == "channel":
            kind = commands.CHANNEL
        else:
            del meta[CHANNEL_PROMPT_META_KEY]
    return meta, kind


async def prompt(request: Request) -> Response:
    state = app_state(request)
    sid = request.path_params["id"]
    client_id = client_id_header(request)
    key = idempotency_key(request)
    body = await json_body(request)
    blocks, text = _prompt_blocks(body)
    meta, kind = _turn_kind(request, body)
    ref, admission = await live_or_first(request, sid, key)
    if ref is not None:
        command = commands.Prompt(
            sid=sid, prompt_id=ids.new_id(), blocks=blocks, text=text, meta=meta, kind=kind, client_id=client_id,
            queued_at=now_ms(),
        )
        admission = await to_owner(state, sid, ref, lambda owner: state.store.send(
            ref.ws, owner, command, admit_limit=1 + MAX_QUEUED_PROMPTS, idempotency_key=key
        ), gone)
    assert admission is not None
    if admission.status is AdmissionStatus.GONE:
        raise not_found(sid)
    if admission.status is AdmissionStatus.FULL:
        raise unavailable(
            f"session already has {MAX_QUEUED_PROMPTS} queued prompts", "prompt_queue_full", sessionId=sid
        )
    # 202, as the reference: the prompt is admitted; its turn runs on (turns/:promptId, SSE).
    return OrjsonResponse(
        {"promptId": admission.prompt_id, "lastEventId": admission.last_event_id, "eventEpoch": admission.epoch},
        status_code=202,
    )


async def cancel(request: Request) -> Response:
    state = app_state(request)
    sid = request.path_params["id"]
    client_id_header(request)
    key = idempotency_key(request)
    ref, admission = await live_or_first(request, sid, key)
    if ref is not None:
        admission = await to_owner(state, sid, ref, lambda owner: state.store.send(
            ref.ws, owner, commands.Cancel(sid=sid), idempotency_key=key
        ), gone)
    if admission is None or admission.status is not AdmissionStatus.OK:
        raise not_found(sid)
    return Response(status_code=204)  # the reference's: no body


async def close(request: Request) -> Response:
    """`DELETE /session/:id`: a live session is closed (the reference's close; its row stays
    listed, and a load resumes it); a listed session that is not live is deleted
    (`_delete_listed`: docs/api.md, "Deleting a session")."""
    state = app_state(request)
    sid = request.path_params["id"]
    client_id_header(request)
    key = idempotency_key(request)
    try:
        ref, admission = await live_or_first(request, sid, key)
    except ApiError as error:
        if error.status != 404:
            raise
        return await _delete_listed(request, sid, key, error)
    request_id = ids.new_id()
    if ref is not None:
        command = commands.Close(sid=sid, request_id=request_id, reason=commands.CLOSED_BY_CLIENT)
        admission = await to_owner(
            state, sid, ref, lambda owner: state.store.send(ref.ws, owner, command, idempotency_key=key), gone
        )
    if admission is None or admission.status is not AdmissionStatus.OK:
        raise not_found(sid)
    if admission.repeated:
        await _await_gone(request, sid)
        return Response(status_code=204)
    assert ref is not None
    reply = await reply_to(state, request_id)
    state.locator.cache.changed(ref.ws, sid)  # (ref: a first close, never a repeat)
    if not reply.ok:
        raise not_found(sid)
    return Response(status_code=204)


async def _delete_listed(request: Request, sid: str, key: str | None, not_live: ApiError) -> Response:
    """Delete a listed session that is not live, in one step against a load's (see
    delete_listed.lua): 204 deleted; 404 no such row (`not_live`); 409 `session_resumed`
    when a load claimed or resumed it first (the load won: the session is, or is becoming,
    live, and a DELETE now closes it); 503 `session_not_released` while its dead worker's
    state is not swept (the sweeper removes it as the lease lapses)."""
    state = app_state(request)
    ws = await state.locator.workspace_of(sid, principal_of(request)) if ids.is_token(sid) else None
    if ws is None or ws not in state.workspaces:
        raise not_live
    loop = asyncio.get_running_loop()
    deadline = loop.time() + state.settings.close_timeout_s
    while True:
        async with effect(state.store.resends):  # a delete sent may have happened: the key tells
            outcome = await state.store.delete_listed(ws, sid, key)
        if outcome in (DeleteOutcome.DELETED, DeleteOutcome.REPEAT):
            state.locator.cache.changed(ws, sid)
            return Response(status_code=204)
        if outcome is DeleteOutcome.MISSING:
            raise not_live
        if outcome is DeleteOutcome.LOADING:
            raise resumed_meanwhile(sid)
        view = await state.store.session(ws, sid)  # LIVE: resumed since, or a dead owner's
        if view is not None and await state.registry.is_live(view.owner):
            raise resumed_meanwhile(sid)
        if loop.time() >= deadline:
            raise unavailable("the session's last worker has not been swept yet; retry shortly",
                              "session_not_released", retry_after_s=1, sessionId=sid)
        await asyncio.sleep(WAIT_STEP_S)


def resumed_meanwhile(sid: str) -> ApiError:
    return ApiError(
        409, "a load resumed this session while it was being deleted; it is live (a DELETE now closes it)",
        "session_resumed", sessionId=sid,
    )


async def _await_gone(request: Request, sid: str) -> None:
    """A repeated close: done once the session is no longer live."""
    state = app_state(request)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + state.settings.close_timeout_s
    while True:
        try:
            await state.locator.live(sid, principal_of(request))
        except ApiError:
            return
        if loop.time() >= deadline:
            raise ApiError(504, "the worker did not close the session in time", "close_timeout", sessionId=sid)
        await asyncio.sleep(WAIT_STEP_S)


async def status(request: Request) -> Response:
    """One read of the store on a cache miss; none while the cached state is current."""
    ref = await app_state(request).locator.live(request.path_params["id"], principal_of(request))
    body, etag = status_answer(ref)
    return Response(body, media_type=JSON_TYPE, headers={"ETag": etag})
