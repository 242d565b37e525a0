"""Seeded chaos run with a recorded history and a checker.

Starts a Redis (one redis-server, or with --cluster a 3-master cluster with one replica per
master), 2 workers and 2 API processes, drives a load over HTTP and SSE while a fault
schedule derived only from `random.Random(seed)` (and the run's shape: minutes, lease,
single or cluster) injects faults, drains among them (`worker_drain`: the workers run with
--drain-grace-s, so a drained worker's sessions move to the other one; see docs/chaos.md,
"Drains"), records every request, every SSE frame, every fault and the sessions' owners
to a JSONL history, and checks the history (bench/chaos_check.py). Exits non-zero on any
violation.

    python -m bench.chaos --seed 7 --minutes 1 [--cluster] [--lease-ms 3000] [--drain-grace-s 2]
                          [--out bench/results/chaos-single-seed7.json] [--print-schedule]

The summary goes to --out; the history to the same path with `.history.jsonl`; process logs
to a temporary folder named in the summary.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import re
import signal
import string
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import orjson

from acp_state.store.connection import connect
from acp_state.ids import workspace_id

from . import chaos_check, chaos_network
from .chaos_redis import ChaosRedis, ChaosRedisCluster, client as redis_client
from .hosts import UNAVAILABLE_EXIT, HostsUnavailable, TestBed
from .redis_server import free_port

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"

WORKERS = 2
APIS = 2
WARMUP_S = 4.0
READY_TIMEOUT_S = 45
# A request may wait out a stalled master and its replica's promotion (sleep 5 leases plus
# the node timeout): a client that gave up sooner would leave outcomes unknown that the
# system would have told.
REQUEST_TIMEOUT = httpx.Timeout(45.0, connect=3.0)
POLL_TIMEOUT = httpx.Timeout(8.0, connect=2.0)
SSE_TIMEOUT = httpx.Timeout(connect=3.0, read=25.0, write=5.0, pool=5.0)
CREATE_TIMEOUT_S = 15
SNAPSHOT_WAIT_S = 30.0  # how long a new session's actor waits for its reader's snapshot
CHAIN_BUDGET_S = 120.0  # how long one logical mutating request is retried with its key
WORKER_NAME = "chaos-w{slot}"  # --name: incarnations are `<name>-<pid>-<8 hex>`
ENDING = chaos_check.ENDINGS
# The workers' --drain-grace-s: how long a drained worker's running turns may finish before
# its sessions move. The load's turns run 0.05-1 s (an echo, `#slow 1`) or wait for votes
# its voters send within moments, so 2 s lets the turns running at the SIGTERM end on
# their own, while its long turns (`#slow 5`, LONG_TURN_S) and a turn whose voters are
# slow are stopped with `turn_error` `worker_draining`: both ways are taken. Short
# against the schedule too: a drain's grace, hand-offs and exit fit in its estimate, so
# no other fault overlaps one; and the final SIGTERM (both workers draining, no target)
# costs only the grace.
DRAIN_GRACE_S = 2.0
# The load's long turn (`#slow 5`, 4% of its steps): longer than the grace.
LONG_TURN_S = 5
# How long a drained worker may take to exit (its grace, every hand-off, the shutdown)
# before it is killed; the fault records the kill (the checker then counts it killed).
DRAIN_EXIT_TIMEOUT_S = 90.0

FAULTS_SINGLE = (
    "worker_kill9", "worker_stop", "worker_drain", "redis_sleep_2x", "redis_sleep_5x", "client_pause_all",
    "client_pause_write", "redis_restart_empty", "maxmemory", "api_kill9", "pubsub_kill",
)
FAULTS_CLUSTER = tuple(k for k in FAULTS_SINGLE if k != "redis_restart_empty") + ("cluster_failover",)
# A run across hosts (--hosts) draws these too (bench/chaos_network.py), and runs a lane of
# link conditions (latency, jitter, loss) beside the schedule.
FAULTS_HOSTS = chaos_network.CUTS
# Off loopback an API needs a bearer token; the load sends this one (role user).
HOSTS_TOKEN = "chaos-hosts-token-0123456789"


def now() -> float:
    return time.time()


def log(message: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- the schedule


def make_schedule(
    seed: int, minutes: float, lease_ms: int, cluster: bool, node_timeout_ms: int = 2000,
    only: list[str] | None = None, drain_grace_s: float = DRAIN_GRACE_S, hosts: bool = False,
) -> list[dict[str, Any]]:
    """The fault plan: only `random.Random(seed)` picks kinds, targets, parameters and
    times; the run's shape (length, lease, single or cluster) bounds them. Targets are
    indexes (worker slot, API slot, master index in port order), resolved when injected.
    Faults never overlap: each is followed by a recovery gap of a lease plus 1-2.5 s."""
    rng = random.Random(seed)
    lease = lease_ms / 1000
    duration = minutes * 60
    cooldown = max(10.0, 3 * lease)
    window_end = duration - cooldown
    kinds = [k for k in (FAULTS_CLUSTER if cluster else FAULTS_SINGLE) if only is None or k in only]
    cuts = [k for k in FAULTS_HOSTS if hosts and (only is None or k in only)]
    rng.shuffle(cuts)
    kinds += cuts * chaos_network.CUT_WEIGHT
    plan: list[dict[str, Any]] = []
    t = WARMUP_S + rng.uniform(0, 2)
    bag: list[str] = []
    misses = 0
    while kinds and t < window_end and misses < len(kinds):
        if not bag:
            bag = kinds[:]
            rng.shuffle(bag)
        kind = bag.pop()
        if kind in FAULTS_HOSTS:
            # Cuts take turns, so each kind is drawn as often as the others (to within one).
            kind = cuts[sum(1 for f in plan if f["kind"] in FAULTS_HOSTS) % len(cuts)]
        params: dict[str, Any] = {}
        target: Any = None
        if kind in ("worker_kill9", "worker_stop"):
            target = rng.randrange(WORKERS)
            if kind == "worker_stop":
                params["stop_s"] = round(2 * lease, 3)
            est = params.get("stop_s", 0) + 3.0
        elif kind == "worker_drain":
            # SIGTERM, or `acp-state drain <incarnation>` (a Drain command on its control
            # stream): the same drain, started from the worker's host or from anywhere.
            target = rng.randrange(WORKERS)
            params["via"] = rng.choice(("sigterm", "sigterm", "cli"))
            params["grace_s"] = drain_grace_s
            # The grace, the hand-offs after it, the replacement's start (2-6 s under the
            # load on a 2-core machine) and the old one's exit.
            est = drain_grace_s + 5.0
        elif kind in ("redis_sleep_2x", "redis_sleep_5x"):
            target = rng.randrange(3) if cluster else 0
            params["sleep_s"] = round((2 if kind.endswith("2x") else 5) * lease, 3)
            est = params["sleep_s"] + (node_timeout_ms / 1000 + 3 if cluster else 1.0)
        elif kind in ("client_pause_all", "client_pause_write"):
            target = "masters"
            params["pause_ms"] = int(lease_ms * rng.choice([0.5, 1.0, 1.5, 2.0]))
            est = params["pause_ms"] / 1000 + 0.5
        elif kind == "redis_restart_empty":
            target = 0
            params["down_s"] = round(rng.uniform(0.3, 2.0), 3)
            est = params["down_s"] + 2.0
        elif kind == "maxmemory":
            target = "masters"
            params["hold_s"] = round(rng.uniform(2.0, 5.0), 3)
            params["margin_bytes"] = rng.choice([16, 64, 256]) * 1024
            est = params["hold_s"] + 0.5
        elif kind == "api_kill9":
            target = rng.randrange(APIS)
            est = 3.0
        elif kind == "pubsub_kill":
            target = "all"
            est = 0.5
        elif kind == "cluster_failover":
            target = rng.randrange(3)
            params["restart_as_replica"] = rng.random() < 0.75
            est = 3 * node_timeout_ms / 1000 + 5.0
        elif kind in FAULTS_HOSTS:
            target, params, est = chaos_network.plan_cut(rng, kind, lease)
        else:  # pragma: no cover
            raise AssertionError(kind)
        if t + est > window_end:
            misses += 1
            continue
        misses = 0
        plan.append({"n": len(plan), "at_s": round(t, 3), "kind": kind, "target": target, "params": params,
                     "estimated_s": round(est, 3)})
        t += est + lease + rng.uniform(1.0, 2.5)
    return plan


def format_schedule(plan: list[dict[str, Any]]) -> str:
    lines = []
    for f in plan:
        params = " ".join(f"{k}={v}" for k, v in f["params"].items())
        lines.append(f"  #{f['n']:<2} t+{f['at_s']:>6.2f}s  {f['kind']:<20} target={f['target']!s:<8} {params}")
    return "\n".join(lines) or "  (no faults fit)"


# ----------------------------------------------------------------------------- the history


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


# ----------------------------------------------------------------------------- processes


class AcpProcess:
    """An `acp-state` subprocess run from this tree; ready at its banner line. Its stderr
    goes to a log file; for a worker every JSON log line is read for its `workerId`, so a
    change of incarnation is noticed (and recorded)."""

    def __init__(self, role: str, slot: int, argv: list[str], log_dir: Path, rec: Recorder, port: int | None = None,
                 env: dict[str, str] | None = None, prefix: list[str] | None = None) -> None:
        self.role = role
        self.prefix = prefix or []  # e.g. `ip netns exec <host>`: run on a host of the test bed
        self.env = env or {}
        self.slot = slot
        self.argv = argv
        self.log_path = log_dir / f"{role}{slot}-{time.monotonic_ns()}.log"
        self.rec = rec
        self.port = port
        self.proc: asyncio.subprocess.Process | None = None
        self.banner = ""
        self.incarnations: list[str] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._ready = False
        self._stopped = False  # its "stopped" record is written once

    @property
    def inc(self) -> str | None:
        return self.incarnations[-1] if self.incarnations else None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def start(self) -> AcpProcess:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "ACP_STATE_LOG": "INFO", **self.env}
        self.proc = await asyncio.create_subprocess_exec(
            *self.prefix, sys.executable, "-m", "acp_state.cli", *self.argv,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=str(ROOT), env=env,
        )
        self._log = open(self.log_path, "ab")  # noqa: SIM115
        self._tasks.append(asyncio.ensure_future(self._pump_stderr()))
        marker = "acp-state worker " if self.role == "worker" else "acp-state api listening on "
        assert self.proc.stdout is not None
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            line = (await asyncio.wait_for(self.proc.stdout.readline(), max(0.1, deadline - time.monotonic()))).decode()
            if not line:
                await asyncio.sleep(0.2)
                raise RuntimeError(f"{self.role} exited early; see {self.log_path}")
            if marker in line:
                self.banner = line.strip()
                break
        if self.role == "worker":
            inc = self.banner.split()[2]
            self.incarnations.append(inc)
            self.rec("worker", slot=self.slot, pid=self.pid, inc=inc, t=now(), event="started")
        self._ready = True
        self._tasks.append(asyncio.ensure_future(self._drain_stdout()))
        return self

    async def _drain_stdout(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        while await self.proc.stdout.readline():
            pass

    async def _pump_stderr(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        own = re.compile(rf"\b{re.escape(WORKER_NAME.format(slot=self.slot))}-{self.proc.pid}-[0-9a-f]{{8}}\b")
        while True:
            line = await self.proc.stderr.readline()
            if not line:
                return
            self._log.write(line)
            if self.role != "worker" or not self._ready:
                continue
            # The incarnation in a JSON line's `workerId`, or any id of this process's form
            # (`<name>-<pid>-<8 hex>`) the line names: a new one means the worker changed it.
            found = set(own.findall(line.decode(errors="replace")))
            if line.startswith(b"{"):
                with contextlib.suppress(orjson.JSONDecodeError, AttributeError):
                    worker_id = orjson.loads(line).get("workerId")
                    if worker_id:
                        found.add(worker_id)
            for worker_id in sorted(found):
                if worker_id not in self.incarnations:
                    self.incarnations.append(worker_id)
                    self.rec("worker", slot=self.slot, pid=self.pid, inc=worker_id, t=now(), event="incarnation")
                    log(f"worker slot {self.slot} changed incarnation to {worker_id}")

    def signal(self, sig: int) -> None:
        if self.alive:
            os.kill(self.pid, sig)

    def sigterm(self) -> None:
        """SIGTERM (a worker drains; see worker/drain.py), recorded for a worker: the
        checker holds a drain's stops and closes to the incarnations told to stop."""
        if not self.alive:
            return
        self.proc.send_signal(signal.SIGCONT)  # type: ignore[union-attr]
        self.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        if self.role == "worker":
            self.rec("worker", slot=self.slot, pid=self.pid, inc=self.inc, incarnations=list(self.incarnations), t=now(),
                     event="sigterm")

    async def wait_exit(self, timeout: float) -> str:
        """Until the process exits; SIGKILL past `timeout`. Returns how it ended."""
        try:
            await asyncio.wait_for(self.proc.wait(), timeout)  # type: ignore[union-attr]
            how = f"exit {self.proc.returncode}"  # type: ignore[union-attr]
        except asyncio.TimeoutError:
            self.proc.kill()  # type: ignore[union-attr]
            how = f"ignored SIGTERM for {timeout}s: killed"
        await self._wait_exit()
        return how

    async def kill9(self) -> None:
        if self.alive:
            self.proc.kill()  # type: ignore[union-attr]
        await self._wait_exit()

    async def terminate(self, timeout: float = 30) -> str:
        """SIGTERM first; SIGKILL only if it is ignored. Returns how it ended."""
        if not self.alive:
            await self._wait_exit()
            return "already exited"
        self.sigterm()
        return await self.wait_exit(timeout)

    async def _wait_exit(self) -> None:
        if self.proc is not None:
            await self.proc.wait()
        for task in self._tasks:
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(task, 2)
        if getattr(self, "_log", None) is not None:
            self._log.close()
            self._log = None
        if self.role == "worker" and self.proc is not None and not self._stopped:
            self._stopped = True
            self.rec("worker", slot=self.slot, pid=self.pid, inc=self.inc, t=now(), event="stopped",
                     code=self.proc.returncode)


