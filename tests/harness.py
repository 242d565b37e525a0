"""Test harness: real `acp-state` worker and API processes (the test bed's wrapper,
testbed/processes.py) started for one test and stopped after it, HTTP over loopback, and an
event watcher and an SSE reader that await events instead of sleeping."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Callable

import httpx
import orjson

from acp_state.store import is_transient, keys
from acp_state.store.connection import connect
from acp_state.store.fanout import Fanout
from acp_state.ids import workspace_id
from testbed.processes import AcpProcess, ApiProcess, WorkerProcess

HOST_TOKEN = "test-bed-host-token-0123456789"  # the APIs on test-bed hosts require one


class EventWatcher:
    """Every event of every session of the watched workspaces, awaited by predicate (no sleeps).

    Built on the product's own fan-out: it follows each workspace's change channel, and on
    the first word of a session subscribes to the session's event channel and reads what
    came before from the replay log, so it works alike on a single Redis and a cluster.
    """

    def __init__(self, redis_url: str, workspaces: list[str]) -> None:
        self.redis = connect(redis_url)
        self.fanout = Fanout(self.redis, on_change=lambda change: self._session_changed(change.ws, change.sid))
        self.workspaces = [workspace_id(w) for w in workspaces]
        self.events: list[dict[str, Any]] = []
        self._changed = asyncio.Condition()
        self._followers: dict[str, asyncio.Task[None]] = {}

    async def start(self) -> None:
        for ws in self.workspaces:
            await self.fanout.watch(ws)
            async for key in self.redis.scan_iter(match=keys.session_prefix(ws) + "*"):
                self._session_changed(ws, key.rsplit(":", 1)[1])

    def _session_changed(self, ws: str, sid: str) -> None:
        if sid not in self._followers:
            self._followers[sid] = asyncio.ensure_future(self._follow(ws, sid))

    async def _follow(self, ws: str, sid: str) -> None:
        channel = keys.events(ws, sid)
        subscription = await self.fanout.subscribe(channel, buffer=1 << 20)
        epoch = await self.redis.hget(keys.session(ws, sid), keys.F.EPOCH)
        seen = await self._catch_up(channel, 0)  # what came before the subscription
        while True:
            delivery = await subscription.queue.get()
            if delivery is not None and delivery.event_id <= seen:
                # A repeat, or the first events of a new epoch (the session was resumed after
                # its worker died: its log starts again at 1).
                now = await self.redis.hget(keys.session(ws, sid), keys.F.EPOCH)
                if now is not None and now != epoch:
                    epoch, seen = now, 0
            if delivery is None or delivery.event_id > seen + 1:  # some were lost: the log has them
                subscription.resync = False
                seen = await self._catch_up(channel, seen)
            else:
                seen = await self._add(channel, delivery.raw, seen)

    async def _catch_up(self, channel: str, seen: int) -> int:
        """Read the log past `seen`; while the store cannot answer (the fan-out tells of a
        lost subscription at once, a failover may still be under way), again shortly."""
        while True:
            try:
                entries = await self.redis.xrange(channel, f"({seen}-0", "+")
            except Exception as error:
                if not is_transient(error):
                    raise
                await asyncio.sleep(0.1)
                continue
            for _, fields in entries:
                seen = await self._add(channel, fields["e"], seen)
            return seen

    async def _add(self, channel: str, raw: str, seen: int) -> int:
        event = orjson.loads(raw)
        if event["id"] <= seen:
            return seen
        event["_channel"] = channel
        async with self._changed:
            self.events.append(event)
            self._changed.notify_all()
        return event["id"]

    async def wait_for(self, predicate: Callable[[dict[str, Any]], bool], timeout: float = 20) -> dict[str, Any]:
        """The first event (seen so far or arriving) that satisfies `predicate`."""

        async def find() -> dict[str, Any]:
            async with self._changed:
                while True:
                    for event in self.events:
                        if predicate(event):
                            return event
                    await self._changed.wait()

        return await asyncio.wait_for(find(), timeout)

    async def wait_type(self, sid: str, event_type: str, timeout: float = 20, **data: Any) -> dict[str, Any]:
        """The first `event_type` event of session `sid` whose envelope or data match `data`."""
        def match(e: dict[str, Any]) -> bool:
            payload = e.get("data") or {}
            return (
                e["type"] == event_type
                and e["_channel"].endswith(sid)
                and all((e[k] if k in e else payload.get(k)) == v for k, v in data.items())
            )

        return await self.wait_for(match, timeout)

    def of(self, sid: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["_channel"].endswith(sid)]

    async def close(self) -> None:
        for task in self._followers.values():
            task.cancel()
        await asyncio.gather(*self._followers.values(), return_exceptions=True)
        await self.fanout.stop()
        await self.redis.aclose()


class Harness:
    """Starts processes for one test and stops them all afterwards."""

    def __init__(self, redis_url: str, workspace: str, free_port: Callable[[], int]) -> None:
        self.redis_url = redis_url
        self.workspace = workspace
        self.free_port = free_port
        self.processes: list[AcpProcess] = []
        self.watcher = EventWatcher(redis_url, [workspace])
        self._watching = False
        self.logs = Path(workspace).parent

    async def events(self) -> EventWatcher:
        if not self._watching:
            await self.watcher.start()
            self._watching = True
        return self.watcher

    async def worker(self, *args: str, env: dict[str, str] | None = None, host: Any = None) -> WorkerProcess:
        """A worker; `env` adds to (or overrides) the inherited environment, which its agents inherit.
        Its SIGTERM closes its sessions at once unless the test gives `--drain-grace-s` (a
        drain would move them to the test's other workers, or wait for one)."""
        n = len(self.processes)
        if "--drain-grace-s" not in args:
            args = (*args, "--drain-grace-s", "0")
        process = WorkerProcess(
            ["worker", "--redis-url", self.redis_url, *args], self.logs / f"worker-{n}.log", env=env,
            prefix=host.exec_prefix if host else None,
        )
        await process.start()
        self.processes.append(process)
        return process

    async def api(self, *args: str, workspaces: list[str] | None = None, host: Any = None) -> ApiProcess:
        """An API process; `host`: on that host of a test bed (testbed/hosts.py), listening on
        its address with a bearer token (off loopback one is required)."""
        port = self.free_port()
        ws_args = [a for w in (workspaces or [self.workspace]) for a in ("--workspace", w)]
        on_host = ["--host", host.ip, "--token", HOST_TOKEN] if host else []
        process = ApiProcess(
            ["api", "--redis-url", self.redis_url, "--port", str(port), *ws_args, *on_host, *args],
            self.logs / f"api-{len(self.processes)}.log",
            port,
            **({"host": host.ip, "prefix": host.exec_prefix, "token": HOST_TOKEN} if host else {}),
        )
        await process.start()
        self.processes.append(process)
        return process

    async def stop_all(self) -> None:
        """SIGTERM to every process: the APIs together, then the workers together (a worker
        gone first would fail the requests an API still serves)."""
        apis = [p for p in self.processes if isinstance(p, ApiProcess)]
        for process in apis:
            await process.close_client()
        for group in (apis, [p for p in self.processes if not isinstance(p, ApiProcess)]):
            # Every process of the group is stopped even when one of them fails its SIGTERM.
            codes = await asyncio.gather(*(process.terminate() for process in group), return_exceptions=True)
            for process, code in zip(group, codes):
                if isinstance(code, BaseException):
                    raise code
                assert code in (0, None, -9), f"{process.argv[0]} exited {code} on SIGTERM; see {process.log_path}"
        if self._watching:
            await self.watcher.close()


class SseClient:
    """Reads `GET /session/:id/events` (or another event stream: `path`) like a browser's
    EventSource would, frame by frame."""

    def __init__(
        self, api: ApiProcess, sid: str = "", last_event_id: int | str | None = None, query: str = "", path: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.api = api
        self.sid = sid
        self.last_event_id = last_event_id
        self.query = query
        self.path = path
        self.headers = headers or {}
        self.response_headers: dict[str, str] = {}
        self.frames: list[dict[str, Any]] = []
        self._arrived = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None
        self.closed = asyncio.Event()
        self.status: int | None = None
        self.error: httpx.HTTPError | None = None  # how the stream broke, if it did not end cleanly

    async def start(self) -> SseClient:
        opened = asyncio.get_running_loop().create_future()
        self._task = asyncio.ensure_future(self._read(opened))
        await asyncio.wait_for(opened, 20)
        return self

    async def _read(self, opened: asyncio.Future[None]) -> None:
        headers = {} if self.last_event_id is None else {"Last-Event-ID": str(self.last_event_id)}
        url = (self.path or f"/session/{self.sid}/events") + self.query
        try:
            async with self.api.client.stream("GET", url, headers={**headers, **self.headers}, timeout=None) as response:
                self.status = response.status_code
                self.response_headers = dict(response.headers)
                opened.set_result(None)
                if response.status_code != 200:
                    return
                current: dict[str, Any] = {}
                async for line in response.aiter_lines():
                    if line == "":
                        if "event" in current or "data" in current:
                            await self._add(current)
                        current = {}
                    elif line.startswith(":"):
                        continue
                    else:
                        name, _, value = line.partition(": ")
                        current[name] = value
        except (httpx.HTTPError, asyncio.CancelledError) as error:
            if isinstance(error, httpx.HTTPError):
                self.error = error
            if not opened.done():
                opened.set_result(None)
        finally:
            self.closed.set()

    async def _add(self, raw: dict[str, Any]) -> None:
        frame = {"event": raw.get("event"), "id": _event_id(raw["id"]) if "id" in raw else None}
        frame["data"] = orjson.loads(raw["data"]) if "data" in raw else None
        async with self._arrived:
            self.frames.append(frame)
            self._arrived.notify_all()

    async def wait_for(self, predicate: Callable[[dict[str, Any]], bool], timeout: float = 20) -> dict[str, Any]:
        async def find() -> dict[str, Any]:
            async with self._arrived:
                while True:
                    for frame in self.frames:
                        if predicate(frame):
                            return frame
                    await self._arrived.wait()

        return await asyncio.wait_for(find(), timeout)

    def events(self, event_type: str | None = None) -> list[dict[str, Any]]:
        """Frames that carry an event id (the session's events, not stream control frames)."""
        return [f for f in self.frames if f["id"] is not None and (event_type is None or f["event"] == event_type)]

    @property
    def last_id(self) -> int | None:
        ids = [f["id"] for f in self.frames if f["id"] is not None]
        return ids[-1] if ids else self.last_event_id

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


def _event_id(text: str) -> int | str:
    """A session stream's id is a number; the live feed's is `<revision>-<generation>`."""
    return int(text) if text.isdigit() else text
