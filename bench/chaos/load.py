"""The chaos run's load: session actors, status pollers and SSE readers over HTTP.

Each actor creates a session, reads its events (a reader that resumes with Last-Event-ID on
the other API after any error), runs a few steps (prompts of every kind, votes from several
voters on both APIs, answers, cancels, queued prompts, status reads) and deletes the session
or leaves it open. Every mutating request carries an Idempotency-Key and is retried with it
while its outcome is unknown or the store says it did nothing; every attempt, every SSE frame
and every session's owner go to the history (bench/chaos/history.py), which
bench/chaos/checker.py checks. docs/chaos.md, "The load", says what it does and why.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import string
import time
from typing import Any, AsyncIterator, Callable, Protocol

import httpx
import orjson

from acp_state.ids import workspace_id
from acp_state.store import RedisStore

from . import checker
from .history import Recorder, log, now
from .schedule import APIS

# A request may wait out a stalled master and its replica's promotion (sleep 5 leases plus
# the node timeout): a client that gave up sooner would leave outcomes unknown that the
# system would have told.
REQUEST_TIMEOUT = httpx.Timeout(45.0, connect=3.0)
POLL_TIMEOUT = httpx.Timeout(8.0, connect=2.0)
SSE_TIMEOUT = httpx.Timeout(connect=3.0, read=25.0, write=5.0, pool=5.0)
SNAPSHOT_WAIT_S = 30.0  # how long a new session's actor waits for its reader's snapshot
CHAIN_BUDGET_S = 120.0  # how long one logical mutating request is retried with its key
ENDING = checker.ENDINGS
# The load's long turn (`#slow 5`, 4% of its steps): longer than the drain grace.
LONG_TURN_S = 5
# Off loopback an API needs a bearer token; the load sends this one (role user).
HOSTS_TOKEN = "chaos-hosts-token-0123456789"


class Run(Protocol):
    """What the load needs of the run that drives it (bench.chaos.Chaos; the rolling deploy
    has its own)."""

    rec: Recorder
    seed: int
    workspace: str
    load_end: float  # when the actors and pollers stop (time.time())
    bed: Any  # the test bed of a run across hosts, or None
    args: Any  # `actors`: how many session actors

    def api_base(self, slot: int) -> str: ...

    def redis_url(self) -> str: ...


class Reader:
    """One SSE reader of a session: resumes with Last-Event-ID (and the eventEpoch it
    knows) after any error, alternating API processes, until the session ends."""

    def __init__(self, load: Load, sid: str, name: str, api: int) -> None:
        self.load = load
        self.sid = sid
        self.name = name
        self.api = api
        self.last_id: int | None = None
        self.epoch: str | None = None
        self.ended = False
        self.snapshot = asyncio.Event()
        self.frames: list[dict[str, Any]] = []  # session events, for the actor to wait on
        self.changed = asyncio.Condition()
        self.task: asyncio.Task[None] | None = None
        self._gone = False

    def start(self) -> Reader:
        self.task = asyncio.ensure_future(self.run())
        return self

    async def run(self) -> None:
        conn = 0
        refused = 0  # answers that say the session is gone (404, or a replay that ends)
        while not self.ended and refused < 6 and not self.load.readers_stop.is_set():
            conn += 1
            new = await self._connect(conn)
            if self.ended:
                break
            refused = 0 if new else refused + (1 if self._gone else 0)
            self.api = (self.api + 1) % APIS
            await asyncio.sleep(0.2 + 0.4 * refused)
        async with self.changed:
            self.changed.notify_all()

    async def _connect(self, conn: int) -> int:
        """One connection; returns how many session events it brought."""
        self._gone = False
        headers: dict[str, str] = {}
        params: dict[str, str] = {}
        if self.last_id is not None:
            headers["Last-Event-ID"] = str(self.last_id)
            if self.epoch:
                params["eventEpoch"] = self.epoch
        client = self.load.sse_clients[self.api]
        rec = self.load.rec
        base = {"reader": self.name, "conn": conn, "sid": self.sid}
        brought = 0
        reason = "eof"
        opened = False
        try:
            async with client.stream("GET", f"/session/{self.sid}/events", headers=headers, params=params) as response:
                opened = True
                rec("sse_open", **base, api=self.api, t=now(), last_event_id=self.last_id, epoch_hint=params.get("eventEpoch"),
                    status=response.status_code)
                if response.status_code != 200:
                    self._gone = response.status_code == 404
                    reason = f"status {response.status_code}"
                    return 0
                async for frame in sse_frames(response):
                    brought += await self.on_frame(frame, base)
                    if self.ended:
                        reason = "ended"
                        break
                else:
                    self._gone = brought == 0
        except (httpx.HTTPError, OSError) as error:
            if not opened:
                rec("sse_open", **base, api=self.api, t=now(), last_event_id=self.last_id,
                    epoch_hint=params.get("eventEpoch"), status=None, error=type(error).__name__)
            reason = type(error).__name__
        except asyncio.CancelledError:
            if opened:
                rec("sse_close", **base, t=now(), reason="stopped")
            raise
        finally:
            if reason.startswith("status"):
                rec("sse_close", **base, t=now(), reason=reason)
        if not reason.startswith("status"):
            rec("sse_close", **base, t=now(), reason=reason)
        return brought

    async def on_frame(self, frame: dict[str, Any], base: dict[str, Any]) -> int:
        """Record one frame and follow it (its id, the epoch, a move, the end); returns 1 for
        a session event, 0 for a control frame."""
        try:
            data = orjson.loads(frame["data"]) if "data" in frame else None
        except orjson.JSONDecodeError:
            data = frame.get("data")
        event_id = int(frame["id"]) if frame.get("id", "").isdigit() else None
        event_type = frame.get("event")
        payload = data.get("data") if isinstance(data, dict) and isinstance(data.get("data"), dict) else {}
        if event_id is None and event_type in ("session_snapshot", "history_truncated"):
            self.epoch = payload.get("eventEpoch") or self.epoch
        # `epoch`: the stream's eventEpoch as this reader knows it (snapshot, history_truncated).
        self.load.rec("sse", **base, t=now(), id=event_id, type=event_type, data=data, epoch=self.epoch)
        if event_id is None:
            if event_type == "session_snapshot":
                self.last_id = payload.get("lastEventId", self.last_id)
                self.snapshot.set()
            return 0
        self.last_id = event_id
        if event_type == checker.MOVED:
            self.load.moved(self.sid, event_id)
        if event_type in ENDING:
            self.ended = True
            self.load.died(self.sid)
        async with self.changed:
            self.frames.append(data if isinstance(data, dict) else {})
            self.changed.notify_all()
        return 1

    async def wait_for(self, predicate: Callable[[dict[str, Any]], bool], timeout: float) -> dict[str, Any] | None:
        async def find() -> dict[str, Any] | None:
            async with self.changed:
                while True:
                    for envelope in self.frames:
                        if predicate(envelope):
                            return envelope
                    if self.ended or self.task is None or self.task.done():
                        return None
                    await self.changed.wait()

        try:
            return await asyncio.wait_for(find(), timeout)
        except asyncio.TimeoutError:
            return None


async def sse_frames(response: httpx.Response) -> AsyncIterator[dict[str, str]]:
    """The frames of an event stream: dicts of field -> value (`id`, `event`, `data`)."""
    current: dict[str, str] = {}
    async for line in response.aiter_lines():
        if line == "":
            if "event" in current or "data" in current:
                yield current
            current = {}
        elif line.startswith(":"):
            continue
        else:
            name, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if name == "data" and "data" in current:
                current["data"] += "\n" + value
            elif name in ("id", "event", "data"):
                current[name] = value


class Load:
    """Session actors (create, prompts of every kind, votes from several voters on both
    APIs, answers, cancels, deletes), status pollers and SSE readers."""

    def __init__(self, chaos: Run) -> None:
        self.chaos = chaos
        self.rec = chaos.rec
        self.rng = random.Random(f"load-{chaos.seed}")
        self.ids = itertools.count(1)
        self.clients: list[httpx.AsyncClient] = []
        self.sse_clients: list[httpx.AsyncClient] = []
        self.store: RedisStore | None = None  # the owner reads
        self.sessions: list[str] = []
        self.dead: dict[str, float] = {}
        self.readers: list[Reader] = []
        self.readers_stop = asyncio.Event()
        self.tasks: list[asyncio.Task[Any]] = []
        self.chains: set[asyncio.Task[Any]] = set()
        self.abandoned = 0
        self.moves_seen: set[tuple[str, int]] = set()

    async def open(self) -> None:
        headers = {"Authorization": f"Bearer {HOSTS_TOKEN}"} if self.chaos.bed else {}
        for slot in range(APIS):
            base = self.chaos.api_base(slot)
            limits = httpx.Limits(max_connections=200, max_keepalive_connections=50)
            self.clients.append(httpx.AsyncClient(base_url=base, timeout=REQUEST_TIMEOUT, limits=limits, headers=headers))
            self.sse_clients.append(httpx.AsyncClient(base_url=base, timeout=SSE_TIMEOUT, headers=headers,
                                                      limits=httpx.Limits(max_connections=None, max_keepalive_connections=0)))
        self.store = RedisStore.from_url(self.chaos.redis_url())

    async def close(self) -> None:
        self.readers_stop.set()
        for reader in self.readers:
            if reader.task is not None:
                reader.task.cancel()
        await asyncio.gather(*(r.task for r in self.readers if r.task), return_exceptions=True)
        for task in [*self.tasks, *self.chains]:
            task.cancel()
        await asyncio.gather(*self.tasks, *self.chains, return_exceptions=True)
        for c in self.clients + self.sse_clients:
            await c.aclose()
        with contextlib.suppress(Exception):
            if self.store is not None:
                await self.store.close()

    def key(self, kind: str) -> str:
        tail = "".join(self.rng.choices(string.ascii_lowercase + string.digits, k=6))
        return f"{kind}-{self.chaos.seed}-{next(self.ids)}-{tail}"

    def died(self, sid: str) -> None:
        self.dead.setdefault(sid, now())

    @property
    def running(self) -> bool:
        return now() < self.chaos.load_end

    # ---- requests -----------------------------------------------------------------------

    async def call(
        self, method: str, route: str, path: str, *, rng: random.Random, json_body: Any = None, sid: str | None = None,
        rid: str | None = None, mutating: bool = True, key: str | None = None, text: str | None = None,
        api: int | None = None, retry: bool = True, timeout: httpx.Timeout | None = None,
    ) -> tuple[int | None, Any]:
        """One logical request: mutating ones carry an Idempotency-Key and are retried with
        that same key (alternating APIs) while the outcome is unknown or the store says it
        did nothing; every attempt is recorded."""
        if mutating and key is None:
            key = self.key(route)
        chain = key or f"{route}-{next(self.ids)}"
        api = rng.randrange(APIS) if api is None else api
        deadline = time.monotonic() + CHAIN_BUDGET_S
        for attempt in itertools.count():
            headers = {"Idempotency-Key": key} if key else {}
            record: dict[str, Any] = {
                "id": next(self.ids), "chain": chain, "attempt": attempt, "method": method, "route": route, "path": path,
                "api": api, "sid": sid, "rid": rid, "key": key, "sent": json_body, "text": text,
            }
            record["t_sent"] = now()
            status: int | None = None
            body: Any = None
            try:
                response = await self.clients[api].request(
                    method, path, json=json_body, headers=headers, timeout=timeout or REQUEST_TIMEOUT
                )
                status = response.status_code
                record["content_type"] = response.headers.get("content-type")
                try:
                    body = response.json() if response.content else None
                except ValueError:
                    body = response.text[:500]
                record["retry_after"] = response.headers.get("retry-after")
            except httpx.HTTPError as error:
                record["error"] = type(error).__name__
            record.update(t_answered=now() if status is not None else None, t_done=now(), status=status, body=body)
            code = body.get("code") if isinstance(body, dict) else None
            retryable = status is None or (status == 503 and code != "prompt_queue_full")
            final = not (retry and mutating and retryable and time.monotonic() < deadline)
            if not mutating and retry and status is None and time.monotonic() < deadline and attempt < 2:
                final = False
            record["final"] = final
            self.rec("http", **record)
            if final:
                return status, body
            pause = 0.2 * (attempt + 1)
            if record.get("retry_after", None) and str(record["retry_after"]).isdigit():
                pause = max(pause, min(float(record["retry_after"]), 2.0))
            await asyncio.sleep(min(pause, 2.0) * rng.uniform(0.5, 1.0))
            api = (api + 1) % APIS
        raise AssertionError("unreachable")

    async def create(self, rng: random.Random) -> str | None:
        status, body = await self.call(
            "POST", "create", "/session", rng=rng, json_body={"cwd": self.chaos.workspace, "sessionScope": "thread"}
        )
        if status == 200 and isinstance(body, dict) and body.get("sessionId"):
            sid = body["sessionId"]
            self.sessions.append(sid)
            self.spawn(self.read_owner(sid))
            return sid
        return None

    async def read_owner(self, sid: str, why: str = "created", tries: int = 30) -> None:
        """Record the session's owner: the incarnation its live state names, with `last_id`
        (its last event id) and `epoch` read with it in one command, which place the owner in
        the session's log (a move changes the owner in the step that writes `session_moved`)."""
        assert self.store is not None
        ws = workspace_id(self.chaos.workspace)
        for _ in range(tries):
            t_sent = now()
            try:
                view = await asyncio.wait_for(self.store.session(ws, sid), 3)
            except Exception:  # noqa: BLE001 - Redis may be away: try again
                view = None
            if view is not None:
                self.rec("owner", sid=sid, inc=view.owner, t=now(), t_sent=t_sent, last_id=view.last_event_id or None,
                         epoch=view.epoch or None, why=why)
                return
            await asyncio.sleep(0.3)
        if why == "created":
            self.rec("owner", sid=sid, inc=None, t=now(), why=why)

    def moved(self, sid: str, event_id: int) -> None:
        """A reader saw `session_moved`: read the owner that took the session (once)."""
        if (sid, event_id) not in self.moves_seen:
            self.moves_seen.add((sid, event_id))
            self.spawn(self.read_owner(sid, "moved", tries=5))

    async def read_owners(self, why: str) -> None:
        """Every session not seen ending: its owner now (after a drain, where each went)."""
        semaphore = asyncio.Semaphore(16)

        async def one(sid: str) -> None:
            async with semaphore:
                await self.read_owner(sid, why, tries=1)

        await asyncio.gather(*(one(sid) for sid in dict.fromkeys(self.sessions) if sid not in self.dead))

    def spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self.chains.add(task)
        task.add_done_callback(self.chains.discard)

    async def status(self, sid: str, rng: random.Random, api: int | None = None) -> tuple[int | None, Any]:
        return await self.call("GET", "status", f"/session/{sid}/status", rng=rng, sid=sid, mutating=False,
                               api=api, retry=False, timeout=POLL_TIMEOUT)

    async def delete(self, sid: str, rng: random.Random) -> int | None:
        status, _ = await self.call("DELETE", "delete", f"/session/{sid}", rng=rng, sid=sid)
        if status == 204:
            self.died(sid)
            await self.status(sid, rng)
        return status

    async def prompt(self, sid: str, scenario: str, rng: random.Random) -> str | None:
        key = self.key("prompt")
        text = f"{scenario} k={key}"
        status, body = await self.call(
            "POST", "prompt", f"/session/{sid}/prompt", rng=rng, sid=sid, key=key, text=text,
            json_body={"prompt": [{"type": "text", "text": text}]},
        )
        if status is not None and 200 <= status < 300 and isinstance(body, dict):
            return body.get("promptId")
        return None

    async def turn_on(self, inc: str | None, seconds: float, tries: int = 3) -> dict[str, Any]:
        """A turn running on worker incarnation `inc` now (for `worker_stop_alone`: the
        issue's split brain needs an agent mid-turn when its worker stops), `#slow
        <seconds>`, returned once the agent has started it. On a session of its own, with a
        reader, created until one lands on `inc` (the others are deleted, as an actor would);
        placement favours the emptier worker, so after `tries` creates, on the most recent
        live session `inc` owns (with a reader of its own; the prompt may queue behind the
        actor's turn for a moment)."""
        assert self.store is not None
        rng = random.Random(f"turn-on-{self.chaos.seed}-{next(self.ids)}")
        ws = workspace_id(self.chaos.workspace)

        async def owner(sid: str) -> str | None:
            try:
                view = await asyncio.wait_for(self.store.session(ws, sid), 3)  # type: ignore[union-attr]
            except Exception:  # noqa: BLE001 - Redis may be away: not this one
                return None
            return view.owner if view is not None else None

        async def run_on(sid: str, reader: Reader, how: str, attempt: int) -> dict[str, Any]:
            pid = await self.prompt(sid, f"#slow {seconds}", rng)
            started = pid is not None and await reader.wait_for(
                lambda f: f.get("promptId") == pid and (f.get("data") or {}).get("update", {}).get(
                    "sessionUpdate") == "agent_message_chunk", 8) is not None
            return {"sid": sid, "promptId": pid, "started": started, "how": how, "tries": attempt, "seconds": seconds}

        for attempt in range(1, tries + 1):
            sid = await self.create(rng)
            if sid is None:
                continue
            reader = Reader(self, sid, f"r{next(self.ids)}", rng.randrange(APIS)).start()
            self.readers.append(reader)
            found = await owner(sid)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(reader.snapshot.wait(), 10)
            if found == inc and reader.snapshot.is_set():
                return await run_on(sid, reader, "created", attempt)
            await self.delete(sid, rng)
        for sid in [s for s in reversed(dict.fromkeys(self.sessions)) if s not in self.dead][:40]:
            if await owner(sid) != inc:
                continue
            reader = Reader(self, sid, f"r{next(self.ids)}", rng.randrange(APIS)).start()
            self.readers.append(reader)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(reader.snapshot.wait(), 10)
            if reader.snapshot.is_set() and sid not in self.dead:
                return await run_on(sid, reader, "live session", tries)
        return {"sid": None, "tries": tries}

    # ---- actors -------------------------------------------------------------------------

    async def run(self) -> None:
        n = self.chaos.args.actors
        self.tasks = [asyncio.ensure_future(self.actor(i)) for i in range(n)]
        self.tasks += [asyncio.ensure_future(self.poller(i)) for i in range(3)]
        await asyncio.gather(*self.tasks, return_exceptions=False)

    async def poller(self, n: int) -> None:
        rng = random.Random(f"poller-{self.chaos.seed}-{n}")
        while self.running:
            if self.sessions:
                recent = [s for s, t in self.dead.items() if now() - t < 15]
                sid = rng.choice(recent) if recent and rng.random() < 0.4 else rng.choice(self.sessions)
                await self.status(sid, rng)
            await asyncio.sleep(rng.uniform(0.05, 0.2))

    async def actor(self, n: int) -> None:
        rng = random.Random(f"actor-{self.chaos.seed}-{n}")
        await asyncio.sleep(rng.uniform(0, 1.5))
        while self.running:
            try:
                await self.lifecycle(rng)
            except Exception as error:  # noqa: BLE001 - a surprise in the load is recorded, not fatal
                self.rec("load_error", actor=n, t=now(), error=repr(error))
                log(f"actor {n}: {error!r}")
                await asyncio.sleep(0.5)

    async def lifecycle(self, rng: random.Random) -> None:
        """One session: create, read its events, a few steps, then close it (or leave it)."""
        sid = await self.create(rng)
        if sid is None:
            await asyncio.sleep(rng.uniform(0.3, 1.0))
            return
        reader = Reader(self, sid, f"r{next(self.ids)}", rng.randrange(APIS)).start()
        self.readers.append(reader)
        # Prompts wait for the reader's snapshot: one sent before it would have its events
        # before any reader's first id, where nothing in the history could show its
        # terminal. Across hosts an API's cut can hold the reader's first connection for a
        # while (it alternates APIs on each failure): 5 s was too short there.
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(reader.snapshot.wait(), SNAPSHOT_WAIT_S)
        if rng.random() < 0.2:
            second = Reader(self, sid, f"r{next(self.ids)}", (reader.api + 1) % APIS).start()
            self.readers.append(second)
        for _ in range(rng.randint(1, 6)):
            if not self.running or sid in self.dead:
                break
            try:
                await self.step(sid, reader, rng)
            except httpx.HTTPError:
                pass
        if sid in self.dead:
            return
        if rng.random() < 0.75 or self.abandoned >= 16:
            await self.delete(sid, rng)
        else:
            self.abandoned += 1

    async def step(self, sid: str, reader: Reader, rng: random.Random) -> None:
        roll = rng.random()
        if roll < 0.22:
            pid = await self.prompt(sid, "hello", rng)
            await self.turn_end(reader, pid, 6)
        elif roll < 0.37:
            # A few turns (4% of steps, picked by the same roll: no other draw moves) outlast
            # a drain's grace, so a drain catching one ends it `worker_draining`.
            seconds = 1 if roll < 0.33 else LONG_TURN_S
            pid = await self.prompt(sid, f"#slow {seconds}", rng)
            if pid and rng.random() < 0.3:
                await asyncio.sleep(rng.uniform(0.1, 0.6))
                await self.call("POST", "cancel", f"/session/{sid}/cancel", rng=rng, sid=sid, json_body={})
            await self.turn_end(reader, pid, 7 + seconds)
        elif roll < 0.62:
            await self.interaction(sid, reader, "#permission", rng)
        elif roll < 0.77:
            await self.interaction(sid, reader, "#question", rng)
        elif roll < 0.87:
            # Queued prompts: a slow one and another behind it (both must end once each).
            first = await self.prompt(sid, "#slow 1", rng)
            second = await self.prompt(sid, rng.choice(["hello", "#slow 1"]), rng)
            if rng.random() < 0.3:
                await self.delete(sid, rng)
                return
            await self.turn_end(reader, first, 8)
            await self.turn_end(reader, second, 8)
        else:
            for _ in range(rng.randint(1, 4)):
                await self.status(sid, rng)
                await asyncio.sleep(rng.uniform(0.05, 0.2))
            if rng.random() < 0.5:
                await self.call("POST", "cancel", f"/session/{sid}/cancel", rng=rng, sid=sid, json_body={})

    async def turn_end(self, reader: Reader, prompt_id: str | None, timeout: float) -> None:
        if prompt_id is None:
            return
        await reader.wait_for(
            lambda e: e.get("type") in checker.TERMINALS + ENDING
            and (e.get("type") in ENDING or checker.envelope_prompt_id(e) == prompt_id),
            timeout,
        )

    async def find_request(self, sid: str, reader: Reader, prompt_id: str, rng: random.Random) -> str | None:
        found = await reader.wait_for(
            lambda e: (e.get("type") == "permission_request" and e.get("promptId") == prompt_id)
            or e.get("type") in ENDING, 5,
        )
        if found is not None and found.get("type") == "permission_request":
            return (found.get("data") or {}).get("requestId")
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline and sid not in self.dead:
            status, body = await self.status(sid, rng)
            if status == 200 and isinstance(body, dict):
                for pending in body.get("pendingInteractions") or []:
                    return pending.get("requestId")
            await asyncio.sleep(0.2)
        return None

    async def interaction(self, sid: str, reader: Reader, scenario: str, rng: random.Random) -> None:
        pid = await self.prompt(sid, scenario, rng)
        if pid is None:
            return
        rid = await self.find_request(sid, reader, pid, rng)
        if rid is None:
            await self.turn_end(reader, pid, 3)
            return
        roll = rng.random()
        if roll < 0.08:  # no vote: cancel the turn while it waits
            await self.call("POST", "cancel", f"/session/{sid}/cancel", rng=rng, sid=sid, json_body={})
        elif roll < 0.13:  # no vote: close the session while it waits
            await self.delete(sid, rng)
            return
        else:
            voters = [self.vote(sid, rid, scenario, i, rng) for i in range(rng.randint(2, 5))]
            await asyncio.gather(*voters)
        await self.turn_end(reader, pid, 6)

    async def vote(self, sid: str, rid: str, scenario: str, i: int, rng: random.Random) -> None:
        if scenario == "#question":
            body: dict[str, Any] = rng.choice([
                {"outcome": {"outcome": "selected", "optionId": "proceed_once"}, "answers": {"0": rng.choice(["Red", "Blue"])}},
                {"outcome": {"outcome": "selected", "optionId": "proceed_once"}, "answers": {"0": "Blue"}},
                {"outcome": {"outcome": "selected", "optionId": "cancel"}},
            ])
        else:
            body = rng.choice([
                {"outcome": {"outcome": "selected", "optionId": "proceed_once"}},
                {"outcome": {"outcome": "selected", "optionId": "proceed_once"}},
                {"outcome": {"outcome": "selected", "optionId": "cancel"}},
                {"outcome": {"outcome": "cancelled"}},
            ])
        legacy = rng.random() < 0.2
        route, path = ("vote_legacy", f"/permission/{rid}") if legacy else ("vote", f"/session/{sid}/permission/{rid}")
        key = self.key("vote")
        api = i % APIS
        status, _ = await self.call("POST", route, path, rng=rng, sid=sid, rid=rid, json_body=body, key=key, api=api)
        if status == 200 and rng.random() < 0.15:  # the same vote again, same key: may repeat its 200
            await self.call("POST", route, path, rng=rng, sid=sid, rid=rid, json_body=body, key=key, api=(api + 1) % APIS)

    # ---- the end ------------------------------------------------------------------------

    async def finish_chains(self, timeout: float = CHAIN_BUDGET_S + 5) -> None:
        if self.chains:
            await asyncio.wait(list(self.chains), timeout=timeout)

    async def final_reads(self, live: bool) -> None:
        """Each session's replay log from the start. `live`: first a fresh connection for
        the epoch (its snapshot), then the replay from 0 with that epoch (a change would be
        announced); otherwise (sessions closed) the replay alone."""
        semaphore = asyncio.Semaphore(8)

        async def one(sid: str) -> None:
            async with semaphore:
                name = f"final-{'live' if live else 'end'}-{sid}"
                epoch = None
                if live:
                    status, epoch = await self._read(name, 1, sid, None, None, until="session_snapshot")
                    if status != 200:
                        return
                await self._read(name, 2, sid, 0, epoch, until="replay_complete")

        await asyncio.gather(*(one(sid) for sid in list(dict.fromkeys(self.sessions))))

    async def _read(self, name: str, conn: int, sid: str, last_id: int | None, epoch: str | None, until: str) -> tuple[int | None, str | None]:
        headers = {} if last_id is None else {"Last-Event-ID": str(last_id)}
        params = {"eventEpoch": epoch} if epoch else {}
        base = {"reader": name, "conn": conn, "sid": sid}
        api = conn % APIS
        seen_epoch = epoch
        status = None
        try:
            async with self.sse_clients[api].stream("GET", f"/session/{sid}/events", headers=headers, params=params,
                                                    timeout=httpx.Timeout(10.0)) as response:
                status = response.status_code
                self.rec("sse_open", **base, api=api, t=now(), last_event_id=last_id, epoch_hint=epoch, status=status)
                if status == 200:
                    async for frame in sse_frames(response):
                        try:
                            data = orjson.loads(frame["data"]) if "data" in frame else None
                        except orjson.JSONDecodeError:
                            data = frame.get("data")
                        event_id = int(frame["id"]) if frame.get("id", "").isdigit() else None
                        self.rec("sse", **base, t=now(), id=event_id, type=frame.get("event"), data=data)
                        payload = data.get("data") if isinstance(data, dict) and isinstance(data.get("data"), dict) else {}
                        if event_id is None and payload.get("eventEpoch"):
                            seen_epoch = payload["eventEpoch"]
                        if frame.get("event") == until or frame.get("event") in ENDING:
                            break
        except (httpx.HTTPError, OSError) as error:
            self.rec("sse_close", **base, t=now(), reason=type(error).__name__)
            return status, seen_epoch
        self.rec("sse_close", **base, t=now(), reason="final read done")
        return status, seen_epoch

    async def listing(self) -> None:
        ws = workspace_id(self.chaos.workspace)
        sids: list[str] = []
        cursor = None
        rng = random.Random(0)
        for _ in range(200):
            path = f"/workspace/{ws}/sessions?size=100" + (f"&cursor={cursor}" if cursor else "")
            status, body = await self.call("GET", "listing", path, rng=rng, mutating=False, retry=True, api=0)
            if status != 200 or not isinstance(body, dict):
                break
            sids += [row.get("sessionId") for row in body.get("sessions", [])]
            cursor = body.get("nextCursor")
            if not cursor:
                break
        self.rec("listing", t=now(), sids=sids)

    async def stop_readers(self, grace_s: float) -> None:
        """Readers still open get their session_closed from the workers' SIGTERM; then stop."""
        pending = [r.task for r in self.readers if r.task is not None and not r.task.done()]
        if pending:
            await asyncio.wait(pending, timeout=grace_s)
        self.readers_stop.set()
        for reader in self.readers:
            if reader.task is not None and not reader.task.done():
                reader.task.cancel()
        await asyncio.gather(*(r.task for r in self.readers if r.task), return_exceptions=True)
