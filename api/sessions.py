"""Session routes: create or attach, prompt, cancel, close, status."""

from __future__ import annotations

import asyncio
import logging
import os
import random
from typing import Any, Awaitable, Callable

import orjson
from starlette.requests import Request
from starlette.responses import Response

from acp_state import commands, ids
from acp_state.commands import Reply
from acp_state.agents import is_agent_name
from acp_state.moves import accepts
from acp_state.ids import workspace_id
from acp_state.clock import iso, now_ms
from acp_state.store import ABANDONED, Admission, AdmissionStatus, CreateRecord, is_transient

from . import workspace_ref
from .auth import principal_of
from .cache import CachedSession
from .etag import weak_etag
from .locator import not_found
from .outcomes import effect, idempotency_key, outcome_unknown
from .responses import ApiError, JSON_TYPE, OrjsonResponse, json_body, unavailable
from .state import AppState, app_state
from .summaries import live_summary

log = logging.getLogger("api.sessions")

MAX_QUEUED_PROMPTS = 5
SINGLE_WAIT_STEP_S = 0.05
# How often a create that found no live worker looks again, and a repeated close or create
# checks whether the first one's effect has landed.
WAIT_STEP_S = 0.1
CHANNEL_PROMPT_META_KEY = "qwen.channel.prompt"


def gone(admission: Admission) -> bool:
    """SEND refused the command: the session is not its owner's (any more)."""
    return admission.status is AdmissionStatus.GONE


def client_id_header(request: Request) -> str | None:
    """`X-Qwen-Client-Id`: optional, at most 128 chars of `[A-Za-z0-9._:-]`."""
    value = request.headers.get("x-qwen-client-id")
    if value is None:
        return None
    if not ids.is_token(value):
        raise ApiError(400, "X-Qwen-Client-Id must be 1-128 characters of [A-Za-z0-9._:-]", "invalid_client_id")
    return value