# ----------------------------------------------------------------------------- Redis access


def session_hash_key(cwd: str, sid: str) -> str:
    """The key of a live session's hash (the owner's incarnation is its field `inc`)."""
    try:
        from acp_state.store import keys

        return keys.session(workspace_id(cwd), sid)
    except (ImportError, AttributeError):
        return f"acp:{{{workspace_id(cwd)}}}:s:{sid}"


async def read_owner(redis: Any, cwd: str, sid: str) -> tuple[str | None, str | None, str | None]:
    """The incarnation that owns session `sid` now (field `inc` of its hash), with the
    session's last event id (`seq`) and event epoch (`epoch`), read in one HMGET."""
    inc, seq, epoch = await redis.hmget(session_hash_key(cwd, sid), ["inc", "seq", "epoch"])
    return inc, seq, epoch


# ----------------------------------------------------------------------------- the run


class Chaos:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.seed: int = args.seed
        self.lease_ms: int = args.lease_ms
        self.cluster: bool = args.cluster
        self.drain_grace_s: float = args.drain_grace_s
        self.schedule = make_schedule(args.seed, args.minutes, args.lease_ms, args.cluster, args.node_timeout_ms,
                                      faults_option(args), args.drain_grace_s, args.hosts)
        # Across hosts: the test bed (built in `run`), its faults, and the link-condition lane.
        self.bed: TestBed | None = None
        self.network: chaos_network.Network | None = None
        self.conditions = (chaos_network.make_conditions(args.seed, args.minutes, args.lease_ms)
                           if args.hosts and faults_option(args) != [] else [])
        self.condition_log: list[dict[str, Any]] = []
        stem = f"chaos-{'hosts-' if args.hosts else ''}{'cluster' if args.cluster else 'single'}-seed{args.seed}"
        self.out = Path(args.out) if args.out else RESULTS / f"{stem}.json"
        self.history_path = self.out.with_suffix(".history.jsonl")
        if args.log_dir:
            self.log_dir = Path(args.log_dir)
            self.log_dir.mkdir(parents=True, exist_ok=True)
        else:
            self.log_dir = Path(tempfile.mkdtemp(prefix="acp-chaos-"))
        self.workspace = str(self.log_dir / "ws")
        os.makedirs(self.workspace, exist_ok=True)
        # The agents' HOME (--state-dir), one for every worker of the run as for workers of
        # one host: the scripted agent keeps each session's history there, so a session
        # moved by a drain loads on any other worker (one agent-state store).
        self.agent_home = self.log_dir / "agent-home"
        self.agent_home.mkdir(parents=True, exist_ok=True)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.rec = Recorder(self.history_path)
        self.redis: Any = None
        self.workers: list[AcpProcess | None] = [None] * WORKERS
        self.drained: list[AcpProcess] = []  # workers told to drain, replaced in their slot
        self.load: Load | None = None
        self.apis: list[AcpProcess | None] = [None] * APIS
        self.api_ports = [free_port() for _ in range(APIS)]
        self.t0 = 0.0
        self.load_end = 0.0
        self.shutdown_notes: dict[str, str] = {}
        self.fault_log: list[dict[str, Any]] = []

    # ---- processes --------------------------------------------------------------------

    def redis_url(self) -> str:
        return self.redis.url_for_alive() if self.cluster else self.redis.url

    def host(self, role: str, slot: int) -> Any:
        """The test-bed host of a process (a run across hosts), or None."""
        return self.bed.hosts[f"{role}-{slot + 1}"] if self.bed is not None else None

    def api_base(self, slot: int) -> str:
        host = self.host("api", slot)
        return f"http://{host.ip if host else '127.0.0.1'}:{self.api_ports[slot]}"

    async def start_worker(self, slot: int) -> AcpProcess:
        host = self.host("worker", slot)
        # Across hosts each worker has its own HOME; the agents' state (--state-dir) is one
        # folder for all, as a volume the workers' hosts share (docs/api.md, "Resume"), so
        # a drained worker's sessions still load on another host.
        process = AcpProcess(
            "worker", slot,
            ["worker", "--redis-url", self.redis_url(), "--lease-ms", str(self.lease_ms), "--max-sessions", "400",
             "--name", WORKER_NAME.format(slot=slot), "--drain-grace-s", str(self.drain_grace_s),
             "--state-dir", str(self.agent_home), *(["--state-store", "shared-volume"] if host else [])],
            self.log_dir, self.rec,
            env={"ACP_SCRIPTED_STATE_DIR": str(self.agent_home / ".acp-state-scripted"),
                 **({"HOME": str(host.home)} if host else {})},
            prefix=host.exec_prefix if host else None,
        )
        await process.start()
        self.workers[slot] = process
        return process

    async def start_api(self, slot: int) -> AcpProcess:
        port = self.api_ports[slot]
        last: Exception | None = None
        for _ in range(10):
            host = self.host("api", slot)
            process = AcpProcess(
                "api", slot,
                ["api", "--redis-url", self.redis_url(), "--port", str(port), "--workspace", self.workspace,
                 # Short enough that a create its API gave up on is taken back within a run.
                 "--create-timeout-s", str(CREATE_TIMEOUT_S),
                 *(["--host", host.ip, "--token", HOSTS_TOKEN] if host else [])],
                self.log_dir, self.rec, port=port, prefix=host.exec_prefix if host else None,
                env={"HOME": str(host.home)} if host else None,
            )
            try:
                await process.start()
            except (RuntimeError, asyncio.TimeoutError) as error:  # the port may linger a moment
                last = error
                await process.kill9()
                await asyncio.sleep(0.5)
                continue
            self.apis[slot] = process
            self.rec("api", slot=slot, pid=process.pid, port=port, t=now(), event="started")
            return process
        raise RuntimeError(f"API slot {slot} did not start on port {port}: {last}")

    # ---- faults -----------------------------------------------------------------------

    async def masters(self) -> list[int]:
        return await asyncio.to_thread(self.redis.masters)

    async def _on_ports(self, ports: list[int], *command: Any, timeout: float = 5) -> dict[int, Any]:
        def run(port: int) -> Any:
            try:
                return redis_client(port, socket_timeout=timeout).execute_command(*command)
            except Exception as error:  # noqa: BLE001 - recorded
                return f"error: {error!r}"

        results = await asyncio.gather(*(asyncio.to_thread(run, p) for p in ports))
        return dict(zip(ports, results, strict=True))

    async def inject(self, plan: dict[str, Any]) -> dict[str, Any]:
        kind, target, params = plan["kind"], plan["target"], plan["params"]
        detail: dict[str, Any] = {}
        record: dict[str, Any] = {"fault": kind, "target": target, "planned": plan}
        start = now()
        try:
            if kind in ("worker_kill9", "worker_stop"):
                process = self.workers[target]
                assert process is not None
                record["incarnations"] = list(process.incarnations)
                record["pid"] = process.pid
                if kind == "worker_kill9":
                    await process.kill9()
                    detail["killed_at"] = now()
                    replacement = await self.start_worker(target)
                    detail["replacement"] = replacement.inc
                else:
                    process.signal(signal.SIGSTOP)
                    try:
                        await asyncio.sleep(params["stop_s"])
                    finally:
                        process.signal(signal.SIGCONT)
            elif kind == "worker_drain":
                process = self.workers[target]
                assert process is not None
                record["incarnations"] = list(process.incarnations)
                record["pid"] = process.pid
                await self.drain_worker(process, params, detail)
            elif kind in ("redis_sleep_2x", "redis_sleep_5x"):
                masters = await self.masters()
                port = masters[target % len(masters)] if masters else self.redis.ports[0]
                detail["node"] = port
                detail["result"] = (await self._on_ports([port], "DEBUG", "SLEEP", params["sleep_s"],
                                                         timeout=params["sleep_s"] + 15))[port]
            elif kind in ("client_pause_all", "client_pause_write"):
                masters = await self.masters()
                mode = "ALL" if kind.endswith("all") else "WRITE"
                detail["nodes"] = masters
                detail["result"] = await self._on_ports(masters, "CLIENT", "PAUSE", params["pause_ms"], mode)
                await asyncio.sleep(params["pause_ms"] / 1000)
            elif kind == "redis_restart_empty":
                await asyncio.to_thread(self.redis.kill9)
                detail["down_at"] = now()
                await asyncio.sleep(params["down_s"])
                await asyncio.to_thread(self.redis.restart_empty)
                detail["up_at"] = now()
            elif kind == "maxmemory":
                masters = await self.masters()
                detail["nodes"] = masters
                def limit(port: int) -> Any:
                    try:
                        c = redis_client(port)
                        used = int(c.info("memory")["used_memory"])
                        c.config_set("maxmemory-policy", "noeviction")
                        c.config_set("maxmemory", used + params["margin_bytes"])
                        return used + params["margin_bytes"]
                    except Exception as error:  # noqa: BLE001 - recorded
                        return f"error: {error!r}"

                detail["limits"] = dict(zip(masters, await asyncio.gather(*(asyncio.to_thread(limit, p) for p in masters)),
                                            strict=True))
                await asyncio.sleep(params["hold_s"])
                detail["lifted"] = await self._on_ports(masters, "CONFIG", "SET", "maxmemory", 0)
            elif kind == "api_kill9":
                process = self.apis[target]
                assert process is not None
                record["pid"] = process.pid
                await process.kill9()
                detail["killed_at"] = now()
                await self.start_api(target)
            elif kind == "pubsub_kill":
                ports = self.redis.alive_ports()
                detail["killed"] = await self._on_ports(ports, "CLIENT", "KILL", "TYPE", "pubsub")
            elif kind in FAULTS_HOSTS:
                assert self.network is not None
                role, number = target.split("-")
                process = (self.workers if role == "worker" else self.apis)[int(number) - 1]
                if role == "worker" and process is not None:
                    # A worker cut from Redis past its lease is declared dead, as a stopped
                    # one is: the checker holds its sessions' deaths to these incarnations.
                    record["incarnations"] = list(process.incarnations)
                    record["pid"] = process.pid
                await self.network.cut(kind, target, params, detail)
            elif kind == "cluster_failover":
                masters = await self.masters()
                with_replica = [(m, r) for m in masters if (r := await asyncio.to_thread(self.redis.replica_of, m))]
                if not with_replica:
                    detail["skipped"] = "no master has a live replica"
                else:
                    old, replica = with_replica[target % len(with_replica)]
                    detail.update(killed=old, replica=replica)
                    await asyncio.to_thread(self.redis.kill9, old)
                    detail["killed_at"] = now()
                    deadline = time.monotonic() + 30
                    while time.monotonic() < deadline:
                        if await asyncio.to_thread(self.redis.promoted, old, replica):
                            detail["promoted_at"] = now()
                            break
                        await asyncio.sleep(0.1)
                    else:
                        detail["promoted_at"] = None
                    if params["restart_as_replica"]:
                        await asyncio.to_thread(self.redis.restart_node, old)
                        detail["restarted_at"] = now()
        except Exception as error:  # noqa: BLE001 - what was done so far is recorded with the error
            detail["error"] = repr(error)
        if kind == "worker_drain" and "signalled_at" in detail:
            start = detail["signalled_at"]  # the drain began then (the replacement came after)
        record.update(t_start=start, t_end=now(), detail=detail)
        self.rec("fault", **record)
        self.fault_log.append(record)
        log(f"fault {kind} target={target}: {round(record['t_end'] - start, 2)} s {json.dumps(detail, default=str)[:200]}")
        return record

    async def drain_worker(self, process: AcpProcess, params: dict[str, Any], detail: dict[str, Any]) -> None:
        """Drain a worker (SIGTERM, or `acp-state drain <incarnation>`), start its replacement
        in its slot at once (a rolling restart), and wait for it to exit: its sessions move
        to the live workers meanwhile (or, with none, close). Then read every session's owner:
        the history ties each move to the incarnation that took the session."""
        slot = process.slot
        self.drained.append(process)
        detail["grace_s"] = params["grace_s"]
        detail["via"] = params["via"]
        detail["drained"] = process.inc
        if params["via"] == "cli":
            detail["signalled_at"] = now()
            cli = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "acp_state.cli", "drain", process.inc or "", "--redis-url", self.redis_url(),
                "--no-wait", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, cwd=str(ROOT),
                env={**os.environ, "PYTHONPATH": str(ROOT)},
            )
            out, _ = await asyncio.wait_for(cli.communicate(), 30)
            detail["cli"] = {"code": cli.returncode, "output": out.decode(errors="replace").strip()[-300:]}
            self.rec("worker", slot=slot, pid=process.pid, inc=process.inc, incarnations=list(process.incarnations),
                     t=detail["signalled_at"], event="drain")
            if cli.returncode != 0:  # not told (e.g. its lease lapsed just now): stop it as an operator would
                process.sigterm()
        else:
            process.sigterm()
            detail["signalled_at"] = now()
        replacement = await self.start_worker(slot)
        detail["replacement"] = replacement.inc
        how = await process.wait_exit(DRAIN_EXIT_TIMEOUT_S)
        detail["exited_at"] = now()
        detail["exit"] = how
        if how.endswith("killed"):
            detail["killed_at"] = detail["exited_at"]
        if self.load is not None:
            await self.load.read_owners("drained")

    async def run_faults(self) -> None:
        for plan in self.schedule:
            wait = self.t0 + plan["at_s"] - now()
            if wait > 0:
                await asyncio.sleep(wait)
            try:
                await self.inject(plan)
            except Exception as error:  # noqa: BLE001 - a fault that could not be injected is recorded
                self.rec("fault", fault=plan["kind"], target=plan["target"], planned=plan, t_start=now(), t_end=now(),
                         detail={"error": repr(error)})
                log(f"fault {plan['kind']} failed: {error!r}")

    async def run_conditions(self) -> None:
        """The link-condition lane (a run across hosts), beside the fault schedule."""
        assert self.network is not None
        for plan in self.conditions:
            wait = self.t0 + plan["at_s"] - now()
            if wait > 0:
                await asyncio.sleep(wait)
            start = now()
            try:
                detail = await self.network.condition(plan)
            except Exception as error:  # noqa: BLE001 - recorded
                detail = {"error": repr(error)}
            record = {"condition": plan["kind"], "target": plan["target"], "planned": plan, "t_start": start,
                      "t_end": now(), "detail": detail}
            self.rec("condition", **record)
            self.condition_log.append(record)

    async def wait_redis_healthy(self, timeout: float = 60) -> bool:
        """Faults are over: lift any limit a fault left behind, restart dead nodes, and wait
        until every node answers (on a cluster: state ok, replicas linked)."""
        await self._on_ports(self.redis.alive_ports(), "CONFIG", "SET", "maxmemory", 0)
        await self._on_ports(self.redis.alive_ports(), "CLIENT", "UNPAUSE")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.cluster:
                # A killed node that was not restarted is started again as a replica here.
                for node in self.redis.nodes:
                    if node.process is None or node.process.poll() is not None:
                        await asyncio.to_thread(self.redis.restart_node, node.port)
            if await asyncio.to_thread(self.redis.healthy):
                return True
            await asyncio.sleep(0.2)
        return False

    # ---- the whole run ----------------------------------------------------------------

    async def run(self) -> dict[str, Any]:
        args = self.args
        log(f"seed {self.seed}, {args.minutes} min, {'cluster' if self.cluster else 'single Redis'}, lease {self.lease_ms} ms")
        log("fault schedule:\n" + format_schedule(self.schedule))
        started = now()
        if args.hosts:
            # First: the bed marks every process started after it, Redis too, for its reaper.
            self.bed = await asyncio.to_thread(
                TestBed(chaos_network.host_names(), proxy_seed=self.seed, folder=self.log_dir / "hosts").start)
            self.network = chaos_network.Network(self.bed)
            log(f"hosts up: {', '.join(f'{h.name} {h.ip}' for h in self.bed.hosts.values())}; Redis at {self.bed.redis_ip}")
            log("link conditions:\n" + format_schedule(self.conditions))
        address = self.bed.redis_ip if self.bed else None
        self.redis = (ChaosRedisCluster(node_timeout_ms=args.node_timeout_ms, address=address) if self.cluster
                      else ChaosRedis(address))
        try:
            await asyncio.to_thread(self.redis.start)
        except BaseException:
            if self.bed is not None:
                self.bed.stop()
            raise
        log(f"Redis up on {self.redis.ports}")
        load: Load | None = None
        try:
            for slot in range(WORKERS):
                await self.start_worker(slot)
            for slot in range(APIS):
                await self.start_api(slot)
            self.rec(
                "meta", seed=self.seed, minutes=args.minutes, cluster=self.cluster, lease_ms=self.lease_ms,
                node_timeout_ms=args.node_timeout_ms if self.cluster else None, schedule=self.schedule,
                drain_grace_s=self.drain_grace_s, hosts=bool(self.bed), conditions=self.conditions,
                workspace=self.workspace, workspace_id=workspace_id(self.workspace), log_dir=str(self.log_dir),
                redis_ports=self.redis.ports, api_ports=self.api_ports, t=now(),
            )
            self.t0 = now()
            self.load_end = self.t0 + args.minutes * 60
            load = self.load = Load(self)
            await load.open()
            log(f"load: {args.actors} session actors on {APIS} APIs for {args.minutes * 60:.0f} s")
            await asyncio.gather(load.run(), self.run_faults(), *([self.run_conditions()] if self.bed else []))
            log("load and faults done; waiting for a healthy Redis and a lease")
            healthy = await self.wait_redis_healthy()
            self.rec("settle", t=now(), redis_healthy=healthy)
            await asyncio.sleep(self.lease_ms / 1000 + 1)
            await load.finish_chains()
            log("final reads of every session's replay log (live)")
            await load.final_reads(live=True)
            await load.listing()
            log(f"SIGTERM to the workers (they drain, find no target, and close after {self.drain_grace_s} s)")
            await self.terminate_all("worker", self.workers)
            await load.stop_readers(grace_s=4)
            log("final reads of every session's replay log (closed)")
            await load.final_reads(live=False)
        finally:
            if load is not None:
                await load.close()
            await self.terminate_all("worker", [p for p in self.workers + self.drained if p is not None and p.alive])
            await self.terminate_all("api", self.apis)
            log("processes stopped; scanning acp:* keys for TTLs")
            try:
                await self.scan_ttls()
            finally:
                self.rec("end", t=now())
                self.rec.close()
                await asyncio.to_thread(self.redis.stop)
                if self.bed is not None:
                    await asyncio.to_thread(self.bed.stop)
        return self.summarize(started)

    async def terminate_all(self, role: str, processes: list[AcpProcess | None]) -> None:
        """SIGTERM to each (all at once), SIGKILL only for one that ignores it."""
        alive = [p for p in processes if p is not None]
        timeout = 30 + (self.drain_grace_s if role == "worker" else 0)
        results = await asyncio.gather(*(p.terminate(timeout) for p in alive))
        for process, how in zip(alive, results, strict=True):
            self.shutdown_notes[f"{role}{process.slot}"] = how

    async def scan_ttls(self) -> None:
        """After every process stopped: every `acp:*` key of every master, with its TTL."""
        await self.wait_redis_healthy(20)
        ports = await self.masters() if self.cluster else self.redis.ports

        def scan(port: int) -> list[list[Any]]:
            c = redis_client(port)
            found = []
            for key in c.scan_iter(match="acp:*", count=1000):
                pipe = c.pipeline(transaction=False)
                pipe.type(key)
                pipe.pttl(key)
                key_type, pttl = pipe.execute()
                found.append([key, key_type, pttl])
            return found

        for port in ports:
            try:
                found = await asyncio.to_thread(scan, port)
            except Exception as error:  # noqa: BLE001
                self.rec("keys", node=port, t=now(), keys=[], error=repr(error))
                continue
            self.rec("keys", node=port, t=now(), keys=found)

    def summarize(self, started: float) -> dict[str, Any]:
        log("checking the history")
        records = chaos_check.load(str(self.history_path))
        report = self.report = chaos_check.check(records)
        checked = report.to_json(examples=20)
        return {
            "seed": self.seed,
            "minutes": self.args.minutes,
            "redis": "3-master cluster, 1 replica each" if self.cluster else "single",
            "lease_ms": self.lease_ms,
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
            "wall_s": round(now() - started, 1),
            "schedule": self.schedule,
            "faults_injected_by_kind": dict(sorted(
                Counter(
                    f["fault"] for f in self.fault_log if not f.get("detail", {}).get("skipped")
                ).items())),
            "faults": [
                {k: f.get(k) for k in ("fault", "target", "t_start", "t_end", "incarnations", "detail")}
                for f in self.fault_log
            ],
            "hosts": bool(self.bed),
            "conditions_by_kind": dict(sorted(Counter(c["condition"] for c in self.condition_log).items())),
            "requests_by_route_and_status": checked["counts"]["requests by route and status"],
            "events": {"sse_frames": checked["counts"]["sse frames"], "distinct_events": checked["counts"]["distinct events"],
                       "sse_connections": checked["counts"]["sse connections"]},
            "moves": {k: checked["counts"].get(k, 0) for k in (
                "moves", "sessions moved", "turns ended worker_draining", "sessions closed worker_shutdown")},
            "checks": checked["checks"],
            "violations_by_invariant": checked["violations_by_invariant"],
            "violations_total": checked["violations_total"],
            "violation_kinds": checked["violation_kinds"],
            "unverifiable": checked["unverifiable"],
            "notes": checked["notes"],
            "violations": checked["violations"],
            "counts": checked["counts"],
            "shutdown": self.shutdown_notes,
            "history": str(self.history_path),
            "logs": str(self.log_dir),
        }


