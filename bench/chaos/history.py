"""The chaos run's history: the recorder (one JSON line per record, numbered in the order
written) and the run's processes, whose starts, incarnations, signals and exits it records.

It also records what the lease meant for each incarnation (`LeaseWatch`: every deadline the
registry held and every death it declared, on Redis's clock) and, at the end, what the agents
wrote to the sessions' shared history (`record_agent_writes`: the scripted agent's
`writes.log` and each history file), so the checker can hold the agents to the lease too
(invariant j: no history write of an incarnation after a sweeper may declare it dead).

bench/chaos/checker.py reads the history back (its docstring lists every kind of record);
bench/rolling_deploy.py records its run the same way.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import orjson
import redis

from acp_state.store import keys
from acp_state.testing.scripted_agent import LOGGED_TEXT_CHARS, read_writes
from testbed.processes import API_BANNER, WORKER_BANNER, AcpProcess

from .redis_nodes import client as redis_client

READY_TIMEOUT_S = 45
WORKER_NAME = "chaos-w{slot}"  # --name: incarnations are `<name>-<pid>-<8 hex>`


def now() -> float:
    return time.time()


def log(message: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class Recorder:
    """Appends one JSON line per record, numbered in the order written."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = open(path, "wb")  # noqa: SIM115 - closed by close()
        self._seq = itertools.count(1)

    def __call__(self, kind: str, **fields: Any) -> None:
        record = {"seq": next(self._seq), "kind": kind, **fields}
        self._file.write(orjson.dumps(record, default=str, option=orjson.OPT_NON_STR_KEYS) + b"\n")

    def close(self) -> None:
        self._file.close()


class RecordedProcess(AcpProcess):
    """A worker or an API process of the chaos run, in slot `slot`. For a worker, every
    stderr line is read for an incarnation of its own (a JSON line's `workerId`, or any
    id of its form the line names), so a change of incarnation is noticed; its start,
    each incarnation, each SIGTERM and its exit go to the history (the checker ties
    sessions, deaths and moves to processes by them)."""

    def __init__(self, role: str, slot: int, argv: list[str], log_dir: Path, rec: Recorder, port: int | None = None,
                 env: dict[str, str] | None = None, prefix: list[str] | None = None) -> None:
        super().__init__(
            argv, log_dir / f"{role}{slot}-{time.monotonic_ns()}.log",
            marker=WORKER_BANNER if role == "worker" else API_BANNER, env=env, prefix=prefix,
            log_level="INFO", ready_timeout_s=READY_TIMEOUT_S,
        )
        self.role = role
        self.slot = slot
        self.rec = rec
        self.port = port
        self.incarnations: list[str] = []
        self.watches_stderr = role == "worker"
        self._own_ids: re.Pattern[str] | None = None

    @property
    def inc(self) -> str | None:
        return self.incarnations[-1] if self.incarnations else None

    def on_ready(self) -> None:
        if self.role != "worker":
            return
        inc = self.banner.split()[2]
        self.incarnations.append(inc)
        self._own_ids = re.compile(rf"\b{re.escape(WORKER_NAME.format(slot=self.slot))}-{self.pid}-[0-9a-f]{{8}}\b")
        self.rec("worker", slot=self.slot, pid=self.pid, inc=inc, t=now(), event="started")

    def on_stderr(self, line: bytes) -> None:
        assert self._own_ids is not None
        found = set(self._own_ids.findall(line.decode(errors="replace")))
        if line.startswith(b"{"):
            try:
                worker_id = orjson.loads(line).get("workerId")
            except (orjson.JSONDecodeError, AttributeError):
                worker_id = None
            if worker_id:
                found.add(worker_id)
        for worker_id in sorted(found):
            if worker_id not in self.incarnations:
                self.incarnations.append(worker_id)
                self.rec("worker", slot=self.slot, pid=self.pid, inc=worker_id, t=now(), event="incarnation")
                log(f"worker slot {self.slot} changed incarnation to {worker_id}")

    def sigterm(self) -> None:
        """SIGTERM (a worker drains; see worker/move.py), recorded for a worker: the checker
        holds a drain's stops and closes to the incarnations told to stop."""
        if not self.alive:
            return
        super().sigterm()
        if self.role == "worker":
            self.rec("worker", slot=self.slot, pid=self.pid, inc=self.inc, incarnations=list(self.incarnations), t=now(),
                     event="sigterm")

    def on_exit(self) -> None:
        if self.role == "worker":
            assert self.proc is not None
            self.rec("worker", slot=self.slot, pid=self.pid, inc=self.inc, t=now(), event="stopped",
                     code=self.proc.returncode)


