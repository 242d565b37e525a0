"""`python -m bench.rolling_deploy`: a rolling deploy of the workers under real Qwen Code,
with drains (the sessions move) against today's stop (the sessions of a stopped worker end).

Each run starts its own redis-server, 3 workers running `qwen --acp` (`--session-mode
default`; one HOME for all of them, holding qwen's settings and its chat history, so their
default `--state-store` is one), 2 API processes, and the scripted OpenAI-compatible endpoint
of the tests (`testbed/model_endpoint.py`, which records every request qwen sends). It creates
`--sessions` sessions, each told a fact in a first turn (`remember this fact: FACT-...`),
then restarts the 3 workers one after another (SIGTERM, start a new worker, wait until it
is ready and the old one has exited) while a client keeps `--in-flight` prompts going
(each to the next session that has none, the next one sent when its terminal arrives). After
the deploy it reads every session's status and asks each one to recall (`RECALL-...`): the
conversation survived if the model endpoint saw the session's fact in that request's
history.

Every request, every SSE frame (one reader per session, resuming with Last-Event-ID on
either API) and every worker start and fault goes to a history in the chaos run's format
(bench/chaos/run.py records it the same way), which bench/chaos/checker.py checks: the same
invariants as the chaos run (acknowledged prompts reach exactly one terminal, ids ordered,
no zombies, kills sweep only the killed worker's sessions, errors are JSON with a code, keys
have TTLs).

The drain run (`--drain-grace-s`, 30 by default, the worker's default; the eager hand-off,
the workers' default: the target takes a session over first and its agent resumes it
after), the paced run (the same drain with `--handoff paced`: the target's agent loads the
session before it takes it over, as before) and the baseline run (`--drain-grace-s 0`:
SIGTERM closes every session, as before drains) run one after another in this process
(`--only` names some of them); `--kill9` also kills -9, mid-deploy, the worker that took the
second drain's first session (its sessions die; the client resumes them with `POST
/session/:id/load`). At each restart the client also sends a burst to a few of the
restarted worker's sessions (two prompts at the SIGTERM, held and carried or parked, one
more once the session moved): each burst's turns must run in the order they were
acknowledged. Prints a table of the runs and writes bench/results/rolling_deploy.json
(`--out`).

    python -m bench.rolling_deploy [--sessions 300] [--in-flight 8] [--drain-grace-s 30] [--kill9]
        [--only drain paced baseline]

Figures (per run):

* sessions moved/s: per restart, the sessions that moved (their stream showed
  `session_moved`) over the time from the SIGTERM to the last of them arriving at the
  client; over the deploy, all moves over the sum of those windows.
* move p50/p99, the stream gap a client sees: per moved session, from the later of the
  SIGTERM and the end (terminal event) of the last turn that ran on the old worker, to the
  `session_moved` frame on the client's stream (the new owner took it over and runs what
  waited).
* prompts acknowledged (2xx) by the client during the deploy; prompts lost: those that did
  not complete (`turn_error`, or no terminal) plus those refused because the session was
  gone (404); conversations lost: sessions not live after the deploy, or whose recall did not
  reach a model that was sent their fact.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from acp_state.ids import workspace_id
from acp_state.store import RedisStore
from testbed.processes import AcpProcess, ApiProcess, WorkerProcess
from testbed.redis_server import RedisServer, free_port

from .chaos import checker
from .chaos.history import Recorder
from .chaos.load import CHAIN_BUDGET_S
from .chaos.schedule import APIS
from testbed.model_endpoint import ModelEndpoint, message_text
from testbed.qwen import find_qwen, qwen_env
from .procs import percentile
from .rolling_deploy_client import TERMINALS, Client, Tracked, log, now

RESULTS = Path(__file__).resolve().parent / "results"

@dataclass
class Plan:
    """One run's shape."""

    sessions: int
    drain_grace_s: float  # 0: today's stop (every session of a stopped worker closed)
    in_flight: int  # prompts the client keeps going at once during the deploy
    kill9: bool = False  # kill -9, mid-deploy, the worker that took the second drain's first session
    workers: int = 3
    lease_ms: int = 3000
    seed: int = 1
    create_concurrency: int = 8
    event_timeout_s: float = 900.0  # the longest a prompt's terminal may take to arrive
    stop_timeout_s: float = 1800.0  # the longest a drain may take (SIGTERM to exit; then killed)
    pollers: int = 2  # status readers (the checker's "no zombies" needs reads)
    handoff: str = "eager"  # the workers' --handoff
    bursts: int = 2  # sessions of each restarted worker sent a burst (see the module)

    @property
    def resumes(self) -> bool:
        """Whether the client resumes a session that died (the drain world's client; today's
        client has no way to)."""
        return self.drain_grace_s > 0


