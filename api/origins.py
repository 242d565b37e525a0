"""Which web pages and which host names may talk to an API process (issue 37 item 4).

Checked first of all, in `ApiApp.__call__`, so the hot reads and the streams answered below
Starlette's stack are held to it as every route is:

* **Host** (DNS rebinding): a loopback bind answers only requests whose `Host` names a
  loopback host (`localhost`, `127.x.y.z`, `[::1]`, `host.docker.internal`, any port);
  anything else is a page of another site whose name was pointed at 127.0.0.1, and gets 403
  `host_not_allowed`. The reference answers the same 403 `{error: "Invalid Host header"}`.
* **Origin** (drive-by requests): a request with an `Origin` that is neither the API's own
  (`http(s)://` + its `Host`) nor one of `--allow-origin` gets 403 `origin_not_allowed`,
  whatever the method, the bind and the token, as the reference's (`{error: "Request
  denied by CORS policy"}`). Browsers send `Origin` with every cross-origin request and every
  POST; a request without one (curl, the SDK, a same-origin GET) is not a page's.
* **CORS**: an allowed origin gets the reference's CORS headers on every answer, and its
  preflight (`OPTIONS` with `Access-Control-Request-Method` or `-Headers`) 204.
"""

from __future__ import annotations

import ipaddress
from typing import Iterable
from urllib.parse import urlsplit

from starlette.responses import Response
from starlette.types import Message, Scope, Send

from .responses import OrjsonResponse

# The reference's CORS answer (qwen serve 0.24.4, `allowOriginCors`), plus the headers
# acp-state reads (`Idempotency-Key`, `If-None-Match`, the live feed's generation) and sends.
ALLOW_METHODS = "GET, POST, PATCH, DELETE, OPTIONS"
ALLOW_HEADERS = (
    "Authorization, Content-Type, X-Qwen-Client-Id, Last-Event-ID, X-Qwen-Event-Epoch, "
    "Idempotency-Key, If-None-Match, X-Acp-Catalog-Generation"
)
EXPOSE_HEADERS = "Retry-After, X-Qwen-Event-Epoch, X-Qwen-SSE-Stream-Id, ETag, X-Acp-Catalog-Generation"
MAX_AGE_S = "86400"

LOOPBACK_NAMES = frozenset({"localhost", "host.docker.internal"})


class OriginError(ValueError):
    """A bad `--allow-origin`: said at start, not at the first request."""


def parse_allowed(patterns: Iterable[str], has_token: bool) -> tuple[bool, frozenset[str]]:
    """`--allow-origin` values: (any origin allowed, the allowed origins, lower case). Each is
    `*` or a canonical origin `scheme://host[:port]`. Refused as the reference refuses them:
    `*` without a token (any page could drive the daemon), and a non-loopback http(s)
    origin without a token."""
    allow_any, origins = False, set()
    for pattern in patterns:
        if pattern == "*":
            allow_any = True
            continue
        parts = urlsplit(pattern)
        canonical = f"{parts.scheme}://{parts.netloc}" if parts.scheme and parts.netloc else ""
        if canonical != pattern or "@" in parts.netloc:
            raise OriginError(
                f"--allow-origin {pattern!r}: expected `*` or an origin `scheme://host[:port]` "
                "(no path, no trailing slash, no user, no query)"
            )
        origins.add(pattern.lower())
    if allow_any and not has_token:
        raise OriginError(
            "refusing --allow-origin '*' without a bearer token: any web page could drive the agents; "
            "set a token or list the origins"
        )
    for origin in sorted(origins):
        parts = urlsplit(origin)
        if parts.scheme in ("http", "https") and not loopback_name(parts.hostname or ""):
            if not has_token:
                raise OriginError(
                    f"refusing --allow-origin {origin!r} without a bearer token: a page of a host that is not "
                    "this machine could drive the agents; set a token or use a loopback origin"
                )
    return allow_any, frozenset(origins)


def loopback_name(name: str) -> bool:
    name = name.strip("[]").lower()
    if name in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _host_name(host: str) -> str:
    """The name of a `Host` value, its port left out (`[::1]:4170` -> `::1`)."""
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    name, colon, port = host.rpartition(":")
    return name if colon and port.isdigit() else host


def _refusal(message: str, code: str, vary: bool = True) -> OrjsonResponse:
    return OrjsonResponse({"error": message, "code": code}, status_code=403, headers={"Vary": "Origin"} if vary else None)


class Edge:
    """The Host and Origin checks of one API process, and the CORS answers."""

    def __init__(self, bind_host: str, allow_origins: Iterable[str] = (), has_token: bool = False) -> None:
        self.loopback_bind = loopback_name(bind_host)
        self.allow_any, self.origins = parse_allowed(allow_origins, has_token)
        self._hosts: dict[bytes, bool] = {}  # Host values judged (a few: the names a bind is reached by)

    def check(self, scope: Scope) -> Response | bytes | None:
        """None: no Origin, or the API's own, and a Host it answers (the common case, kept
        to one pass over the headers); an allowed origin (bytes): its answers get the CORS
        headers (`cors_send`); a response: the refusal, or an allowed origin's preflight."""
        host = origin = None
        for name, value in scope["headers"]:
            if name == b"host":
                host = value
            elif name == b"origin":
                origin = value
        # No Host at all (HTTP/1.0): no page's, whose browser always names the host it asked.
        if self.loopback_bind and host is not None and not self._loopback_host(host):
            return _refusal("Invalid Host header", "host_not_allowed", vary=False)
        if origin is None:
            return None
        lowered = origin.lower()
        if host is not None and _own_origin(lowered, host.lower()):
            return None
        if lowered == b"null" or not (self.allow_any or lowered.decode("latin-1") in self.origins):
            return _refusal("Request denied by CORS policy", "origin_not_allowed")
        if scope["method"] == "OPTIONS" and any(
            name in (b"access-control-request-method", b"access-control-request-headers") for name, _ in scope["headers"]
        ):
            return Response(status_code=204, headers={k.decode(): v.decode("latin-1") for k, v in cors_headers(origin)})
        return origin

    def _loopback_host(self, host: bytes) -> bool:
        judged = self._hosts.get(host)
        if judged is None:
            judged = loopback_name(_host_name(host.decode("latin-1")))
            if len(self._hosts) < 256:
                self._hosts[host] = judged
        return judged


def _own_origin(origin: bytes, host: bytes) -> bool:
    """Is `origin` the API's own: the scheme and the `Host` it was reached by (a default
    port named or not)?"""
    for scheme, default in ((b"http://", b":80"), (b"https://", b":443")):
        if origin.startswith(scheme):
            rest = origin[len(scheme):]
            return rest == host or rest + default == host or (host.endswith(default) and rest == host[: -len(default)])
    return False


def cors_headers(origin: bytes) -> list[tuple[bytes, bytes]]:
    return [
        (b"access-control-allow-origin", origin),
        (b"vary", b"Origin"),
        (b"access-control-allow-methods", ALLOW_METHODS.encode()),
        (b"access-control-allow-headers", ALLOW_HEADERS.encode()),
        (b"access-control-max-age", MAX_AGE_S.encode()),
        (b"access-control-expose-headers", EXPOSE_HEADERS.encode()),
    ]


def cors_send(send: Send, origin: bytes) -> Send:
    """`send` that adds an allowed origin's CORS headers to the answer's start."""
    added = cors_headers(origin)

    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), *added]}
        await send(message)

    return sending
