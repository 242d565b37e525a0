"""API process settings (from the command line)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from acp_state.ids import workspace_id

from .auth import Token


@dataclass
class Settings:
    redis_url: str = "memory://"
    host: str = "127.0.0.1"
    port: int = 4170
    workspaces: list[str] = field(default_factory=lambda: [os.getcwd()])
    create_timeout_s: float = 60.0
    close_timeout_s: float = 15.0
    sweep_interval_s: float = 5.0
    client_ttl_ms: int = 90_000  # a heartbeating client's presence lasts this long after its last heartbeat
    presence_prune_s: float = 1.0  # how often lapsed clients are removed from their sessions
    tokens: list[Token] = field(default_factory=list)
    sse_send_timeout_s: float = 10.0
    allow_origins: list[str] = field(default_factory=list)  # --allow-origin: pages of other origins that may call
    web_shell: str | None = None  # --web-shell: a Web Shell build (the reference's `web-shell/`) served at `/`

    def workspace_cwds(self) -> dict[str, str]:
        """Registered workspaces by id (first 16 hex chars of sha256 of the cwd)."""
        return {workspace_id(cwd): cwd for cwd in self.workspaces}
