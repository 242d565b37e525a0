"""`GET /openapi.json`: an OpenAPI 3.1 description of every route this API serves.

Built from small helpers so each operation reads as one block. The shapes are the ones the
route code really returns (checked by `tests/test_fuzz.py`, which validates every response
of a schema-driven fuzz run against this document).
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from acp_state.commands import CALLER_TURN_KINDS, FOREGROUND

from ..limits import (
    ATTENTION_DEFAULT_SIZE,
    ATTENTION_MAX_SIZE,
    CATALOG_MAX_WORKSPACES,
    LISTING_MAX_SIZE,
    LIVE_STATE_MAX_WORKSPACES,
    MAX_BODY_BYTES,
    MAX_SAFE_INTEGER,
    MAX_SOURCE_ID,
    STREAM_BUFFER_MAX,
    STREAM_BUFFER_MIN,
    TRANSCRIPT_DEFAULT_PAGE,
    TRANSCRIPT_MAX_PAGE,
)
from ..responses import OrjsonResponse

Schema = dict[str, Any]

TOKEN_PATTERN = "^[A-Za-z0-9._:-]{1,128}$"
UUID_PATTERN = "^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[1-5][0-9a-fA-F]{3}-[89abAB][0-9a-fA-F]{3}-[0-9a-fA-F]{12}$"


# --- schema helpers -----------------------------------------------------------------------


def ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def string(**extra: Any) -> Schema:
    return {"type": "string", **extra}


def integer(**extra: Any) -> Schema:
    return {"type": "integer", **extra}


def boolean() -> Schema:
    return {"type": "boolean"}


def array(items: Schema, **extra: Any) -> Schema:
    return {"type": "array", "items": items, **extra}


def obj(
    required: dict[str, Schema] | None = None,
    optional: dict[str, Schema] | None = None,
    *,
    extra: bool | Schema = True,
    **annotations: Any,
) -> Schema:
    """An object with `required` and `optional` properties; `extra` says what other members may be."""
    properties = {**(required or {}), **(optional or {})}
    schema: Schema = {"type": "object", "properties": properties, "additionalProperties": extra, **annotations}
    if required:
        schema["required"] = list(required)
    return schema


# --- parameter helpers --------------------------------------------------------------------


def path_param(name: str, description: str, schema: Schema | None = None) -> Schema:
    return {"name": name, "in": "path", "required": True, "description": description, "schema": schema or string(minLength=1)}


def query_param(name: str, description: str, schema: Schema) -> Schema:
    return {"name": name, "in": "query", "required": False, "description": description, "schema": schema}


SESSION_ID = path_param("id", "Session id (as returned by `POST /session`).")
REQUEST_ID = path_param("requestId", "Permission request id (from the `permission_request` event or status).")
WORKSPACE_ID = path_param(
    "id", "Workspace id (the first 16 hex characters of sha256 of the workspace cwd) or its URL-encoded absolute cwd."
)
WORKSPACE = dict(WORKSPACE_ID, name="workspace")
PROMPT_ID = path_param("promptId", "Prompt id (as returned by `POST /session/:id/prompt`).")
BAD_WORKSPACE = "Neither the id nor an absolute path of a registered workspace the caller may see (`workspace_mismatch`)."
CLIENT_ID = {
    "name": "X-Qwen-Client-Id",
    "in": "header",
    "required": False,
    "description": "The caller's client id. Anything but 1-128 characters of `[A-Za-z0-9._:-]` is a 400 "
    "`invalid_client_id`.",
    "schema": string(pattern=TOKEN_PATTERN),
}
IDEMPOTENCY_KEY = {
    "name": "Idempotency-Key",
    "in": "header",
    "required": False,
    "description": "Makes a retry safe: the first success under this key is kept for a day, and a request "
    "with the same key returns it instead of acting again (after a 503 `outcome_unknown`, retry with it). "
    "Anything but 1-128 characters of `[A-Za-z0-9._:-]` is a 400 `invalid_idempotency_key`.",
    "schema": string(pattern=TOKEN_PATTERN),
}
LAST_EVENT_ID = {
    "name": "Last-Event-ID",
    "in": "header",
    "required": False,
    "description": "Resume after this event id: what was missed is replayed from the log, then `replay_complete`. "
    f"Only decimal digits up to {MAX_SAFE_INTEGER} count; any other value opens a fresh stream.",
    "schema": string(),
}


# --- response helpers ---------------------------------------------------------------------

RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before retrying.", "schema": string(pattern="^[0-9]+$")}}


def json_response(description: str, schema: Schema, headers: Schema | None = None) -> Schema:
    response: Schema = {"description": description, "content": {"application/json": {"schema": schema}}}
    if headers:
        response["headers"] = headers
    return response


def error(description: str, headers: Schema | None = None) -> Schema:
    return json_response(description, ref("Error"), headers)


def not_found(description: str) -> Schema:
    """A 404 from a route (JSON) or from the router itself when no route matches (plain text)."""
    response = error(description)
    response["content"]["text/plain"] = {"schema": string()}
    return response


TICKET = {
    "name": "ticket", "in": "query", "required": False, "schema": {"type": "string"},
    "description": "A stream ticket (`POST /stream-tickets`) in place of `Authorization`: it opens this stream once, "
    "within 60 s; used, expired or for another stream, the answer is 401 (`ticket_used`, `ticket_expired`, "
    "`ticket_invalid`).",
}
TOO_LARGE = {"413": error(f"The body exceeds {MAX_BODY_BYTES} bytes (`body_too_large`).")}


def json_body(schema: Schema, required: bool = True) -> Schema:
    return {"required": required, "content": {"application/json": {"schema": schema}}}


UNAUTHORIZED = error("A bearer token is required (any bind but a tokenless loopback one) and was missing or wrong.")
EDGE_REFUSED = (
    "A page of another origin than the API's own and `--allow-origin`'s (`origin_not_allowed`), or, on a loopback "
    "bind, a `Host` that names no loopback host (`host_not_allowed`)."
)
STORE_DOWN = (
    "Redis is unreachable (`store_unavailable`) or out of memory (`store_full`): nothing was taken, retry after "
    "`Retry-After`. Or Redis did not confirm the outcome (`outcome_unknown`): retry with the same `Idempotency-Key`."
)


def operation(operation_id: str, tag: str, summary: str, responses: Schema, *, parameters: list[Schema] | None = None,
              body: Schema | None = None, description: str | None = None, store: bool = True,
              auth: bool = True) -> Schema:
    """One operation. Any may answer the HTTP server's plain-text 400 for a malformed request
    (say a NUL byte in a header); one behind the token check (`auth`) may answer 401, one
    that reads Redis (`store`) 503."""
    op: Schema = {"operationId": operation_id, "tags": [tag], "summary": summary}
    if description:
        op["description"] = description
    if parameters:
        op["parameters"] = parameters
    if body is not None:
        op["requestBody"] = body
    op["responses"] = {**responses, "401": UNAUTHORIZED} if auth else dict(responses)
    forbidden = op["responses"].get("403", {}).get("description")
    op["responses"]["403"] = error(f"{forbidden} Or: {EDGE_REFUSED}" if forbidden else EDGE_REFUSED)
    bad = op["responses"].get("400", {"description": "The HTTP server rejected a malformed request.", "content": {}})
    op["responses"]["400"] = {**bad, "content": {**bad["content"], "text/plain": {"schema": string()}}}
    if not auth:
        op["security"] = [{}]
    if store:
        busy = responses.get("503", {}).get("description")
        op["responses"]["503"] = error(f"{busy} Or: {STORE_DOWN}" if busy else STORE_DOWN, RETRY_AFTER)
    return op


# --- components ---------------------------------------------------------------------------


def _error() -> Schema:
    return obj(
        {"error": string()},
        {
            "code": string(),
            "sessionId": string(),
            "requestId": string(),
            "workspaceId": string(),
            "workspaceCwd": {"description": "The cwd the request named, echoed as sent."},
            "optionId": string(),
            "retryAfterMs": integer(minimum=0),
        },
    )


def _pending_interaction() -> Schema:
    option = obj({"optionId": string()}, {"label": string(), "kind": string()})
    common = {"requestId": string(), "createdAt": string(), "options": array(option)}
    permission = obj(
        {**common, "kind": {"const": "permission"}, "action": obj(
            optional={"type": string(), "title": string(), "content": {}, "locations": {}, "input": {}}
        )},
    )
    question = obj(
        {**common, "kind": {"const": "user_question"}, "questions": array(obj({"answerKey": string()}))},
        {"title": string()},
    )
    return {"oneOf": [permission, question]}


def _status_fields() -> dict[str, Schema]:
    """Required in a live status (`updatedAt` and `hasRunningBackgroundTasks` are not: they
    appear once a turn has ended, as the reference's)."""
    return {
        "clientCount": integer(minimum=0),
        "hasActivePrompt": boolean(),
        "activeWorkState": string(enum=["active", "idle"]),
        "isWaitingForPermission": boolean(),
        "isWaitingForUserQuestion": boolean(),
        "pendingInteractionCount": integer(minimum=0),
        "hasTurnError": boolean(),
        "pendingInteractions": array(ref("PendingInteraction")),
    }


SESSION_BASE = {"sessionId": string(), "workspaceCwd": string(), "createdAt": string()}
MOVING = "acp-state's own: a draining worker is handing the session to another (prompts sent meanwhile wait)."
AFTER_A_TURN = {"updatedAt": string(), "hasRunningBackgroundTasks": boolean()}
# The reference's `session_source_metadata`: where a session came from (api/session_source.py).
SOURCE = {"sourceType": string(pattern="^[a-z][a-z0-9_-]{0,63}$"), "sourceId": string(minLength=1, maxLength=MAX_SOURCE_ID)}


def components() -> Schema:
    envelope = obj({"v": {"const": 1}, "type": string(), "data": {}}, {"id": integer(), "promptId": string(), "_meta": obj()})
    return {
        "Error": _error(),
        "EmptyObject": obj(extra=False),
        "Health": obj({"status": {"const": "ok"}}, extra=False),
        "Readiness": obj(
            {"status": {"enum": ["ready", "not_ready"]}, "redis": boolean(), "workers": integer(minimum=0)},
            {"code": {"enum": ["store_unavailable", "no_worker"]}, "error": string()},
            extra=False,
        ),
        "Capabilities": obj(
            {
                "v": {"const": 1},
                "protocolVersions": obj({"current": string(), "supported": array(string())}),
                "mode": string(),
                "features": array(string()),
                "sessionLiveStatePollIntervalMs": integer(minimum=1000),
                "workspaceCwd": string(),
                "transports": array(string()),
                "policy": obj({"permission": string()}),
                "limits": obj({"maxPendingPromptsPerSession": integer()}),
                "workspaces": array(
                    obj({"id": string(), "cwd": string(), "primary": boolean(), "trusted": boolean()})
                ),
                "agents": array(
                    obj(
                        {"name": string(), "workers": integer(minimum=0), "defaultOn": integer(minimum=0)},
                        description="An agent a create may name: how many live workers offer it (0: a create "
                        "naming it is 503 until one is back), and how many run it when a create names none.",
                    )
                ),
            }
        ),
        "CatalogVersion": obj({"generation": string(), "revision": integer(minimum=0)}, extra=False),
        "LiveStateRow": obj(
            {
                "sessionId": string(), "clientCount": integer(minimum=0), "hasActivePrompt": boolean(),
                "activeWorkState": string(enum=["idle", "active"]), "hasRunningBackgroundTasks": boolean(),
                "isWaitingForPermission": boolean(), "isWaitingForUserQuestion": boolean(),
            },
            {"updatedAt": string(), "moving": {"const": True, "description": MOVING}},
        ),
        "LiveState": obj(
            {"v": {"const": 1}, "catalogVersion": ref("CatalogVersion"), "sessions": array(ref("LiveStateRow"))}
        ),
        "AttentionItem": obj(
            {"sessionId": string(), "workspaceId": string(), "workspaceCwd": string(),
             "kind": string(enum=["permission", "user_question", "turn_error"]), "since": integer()},
            {"requestId": string(), "title": string()},
        ),
        "AttentionPage": obj(
            {"items": array(ref("AttentionItem")), "nextCursor": {"type": ["string", "null"]}}
        ),
        "Workers": obj(
            {"workers": array(obj(
                {"incarnation": string(), "sessions": integer(), "maxSessions": integer(), "expiresInMs": integer(),
                 "states": {"type": "object"}},
                {"host": {"type": ["string", "null"]}, "pid": {"type": ["integer", "null"]},
                 "startedAt": {"type": ["string", "null"]}, "leaseMs": {"type": ["integer", "null"]},
                 "leaseAgeMs": {"type": ["integer", "null"]}, "load": {"type": ["number", "null"]},
                 "agents": {}, "draining": boolean(), "stateStore": {"type": ["string", "null"]}},
            )), "serverTime": integer()}
        ),
        "MemberError": obj(
            {"workspace": string(), "error": obj({"code": string(), "message": string(), "status": integer()})},
            {"workspaceId": string(), "cwd": string()},
        ),
        "LiveStates": obj(
            {"v": {"const": 1}, "workspaces": array({"oneOf": [
                obj({"workspace": string(), "workspaceId": string(), "cwd": string(),
                     "catalogVersion": ref("CatalogVersion"), "sessions": array(ref("LiveStateRow"))}),
                ref("MemberError"),
            ]})}
        ),
        "LiveStatesRequest": obj(
            {"workspaces": array(string(minLength=1), minItems=1, maxItems=LIVE_STATE_MAX_WORKSPACES,
                                 description="Workspace ids or absolute cwds.")},
            extra=False,
        ),
        "CatalogRequest": obj(
            {"workspaces": {"oneOf": [
                {"const": "all"},
                array(obj({"workspace": string(minLength=1, maxLength=4096)}, {"cursor": string()}, extra=False),
                      minItems=1, maxItems=CATALOG_MAX_WORKSPACES),
            ]}},
            {
                "options": obj(optional={
                    "size": integer(minimum=1, maximum=LISTING_MAX_SIZE),
                    "archiveState": string(enum=["active", "archived"]),
                    **SOURCE,
                }, extra=False),
                "includeGroups": boolean(),
            },
            extra=False,
        ),
        "Catalog": obj({"workspaces": array({"oneOf": [
            obj({"workspace": string(), "workspaceId": string(), "cwd": string(),
                 "sessions": array(ref("SessionRow"))}, {"nextCursor": string(), "groups": array(obj())}),
            ref("MemberError"),
        ]})}),
        "TurnStatus": obj(
            {"sessionId": string(), "state": string(enum=["idle", "queued", "running", "completed", "cancelled", "error"])},
            {
                "promptId": string(), "promptText": string(), "promptTextTruncated": boolean(),
                "queuedAt": integer(), "startedAt": integer(), "endedAt": integer(), "stopReason": string(),
                "error": obj({"message": string()}, {"code": string()}), "resultText": string(),
                "resultTruncated": boolean(), "resultCode": string(), "originatorClientId": string(),
            },
        ),
        "CreateSessionRequest": obj(
            optional={
                "cwd": string(description="A registered workspace cwd; default: the API's first workspace."),
                "workspaceCwd": string(description="Same as `cwd` (takes precedence)."),
                "sessionScope": string(enum=["single", "thread"], default="single"),
                "sessionId": string(pattern=UUID_PATTERN, description="Caller-chosen id (RFC 4122 UUID v1-5)."),
                "agent": string(description="The agent to run (a name in `/capabilities` `agents`); default: the "
                                "default agent of the worker that gets the session."),
                **SOURCE,
            }
        ),
        "Session": obj(
            {"sessionId": string(), "workspaceCwd": string(), "attached": boolean(), "clientId": string(), "createdAt": string()},
            {**SOURCE, "sourcePersisted": boolean()},
        ),
        "ContentBlock": {
            **obj({"type": string()}, {"text": string()}),
            "if": obj({"type": {"const": "text"}}),
            "then": obj({"text": string()}),
        },
        "PromptRequest": obj(
            {"prompt": array(ref("ContentBlock"), minItems=1)},
            {
                "turnKind": string(enum=list(CALLER_TURN_KINDS), default=FOREGROUND),
                "_meta": obj(description="Passed to the agent; `qwen.channel.prompt` only from a channel caller."),
            },
        ),
        "PromptAccepted": obj({"promptId": string(), "lastEventId": integer(minimum=0), "eventEpoch": string()}),
        "TurnError": obj({"message": string()}, {"code": string(), "errorKind": string()}),
        "PendingInteraction": _pending_interaction(),
        "SessionStatus": obj(
            {**SESSION_BASE, **_status_fields()},
            {**AFTER_A_TURN, "turnError": ref("TurnError"), "moving": {"const": True, "description": MOVING},
             "approvalMode": string(description="The agent's ACP session mode, when it has modes.")},
        ),
        "SessionRow": {
            "description": "A live session (status fields and `isArchived: false`) or a persisted one "
            "(`clientCount: 0`, `hasActivePrompt: false`, `isArchived: false`, no other runtime fields).",
            **obj(
                {**SESSION_BASE, "clientCount": integer(minimum=0), "hasActivePrompt": boolean()},
                {**_status_fields(), **AFTER_A_TURN, "isArchived": {"const": False}, "displayName": string(),
                 "turnError": ref("TurnError"), "moving": {"const": True, "description": MOVING},
                 "resumable": {"type": "boolean", "description": "A persisted row's: whether a load can resume "
                               "it (false: its agent cannot load sessions)."}, **SOURCE},
            ),
        },
        "SessionList": obj({"sessions": array(ref("SessionRow"))}, {"nextCursor": string()}),
        "TranscriptRecord": obj({"v": {"const": 1}, "type": string(), "data": {}}),
        "Transcript": obj(
            {"v": {"const": 1}, "sessionId": string(), "events": array(ref("TranscriptRecord")), "hasMore": boolean()},
            {"nextCursor": string(), "startTime": string(), "lastUpdated": string()},
        ),
        "LoadRequest": obj(
            optional={"historyPageSize": {"oneOf": [integer(minimum=1, maximum=TRANSCRIPT_MAX_PAGE), string(pattern="^[0-9]+$")]}}
        ),
        "RestoredSession": obj(
            {
                "sessionId": string(),
                "workspaceCwd": string(),
                "attached": boolean(),
                "clientId": string(),
                "createdAt": string(),
                "state": obj(),
                "hasRunningBackgroundTasks": boolean(),
                "hasActivePrompt": boolean(),
                "compactedReplay": array(envelope),
                "liveJournal": array({}),
                "lastEventId": integer(minimum=0),
                "eventEpoch": string(),
            },
            {"historyHasMore": {"const": True, "description": "Present when older transcript pages remain."}},
        ),
        "VoteRequest": obj(
            {
                "outcome": {
                    "oneOf": [
                        obj({"outcome": {"const": "cancelled"}}),
                        obj({"outcome": {"const": "selected"}, "optionId": string(minLength=1)}),
                    ]
                }
            },
            {"answers": obj(description="Answers to a user question, by `answerKey`.", extra=string())},
        ),
    }


# --- paths --------------------------------------------------------------------------------

NO_SESSION = "No live session with this id (unknown, closed, or its worker's lease lapsed)."
BAD_CLIENT = error("`X-Qwen-Client-Id` is malformed (`invalid_client_id`).")


def paths() -> Schema:
    return {
        "/openapi.json": {
            "get": operation(
                "getOpenApi", "Discovery", "This document", {"200": json_response("OpenAPI 3.1", obj())}, store=False
            )
        },
        "/health": {
            "get": operation(
                "getHealth", "Discovery", "Liveness probe (open even where tokens are required)",
                {"200": json_response("Up.", ref("Health"))}, store=False, auth=False,
            )
        },
        "/health/ready": {
            "get": operation(
                "getReadiness", "Discovery", "Readiness probe: Redis reachable and at least one live worker",
                {
                    "200": json_response("Ready: Redis answers and a worker holds a lease.", ref("Readiness")),
                    "503": json_response("Not ready: Redis is unreachable or no worker is live.", ref("Readiness")),
                },
                store=False, auth=False,
            )
        },
        "/metrics": {
            "get": operation(
                "getMetrics", "Discovery", "Prometheus metrics of this API process",
                {"200": {"description": "Prometheus text exposition.", "content": {"text/plain": {"schema": string()}}},
                 "403": error("Not an admin token (`forbidden`), or one scoped to a workspace "
                              "(`deployment_scope_required`: the metrics count every workspace's sessions).")},
            )
        },
        "/capabilities": {
            "get": operation(
                "getCapabilities", "Discovery", "Features, limits and registered workspaces",
                {"200": json_response("What this API serves (workspaces: those the caller's token may see; "
                                      "agents: those workers offer).", ref("Capabilities"))},
            )
        },
        "/session": {
            "post": operation(
                "createOrAttachSession", "Sessions", "Create a session, or attach to the workspace's shared one",
                {
                    "200": json_response("Created (`attached: false`) or attached (`attached: true`).", ref("Session")),
                    **TOO_LARGE,
                    "400": error("Bad body, header, workspace (`workspace_mismatch`), scope, session id, or an "
                                 "agent no worker offers (`unknown_agent`)."),
                    "409": error("A live session of the workspace already has the requested `sessionId` "
                                 "(`session_exists`), or a session of another workspace, live or listed, holds it "
                                 "(`session_id_conflict`: ids are unique across workspaces; which one is not said)."),
                    "503": error("No worker has capacity, no live worker offers the agent named "
                                 "(`no_worker_for_agent`), the shared session is being replaced, or the agent failed "
                                 "to start.", RETRY_AFTER),
                    "504": error("The worker did not start the session in time (`agent_init_timeout`)."),
                },
                parameters=[CLIENT_ID, IDEMPOTENCY_KEY],
                body=json_body(ref("CreateSessionRequest")),
            )
        },
        "/session/{id}": {
            "delete": operation(
                "closeSession", "Sessions", "Close a live session, or delete a listed one that is not live",
                {
                    "204": {"description": "Closed (a live session: its row stays listed), or deleted (a listed "
                                           "session that is not live: gone from the listing, a load answers 404)."},
                    "400": BAD_CLIENT,
                    "404": not_found("No session with this id, live or listed (unknown, or deleted)."),
                    "409": error("A load resumed the session (or claimed it) before the delete: the load won "
                                 "(`session_resumed`); a DELETE now closes it."),
                    "504": error("The worker did not confirm the close in time (`close_timeout`)."),
                },
                parameters=[SESSION_ID, CLIENT_ID, IDEMPOTENCY_KEY],
                description="A live session is closed, as the reference closes it, and stays listed (a load "
                            "resumes it). A listed session that is not live (its worker died, or it was closed) "
                            "is deleted, in one step against any load of it: docs/api.md, \"Deleting a session\". "
                            "503 `session_not_released` while its dead worker is not swept yet.",
            )
        },
        "/session/{id}/prompt": {
            "post": operation(
                "promptSession", "Prompts and events", "Send a prompt (runs now, or queues behind the running one)",
                {
                    "202": json_response("Admitted; its events carry `promptId`.", ref("PromptAccepted")),
                    **TOO_LARGE,
                    "400": error("Bad body or header (`invalid_prompt`, `invalid_turn_kind`, `invalid_client_id`, ...)."),
                    "404": not_found(NO_SESSION),
                    "503": error("The session's prompt queue is full (`prompt_queue_full`).", RETRY_AFTER),
                },
                parameters=[SESSION_ID, CLIENT_ID, IDEMPOTENCY_KEY],
                body=json_body(ref("PromptRequest")),
            )
        },
        "/session/{id}/cancel": {
            "post": operation(
                "cancelSession", "Prompts and events", "Cancel the running prompt",
                {"204": {"description": "Sent (no body, as the reference)."}, "400": BAD_CLIENT, "404": not_found(NO_SESSION)},
                parameters=[SESSION_ID, CLIENT_ID, IDEMPOTENCY_KEY],
                description="Any request body is ignored.",
            )
        },
        "/session/{id}/heartbeat": {
            "post": operation(
                "heartbeatSession", "Prompts and events", "A client is still watching the session",
                {
                    "200": json_response("Recorded; `lastSeenAt` is Redis's clock (epoch ms).", obj(
                        {"sessionId": string(), "lastSeenAt": integer(minimum=0)}, {"clientId": string()},
                    )),
                    "400": error("`X-Qwen-Client-Id` is malformed, or not registered on the session "
                                 "(`invalid_client_id`, with `sessionId` and `clientId`)."),
                    "404": not_found(NO_SESSION),
                },
                parameters=[SESSION_ID, CLIENT_ID],
                description="The named client counts (`clientCount`) until `--client-ttl-ms` after its last "
                "heartbeat, or until it detaches. Any request body is ignored.",
            )
        },
        "/session/{id}/detach": {
            "post": operation(
                "detachSession", "Prompts and events", "A client leaves the session",
                {"204": {"description": "Done, or nothing to do (no client id, one the session does not know, or "
                                        "no live session of that id the caller may see), as the reference."},
                 "400": BAD_CLIENT},
                parameters=[SESSION_ID, CLIENT_ID],
                description="The client no longer counts (`clientCount`) nor may it vote. Any request body is ignored.",
            )
        },
        "/session/{id}/pending-prompts": {
            "get": operation(
                "listPendingPrompts", "Prompts and events", "The session's prompt queue",
                {
                    "200": json_response("The prompts accepted and not ended: the running one, then the queued "
                                         "ones in admission order.", obj({"pendingPrompts": array(obj(
                                             {"promptId": string(), "text": string(), "queuedAt": integer(minimum=0),
                                              "state": string(enum=["queued", "running"])},
                                             {"originatorClientId": string()},
                                         ))})),
                    "400": BAD_CLIENT,
                    "404": not_found(NO_SESSION),
                },
                parameters=[SESSION_ID, CLIENT_ID],
            )
        },
        "/session/{id}/pending-prompts/{promptId}": {
            "delete": operation(
                "removePendingPrompt", "Prompts and events", "Take a prompt out of the queue",
                {
                    "200": json_response("`removed: true`: it was pending (a queued one ends `cancelled` without "
                                         "running, the running one is cancelled); false: unknown or ended.",
                                         obj({"removed": boolean()})),
                    "400": BAD_CLIENT,
                    "404": not_found(NO_SESSION),
                    "503": error("The worker did not answer in time (`outcome_unknown`), or the store is "
                                 "unavailable."),
                },
                parameters=[SESSION_ID, path_param("promptId", "A prompt id the session accepted."), CLIENT_ID],
            )
        },
        "/session/{id}/supported-commands": {
            "get": operation(
                "getSupportedCommands", "Prompts and events", "The commands the session's agent advertises",
                {
                    "200": json_response("The agent's last ACP `available_commands_update` (`[]` before any).", obj({
                        "v": integer(minimum=1), "sessionId": string(), "availableCommands": array(obj({"name": string()})),
                        "availableSkills": array(obj()),
                    })),
                    "404": not_found(NO_SESSION),
                },
                parameters=[SESSION_ID],
            )
        },
        "/session/{id}/approval-mode": {
            "post": operation(
                "setApprovalMode", "Prompts and events", "Switch the agent's session mode",
                {
                    "200": json_response("Switched (ACP `session/set_mode`); nothing is persisted.", obj({
                        "sessionId": string(), "mode": string(), "previous": string(), "persisted": boolean(),
                    })),
                    "400": error("`invalid_approval_mode` (not one of the reference's modes, or not one the agent "
                                 "offers: `allowed` names those), `invalid_persist_flag`, `invalid_plan_mode`, "
                                 "`invalid_client_id`, `invalid_json`."),
                    "404": not_found(NO_SESSION),
                    "502": error("The agent refused the mode (`agent_error`)."),
                    "503": error("The worker did not answer in time (`outcome_unknown`), or the store is "
                                 "unavailable."),
                },
                parameters=[SESSION_ID, CLIENT_ID],
                body=json_body(obj({"mode": string(enum=["plan", "default", "auto-edit", "auto", "yolo"])},
                                   {"persist": boolean(), "planMode": boolean()}), required=False),
            )
        },
        "/session/{id}/status": {
            "get": operation(
                "getSessionStatus", "Prompts and events", "Runtime status of a live session",
                {"200": json_response("The live status.", ref("SessionStatus")), "404": not_found(NO_SESSION)},
                parameters=[SESSION_ID],
            )
        },
        "/session/{id}/events": {
            "get": operation(
                "streamSessionEvents", "Prompts and events", "The session's events as Server-Sent Events",
                {
                    "200": {
                        "description": "An endless `text/event-stream`: `retry:`, then `session_snapshot` (fresh) or the "
                        "replay and `replay_complete` (with `Last-Event-ID`), then live events; `history_truncated` "
                        "announces history the log no longer holds. Each frame's `data:` is one JSON envelope.",
                        "content": {"text/event-stream": {"schema": string()}},
                    },
                    "404": not_found("No such session, or it is not live and no `Last-Event-ID` was sent."),
                },
                parameters=[
                    SESSION_ID,
                    LAST_EVENT_ID,
                    query_param("eventEpoch", "The epoch the client's `Last-Event-ID` belongs to.", string()),
                    query_param("maxQueued", f"Live events buffered for a slow reader ({STREAM_BUFFER_MIN}-{STREAM_BUFFER_MAX}).",
                                string(pattern="^[0-9]+$")),
                    TICKET,
                ],
            )
        },
        "/session/{id}/transcript": {
            "get": operation(
                "getSessionTranscript", "Prompts and events", "One page of the session's transcript, newest page first",
                {
                    "200": json_response("A page, oldest record first.", ref("Transcript")),
                    "400": error("Bad `limit` (`invalid_limit`) or `cursor` (`invalid_cursor`)."),
                    "404": not_found("No transcript for this session id."),
                },
                parameters=[
                    SESSION_ID,
                    query_param("limit", "Page size.", integer(minimum=1, maximum=TRANSCRIPT_MAX_PAGE, default=TRANSCRIPT_DEFAULT_PAGE)),
                    query_param("cursor", "`nextCursor` of the previous page.", string(pattern="^[0-9]{1,20}-[0-9]{1,20}$")),
                ],
            )
        },
        "/session/{id}/load": {
            "post": operation(
                "loadSession", "Sessions", "Attach to a live session, or resume a persisted one, and get its replay",
                {
                    "200": json_response(
                        "Attached (`attached: true`), or resumed on a live worker through its agent's `session/load` "
                        "(`attached: false`), with the newest transcript page or the live log.",
                        ref("RestoredSession"),
                    ),
                    **TOO_LARGE,
                    "400": error("Bad body (`invalid_request`, `invalid_limit`) or header."),
                    "404": not_found(NO_SESSION),
                    "409": error("The session's agent cannot load sessions (`not_resumable`)."),
                    "503": error("No live worker can resume it now (`no_worker_for_state_store`, `no_worker_for_agent`, "
                                 "`no_worker`, `no_worker_capacity`, `resume_failed`), its last worker is not swept yet "
                                 "(`session_not_released`), or another load of it is still under way "
                                 "(`restore_in_progress`).", RETRY_AFTER),
                    "504": error("The worker did not load the session in time (`agent_init_timeout`)."),
                },
                parameters=[SESSION_ID, CLIENT_ID],
                body=json_body(ref("LoadRequest"), required=False),
            )
        },
        "/session/{id}/resume": {
            "post": operation(
                "resumeSession", "Sessions", "Attach to a live session, or resume a persisted one, without its replay",
                {
                    "200": json_response(
                        "Attached (`attached: true`, `state: {}`), or resumed on a live worker through its agent's "
                        "`session/resume` where it advertises it, else `session/load` (`attached: false`, `state`: "
                        "what the agent reported of the session). No `compactedReplay`.",
                        obj({"sessionId": string(), "workspaceCwd": string(), "attached": boolean(), "clientId": string(),
                             "createdAt": string(), "state": obj(), "hasRunningBackgroundTasks": boolean(),
                             "hasActivePrompt": boolean(), "lastEventId": integer(minimum=0), "eventEpoch": string()}),
                    ),
                    **TOO_LARGE,
                    "400": error("Bad body (`invalid_request`, `invalid_json`) or header."),
                    "404": not_found(NO_SESSION),
                    "409": error("The session's agent cannot resume sessions (`not_resumable`)."),
                    "503": error("No live worker can resume it now (as `POST /session/{id}/load`).", RETRY_AFTER),
                    "504": error("The worker did not resume the session in time (`agent_init_timeout`)."),
                },
                parameters=[SESSION_ID, CLIENT_ID],
                body=json_body(obj(), required=False),
            )
        },
        "/session/{id}/context": {
            "get": operation(
                "getSessionContext", "Prompts and events", "The session's state as its agent reported it",
                {
                    "200": json_response(
                        "`state`: the agent's `modes` and `configOptions` from its ACP session/new, load or resume "
                        "(`{}` if it said none); `recovery` is always `{kind: clean, canContinue: false}`.",
                        obj({"v": integer(minimum=1), "sessionId": string(), "workspaceCwd": string(),
                             "recovery": obj({"kind": string(), "canContinue": boolean()}), "state": obj()})),
                    "404": not_found(NO_SESSION),
                },
                parameters=[SESSION_ID],
            )
        },
        "/session/{id}/context-usage": {
            "get": operation(
                "getSessionContextUsage", "Prompts and events", "How full the agent's context window is",
                {
                    "200": json_response(
                        "From the agent's last ACP `usage_update` (`used` of `size` tokens, all `unattributed` in the "
                        "breakdown); 0 tokens and `isEstimated: true` before it reported any.",
                        obj({"v": integer(minimum=1), "sessionId": string(), "workspaceCwd": string(),
                             "usage": obj({"totalTokens": integer(minimum=0), "contextWindowSize": integer(minimum=0),
                                           "breakdown": obj(), "isEstimated": boolean(), "showDetails": boolean()}),
                             "formattedText": string()})),
                    "404": not_found(NO_SESSION),
                },
                parameters=[SESSION_ID, query_param("detail", "`true`: `showDetails` (nothing more is known).", string())],
            )
        },
        "/session/{id}/goal": {
            "get": operation(
                "getSessionGoal", "Prompts and events", "The reference's session goal: none here (acp-state has no goals)",
                {
                    "200": json_response("No goal.", obj({"snapshot": obj({"v": {"const": 2}, "goal": {"type": "null"},
                                                                           "activity": {"const": "idle"}})})),
                    "404": not_found(NO_SESSION),
                },
                parameters=[SESSION_ID],
            )
        },
        "/session/{id}/permission/{requestId}": {
            "post": operation(
                "voteOnPermission", "Permissions", "Answer a pending permission request or user question",
                {
                    "200": json_response("The vote won the request.", ref("EmptyObject")),
                    **TOO_LARGE,
                    "400": error("Malformed `outcome`, option not offered (`invalid_option_id`), or an unregistered or "
                                 "malformed client id (`invalid_client_id`)."),
                    "404": not_found("No such session, or no such pending request in it."),
                },
                parameters=[SESSION_ID, REQUEST_ID, CLIENT_ID, IDEMPOTENCY_KEY],
                body=json_body(ref("VoteRequest")),
            )
        },
        "/permission/{requestId}": {
            "post": operation(
                "voteOnPermissionLegacy", "Permissions", "Answer a pending request by its id alone (legacy route)",
                {
                    "200": json_response("The vote won the request.", ref("EmptyObject")),
                    **TOO_LARGE,
                    "400": error("Malformed `outcome`, option not offered, or a bad client id."),
                    "404": not_found("No such pending request."),
                },
                parameters=[REQUEST_ID, CLIENT_ID, IDEMPOTENCY_KEY],
                body=json_body(ref("VoteRequest")),
            )
        },
        "/workspace/{id}/sessions": {
            "get": operation(
                "listWorkspaceSessions", "Sessions", "The workspace's sessions, newest first, live ones with runtime fields",
                {
                    "200": json_response("One page.", ref("SessionList")),
                    "400": error("`size` not an integer (`invalid_size`), bad `archiveState` or `cursor` (`invalid_cursor`). Or: "
                                 + BAD_WORKSPACE),
                    "404": not_found("No route matches the path (a workspace the caller's token may not see is "
                                     "answered as an unregistered one: 400 `workspace_mismatch`)."),
                },
                parameters=[
                    WORKSPACE_ID,
                    query_param("size", f"Page size: any integer, clamped to 1..{LISTING_MAX_SIZE} as the reference clamps it.",
                                integer(default=20)),
                    query_param("archiveState", "Which sessions.", string(enum=["active", "archived"], default="active")),
                    query_param("cursor", "`nextCursor` of the previous page.", string()),
                    query_param("sourceType", "Only sessions of this source (`default`: also those created "
                                "without one); 400 `invalid_session_source` if malformed.", string()),
                    query_param("sourceId", "With `sourceType`: only this source id.", string()),
                ],
            )
        },
        "/workspaces/{workspace}/sessions/live-state": {
            "get": operation(
                "getWorkspaceLiveState", "Sessions", "The runtime flags of the workspace's live sessions, versioned",
                {
                    "200": json_response("The live state; `ETag` names it.", ref("LiveState")),
                    "304": {"description": "Unchanged since the `If-None-Match` ETag."},
                    "400": error(BAD_WORKSPACE),
                    "404": not_found("No route matches the path (a workspace the caller's token may not see is "
                                     "answered as an unregistered one: 400 `workspace_mismatch`)."),
                },
                parameters=[WORKSPACE, {"name": "If-None-Match", "in": "header", "required": False,
                                        "description": "An ETag of an earlier answer.", "schema": string()}],
            )
        },
        "/workspaces/{workspace}/sessions/live-state/events": {
            "get": operation(
                "streamWorkspaceLiveState", "Sessions", "The workspace's live state, pushed as Server-Sent Events",
                {
                    "200": {
                        "description": "An endless `text/event-stream`: `retry:`, then `live_state_snapshot` (the "
                        "live-state body) and one `live_state_changed` `{catalogVersion, sessions, removed}` per "
                        "change, `id:` `<revision>-<generation>` (the frame's `catalogVersion`): all a resume needs, "
                        "so a browser's EventSource reconnect (`Last-Event-ID` alone) gets what changed since that "
                        "revision, or a snapshot when the API process cannot tell it. The "
                        "`X-Acp-Catalog-Generation` header names the generation.",
                        "content": {"text/event-stream": {"schema": string()}},
                    },
                    "400": error(BAD_WORKSPACE),
                    "404": not_found("No route matches the path (a workspace the caller's token may not see is "
                                     "answered as an unregistered one: 400 `workspace_mismatch`)."),
                },
                parameters=[
                    WORKSPACE,
                    {**LAST_EVENT_ID, "description": "Resume after this frame: its `id:` as sent "
                     "(`<revision>-<generation>`), or a bare revision with `generation` beside it (the form before). "
                     "Any other value opens a fresh stream (a snapshot)."},
                    query_param("lastEventId", "As `Last-Event-ID`, for clients that cannot send it (the header "
                                "wins).", string(pattern="^[0-9]+(-[0-9A-Za-z]+)?$")),
                    query_param("generation", "The generation of a bare revision (a generation in the id wins).",
                                string()),
                    TICKET,
                ],
            )
        },
        "/attention": {
            "get": operation(
                "getAttention", "Sessions", "Every live session the token may see that waits for a human, oldest first",
                {
                    "200": json_response("One page of the inbox.", ref("AttentionPage")),
                    "400": error("Bad `size` (`invalid_size`) or `cursor` (`invalid_cursor`)."),
                },
                parameters=[
                    query_param("size", f"Items per page (1-{ATTENTION_MAX_SIZE}, default {ATTENTION_DEFAULT_SIZE}).", string(pattern="^[0-9]+$")),
                    query_param("cursor", "The `nextCursor` of the previous page.", string()),
                ],
            )
        },
        "/attention/events": {
            "get": operation(
                "streamAttention", "Sessions", "The attention inbox, pushed as Server-Sent Events",
                {
                    "200": {
                        "description": "An endless `text/event-stream`: `retry:`, then `attention_snapshot` `{items}`, "
                        "then `attention_added` (an item) and `attention_removed` `{sessionId, workspaceId, kind, "
                        "requestId?}`, `id:` `<position>-<epoch>` (the changes the API process's hub pushed, and its "
                        "epoch): a reconnect with `Last-Event-ID` alone, on that process while its hub runs, gets "
                        "what changed since; any other resume a fresh snapshot.",
                        "content": {"text/event-stream": {"schema": string()}},
                    },
                },
                parameters=[
                    {**LAST_EVENT_ID, "description": "Resume after this frame: its `id:` as sent. Any other "
                     "value opens a fresh stream (a snapshot)."},
                    query_param("lastEventId", "As `Last-Event-ID`, for clients that cannot send it (the header "
                                "wins).", string(pattern="^[0-9]+(-[0-9A-Za-z]+)?$")),
                    TICKET,
                ],
            )
        },
        "/stream-tickets": {
            "post": operation(
                "createStreamTicket", "Prompts and events",
                "A single-use ticket that opens one event stream, for clients that cannot send `Authorization`",
                {
                    "200": json_response(
                        "The ticket: pass it as `?ticket=` to the stream at `path` within 60 s (`expiresAt`, epoch "
                        "ms); it opens that stream once, as the caller.",
                        obj({"ticket": string(), "expiresAt": integer(minimum=0), "path": string()}),
                    ),
                    "400": error("Not JSON (`invalid_json`), or `path` names no event stream (`invalid_stream_path`)."),
                    **TOO_LARGE,
                },
                body=json_body(obj({"path": string()})),
                store=False,
            )
        },
        "/brand": {
            "get": operation(
                "getBrand", "Discovery", "The reference's white-label brand: none here (`{}`, the built-in one)",
                {"200": json_response("No brand.", obj({}, extra=False))},
                store=False,
            )
        },
        "/goals": {
            "get": operation(
                "listGoals", "Discovery", "The reference's active session goals: none here (acp-state has no goals)",
                {"200": json_response("No goal.", obj({"v": {"const": 1}, "goals": array({}, maxItems=0),
                                                      "droppedCount": {"const": 0}}))},
                store=False,
            )
        },
        "/workspace/settings": {
            "get": operation(
                "getWorkspaceSettings", "Discovery", "The reference's workspace settings: none here",
                {"200": json_response("No setting.", obj({"v": {"const": 1}, "settings": array({}, maxItems=0)}))},
                store=False,
            )
        },
        "/workspace/extensions": {
            "get": operation(
                "listExtensions", "Discovery", "The reference's installed extensions: none here",
                {"200": json_response("No extension.", obj({"v": {"const": 1}, "workspaceCwd": string(),
                                                            "initialized": boolean(), "extensions": array({}, maxItems=0)}))},
                store=False,
            )
        },
        "/workspace/extensions/operations": {
            "get": operation(
                "listExtensionOperations", "Discovery", "The reference's extension installs under way: none here",
                {"200": json_response("None.", obj({"v": {"const": 1}, "operations": array({}, maxItems=0)}))},
                store=False,
            )
        },
        "/workers": {
            "get": operation(
                "getWorkers", "Discovery", "The deployment's live workers: lease age, sessions, load",
                {
                    "200": json_response("Every worker whose lease holds.", ref("Workers")),
                    "403": error("A workspace-scoped token (`deployment_scope_required`)."),
                },
            )
        },
        "/sessions/live-state": {
            "post": operation(
                "getLiveStates", "Sessions", f"The live state of 1 to {LIVE_STATE_MAX_WORKSPACES} workspaces in one request",
                {
                    "200": json_response("One member per workspace asked, in order.", ref("LiveStates")),
                    **TOO_LARGE,
                    "400": error(f"Malformed body (`invalid_live_state_request`) or more than {LIVE_STATE_MAX_WORKSPACES} "
                                 "(`too_many_workspaces`)."),
                },
                body=json_body(ref("LiveStatesRequest")),
            )
        },
        "/sessions/catalog": {
            "post": operation(
                "getCatalog", "Sessions", "One listing page of each selected workspace",
                {
                    "200": json_response("One member per selection, in order.", ref("Catalog")),
                    **TOO_LARGE,
                    "400": error(f"Malformed body (`invalid_session_catalog_request`) or more than {CATALOG_MAX_WORKSPACES} "
                                 "(`too_many_workspaces`)."),
                },
                body=json_body(ref("CatalogRequest")),
            )
        },
        "/session/{id}/turns/current": {
            "get": operation(
                "getCurrentTurn", "Prompts and events", "The running turn, else the oldest queued, else the last one",
                {"200": json_response("A turn, or `{sessionId, state: idle}`.", ref("TurnStatus")),
                 "400": BAD_CLIENT, "404": not_found(NO_SESSION)},
                parameters=[SESSION_ID, CLIENT_ID],
            )
        },
        "/session/{id}/turns/{promptId}": {
            "get": operation(
                "getTurn", "Prompts and events", "One turn of the session, among its kept ones",
                {"200": json_response("The turn.", ref("TurnStatus")), "400": BAD_CLIENT,
                 "404": not_found("No such session (`session_not_found`), or no such turn in it (`prompt_not_found`).")},
                parameters=[SESSION_ID, PROMPT_ID, CLIENT_ID],
            )
        },
    }


def build() -> Schema:
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "acp-state API",
            "version": "1",
            "description": "The `qwen serve` session routes, answered from Redis by any number of stateless API "
            "processes. Errors are `{error, code?, ...context}`.",
            "license": {"name": "Apache-2.0", "identifier": "Apache-2.0"},
        },
        "security": [{}, {"bearerAuth": []}],
        "paths": paths(),
        "components": {
            "securitySchemes": {
                "bearerAuth": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "`--token SECRET[,role=user|channel|admin][,workspace=PATH]`; a loopback bind "
                    "without tokens needs none. A workspace-scoped token sees other workspaces' sessions as 404.",
                }
            },
            "schemas": components(),
        },
    }


SPEC = build()


async def openapi_json(_: Request) -> Response:
    return OrjsonResponse(SPEC)
