"""What one API process holds: its store, its view of the worker leases, its caches."""

from __future__ import annotations

from dataclasses import dataclass, field

from starlette.requests import Request

from acp_state.store import Fanout, Store, WorkerRegistry

from .locator import SessionLocator
from .reads.worker_reports import LiveReports
from .settings import Settings
from .streams.attention_hub import AttentionFeeds
from .streams.live_state_hub import LiveFeeds
from .streams.opens import StreamOpens


@dataclass
class AppState:
    settings: Settings
    store: Store
    registry: WorkerRegistry
    locator: SessionLocator
    workspaces: dict[str, str]  # workspace id -> cwd
    fanout: Fanout
    feeds: LiveFeeds  # the live workspace feeds (push)
    attention: AttentionFeeds  # the attention inbox's stream (push)
    reports: LiveReports  # the live workers' load reports, for placing creates
    stream_opens: StreamOpens = field(default_factory=StreamOpens)  # the session reads of opening streams


def app_state(request: Request) -> AppState:
    """What the API process serving `request` holds (set up by `app.create_app`)."""
    return request.app.state.acp
