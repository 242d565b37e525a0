"""The rolling deploy's client (bench/rolling_deploy.py): the chaos run's load, recorded the
same way, keeping `--in-flight` prompts going over the sessions while their workers restart,
resuming a session that died (`POST /session/:id/load`), and noting what it saw for the
figures (each prompt's answer and end, each `session_moved`).
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Protocol

from .chaos import checker, load
from .chaos.history import Recorder, now
from .chaos.schedule import APIS


class Plan(Protocol):
    """What the client reads of the deploy's plan (`rolling_deploy.Plan`)."""

    seed: int
    event_timeout_s: float

    @property
    def resumes(self) -> bool: ...


class Run(Protocol):
    """What the client needs of the deploy that drives it (`rolling_deploy.Run`)."""

    plan: Plan
    rec: Recorder
    api_ports: list[int]
    redis_url: str
    workspace: str

TERMINALS = checker.TERMINALS
ENDINGS = checker.ENDINGS
# A prompt's events that are not its turn's: announced queued, ended, or taken out.
NOT_A_START = {"pending_prompt_added", "pending_prompt_completed", *TERMINALS}


def log(message: str) -> None:
    print(f"[rolling-deploy {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclass
class Tracked:
    """One session as the client follows it."""

    sid: str
    n: int
    fact: str
    life: int = 1
    reader: Any = None
    live: bool = True  # prompts may go to it
    busy: bool = False  # a prompt of the deploy's client is under way
    resuming: bool = False
    lost: bool = False  # ended for good (closed, or a resume failed)


class Reader(load.Reader):
    """The chaos run's reader (records every frame, resumes with Last-Event-ID on either API),
    which also tells the client of moves and endings."""

    async def on_frame(self, frame: dict[str, Any], base: dict[str, Any]) -> int:
        brought = await super().on_frame(frame, base)
        if brought:
            self.load.frame_seen(self.sid, frame.get("event"))
        return brought


class Client(load.Load):
    """The deploy's client, on the chaos load's recorded requests (Idempotency-Key on mutating
    routes, retried with it while the outcome is unknown or the store refused)."""

    def __init__(self, run: Run) -> None:
        host = SimpleNamespace(
            rec=run.rec, seed=run.plan.seed, api_ports=run.api_ports, redis_url=lambda: run.redis_url,
            workspace=run.workspace, load_end=float("inf"), args=SimpleNamespace(actors=0),
            bed=None, api_base=lambda slot: f"http://127.0.0.1:{run.api_ports[slot]}",  # one host
        )
        super().__init__(host)  # type: ignore[arg-type]
        self.plan = run.plan
        self.tracked: dict[str, Tracked] = {}
        self.order: list[str] = []
        self.cursor = 0
        self.changed = asyncio.Condition()
        self.stop_prompting = asyncio.Event()
        self.lives: dict[str, list[float]] = {}
        self.reader_life: dict[str, int] = {}
        self.moves: list[tuple[float, str]] = []  # (arrival, sid) of every session_moved frame
        self.deaths: list[tuple[float, str]] = []  # (arrival, sid) of every session_died frame
        self.prompts: list[dict[str, Any]] = []  # the deploy's prompts: sid, key, status, promptId, t_answered
        self.resume_tasks: set[asyncio.Task[Any]] = set()
        self.resume_results: list[dict[str, Any]] = []
        self.bursts: list[tuple[str, int, list[str]]] = []  # (sid, life, prompt ids in the order acknowledged)

    # ---- sessions and their readers ---------------------------------------------------------

    def reader_for(self, s: Tracked) -> Reader:
        name = f"r{s.n}" if s.life == 1 else f"r{s.n}~{s.life}"
        self.reader_life[name] = s.life
        reader = Reader(self, s.sid, name, s.n % APIS).start()
        self.readers.append(reader)
        return reader

    async def open_session(self, n: int, fact: str, rng: random.Random) -> Tracked | None:
        sid = await self.create(rng)  # records the owner as well
        if sid is None:
            return None
        s = Tracked(sid, n, fact)
        self.tracked[sid] = s
        self.order.append(sid)
        s.reader = self.reader_for(s)
        await asyncio.wait_for(s.reader.snapshot.wait(), 30)
        return s

    def frame_seen(self, sid: str, event_type: str | None) -> None:
        s = self.tracked.get(sid)
        if s is None:
            return
        if event_type == checker.MOVED:
            self.moves.append((now(), sid))  # (the chaos reader has the new owner read: Load.moved)
        elif event_type in ENDINGS:
            s.live = False
            died = event_type == "session_died"
            if died:
                self.deaths.append((now(), sid))
            if died and self.plan.resumes and not self.stop_prompting.is_set():
                s.resuming = True
                task = asyncio.ensure_future(self.resume(s))
                self.resume_tasks.add(task)
                task.add_done_callback(self.resume_tasks.discard)
            else:
                s.lost = True
        asyncio.ensure_future(self.notify())

    async def notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def resume(self, s: Tracked) -> None:
        """`POST /session/:id/load` of a session whose worker died (503 while its state is
        not swept yet: retried, as the chaos load retries, with Retry-After), then a reader of
        its new life."""
        sent = now()
        status, body = await self.call("POST", "load", f"/session/{s.sid}/load", rng=random.Random(s.sid),
                                       sid=s.sid, json_body={})
        first_sent = min((r["t_sent"] for r in self.rec.records if r["kind"] == "http" and r.get("route") == "load"
                          and r.get("sid") == s.sid and r["t_sent"] >= sent), default=sent)
        self.resume_results.append({"sid": s.sid, "status": status, "code": (body or {}).get("code") if isinstance(body, dict) else None,
                                    "attached": body.get("attached") if isinstance(body, dict) else None,
                                    "s": round(now() - sent, 3)})
        if status != 200:
            log(f"resuming {s.sid} failed: {status} {body}")
            s.lost, s.resuming = True, False
            await self.notify()
            return
        self.lives.setdefault(s.sid, []).append(first_sent)
        s.life += 1
        s.reader = self.reader_for(s)
        await asyncio.wait_for(s.reader.snapshot.wait(), 30)
        self.spawn(self.read_owner(s.sid))  # the new life's first owner (as after a create)
        s.live, s.resuming = True, False
        await self.notify()

    # ---- prompts -------------------------------------------------------------------------

    async def send(self, s: Tracked, text: str, rng: random.Random) -> tuple[int | None, Any, str]:
        key = self.key("prompt")
        tagged = f"{text} k={key}"
        status, body = await self.call(
            "POST", "prompt", f"/session/{s.sid}/prompt", rng=rng, sid=s.sid, key=key, text=tagged,
            json_body={"prompt": [{"type": "text", "text": tagged}]},
        )
        return status, body, key

    async def terminal(self, reader: Reader, prompt_id: str) -> dict[str, Any] | None:
        """The prompt's terminal on `reader`, or the session's end, or None (timed out)."""
        return await reader.wait_for(
            lambda e: (e.get("type") in TERMINALS and checker.envelope_prompt_id(e) == prompt_id)
            or e.get("type") in ENDINGS,
            self.plan.event_timeout_s,
        )

    async def turn(self, s: Tracked, text: str, rng: random.Random, note: bool = False) -> dict[str, Any]:
        """One prompt and its end as this client sees it."""
        reader = s.reader
        status, body, key = await self.send(s, text, rng)
        outcome: dict[str, Any] = {"sid": s.sid, "key": key, "status": status, "t_answered": now()}
        prompt_id = body.get("promptId") if isinstance(body, dict) else None
        outcome["promptId"] = prompt_id
        if status is not None and 200 <= status < 300 and prompt_id:
            end = await self.terminal(reader, prompt_id)
            outcome["end"] = None if end is None else end.get("type")
        else:
            outcome["code"] = body.get("code") if isinstance(body, dict) else None
            if status == 404 and not self.plan.resumes:
                s.live, s.lost = False, True  # today: the session is gone, and its conversation
        if note:
            self.prompts.append(outcome)
        return outcome

    def next_session(self) -> Tracked | None:
        for _ in range(len(self.order)):
            s = self.tracked[self.order[self.cursor % len(self.order)]]
            self.cursor += 1
            if s.live and not s.busy and not s.lost:
                return s
        return None

    async def prompter(self, n: int) -> None:
        """Keeps one prompt going: to the next session with none, the next as it ends."""
        rng = random.Random(f"prompter-{self.plan.seed}-{n}")
        while not self.stop_prompting.is_set():
            async with self.changed:
                s = self.next_session()
                if s is None:
                    if all(t.lost for t in self.tracked.values()):
                        return
                    await self.changed.wait()  # a session freed, resumed or ended; or the stop
                    continue
                s.busy = True
            try:
                await self.turn(s, "hello", rng, note=True)
            finally:
                s.busy = False
                await self.notify()

    def bursts_at(self, sids: set[str], t_sigterm: float, count: int) -> None:
        """A burst to `count` idle sessions of a worker just told to drain (see
        bench/rolling_deploy.py): two prompts now (held, then carried or parked), one more
        once its move reached the client."""
        chosen = [s for sid in sorted(sids) if (s := self.tracked.get(sid)) and s.live and not s.busy][:count]
        for s in chosen:
            s.busy = True
            self.spawn(self.burst(s, t_sigterm))

    async def burst(self, s: Tracked, t_sigterm: float) -> None:
        rng = random.Random(f"burst-{self.plan.seed}-{s.sid}-{t_sigterm}")
        reader, life = s.reader, s.life
        sent: list[dict[str, Any]] = []
        try:
            for text in ("burst one", "burst two", "burst three"):
                if text == "burst three":  # once the session moved (or ended)
                    async with self.changed:
                        await asyncio.wait_for(self.changed.wait_for(lambda: not s.live or any(
                            t >= t_sigterm and sid == s.sid for t, sid in self.moves)), self.plan.event_timeout_s)
                    if not s.live:
                        break
                status, body, key = await self.send(s, text, rng)
                prompt_id = body.get("promptId") if isinstance(body, dict) else None
                sent.append({"sid": s.sid, "key": key, "status": status, "t_answered": now(), "promptId": prompt_id,
                             "code": body.get("code") if isinstance(body, dict) and not prompt_id else None})
            for outcome in sent:
                if outcome["promptId"] and outcome["status"] is not None and 200 <= outcome["status"] < 300:
                    end = await self.terminal(reader, outcome["promptId"])
                    outcome["end"] = None if end is None else end.get("type")
        finally:
            self.prompts.extend(sent)
            if s.life == life:
                self.bursts.append((s.sid, life, [o["promptId"] for o in sent if o["promptId"]]))
            s.busy = False
            await self.notify()

    def burst_orders(self, history: Any) -> list[bool]:
        """Per burst: whether its turns started in the order its prompts were acknowledged
        (a prompt that never started, ended by a death's sweep, starts none after it)."""
        started: dict[str, int] = {}  # prompt id -> the id of its turn's first event
        for e in history.events.values():
            env = e["env"]
            pid = checker.envelope_prompt_id(env)
            if pid and env.get("type") not in NOT_A_START and isinstance(env.get("id"), int):
                started[pid] = min(started.get(pid, env["id"]), env["id"])
        kept = []
        for _, _, pids in self.bursts:
            ran = [p for p in pids if p in started]
            kept.append(ran == pids[:len(ran)] and [started[p] for p in ran] == sorted(started[p] for p in ran))
        return kept

    async def poller(self, n: int) -> None:
        """Status reads, now and then of a session that just ended (the checker's zombies)."""
        rng = random.Random(f"poller-{self.plan.seed}-{n}")
        while not self.stop_prompting.is_set():
            recent = [sid for sid, t in self.dead.items() if now() - t < 15]
            sid = rng.choice(recent) if recent and rng.random() < 0.4 else rng.choice(self.order)
            if not self.tracked[sid].resuming:  # a read racing a resume belongs to neither life
                await self.status(sid, rng)
            await asyncio.sleep(rng.uniform(0.1, 0.3))  # a pace, not a wait for an event

    async def stop_load(self) -> None:
        self.stop_prompting.set()
        async with self.changed:
            self.changed.notify_all()