# ---------------------------------------------------------------------------- the history


class KeptRecorder(Recorder):
    """The chaos run's recorder (JSON lines, numbered), keeping the records in memory too."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.records: list[dict[str, Any]] = []

    def __call__(self, kind: str, **fields: Any) -> None:
        super().__call__(kind, **fields)
        self.records.append({"seq": len(self.records) + 1, "kind": kind, **fields})


def split_lives(records: list[dict[str, Any]], lives: dict[str, list[float]], reader_life: dict[str, int]) -> list[dict[str, Any]]:
    """The history as the checker reads it: a session resumed by `POST /session/:id/load`
    after its death is a new life (a new event epoch, a new log from id 1) under the name
    `<sid>~<n>`. The checker takes a death as final (no status 200 after it; the owner at
    the end owns the death), which holds per life. `lives[sid]`: when each resuming load
    was sent; `reader_life[reader]`: the life its reader followed (final readers: the last)."""
    if not lives:
        return records

    def alias(sid: str, life: int) -> str:
        return sid if life <= 1 else f"{sid}~{life}"

    def life_at(sid: str, t: float | None) -> int:
        return 1 + sum(1 for start in lives.get(sid, []) if t is not None and t >= start)

    out = []
    for record in records:
        sid = record.get("sid")
        if not isinstance(sid, str) or sid not in lives:
            out.append(record)
            continue
        kind = record["kind"]
        if kind in ("sse_open", "sse", "sse_close"):
            reader = record.get("reader", "")
            life = 1 + len(lives[sid]) if reader.startswith("final-") else reader_life.get(reader, 1)
        elif kind == "http":
            life = life_at(sid, record.get("t_sent"))
        else:
            life = life_at(sid, record.get("t"))
        out.append({**record, "sid": alias(sid, life)})
    return out


# ---------------------------------------------------------------------------- the run


class Run:
    """One rolling deploy: processes, client, history, and its figures."""

    def __init__(self, plan: Plan, redis_url: str, workspace: str, fake: ModelEndpoint, home: Path, log_dir: Path) -> None:
        self.plan = plan
        self.redis_url = redis_url
        self.fake = fake
        self.home = home
        self.log_dir = log_dir
        self.workspace = workspace
        self.ws = workspace_id(self.workspace)
        self.rec = KeptRecorder(log_dir / "history.jsonl")
        self.api_ports: list[int] = []
        self.workers: list[WorkerProcess] = []  # the serving workers, by slot
        self.restarts: list[dict[str, Any]] = []
        self.faults: list[dict[str, Any]] = []
        self.processes: list[AcpProcess] = []  # every process the run started, stopped at its end
        self.store: RedisStore | None = None  # what the run reads of the store's state
        self.qwen = find_qwen()
        if self.qwen is None:
            raise RuntimeError("qwen is not installed (npm install --prefix tests/node)")
        (log_dir / "qwen-tmp").mkdir(exist_ok=True)
        self.env = qwen_env(home, fake.openai_url)
        self.env["TMPDIR"] = str(log_dir / "qwen-tmp")  # qwen leaves qwen-socks-* folders there
        self.started_workers = 0
        self.slot_of: dict[int, int] = {}  # worker pid -> slot
        self.exited_at: dict[int, float] = {}  # worker pid -> when it exited

    async def start_worker(self, slot: int) -> WorkerProcess:
        worker = WorkerProcess(
            ["worker", "--redis-url", self.redis_url, "--agent", f"{self.qwen} --acp", "--session-mode", "default",
             "--agent-stderr", str(self.log_dir / "qwen-stderr.log"),
             "--drain-grace-s", str(self.plan.drain_grace_s), "--lease-ms", str(self.plan.lease_ms),
             "--name", f"rd-w{slot}", "--handoff", self.plan.handoff],
            self.log_dir / f"worker-{len(self.processes)}.log", env=self.env, ready_timeout_s=60,
        )
        self.processes.append(worker)
        await worker.start()
        self.started_workers += 1
        self.slot_of[worker.pid] = slot
        self.rec("worker", slot=slot, pid=worker.pid, inc=worker.incarnation, t=now(), event="started")
        return worker

    def sigterm(self, worker: WorkerProcess, at_once: bool = False) -> None:
        """SIGTERM (a drain), recorded: the checker holds a drain's moves, stops and closes to
        the workers told to stop. `at_once`: then SIGINT, which the worker takes as a second
        SIGTERM (stop now, closing what has not moved); a second SIGTERM sent right after the
        first may merge with it while pending (the kernel keeps one of each signal)."""
        assert worker.proc is not None
        worker.proc.send_signal(signal.SIGTERM)
        if at_once:
            worker.proc.send_signal(signal.SIGINT)
        self.rec("worker", slot=self.slot_of[worker.pid], pid=worker.pid, inc=worker.incarnation,
                 incarnations=[worker.incarnation], t=now(), event="sigterm")

    async def start_api(self) -> ApiProcess:
        port = free_port()
        api = ApiProcess(["api", "--redis-url", self.redis_url, "--port", str(port), "--workspace", self.workspace],
                         self.log_dir / f"api-{len(self.processes)}.log", port, ready_timeout_s=60)
        self.processes.append(api)
        return await api.start()  # type: ignore[return-value]

    async def exit_of(self, worker: WorkerProcess, timeout: float) -> int | None:
        """Until the worker exits (killed past `timeout`), recorded with its exit code."""
        assert worker.proc is not None
        if (await worker.wait_exit(timeout)).endswith("killed"):
            log(f"{worker.incarnation} did not exit within {timeout} s of its SIGTERM: killed")
        self.exited_at[worker.pid] = now()
        self.rec("worker", slot=self.slot_of[worker.pid], pid=worker.pid, inc=worker.incarnation, t=now(),
                 event="stopped", code=worker.proc.returncode)
        return worker.proc.returncode

    async def hosted(self, worker: WorkerProcess) -> set[str]:
        """The sessions the worker holds now (its session index)."""
        assert self.store is not None
        return {sid for _, sid in await self.store.worker_index(worker.incarnation)}

    async def run(self) -> dict[str, Any]:
        plan = self.plan
        t_start = now()
        self.load_avg = {"start": [round(x, 2) for x in os.getloadavg()]}  # the machine is shared: say how busy
        self.store = RedisStore.from_url(self.redis_url)
        client: Client | None = None
        try:
            log(f"{plan.workers} workers (qwen), 2 APIs, drain grace {plan.drain_grace_s} s, {plan.sessions} sessions")
            self.workers = list(await asyncio.gather(*(self.start_worker(slot) for slot in range(plan.workers))))
            apis = [await self.start_api() for _ in range(APIS)]
            self.api_ports = [api.port for api in apis]
            self.rec("meta", seed=plan.seed, cluster=False, lease_ms=plan.lease_ms, drain_grace_s=plan.drain_grace_s,
                     workspace=self.workspace,
                     workspace_id=self.ws, plan=plan.__dict__, api_ports=self.api_ports, t=now())
            client = self.client = Client(self)
            await client.open()
            return await self._run(client, t_start)
        except BaseException:
            # Leave no drain behind: a SIGTERM now would wait out each worker's grace.
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(self.stop_all(), 90)
            raise
        finally:
            if client is not None:
                await client.close()
            with contextlib.suppress(Exception):
                await self.store.close()
            self.rec.close()
            for process in self.processes:  # what stop_all left (an error on the way): gone
                await process.kill9()

    async def _run(self, client: Client, t_start: float) -> dict[str, Any]:
        plan = self.plan
        rng = random.Random(f"setup-{plan.seed}")
        tokens = [f"{n:03d}{rng.getrandbits(32):08x}" for n in range(plan.sessions)]
        # 1. Sessions, each told its fact.
        gate = asyncio.Semaphore(plan.create_concurrency)

        async def setup(n: int) -> None:
            async with gate:
                s = await client.open_session(n, f"FACT-{tokens[n]}", random.Random(f"create-{n}"))
                if s is None:
                    raise RuntimeError(f"session {n} was not created")
                told = await client.turn(s, f"remember this fact: {s.fact}", random.Random(f"fact-{n}"))
                if told.get("end") != "turn_complete":
                    raise RuntimeError(f"the fact turn of session {n} did not complete: {told}")

        t0 = now()
        await asyncio.gather(*(setup(n) for n in range(plan.sessions)))
        setup_s = now() - t0
        placed = {w.incarnation: len(await self.hosted(w)) for w in self.workers}
        log(f"{plan.sessions} sessions created and told their fact in {setup_s:.1f} s; placed {sorted(placed.values())}")

        # 2. The deploy, the client prompting throughout.
        load = [asyncio.ensure_future(client.prompter(n)) for n in range(plan.in_flight)]
        load += [asyncio.ensure_future(client.poller(n)) for n in range(plan.pollers)]
        t_deploy = now()
        original = list(range(plan.workers))
        replaced: set[int] = set()
        for step, slot in enumerate(original):
            if slot in replaced:
                continue
            await self.restart(slot, kill=plan.kill9 and step == 1, replaced=replaced)
        await self.killed_sessions_died()
        deploy_s = now() - t_deploy
        log(f"deploy done in {deploy_s:.1f} s; letting the client's prompts end")
        await client.stop_load()
        await asyncio.wait(load, timeout=plan.event_timeout_s + 30)
        if client.resume_tasks:
            await asyncio.wait(list(client.resume_tasks), timeout=CHAIN_BUDGET_S + 10)
        for task in load:
            task.cancel()
        await asyncio.gather(*load, return_exceptions=True)

        # 3. After the deploy: every session live, with its id, and its conversation.
        after = await self.after_deploy(client)
        log("final replay reads, listing, stopping")
        await client.finish_chains(30)
        await client.final_reads(live=True)
        await client.listing()
        hosting = {w.incarnation: len(await self.hosted(w)) for w in self.workers}
        await client.stop_readers(grace_s=0)
        await self.stop_all()
        await self.scan_keys()
        self.rec("end", t=now())
        self.load_avg["end"] = [round(x, 2) for x in os.getloadavg()]
        return self.figures(client, after, {
            "load_avg_1_5_15min": self.load_avg,
            "setup_s": round(setup_s, 1), "deploy_s": round(deploy_s, 1), "wall_s": round(now() - t_start, 1),
            "placed_before": sorted(placed.values()), "sessions_per_worker_after": sorted(hosting.values()),
        })

    async def restart(self, slot: int, kill: bool, replaced: set[int]) -> None:
        """SIGTERM the worker of `slot`, start its successor, wait until the successor is ready
        and the old one has exited. `kill`: mid-drain, kill -9 the worker that took the
        drain's first session, and start one in its place."""
        old = self.workers[slot]
        on_it = await self.hosted(old)
        t_sigterm = now()
        self.rec("restart", slot=slot, inc=old.incarnation, pid=old.pid, t=t_sigterm, sessions=sorted(on_it))
        log(f"restart of slot {slot} ({old.incarnation}, {len(on_it)} sessions): SIGTERM")
        self.sigterm(old)
        stopping = asyncio.ensure_future(self.exit_of(old, self.plan.stop_timeout_s))
        if self.plan.drain_grace_s > 0:
            self.client.bursts_at(on_it, t_sigterm, self.plan.bursts)
        successor = await self.start_worker(slot)
        t_ready = now()
        self.workers[slot] = successor
        if kill:
            await self.kill_first_target(old, on_it, t_sigterm, replaced)
        code = await stopping
        t_exit = self.exited_at[old.pid]  # (it may exit before its successor is ready)
        if hasattr(self.client, "read_owners"):  # where each session went (the checker's owners)
            await self.client.read_owners("drained")
        log(f"slot {slot}: successor ready after {t_ready - t_sigterm:.1f} s, old worker exited {code} after {t_exit - t_sigterm:.1f} s")
        self.restarts.append({"slot": slot, "old": old.incarnation, "new": successor.incarnation, "sessions": sorted(on_it),
                              "t_sigterm": t_sigterm, "t_ready": t_ready, "t_exit": t_exit, "exit_code": code})

    async def kill_first_target(self, draining: WorkerProcess, on_it: set[str], t_sigterm: float, replaced: set[int]) -> None:
        client = self.client

        def first_move() -> str | None:
            return next((sid for t, sid in client.moves if t >= t_sigterm and sid in on_it), None)

        async with client.changed:
            await asyncio.wait_for(client.changed.wait_for(lambda: first_move() is not None), self.plan.event_timeout_s)
        sid = first_move()
        assert self.store is not None and sid is not None
        view = await self.store.session(self.ws, sid)
        owner = view.owner if view is not None else None
        slot = next((i for i, w in enumerate(self.workers) if w.incarnation == owner), None)
        if slot is None:
            raise RuntimeError(f"the first moved session's owner {owner} is not a serving worker")
        victim = self.workers[slot]
        hosted = await self.hosted(victim)
        t_kill = now()
        await victim.kill9()
        self.rec("worker", slot=slot, pid=victim.pid, inc=victim.incarnation, t=now(), event="stopped",
                 code=victim.proc.returncode if victim.proc else None)
        self.rec("fault", fault="worker_kill9", target=slot, pid=victim.pid, incarnations=[victim.incarnation],
                 t_start=t_kill, t_end=now(), detail={"sessions": len(hosted), "moved_first": sid}, planned={"params": {}})
        self.faults.append({"fault": "worker_kill9", "slot": slot, "incarnation": victim.incarnation, "t": t_kill,
                            "sessions": sorted(hosted), "while_draining": draining.incarnation})
        log(f"kill -9 of slot {slot} ({victim.incarnation}, {len(hosted)} sessions), the target of {sid}")
        replaced.add(slot)  # an original worker killed is not restarted again
        self.workers[slot] = await self.start_worker(slot)

    async def killed_sessions_died(self) -> None:
        """Wait until the client saw each session a killed worker held die (swept once the
        worker's lease lapsed, a few seconds after the kill). The deploy is not over before
        that: the client resumes the deaths it sees while it runs, and a drain that ends
        sooner than the lease must not end the run under them."""
        client = self.client
        for fault in self.faults:
            def all_died() -> bool:
                died = {sid for t, sid in client.deaths if t >= fault["t"]}
                return set(fault["sessions"]) <= died

            try:
                async with client.changed:
                    await asyncio.wait_for(client.changed.wait_for(all_died), self.plan.event_timeout_s)
            except asyncio.TimeoutError:
                log(f"not every session of the killed {fault['incarnation']} died within {self.plan.event_timeout_s} s")

    async def after_deploy(self, client: Client) -> dict[str, Any]:
        rng = random.Random(f"after-{self.plan.seed}")
        gate = asyncio.Semaphore(16)
        outcome: dict[str, dict[str, Any]] = {}

        async def check(s: Tracked) -> None:
            async with gate:
                status, body = await client.status(s.sid, rng, api=s.n % APIS)
                live = status == 200 and isinstance(body, dict) and body.get("sessionId") == s.sid
                result: dict[str, Any] = {"live": live, "status": status, "life": s.life}
                if live and not s.lost:
                    marker = f"RECALL-{s.fact.removeprefix('FACT-')}"
                    turn = await client.turn(s, f"{marker} what fact did I ask you to remember?", rng)
                    result["recall"] = turn.get("end")
                    requests = [r for r in self.fake.chat_requests if marker in last_user_text(r)]
                    result["model_requests"] = len(requests)
                    result["fact_in_history"] = bool(requests) and all(
                        any(s.fact in message_text(m) for m in r.get("messages") or []) for r in requests
                    )
                outcome[s.sid] = result

        await asyncio.gather(*(check(s) for s in client.tracked.values()))
        return outcome

    async def stop_all(self) -> None:
        """Workers stop at once (a second SIGTERM skips the drain), then the APIs."""
        workers = [p for p in self.processes if isinstance(p, WorkerProcess) and p.alive]
        for worker in workers:
            self.sigterm(worker, at_once=True)
        self.stop_codes = list(await asyncio.gather(*(self.exit_of(w, 60) for w in workers)))
        for process in self.processes:
            if process.alive:
                await process.shut_down(60)

    async def scan_keys(self) -> None:
        """Every key of the store left after the stop, with its TTL (the checker's h)."""
        assert self.store is not None
        self.rec("keys", node=0, t=now(), keys=[list(key) for key in await self.store.key_expiries()])

    # ---- figures ------------------------------------------------------------------------

    def figures(self, client: Client, after: dict[str, dict[str, Any]], times: dict[str, Any]) -> dict[str, Any]:
        records = split_lives(self.rec.records, client.lives, client.reader_life)
        report = checker.check(records)
        checked = report.to_json(examples=5)
        history = checker.History.of(records)
        distinct = Counter(e["env"].get("type") for e in history.events.values())
        terminals: dict[str, list[str]] = defaultdict(list)
        for e in history.events_of_type(*TERMINALS):
            pid = checker.envelope_prompt_id(e["env"])
            if pid:
                terminals[pid].append(e["env"]["type"])
        frames = defaultdict(list)  # sid -> (t, type) on its live readers, in arrival order
        for r in self.rec.records:
            if r["kind"] == "sse" and r.get("id") is not None and not r["reader"].startswith("final-"):
                frames[r["sid"]].append((r["t"], r.get("type")))

        acked = [p for p in client.prompts if p["status"] is not None and 200 <= p["status"] < 300 and p.get("promptId")]
        restarts, gaps, moved_total, window_total = [], [], 0, 0.0
        across: list[dict[str, Any]] = []  # prompts acknowledged while their session was on its way
        for restart in self.restarts:
            t0, ids = restart["t_sigterm"], set(restart["sessions"])
            moved_at = {}
            for t, sid in client.moves:
                if sid in ids and t >= t0 and sid not in moved_at and t <= restart["t_exit"] + 5:
                    moved_at[sid] = t
            for sid, t_moved in moved_at.items():
                ended = [t for t, kind in frames[sid] if t0 <= t < t_moved and kind in TERMINALS]
                gaps.append(t_moved - max([t0, *ended]))
                across += [p for p in acked if p["sid"] == sid and t0 <= p["t_answered"] <= t_moved]
            window = (max(moved_at.values()) - t0) if moved_at else 0.0
            moved_total += len(moved_at)
            window_total += window
            restarts.append({
                "slot": restart["slot"], "sessions": len(ids), "moved": len(moved_at),
                "moved_per_s": round(len(moved_at) / window, 1) if window else None,
                "move_window_s": round(window, 2), "successor_ready_s": round(restart["t_ready"] - t0, 2),
                "old_exit_s": round(restart["t_exit"] - t0, 2), "old_exit_code": restart["exit_code"],
            })

        bursts = client.burst_orders(history)
        refused = [p for p in client.prompts if p not in acked]
        completed = [p for p in acked if terminals.get(p["promptId"]) == ["turn_complete"]]
        errored = [p for p in acked if "turn_error" in terminals.get(p["promptId"], [])]
        unended = [p for p in acked if not terminals.get(p["promptId"])]
        conversations_lost = sorted(
            sid for sid, a in after.items()
            if not (a["live"] and a.get("recall") == "turn_complete" and a.get("fact_in_history"))
        )
        live_after = sum(1 for a in after.values() if a["live"])
        return {
            "plan": dict(self.plan.__dict__),
            "times": times,
            "restarts": restarts,
            "faults": self.faults,
            "sessions_moved": moved_total,
            "sessions_moved_per_s": round(moved_total / window_total, 1) if window_total else None,
            "move_gap_s": {
                "p50": round(percentile(gaps, 50), 3) if gaps else None,
                "p99": round(percentile(gaps, 99), 3) if gaps else None,
                "max": round(max(gaps), 3) if gaps else None, "n": len(gaps),
            },
            "prompts": {
                "sent": len(client.prompts), "acknowledged": len(acked), "completed": len(completed),
                "turn_error": len(errored), "no_terminal": len(unended), "refused": len(refused),
                "refused_by_status": dict(Counter(f"{p['status']} {p.get('code')}" for p in refused)),
                "lost": len(acked) - len(completed) + len(refused),
                # Acknowledged after the session's worker was told to drain and before the
                # session_moved reached the client: queued, carried or parked, run after the move.
                "during_a_move": len(across),
                "during_a_move_completed": sum(1 for p in across if terminals.get(p["promptId"]) == ["turn_complete"]),
                # Bursts (see the module) whose turns ran in the order they were acknowledged.
                "bursts": len(bursts), "bursts_in_order": sum(1 for kept in bursts if kept),
                "turn_error_codes": dict(Counter(
                    (e["env"].get("data") or {}).get("code") for e in history.events_of_type("turn_error")
                )),
            },
            "sessions": {
                "created": len(client.tracked), "live_after": live_after,
                "ids_unchanged": sum(1 for sid, a in after.items() if a["live"]),
                "conversations_lost": len(conversations_lost),
                "conversations_lost_ids": conversations_lost[:20],
                "resumed_by_load": sum(len(v) for v in client.lives.values()),
                "resumes": client.resume_results,
            },
            "events": {
                "session_moved": distinct.get("session_moved", 0), "session_died": distinct.get("session_died", 0),
                "session_closed": distinct.get("session_closed", 0), "distinct": len(history.events),
            },
            "after": after,
            "check": {
                "checks": checked["checks"], "violations_total": checked["violations_total"],
                "violations_by_invariant": checked["violations_by_invariant"],
                "violation_kinds": checked["violation_kinds"], "violations": checked["violations"],
                "unverifiable": checked["unverifiable"], "notes": checked["notes"],
            },
            "history": str(self.rec.path),
            "logs": str(self.log_dir),
            "final_stop_exit_codes": getattr(self, "stop_codes", None),
            "model_requests": len(self.fake.chat_requests),
            "agent_processes": self.started_workers,
        }