async def _live_reports(state: AppState) -> list[dict[str, Any]]:
    """The live workers' load reports. Right after a start (or while every worker is
    between incarnations) there may be none yet: wait for one, up to the create timeout."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + state.settings.create_timeout_s
    fresh = False
    while True:
        reports = await state.reports.get(fresh)
        if reports or loop.time() >= deadline:
            return reports
        fresh = True  # none yet: read again each step, not the kept empty answer
        await asyncio.sleep(WAIT_STEP_S)


async def _offering(state: AppState, agent: str | None, state_store: str | None = None) -> list[dict[str, Any]]:
    """The live workers that can run a session of `agent` (None: any, its default agent),
    not draining, and reading `state_store` if one is named (a resume). A name no worker
    offers is 400 `unknown_agent`; a known one no live worker offers now (its workers died
    or left), or a store no live worker reads, is 503 with Retry-After."""
    if state_store is not None:
        stored = [r for r in await _live_reports(state) if accepts(r, None, state_store)]
        if not stored:
            raise unavailable(
                "no live worker reads the agent-state store this session's history is in",
                "no_worker_for_state_store", retry_after_s=2, stateStore=state_store,
            )
    if agent is None:
        candidates = [r for r in await _live_reports(state) if accepts(r, None, state_store)]
        if not candidates:
            raise unavailable("no worker is registered", "no_worker", retry_after_s=2)
        return candidates
    # A known name is judged at once; an unknown one only once some worker is live (right
    # after a start, the worker offering it may not have registered yet).
    known = agent in await state.store.known_agents()
    live = await state.store.worker_reports(await state.registry.live())
    candidates = list(live.values()) if known or live else await _live_reports(state)
    offering = [report for report in candidates if accepts(report, agent, state_store)]
    if offering:
        return offering
    if known:
        raise unavailable(f"no live worker offers agent {agent!r} now", "no_worker_for_agent", retry_after_s=2, agent=agent)
    raise unknown_agent(agent)


def not_resumable(sid: str) -> ApiError:
    return ApiError(409, "the session's agent cannot load sessions (no ACP loadSession); it cannot be resumed",
                    "not_resumable", sessionId=sid)


def unknown_agent(agent: Any) -> ApiError:
    return ApiError(400, f"no worker offers an agent named {agent!r} (see /capabilities)", "unknown_agent", agent=agent)


async def place(
    state: AppState,
    create: Callable[[str], commands.Create],
    before_send: Callable[[str], Awaitable[None]] | None = None,
    agent: str | None = None,
    state_store: str | None = None,
) -> Reply:
    """Send a create (`create(request id)`) to a live worker offering `agent` with spare
    capacity (and, for a load, reading `state_store`); try the next one if it is full or
    draining. `before_send(request id)` runs before each create goes out."""
    candidates = await _offering(state, agent, state_store)
    random.shuffle(candidates)  # equal loads spread instead of piling onto one worker
    # Least loaded first. Reports are as old as the last heartbeat, so a worker that looked
    # full is still asked last: the worker itself is the judge of its capacity.
    candidates.sort(key=lambda r: r.get("sessions", 0) / max(r.get("maxSessions", 1), 1))
    for report in candidates:
        request_id = ids.new_id()
        incarnation = report["incarnation"]
        if before_send is not None:
            await before_send(request_id)
        command = create(request_id)
        await state.store.send_control(incarnation, command)
        try:
            reply = await state.store.await_reply(
                request_id, state.settings.create_timeout_s, alive=lambda: state.registry.is_live(incarnation)
            )
        except Exception as error:  # the create went out: it may be under way, or done
            if is_transient(error):
                raise outcome_unknown() from error
            raise
        if reply is None and not await state.registry.is_live(incarnation):
            continue  # the worker died with the create: it was abandoned, try the next one
        if reply is None:
            raise ApiError(504, "the worker did not start the session in time", "agent_init_timeout")
        if reply.ok:
            await _told(state, command.ws, command.sid)
            return reply
        code = reply.code or "agent_unavailable"
        if code == "not_resumable":
            raise not_resumable(command.sid)
        if code not in ("worker_full", "agent_not_offered", "worker_draining"):
            raise ApiError(503, reply.error or "the agent could not start", code)
    raise unavailable("no live worker has spare capacity", "no_worker_capacity", retry_after_s=2)


async def _told(state: AppState, ws: str, sid: str) -> None:
    """A create's answer was taken: its session is one somebody was told of, and keeps its
    catalog row even if its worker dies. Best effort: if this is lost, such a death also
    takes the row, and the session was gone anyway."""
    try:
        await state.store.mark_told(ws, sid)
    except Exception:  # the store is away: the create's answer stands
        log.warning("could not mark session %s as told", sid, exc_info=True)


async def _keep(state: AppState, key: str, sid: str, client_id: str, attached: bool) -> None:
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
    if cwd is None:
        cwd = state.settings.workspaces[0]
    # The reference canonicalizes the cwd (resolve + realpath) before matching it.
    found = workspace_ref.find(request, cwd) if isinstance(cwd, str) and os.path.isabs(cwd) else None
    if found is None:
        raise workspace_ref.mismatch(request, cwd if isinstance(cwd, str) else "", "id")
    cwd = state.workspaces[found]
    if not principal_of(request).may(found):
        raise ApiError(404, "no such workspace", "workspace_not_found", workspaceCwd=cwd)
    scope = body.get("sessionScope", "single")
    if scope not in ("single", "thread"):
        raise ApiError(400, "sessionScope must be 'single' or 'thread'", "invalid_session_scope")
    requested = body.get("sessionId")
    if requested is not None and not ids.is_session_id(requested):
        raise ApiError(400, "sessionId must be an RFC 4122 UUID (versions 1-5)", "invalid_session_id")
    agent = body.get("agent")
    if agent is not None and not is_agent_name(agent):
        raise unknown_agent(agent)
    ws = workspace_id(cwd)
    client_id = header_client or ids.new_client_id()
    sid = requested or ids.new_id()
    key = idempotency_key(request)
    if key is None:
        return OrjsonResponse(await _create_or_attach(state, ws, cwd, scope, sid, client_id, requested, agent=agent))
    claim_ms = int(state.settings.create_timeout_s * 1000) + 10_000
    first = await state.store.claim_create(key, sid, client_id, claim_ms)
    if first is not None:
        return await _repeated_create(state, key, ws, cwd, first)
    sent: list[str] = []

    async def note(request_id: str) -> None:  # before the create goes out, so a retry can stop it
        await state.store.note_create_request(key, sid, client_id, request_id)
        sent.append(request_id)

    try:
        body = await _create_or_attach(state, ws, cwd, scope, sid, client_id, requested, note, agent=agent)
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
        await _told(state, ws, sid)
        body = {"sessionId": sid, "workspaceCwd": cwd, "attached": False, "clientId": client_id,
                "createdAt": late.created_at}
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
) -> dict[str, Any]:
    """Create the session on a worker offering `agent`, or attach to the workspace's shared
    one (whichever agent it runs)."""
    if requested is not None:
        existing = await state.store.session(ws, sid)
        if existing is not None and await state.registry.is_live(existing.owner):
            raise ApiError(409, f'Session "{sid}" is already live', "session_exists", sessionId=sid)

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
        )

    try:
        async with effect(state.store.resends):  # a create sent to a worker may have happened
            reply = await place(state, create, before_send, agent)
    except BaseException:
        if claimed:
            await state.store.release_single(ws, sid)
        raise
    state.locator.remember(sid, ws)
    return {"sessionId": sid, "workspaceCwd": cwd, "attached": False, "clientId": client_id, "createdAt": reply.created_at}


async def _repeated_create(state: AppState, key: str, ws: str, cwd: str, first: CreateRecord) -> Response:
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
                raise ApiError(503, answer.error or "the agent could not start", answer.code or "agent_unavailable")
            await _told(state, ws, record.sid)
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
    return OrjsonResponse(dict(body, createdAt=row["createdAt"] if row else created_at or iso(now_ms())))


async def first_create_outcome(state: AppState, key: str, ws: str, first: CreateRecord) -> CreateRecord | None:
    """How a create whose key record lapsed ended: its answer taken here (told, kept), or
    taken by an API that told the session and died before keeping it (kept), or unknown yet
    (the record is written again, so the next retry follows this same create, and the
    caller is told the outcome is unknown). None: it failed, or was abandoned (undone)."""
    assert first.request is not None
    answer = await state.store.take_reply(first.request)
    if isinstance(answer, Reply):
        if not answer.ok:
            return None
        await _told(state, ws, first.sid)
    elif answer == ABANDONED or not await state.store.was_told(ws, first.sid):
        if answer != ABANDONED and await state.store.catalog_row(ws, first.sid) is not None:
            claim_ms = int(state.settings.create_timeout_s * 1000) + 10_000
            if await state.store.claim_create(key, first.sid, first.client_id, claim_ms) is None:
                await state.store.note_create_request(key, first.sid, first.client_id, first.request)
            raise unavailable("the create's outcome is not known yet; retry with the same key", "outcome_unknown")
        return None
    await _keep(state, key, first.sid, first.client_id, first.attached)
    return first


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
        async with effect(state.store.resends):
            admission = await state.locator.to_owner(sid, ref, lambda owner: state.store.send(
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
        async with effect(state.store.resends):
            admission = await state.locator.to_owner(sid, ref, lambda owner: state.store.send(
                ref.ws, owner, commands.Cancel(sid=sid), idempotency_key=key
            ), gone)
    if admission is None or admission.status is not AdmissionStatus.OK:
        raise not_found(sid)
    return Response(status_code=204)  # the reference's: no body


async def close(request: Request) -> Response:
    state = app_state(request)
    sid = request.path_params["id"]
    client_id_header(request)
    key = idempotency_key(request)
    ref, admission = await live_or_first(request, sid, key)
    request_id = ids.new_id()
    if ref is not None:
        command = commands.Close(sid=sid, request_id=request_id, reason=commands.CLOSED_BY_CLIENT)
        async with effect(state.store.resends):
            admission = await state.locator.to_owner(
                sid, ref, lambda owner: state.store.send(ref.ws, owner, command, idempotency_key=key), gone
            )
    if admission is None or admission.status is not AdmissionStatus.OK:
        raise not_found(sid)
    if admission.repeated:
        await _await_gone(request, sid)
        return Response(status_code=204)
    assert ref is not None
    async with effect(state.store.resends):  # the close was sent: a lost reply leaves its outcome unknown
        reply = await state.store.await_reply(request_id, state.settings.close_timeout_s)
    if reply is None:  # the close stays queued for the worker: done later, or its death is told
        raise outcome_unknown()
    state.locator.cache.changed(ref.ws, sid)  # (ref: a first close, never a repeat)
    if not reply.ok:
        raise not_found(sid)
    return Response(status_code=204)


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


def status_answer(ref: CachedSession) -> tuple[bytes, str]:
    """The status answer of a kept session and its ETag, made on its first read: a poller's
    reads hash nothing again, as a listing page's do not."""
    if ref.status_body is None:
        ref.status_body = orjson.dumps(live_summary(ref.view))
        ref.status_etag = weak_etag(ref.status_body)
    return ref.status_body, ref.status_etag
