"""The chaos run's history: the recorder (one JSON line per record, numbered in the order
written) and the run's processes, whose starts, incarnations, signals and exits it records.

bench/chaos_check.py reads the history back (its docstring lists every kind of record);
bench/rolling_deploy.py records its run the same way.
"""

from __future__ import annotations

import itertools
import re
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from .procs import API_BANNER, WORKER_BANNER, AcpProcess

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
            *argv, marker=WORKER_BANNER if role == "worker" else API_BANNER,
            log=log_dir / f"{role}{slot}-{time.monotonic_ns()}.log", env=env, prefix=prefix or (),
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
        """SIGTERM (a worker drains; see worker/drain.py), recorded for a worker: the checker
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