# ----------------------------------------------------------------------------- the load


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
                    brought += await self._frame(frame, base)
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

    async def _frame(self, frame: dict[str, Any], base: dict[str, Any]) -> int:
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
        if event_type == chaos_check.MOVED:
            self.load.moved(self.sid, event_id)
        if event_type in ENDING:
            self.ended = True
            self.load.died(self.sid)
        async with self.changed:
            self.frames.append(data if isinstance(data, dict) else {})
            self.changed.notify_all()
        return 1

    async def wait_for(self, predicate: Any, timeout: float) -> dict[str, Any] | None:
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


async def sse_frames(response: httpx.Response) -> Any:
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

    def __init__(self, chaos: Chaos) -> None:
        self.chaos = chaos
        self.rec = chaos.rec
        self.rng = random.Random(f"load-{chaos.seed}")
        self.ids = itertools.count(1)
        self.clients: list[httpx.AsyncClient] = []
        self.sse_clients: list[httpx.AsyncClient] = []
        self.redis: Any = None
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
        self.redis = connect(self.chaos.redis_url())

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
            await self.redis.aclose()

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
        """Record the session's owner: its hash's `inc`, with `last_id` (its `seq`: the last
        event id) and `epoch` read in the same command, which place the owner in the session's log (a
        move changes `inc` in the step that writes `session_moved`)."""
        for _ in range(tries):
            t_sent = now()
            try:
                inc, seq, epoch = await asyncio.wait_for(read_owner(self.redis, self.chaos.workspace, sid), 3)
            except Exception:  # noqa: BLE001 - Redis may be away: try again
                inc = seq = epoch = None
            if inc:
                self.rec("owner", sid=sid, inc=inc, t=now(), t_sent=t_sent, last_id=int(seq) if seq else None, epoch=epoch,
                         why=why)
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
            lambda e: e.get("type") in chaos_check.TERMINALS + ENDING
            and (e.get("type") in ENDING or chaos_check.envelope_prompt_id(e) == prompt_id),
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


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--minutes", type=float, default=1.0)
    parser.add_argument("--cluster", action="store_true", help="a 3-master Redis Cluster with one replica per master")
    parser.add_argument("--lease-ms", type=int, default=3000)
    parser.add_argument("--node-timeout-ms", type=int, default=2000, help="cluster-node-timeout of the test cluster")
    parser.add_argument("--drain-grace-s", type=float, default=DRAIN_GRACE_S,
                        help="the workers' --drain-grace-s (how long a drained worker's turns may finish)")
    parser.add_argument("--actors", type=int, default=24, help="session actors (sessions alive at a time, about)")
    parser.add_argument("--out", help="summary JSON (default bench/results/chaos-<single|cluster>-seed<N>.json)")
    parser.add_argument("--faults", help="comma-separated fault kinds the schedule may draw from, or `none` "
                        "(default: all that apply: " + ", ".join(dict.fromkeys(FAULTS_SINGLE + FAULTS_CLUSTER)) + ")")
    parser.add_argument("--log-dir", help="where the processes' logs (and the sessions' workspace) go "
                        "(default: a new temporary folder)")
    parser.add_argument("--print-schedule", action="store_true", help="print the fault schedule as JSON and exit")
    parser.add_argument("--hosts", action="store_true",
                        help="run each process on its own host of a network-namespace test bed (bench/hosts.py, "
                             "root and nftables needed) and draw network faults too (bench/chaos_network.py)")
    return parser.parse_args(argv)


