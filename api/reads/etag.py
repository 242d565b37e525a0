"""ETags and conditional GETs on every whole (non-streamed) answer, as the reference's
Express server gives them: a weak `ETag` over the body, and a 304 without a body to a GET
whose `If-None-Match` names it. A poller of status, listing or live state that saw nothing
change then costs no body on the wire.

A route that names its answer itself (live state: from its cache, without a Redis read)
sets its own `ETag`, which is kept. Event streams pass through untouched.
"""

from __future__ import annotations

import hashlib

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

CONDITIONAL = ("GET", "HEAD")


def weak_etag(body: bytes) -> str:
    return f'W/"{len(body):x}-{hashlib.blake2b(body, digest_size=10).hexdigest()}"'


def names(if_none_match: str | None, etag: str) -> bool:
    """`If-None-Match` names this ETag (compared weakly, as RFC 9110 says for it)."""
    if if_none_match is None:
        return False
    wanted = etag.removeprefix("W/")
    return any(tag.strip() in ("*", wanted) or tag.strip().removeprefix("W/") == wanted for tag in if_none_match.split(","))


class ETagMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        conditional = scope["method"] in CONDITIONAL
        if_none_match = Headers(scope=scope).get("if-none-match") if conditional else None
        start: Message | None = None

        async def tag(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                start = message  # held until the body says whether the answer is whole
                return
            if start is None:
                await send(message)
                return
            held, start = start, None
            if message["type"] != "http.response.body":  # e.g. `http.response.pathsend` (a file)
                await send(held)
                await send(message)
                return
            headers = MutableHeaders(raw=held["headers"])
            if message.get("more_body", False) or headers.get("content-type", "").startswith("text/event-stream"):
                await send(held)  # a stream: sent as it comes
                await send(message)
                return
            body = message.get("body", b"")
            if not body and "etag" not in headers:  # no body (204): nothing to name, as Express
                await send(held)
                await send(message)
                return
            etag = headers.get("etag") or weak_etag(body)
            headers["ETag"] = etag
            if held["status"] == 200 and names(if_none_match, etag):
                del headers["content-length"]
                del headers["content-type"]
                await send({**held, "status": 304, "headers": headers.raw})
                await send({"type": "http.response.body", "body": b""})
                return
            await send(held)
            await send(message)

        await self.app(scope, receive, tag)
