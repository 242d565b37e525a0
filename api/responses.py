"""JSON responses and the error shape of the reference: `{error, code?, ...context}`."""

from __future__ import annotations

import logging
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from acp_state.store import is_out_of_memory, is_transient

from .limits import MAX_BODY_BYTES

# Memory frees as retention windows pass or as an operator acts: not within a second.
STORE_FULL_RETRY_S = 5

log = logging.getLogger("api.errors")


# The reference's JSON content type (Express names the charset).
JSON_TYPE = "application/json; charset=utf-8"


class OrjsonResponse(JSONResponse):
    media_type = JSON_TYPE

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


class ApiError(Exception):
    """Raised by a route; rendered as `status` with `{error, code, **context}`."""

    def __init__(self, status: int, message: str, code: str | None = None, **context: Any) -> None:
        super().__init__(message)
        self.status = status
        self.body: dict[str, Any] = {"error": message}
        if code is not None:
            self.body["code"] = code
        self.body.update(context)
        self.headers: dict[str, str] = {}


def unavailable(message: str, code: str, retry_after_s: int = 1, **context: Any) -> ApiError:
    """A 503 with a retry hint: the command was not taken, the client may try again."""
    error = ApiError(503, message, code, retryAfterMs=retry_after_s * 1000, **context)
    error.headers["Retry-After"] = str(retry_after_s)
    return error


async def api_error_handler(_: Request, error: Exception) -> Response:
    assert isinstance(error, ApiError)
    return OrjsonResponse(error.body, status_code=error.status, headers=error.headers)


def _store_unavailable() -> Response:
    """Redis could not take the command now: nothing was taken, say so and when to retry."""
    body = {"error": "the state store is unavailable; retry shortly", "code": "store_unavailable", "retryAfterMs": 1000}
    return OrjsonResponse(body, status_code=503, headers={"Retry-After": "1"})


async def store_error_handler(request: Request, error: Exception) -> Response:
    """An error from Redis. Out of memory: Redis refused the command before it ran (a script
    is refused before its first write), so the client may retry later: 503 `store_full`.
    Unreachable, stalled, loading, read-only or a cluster failing over: 503
    `store_unavailable`. Any other is a bug of ours: 500."""
    if is_out_of_memory(error):
        log.warning("Redis is out of memory (maxmemory): %s %s refused", request.method, request.url.path)
        return await api_error_handler(
            request, unavailable("the state store is full; retry later", "store_full", STORE_FULL_RETRY_S)
        )
    if is_transient(error):
        return _store_unavailable()
    return await internal_error_handler(request, error)


async def internal_error_handler(request: Request, error: Exception) -> Response:
    """The last resort for anything unhandled, from a route or from a middleware (Starlette
    calls it from ServerErrorMiddleware, outside every other one): JSON with a code, never
    Starlette's plain-text "Internal Server Error". The errors with a handler of their own
    are answered as that handler would, since a middleware's are not seen by it."""
    if isinstance(error, ApiError):
        return await api_error_handler(request, error)
    if is_transient(error):
        return await store_error_handler(request, error)
    log.error("unhandled error in %s %s", request.method, request.url.path, exc_info=error)
    return OrjsonResponse({"error": "internal server error", "code": "internal_error"}, status_code=500)


def parse_decimal(text: str | None, maximum: int) -> int | None:
    """`text` as a decimal integer of ASCII digits from 0 to `maximum`, else None.

    `str.isdigit()` alone admits digits `int()` rejects ("²") or reads ("١٢"), and `int()`
    refuses more than 4,300 digits: query parameters and headers go through here instead."""
    if text is None or not text.isascii() or not text.isdigit():
        return None
    significant = text.lstrip("0") or "0"
    if len(significant) > len(str(maximum)):
        return None
    number = int(significant)
    return number if number <= maximum else None


async def json_body(request: Request, *, required: bool = True) -> Any:
    """The request's JSON body, size-capped; 400/413 with a reason otherwise."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise ApiError(413, f"request body exceeds {MAX_BODY_BYTES} bytes", "body_too_large")
    raw = b""
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_BODY_BYTES:
            raise ApiError(413, f"request body exceeds {MAX_BODY_BYTES} bytes", "body_too_large")
    if not raw.strip():
        if required:
            raise ApiError(400, "request body must be a JSON object", "invalid_json")
        return {}
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise ApiError(400, "Invalid JSON in request body", "invalid_json") from None