class LeaseWatch:
    """Reads the registry every `interval_s` (on every live node: only the registry's master
    answers) and records what changed: `lease` {inc, deadline, redis_ms, t} when an
    incarnation's deadline (its last accepted renewal + its lease, epoch ms of Redis's
    clock) is new or moved, and `lease_dead` {inc, at, t} when it first shows among the
    tombstones (`at`: when it was declared dead, Redis's clock). A renewal extends the
    deadline by a whole lease, so a read at least every lease sees the last one before a
    death (unless Redis itself stalls then; it also holds the sweep). It runs in a thread
    of its own (a stalled node holds a read up to its timeout), and hands its records to
    the event loop, the recorder's only writer."""

    def __init__(self, rec: Recorder, ports: Callable[[], list[int]], interval_s: float,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.rec = rec
        self.ports = ports
        self.interval_s = interval_s
        self.loop = loop
        self.deadlines: dict[str, int] = {}
        self.dead: set[str] = set()
        self.reads = 0
        self._stop = threading.Event()
        self._clients: dict[int, redis.Redis] = {}
        self._thread = threading.Thread(target=self._run, name="lease-watch", daemon=True)

    def start(self) -> LeaseWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def read(self) -> tuple[int, dict[str, int], dict[str, int]] | None:
        """(Redis's time in ms, deadline by incarnation, declared-dead time by incarnation)
        from the node that holds the registry, or None when none answered."""
        for port in self.ports():
            c = self._clients.get(port) or self._clients.setdefault(
                port, redis_client(port, socket_timeout=1, socket_connect_timeout=0.5))
            try:
                pipe = c.pipeline(transaction=False)
                pipe.time()
                pipe.zrange(keys.WORKERS, 0, -1, withscores=True)
                pipe.zrange(keys.DEAD, 0, -1, withscores=True)
                (sec, usec), workers, dead = pipe.execute()
            except redis.RedisError:  # not the registry's node (MOVED), down, or stalled
                continue
            return (int(sec) * 1000 + int(usec) // 1000, {inc: int(score) for inc, score in workers},
                    {inc: int(score) for inc, score in dead})
        return None

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                read = self.read()
            except Exception as error:  # noqa: BLE001 - the watch goes on; the checker sees gaps as unknown
                log(f"lease watch: {error!r}")
                read = None
            if read is not None:
                self.reads += 1
                self._note(*read)
            self._stop.wait(self.interval_s)

    def _note(self, redis_ms: int, workers: dict[str, int], dead: dict[str, int]) -> None:
        t = now()
        for inc, deadline in workers.items():
            if self.deadlines.get(inc) != deadline:
                self.deadlines[inc] = deadline
                self._record("lease", inc=inc, deadline=deadline, redis_ms=redis_ms, t=t)
        for inc, at in dead.items():
            if inc not in self.dead:
                self.dead.add(inc)
                self._record("lease_dead", inc=inc, at=at, redis_ms=redis_ms, t=t)

    def _record(self, kind: str, **fields: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(lambda: self.rec(kind, **fields))
        except RuntimeError:  # the loop is closed: the run is over
            pass


def record_agent_writes(rec: Recorder, state_dir: Path) -> int:
    """The scripted agent's history writes (`agent_write` {sid, inc, t, end, prior, pid, text}:
    its `writes.log`, one `acp_state.testing.scripted_agent.HistoryWrite` a line) and each
    session's history as it is left (`agent_history` {sid, size, texts}: the file's size and
    its turns' prompt texts, cut as the log cuts them). Returns the writes recorded."""
    writes = read_writes(str(state_dir))
    for w in writes:
        rec("agent_write", sid=w.session_id, inc=w.incarnation, t=w.t, end=w.end, prior=w.prior, pid=w.pid,
            text=w.text)
    sessions = state_dir / "sessions"
    for path in sorted(sessions.glob("*.jsonl")) if sessions.is_dir() else []:
        data = path.read_bytes()
        texts = []
        for line in data.splitlines():
            try:
                message = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            if isinstance(message, dict) and message.get("role") == "user" and isinstance(message.get("text"), str):
                texts.append(message["text"][:LOGGED_TEXT_CHARS])
        rec("agent_history", sid=path.stem, size=len(data), texts=texts, t=now())
    return len(writes)
