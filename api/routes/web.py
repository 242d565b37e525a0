"""The Web Shell: a static page at `/` and its assets under `/static` (no build step).

Both answer with headers that keep the page to itself: a Content-Security-Policy that lets
it load only its own files (no inline script or style, no other origin, no framing),
`nosniff`, and no `Referer` sent anywhere (issue 37 item 6).
"""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.staticfiles import StaticFiles
from starlette.types import Message, Receive, Scope, Send

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"  # api/static: the package data

# `img-src data:`: the page's empty favicon (`data:,`), which keeps the browser from asking
# for /favicon.ico. Everything else is the page's own: its modules, its stylesheet, its
# calls to this API.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)
PAGE_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",  # frame-ancestors, for browsers that predate it
}
_RAW_PAGE_HEADERS = [(name.lower().encode(), value.encode()) for name, value in PAGE_HEADERS.items()]


async def index(_: Request) -> Response:
    # no-cache: a deploy's new page is picked up at once (assets revalidate by ETag).
    return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache", **PAGE_HEADERS})


class _WithPageHeaders:
    """The static files, every answer (a 404, a 304 too) with the page's headers."""

    def __init__(self, app: StaticFiles) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *_RAW_PAGE_HEADERS]}
            await send(message)

        await self.app(scope, receive, sending)


static_files = _WithPageHeaders(StaticFiles(directory=STATIC_DIR))
