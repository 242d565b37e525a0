"""Who is calling: bearer tokens with a role and an optional workspace scope.

A loopback bind may run tokenless, as the reference does (every caller is then trusted);
any other bind refuses to start without a token. A scoped token sees nothing of another
workspace: such sessions answer 404, exactly like sessions that do not exist.
"""

from __future__ import annotations

import ipaddress
import secrets
from dataclasses import dataclass

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from acp_state.ids import workspace_id

from . import reference_shell
from .responses import OrjsonResponse

ROLES = ("user", "channel", "admin")
# Served to anyone: the probes and the Web Shell's files (the page asks for a token itself).
OPEN_PATHS = ("/health", "/health/ready", "/")
OPEN_PREFIXES = ("/static/",)
# Where `stream_tickets` keeps the principal of a redeemed stream ticket in the scope.
TICKET_PRINCIPAL = "acp.ticket_principal"


@dataclass(frozen=True)
class Principal:
    role: str
    workspaces: frozenset[str] | None = None  # workspace ids; None = every workspace

    def may(self, ws: str) -> bool:
        return self.workspaces is None or ws in self.workspaces

    @property
    def name(self) -> str:
        """A stable name of who calls, for what is kept per caller (a create's
        `Idempotency-Key`): the role and the token's workspace scope (`*`: every workspace).
        Tokens of one role and scope share a name: each may do and see what the other may.
        No token's secret (nor a digest of one) goes into it, so Redis never holds one. A
        tokenless loopback API has one caller, `admin.*`, as an unscoped admin token."""
        scope = "*" if self.workspaces is None else "+".join(sorted(self.workspaces)) or "-"
        return f"{self.role}.{scope}"


TRUSTED_LOOPBACK = Principal("admin")


@dataclass(frozen=True)
class Token:
    secret: str
    role: str = "user"
    workspace: str | None = None  # a workspace cwd

    @classmethod
    def parse(cls, spec: str) -> Token:
        """`SECRET[,role=user|channel|admin][,workspace=/abs/path]`."""
        secret, *options = spec.split(",")
        fields: dict[str, str] = {}
        for option in options:
            name, _, value = option.partition("=")
            if name not in ("role", "workspace") or not value:
                raise ValueError(f"unknown token option {option!r}")
            fields[name] = value
        if len(secret) < 16:
            raise ValueError("a token needs at least 16 characters")
        role = fields.get("role", "user")
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}")
        return cls(secret, role, fields.get("workspace"))

    def principal(self) -> Principal:
        scope = None if self.workspace is None else frozenset({workspace_id(self.workspace)})
        return Principal(self.role, scope)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class Authenticator:
    """Who presents the request's bearer token: a Principal, or None (answer 401)."""

    def __init__(self, tokens: list[Token]) -> None:
        self.tokens = [(t.secret.encode(), t.principal()) for t in tokens]

    def principal(self, scope: Scope) -> Principal | None:
        ticketed = scope.get(TICKET_PRINCIPAL)
        if ticketed is not None:  # an event stream opened with a stream ticket (`stream_tickets`)
            return ticketed
        if not self.tokens:
            return TRUSTED_LOOPBACK
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, presented = header.partition(b" ")
        if scheme.lower() != b"bearer" or not presented:
            return None
        found = None
        for secret, principal in self.tokens:  # compare with every token: no timing oracle
            if secrets.compare_digest(presented, secret):
                found = principal
        return found


class AuthMiddleware:
    """Resolves the bearer token to a Principal in `request.state.principal`, or answers 401."""

    def __init__(self, app: ASGIApp, authenticator: Authenticator) -> None:
        self.app = app
        self.authenticator = authenticator

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        principal = self.authenticator.principal(scope)
        path = scope["path"]
        if principal is None and not _open(scope, path):
            response = OrjsonResponse(
                {"error": "a valid bearer token is required", "code": "unauthorized"},
                status_code=401,
                headers={"WWW-Authenticate": "Bearer"},
            )
            await response(scope, receive, send)
            return
        scope.setdefault("state", {})["principal"] = principal or Principal("user", frozenset())
        await self.app(scope, receive, send)


def _open(scope: Scope, path: str) -> bool:
    """The routes that answer without a token: health, and the Web Shell's files and page
    loads (either shell's: the page asks for the token itself)."""
    return (
        path in OPEN_PATHS
        or path.startswith(OPEN_PREFIXES)
        or path in reference_shell.OPEN_PATHS
        or path.startswith(reference_shell.OPEN_PREFIXES)
        or reference_shell.is_open_page(scope)
    )


def principal_of(request: Request) -> Principal:
    return request.state.principal
