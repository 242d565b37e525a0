"""The reference's Web Shell (`acp-state api --web-shell PATH`): a built single-page app
(the `web-shell/` folder of `@qwen-code/qwen-code`), served as `qwen serve` serves it
(`packages/cli/src/serve/web-shell-static.ts`): its index at `/` and for page loads of
`/session/:id`, `/assets/*` (content-addressed files cached for a year), `/sw.js` (with
`Service-Worker-Allowed: /`) and `/manifest.webmanifest`, all without a token.

Its CSP is narrower than the reference's (`script-src 'self' 'unsafe-inline' 'unsafe-eval'
...`): the index's inline scripts are allowed by their hashes, taken from the file at start,
and no other inline script and no eval runs (WebAssembly may compile); it connects to this
API only (no `unpkg.com`, which the reference allows for its transcript export, nor other
daemons' origins for `?daemon=`), and no page may frame it.
"""

from __future__ import annotations

import base64
import hashlib
import re
from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, PlainTextResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import Message, Receive, Scope, Send

INLINE_SCRIPT = re.compile(rb"<script>(.*?)</script>", re.DOTALL)
# `/session/<id>` page loads get the index (a deep link); the reference's test of a page load.
CONTENT_ADDRESSED = re.compile(r"-[a-zA-Z0-9_-]{8,}\.[^.]+$")
PWA_FILES = {
    "/manifest.webmanifest": ("application/manifest+json", False),
    "/sw.js": ("application/javascript", True),
}
OPEN_PATHS = tuple(PWA_FILES)
OPEN_PREFIXES = ("/assets/",)
SESSION_PAGE = re.compile(r"/session/[^/]+/?")


def is_document_navigation(scope: Scope) -> bool:
    """The reference's `isDocumentNavigation`: a browser's page load, not a script's fetch."""
    headers = dict(scope["headers"])
    return (
        headers.get(b"sec-fetch-mode") == b"navigate"
        or headers.get(b"sec-fetch-dest") == b"document"
        or headers.get(b"accept", b"").strip().lower().startswith(b"text/html")
    )


def is_open_page(scope: Scope) -> bool:
    """A page load of `/session/<id>`: answered without a token, as the reference does (the
    page asks for the token itself)."""
    return (
        scope["method"] in ("GET", "HEAD")
        and SESSION_PAGE.fullmatch(scope["path"]) is not None
        and is_document_navigation(scope)
    )


def csp_of(index_html: bytes) -> str:
    hashes = " ".join(
        "'sha256-" + base64.b64encode(hashlib.sha256(script).digest()).decode() + "'"
        for script in INLINE_SCRIPT.findall(index_html)
    )
    return "; ".join([
        "default-src 'self'",
        # 'wasm-unsafe-eval': its code highlighter (shiki) compiles its WebAssembly regex
        # engine; without it code blocks show unhighlighted. No 'unsafe-eval': the one
        # `new Function` it runs is zod's probe of whether eval is allowed, which catches
        # the refusal and parses without it (the browser still reports that probe).
        f"script-src 'self' {hashes} 'wasm-unsafe-eval'",
        # React and the markdown renderers (KaTeX, mermaid, shiki) set style attributes.
        "style-src 'self' 'unsafe-inline'",
        "font-src 'self' data:",
        # The favicon is a data: URI; pasted images are previewed from blob: URLs.
        "img-src 'self' data: blob:",
        "connect-src 'self'",
        "worker-src 'self'",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    ])


class ReferenceShell:
    """The routes that serve one Web Shell build."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory).resolve()
        index = self.directory / "index.html"
        if not index.is_file() or not (self.directory / "assets").is_dir():
            raise ValueError(f"{self.directory} is not a Web Shell build (no index.html and assets/)")
        self.index_path = index
        self.page_headers = {
            "Content-Security-Policy": csp_of(index.read_bytes()),
            "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer",
            "X-Frame-Options": "DENY",
            "Permissions-Policy": "camera=(), microphone=(self), geolocation=(), payment=(), clipboard-write=(self)",
            "Cache-Control": "no-cache",
        }
        self.assets = _Assets(StaticFiles(directory=self.directory / "assets"))

    async def index(self, _: Request) -> Response:
        return FileResponse(self.index_path, headers=self.page_headers, media_type="text/html")

    async def session_page(self, request: Request) -> Response:
        if not is_document_navigation(request.scope):
            # Not a page load: what this path answered without the shell (only DELETE).
            return PlainTextResponse("Method Not Allowed", status_code=405, headers={"Allow": "DELETE"})
        return await self.index(request)

    def pwa_file(self, route: str) -> Route:
        media_type, worker = PWA_FILES[route]
        headers = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}
        if worker:
            headers["Service-Worker-Allowed"] = "/"
        path = self.directory / route[1:]

        async def answer(_: Request) -> Response:
            if not path.is_file():
                return PlainTextResponse("Not found", status_code=404)
            return FileResponse(path, headers=headers, media_type=media_type)

        return Route(route, answer, methods=["GET"])

    def routes(self) -> list[BaseRoute]:
        return [
            Route("/", self.index, methods=["GET"]),
            Route("/session/{id}", self.session_page, methods=["GET"]),
            Mount("/assets", self.assets, name="assets"),
            *(self.pwa_file(route) for route in PWA_FILES),
        ]


class _Assets:
    """`/assets/*`: content-addressed files cached for a year, others revalidated; a file not
    there answers a plain 404, as the reference's."""

    def __init__(self, app: StaticFiles) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        cache = "public, max-age=31536000, immutable" if CONTENT_ADDRESSED.search(scope["path"]) else "no-cache"

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                extra = [(b"x-content-type-options", b"nosniff")]
                if message["status"] < 400:
                    extra.append((b"cache-control", cache.encode()))
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, sending)