def faults_option(args: argparse.Namespace) -> list[str] | None:
    if not args.faults:
        return None
    if args.faults.strip() == "none":
        return []
    chosen = [k.strip() for k in args.faults.split(",") if k.strip()]
    unknown = [k for k in chosen if k not in FAULTS_SINGLE + FAULTS_CLUSTER + FAULTS_HOSTS]
    if unknown:
        raise SystemExit(f"unknown fault kinds: {', '.join(unknown)}")
    return chosen


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.print_schedule:
        plan = make_schedule(args.seed, args.minutes, args.lease_ms, args.cluster, args.node_timeout_ms,
                             faults_option(args), args.drain_grace_s, args.hosts)
        conditions = chaos_network.make_conditions(args.seed, args.minutes, args.lease_ms) if args.hosts else []
        print(json.dumps({"faults": plan, "conditions": conditions} if args.hosts else plan, indent=2))
        return 0
    chaos = Chaos(args)
    try:
        summary = asyncio.run(chaos.run())
    except HostsUnavailable as error:
        print(f"the run across hosts cannot run here: {error}", file=sys.stderr)
        return UNAVAILABLE_EXIT
    chaos.out.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    print(chaos_check.render(chaos.report, examples=2))
    print(f"summary: {chaos.out}\nhistory: {chaos.history_path}\nlogs: {chaos.log_dir}")
    return 1 if summary["violations_total"] else 0


if __name__ == "__main__":
    sys.exit(main())