def last_user_text(request: dict[str, Any]) -> str:
    return next((message_text(m) for m in reversed(request.get("messages") or []) if m.get("role") == "user"), "")


async def deploy(plan: Plan, redis_url: str, workspace: str, fake: ModelEndpoint, home: Path, log_dir: Path) -> dict[str, Any]:
    """One rolling deploy on the Redis at `redis_url`, its sessions in `workspace` (a folder),
    its model endpoint `fake`, qwen's HOME `home`; every process it starts is gone when it
    returns."""
    return await Run(plan, redis_url, workspace, fake, home, log_dir).run()


async def standalone(plan: Plan, log_dir: Path) -> dict[str, Any]:
    """One run on a Redis, a model endpoint and a HOME of its own."""
    log_dir.mkdir(parents=True, exist_ok=True)
    (log_dir / "ws").mkdir(exist_ok=True)
    redis = RedisServer().start()
    fake = ModelEndpoint().start()
    try:
        return await deploy(plan, redis.url, str(log_dir / "ws"), fake, log_dir / "home", log_dir)
    finally:
        fake.stop()
        redis.stop()


# ---------------------------------------------------------------------------- main


def cell(run: dict[str, Any], figure: str) -> str:
    p, s, e = run["prompts"], run["sessions"], run["events"]
    if figure == "exits":
        return ", ".join(f"{r['old_exit_s']:.1f}" for r in run["restarts"]) + " s"
    if figure == "moved":
        return "0" if not run["sessions_moved"] else f"{run['sessions_moved_per_s']} ({run['sessions_moved']} moves)"
    if figure == "gap":
        g = run["move_gap_s"]
        return "n/a (no move)" if not g["n"] else f"{g['p50']:.2f} / {g['p99']:.2f} s"
    if figure == "acked":
        return f"{p['acknowledged']} of {p['sent']} sent"
    if figure == "lost":
        return f"{p['lost']} ({p['turn_error']} turn_error, {p['no_terminal']} no terminal, {p['refused']} refused)"
    if figure == "conversations":
        return f"{s['conversations_lost']} of {s['created']} ({s['live_after']} live after)"
    if figure == "died":
        return f"{e['session_died']} (session_closed {e['session_closed']}, session_moved {e['session_moved']})"
    if figure == "check":
        return f"{run['check']['violations_total']} violations"
    raise KeyError(figure)


