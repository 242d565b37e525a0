"""What one API process holds: its store, its view of the worker leases, its caches."""

from __future__ import annotations

from dataclasses import dataclass

from acp_state.fanout import Fanout
from acp_state.registry import WorkerRegistry
from acp_state.store import Store

from .locator import SessionLocator
from .settings import Settings


@dataclass
class AppState:
    settings: Settings
    store: Store
    registry: WorkerRegistry
    locator: SessionLocator
    workspaces: dict[str, str]  # workspace id -> cwd
    fanout: Fanout
