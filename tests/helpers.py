"""What several test modules use: create a session, prompt it, read its status, a session
watched from its first completed turn, and a wait for a state no event announces.
(Fixtures stay in conftest.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

import pytest
from prometheus_client.parser import text_string_to_metric_families

from acp_state.clock import now_ms
from acp_state.store import keys

from testbed.processes import ApiProcess
from tests.harness import Harness, SseClient


# A wait's time limit is a safety stop, never what a test asserts: far past the moment the
# state comes on the slowest machine, so that only a state that never comes fails the test.
SAFETY_STOP_S = 60.0


async def eventually(
    condition: Callable[[], Any | Awaitable[Any]], what: str, *, safety_stop_s: float = SAFETY_STOP_S, step: float = 0.05
) -> Any:
    """Poll `condition` (plain or async) until it returns something truthy, and return that.

    For states no event announces (a registry entry, a key gone, a metric, a log line). Past
    `safety_stop_s` the test fails, naming `what` never happened."""
    stop = time.monotonic() + safety_stop_s
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > stop:
            pytest.fail(f"safety stop: {what} did not happen in {safety_stop_s:.0f} s")
        await asyncio.sleep(step)


def eventually_sync(condition: Callable[[], Any], what: str, *, safety_stop_s: float = SAFETY_STOP_S, step: float = 0.05) -> Any:
    """`eventually` for a test with no event loop."""
    stop = time.monotonic() + safety_stop_s
    while not (value := condition()):
        if time.monotonic() > stop:
            pytest.fail(f"safety stop: {what} did not happen in {safety_stop_s:.0f} s")
        time.sleep(step)
    return value


def proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, pgrp) of a process from /proc, or None once it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    state, ppid, pgrp = raw[raw.rindex(")") + 2 :].split()[:3]
    return state, int(ppid), int(pgrp)


async def create(api: ApiProcess, workspace: str, **body: object) -> dict:
    response = await api.client.post("/session", json={"cwd": workspace, "sessionScope": "thread", **body})
    assert response.status_code == 200, response.text
    return response.json()


async def prompt(api: ApiProcess, sid: str, text: str) -> dict:
    response = await api.client.post(f"/session/{sid}/prompt", json={"prompt": [{"type": "text", "text": text}]})
    assert response.status_code == 202, response.text
    return response.json()


async def status(api: ApiProcess, sid: str) -> dict:
    response = await api.client.get(f"/session/{sid}/status")
    assert response.status_code == 200, response.text
    return response.json()


def is_type(event_type: str, **data: object):
    return lambda f: f["event"] == event_type and all(f["data"]["data"].get(k) == v for k, v in data.items())


async def watched_session_after_a_turn(harness: Harness, workspace: str, text: str = "#burst 3") -> tuple[ApiProcess, str, SseClient]:
    """A worker and an API; a session watched by an SSE client from its snapshot on, whose
    first turn (`text`) has completed on that stream."""
    await harness.worker()
    api = await harness.api()
    sid = (await create(api, workspace))["sessionId"]
    live = await SseClient(api, sid).start()
    await live.wait_for(lambda f: f["event"] == "session_snapshot")
    first = await prompt(api, sid, text)
    await live.wait_for(is_type("turn_complete", promptId=first["promptId"]))
    return api, sid, live


def samples(text: str, name: str) -> dict[tuple, float]:
    """The samples of metric `name` in a `/metrics` text, by their sorted labels."""
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                found[tuple(sorted(sample.labels.items()))] = sample.value
    return found


class AsgiRequest:
    """One GET (or other method) driven by hand at an ASGI callable: its request body is
    empty, it disconnects on `leave()`, `sent` holds what was sent back, and `seen[marker]`
    is set once a body carried that marker."""

    def __init__(self, *markers: bytes) -> None:
        self.sent: list[dict] = []
        self.seen = {marker: asyncio.Event() for marker in markers}
        self._left = asyncio.Event()
        self._messages = [{"type": "http.request", "body": b"", "more_body": False}]

    @staticmethod
    def scope(path: str, method: str = "GET") -> dict:
        return {"type": "http", "method": method, "path": path, "headers": [], "query_string": b""}

    async def receive(self) -> dict:
        if self._messages:
            return self._messages.pop()
        await self._left.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        self.sent.append(message)
        body = message.get("body", b"")
        for marker, event in self.seen.items():
            if marker in body:
                event.set()

    def leave(self) -> None:
        self._left.set()

    async def served_below_the_stack(self, app: Any, path: str, method: str = "GET") -> bool:
        """Serve this request as the app serves an event stream below Starlette's stack
        (`ApiApp.opened_stream`, then the stream); False: not served, nothing sent."""
        scope = self.scope(path, method)
        stream = await app.opened_stream(scope, self.receive)
        if stream is None:
            return False
        await stream(scope, self.receive, self.send)
        return True


@contextlib.asynccontextmanager
async def app_in_process(redis_url: str, workspace: str) -> AsyncIterator[tuple[Any, str]]:
    """The API's ASGI app in this process (its lifespan running), and a session created
    through it: for tests that drive the app's `__call__` by hand."""
    import httpx

    from acp_state.api.app import create_app
    from acp_state.api.settings import Settings

    app = create_app(Settings(redis_url=redis_url, workspaces=[workspace]))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as client:
            sid = (await client.post("/session", json={"cwd": workspace}, timeout=60)).json()["sessionId"]
        yield app, sid


async def turn_done(watcher, sid: str, prompt_id: str) -> dict:
    return await watcher.wait_for(
        lambda e: e["data"].get("sessionId") == sid and e["type"] in ("turn_complete", "turn_error")
        and e["data"].get("promptId") == prompt_id
    )


async def recalled(harness: Harness, api: ApiProcess, sid: str) -> str:
    """What the session's agent answers `#recall` (every earlier prompt of the session)."""
    watcher = await harness.events()
    sent = await prompt(api, sid, "#recall")
    assert (await turn_done(watcher, sid, sent["promptId"]))["type"] == "turn_complete"
    chunks = [
        e["data"]["update"]["content"]["text"] for e in watcher.of(sid)
        if e["type"] == "session_update" and e.get("promptId") == sent["promptId"]
        and e["data"]["update"].get("sessionUpdate") == "agent_message_chunk"
    ]
    return "".join(chunks)


async def load(api: ApiProcess, sid: str, **body: object):
    return await api.client.post(f"/session/{sid}/load", json=body)


async def past_lease(redis_client: Any, incarnation: str) -> None:
    """Until the lease of a worker that was killed has passed, as Redis holds it. A renewal
    the worker sent just before its death may land after a first read of the deadline and
    move it: the deadline is read again until it stands (gone: a sweeper declared it dead)."""
    while (deadline := await redis_client.zscore(keys.WORKERS, incarnation)) is not None and deadline >= now_ms():
        await asyncio.sleep((deadline - now_ms()) / 1000 + 0.01)