ROWS = (
    ("old worker exits after SIGTERM", "exits"),
    ("sessions moved/s", "moved"),
    ("move p50 / p99 (client's stream gap)", "gap"),
    ("prompts acknowledged", "acked"),
    ("prompts lost (goal 0)", "lost"),
    ("conversations lost", "conversations"),
    ("session_died", "died"),
    ("chaos checker", "check"),
)


def table(result: dict[str, Any]) -> str:
    runs = result["runs"]
    names = list(runs)
    heads = [f"{name} (--drain-grace-s {runs[name]['plan']['drain_grace_s']:g}"
             + (f", --handoff {runs[name]['plan']['handoff']})" if runs[name]['plan']['drain_grace_s'] else ")")
             for name in names]
    lines = ["| figure | " + " | ".join(heads) + " |", "| --- |" + " --- |" * len(names)]
    for title, figure in ROWS:
        lines.append(f"| {title} | " + " | ".join(cell(runs[name], figure) for name in names) + " |")
    return "\n".join(lines)


def qwen_version(qwen: str | None) -> str | None:
    if qwen is None:
        return None
    with contextlib.suppress(Exception):
        return subprocess.run([qwen, "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=300)
    parser.add_argument("--in-flight", type=int, default=8, help="prompts the client keeps going at once")
    parser.add_argument("--drain-grace-s", type=float, default=30.0, help="the drain run's grace (the baseline's is 0)")
    parser.add_argument("--kill9", action="store_true", help="the drain run also kills -9, mid-deploy, the worker "
                        "that took the second drain's first session")
    parser.add_argument("--only", choices=["drain", "paced", "baseline"], nargs="+",
                        help="run only these (drain: the eager hand-off; paced: the same drain, --handoff paced)")
    parser.add_argument("--log-dir", help="processes' logs, histories, HOME (default: a new temporary folder)")
    parser.add_argument("--out", default=str(RESULTS / "rolling_deploy.json"))
    args = parser.parse_args(argv)
    if find_qwen() is None:
        raise SystemExit("qwen is not installed: npm install --prefix tests/node (scripts/test does)")
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="acp-rolling-deploy-"))
    plans = {
        "drain": Plan(args.sessions, args.drain_grace_s, args.in_flight, kill9=args.kill9),
        "paced": Plan(args.sessions, args.drain_grace_s, args.in_flight, kill9=args.kill9, handoff="paced"),
        "baseline": Plan(args.sessions, 0.0, args.in_flight, kill9=False),
    }
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    runs = {}
    for name, plan in plans.items():
        if args.only and name not in args.only:
            continue
        log(f"---- the {name} run")
        runs[name] = asyncio.run(standalone(plan, log_dir / name))
    result = {
        "command": "python -m bench.rolling_deploy " + " ".join(argv if argv is not None else sys.argv[1:]),
        "started": started,
        "machine": {"arch": platform.machine(), "cores": os.cpu_count(), "python": platform.python_version()},
        "qwen": qwen_version(find_qwen()),
        "logs": str(log_dir),
        "runs": runs,
    }
    print(table(result))
    for name, run in runs.items():
        print(f"{name}: restarts {[(r['slot'], r['sessions'], r['moved'], r['moved_per_s']) for r in run['restarts']]}, "
              f"times {run['times']}, checker {run['check']['violations_by_invariant']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    slim = json.loads(json.dumps(result, default=str))
    for run in slim["runs"].values():
        run["after"] = {"sessions": len(run["after"])}  # per-session detail stays in the logs
        run["sessions"]["resumes"] = run["sessions"]["resumes"][:10]
    out.write_text(json.dumps(slim, indent=1) + "\n")
    print(f"wrote {out}; logs and histories in {log_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
