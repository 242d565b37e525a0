"""Seeded chaos run with a recorded history and a checker.

Starts a Redis (one redis-server, or with --cluster a 3-master cluster with one replica per
master), 2 workers and 2 API processes, drives a load over HTTP and SSE while a fault
schedule derived only from `random.Random(seed)` (and the run's shape: minutes, lease,
single or cluster) injects faults, drains among them (`worker_drain`: the workers run with
--drain-grace-s, so a drained worker's sessions move to the other one; see docs/chaos.md,
"Drains"), records every request, every SSE frame, every fault and the sessions' owners
to a JSONL history, and checks the history (bench/chaos/checker.py). Exits non-zero on any
violation.

    python -m bench.chaos --seed 7 --minutes 1 [--cluster] [--lease-ms 3000] [--drain-grace-s 2]
                          [--out bench/results/chaos-single-seed7.json] [--print-schedule]

The summary goes to --out; the history to the same path with `.history.jsonl`; process logs
to a temporary folder named in the summary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from acp_state.ids import workspace_id
from acp_state.store import RedisStore
from testbed.hosts import UNAVAILABLE_EXIT, HostsUnavailable, TestBed
from testbed.redis_server import free_port

from . import checker, network
from .faults import Faults
from .history import WORKER_NAME, LeaseWatch, RecordedProcess, Recorder, log, now, record_agent_writes
from .load import HOSTS_TOKEN, Load
from .redis_nodes import ChaosRedis, ChaosRedisCluster
from .schedule import (
    APIS,
    DRAIN_GRACE_S,
    FAULTS_CLUSTER,
    FAULTS_SINGLE,
    WORKERS,
    faults_option,
    format_schedule,
    make_schedule,
)

RESULTS = Path(__file__).resolve().parent / "results"
CREATE_TIMEOUT_S = 15


# ----------------------------------------------------------------------------- the run


class Chaos:
    """One chaos run: its Redis, workers and API processes (and, across hosts, its test
    bed), the load, the fault lanes, the history, and its summary."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.seed: int = args.seed
        self.lease_ms: int = args.lease_ms
        self.cluster: bool = args.cluster
        self.drain_grace_s: float = args.drain_grace_s
        self.schedule = make_schedule(args.seed, args.minutes, args.lease_ms, args.cluster, args.node_timeout_ms,
                                      faults_option(args), args.drain_grace_s, args.hosts)
        # Across hosts: the test bed (built in `run`), and the link-condition lane.
        self.bed: TestBed | None = None
        self.conditions = (network.make_conditions(args.seed, args.minutes, args.lease_ms)
                           if args.hosts and faults_option(args) != [] else [])
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
        self.workers: list[RecordedProcess | None] = [None] * WORKERS
        self.load: Load | None = None
        self.apis: list[RecordedProcess | None] = [None] * APIS
        self.api_ports = [free_port() for _ in range(APIS)]
        self.t0 = 0.0
        self.load_end = 0.0
        self.shutdown_notes: dict[str, str] = {}
        self.faults = Faults(self)

    # ---- processes --------------------------------------------------------------------

    def redis_url(self) -> str:
        return self.redis.url_for_alive() if self.cluster else self.redis.url

    def host(self, role: str, slot: int) -> Any:
        """The test-bed host of a process (a run across hosts), or None."""
        return self.bed.hosts[f"{role}-{slot + 1}"] if self.bed is not None else None

    def api_base(self, slot: int) -> str:
        host = self.host("api", slot)
        return f"http://{host.ip if host else '127.0.0.1'}:{self.api_ports[slot]}"

    async def start_worker(self, slot: int) -> RecordedProcess:
        host = self.host("worker", slot)
        # Across hosts each worker has its own HOME; the agents' state (--state-dir) is one
        # folder for all, as a volume the workers' hosts share (docs/api.md, "Resume"), so
        # a drained worker's sessions still load on another host.
        process = RecordedProcess(
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

    async def start_api(self, slot: int) -> RecordedProcess:
        port = self.api_ports[slot]
        last: Exception | None = None
        for _ in range(10):
            host = self.host("api", slot)
            process = RecordedProcess(
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

    # ---- the whole run ----------------------------------------------------------------

    async def run(self) -> dict[str, Any]:
        args = self.args
        log(f"seed {self.seed}, {args.minutes} min, {'cluster' if self.cluster else 'single Redis'}, lease {self.lease_ms} ms")
        log("fault schedule:\n" + format_schedule(self.schedule))
        started = now()
        if args.hosts:
            # First: the bed marks every process started after it, Redis too, for its reaper.
            self.bed = await asyncio.to_thread(
                TestBed(network.host_names(), proxy_seed=self.seed, folder=self.log_dir / "hosts").start)
            self.faults.network = network.Network(self.bed)
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
        # Every lease deadline and declared death, from before the first worker registers.
        watch = LeaseWatch(self.rec, self.redis.alive_ports, self.lease_ms / 12000, asyncio.get_running_loop()).start()
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
            await asyncio.gather(load.run(), self.faults.run_faults(), *([self.faults.run_conditions()] if self.bed else []))
            log("load and faults done; waiting for a healthy Redis and a lease")
            healthy = await self.faults.wait_redis_healthy()
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
            await self.terminate_all("worker", [p for p in self.workers + self.faults.drained if p is not None and p.alive])
            await self.terminate_all("api", self.apis)
            await asyncio.to_thread(watch.stop)
            await asyncio.sleep(0)  # the watch's last records
            written = record_agent_writes(self.rec, self.agent_home / ".acp-state-scripted")
            log(f"processes stopped; {watch.reads} registry reads, {written} agent history writes recorded; "
                "scanning acp:* keys for TTLs")
            try:
                await self.scan_ttls()
            finally:
                self.rec("end", t=now())
                self.rec.close()
                await asyncio.to_thread(self.redis.stop)
                if self.bed is not None:
                    await asyncio.to_thread(self.bed.stop)
        return self.summarize(started)

    async def terminate_all(self, role: str, processes: list[RecordedProcess | None]) -> None:
        """SIGTERM to each (all at once), SIGKILL only for one that ignores it."""
        alive = [p for p in processes if p is not None]
        timeout = 30 + (self.drain_grace_s if role == "worker" else 0)
        results = await asyncio.gather(*(p.shut_down(timeout) for p in alive))
        for process, how in zip(alive, results, strict=True):
            self.shutdown_notes[f"{role}{process.slot}"] = how

    async def scan_ttls(self) -> None:
        """After every process stopped: every key of the store on every master, with its TTL."""
        await self.faults.wait_redis_healthy(20)
        ports = await self.faults.masters() if self.cluster else self.redis.ports
        for port in ports:
            store = RedisStore.from_url(f"redis://127.0.0.1:{port}/0")  # that node's own keys
            try:
                found = [list(key) for key in await asyncio.wait_for(store.key_expiries(), 60)]
            except Exception as error:  # noqa: BLE001
                self.rec("keys", node=port, t=now(), keys=[], error=repr(error))
                continue
            finally:
                await store.close()
            self.rec("keys", node=port, t=now(), keys=found)

    def summarize(self, started: float) -> dict[str, Any]:
        log("checking the history")
        records = checker.load(str(self.history_path))
        report = self.report = checker.check(records)
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
                    f["fault"] for f in self.faults.log if not f.get("detail", {}).get("skipped")
                ).items())),
            "faults": [
                {k: f.get(k) for k in ("fault", "target", "t_start", "t_end", "incarnations", "detail")}
                for f in self.faults.log
            ],
            "hosts": bool(self.bed),
            "conditions_by_kind": dict(sorted(Counter(c["condition"] for c in self.faults.condition_log).items())),
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
                        help="run each process on its own host of a network-namespace test bed (testbed/hosts.py, "
                             "root and nftables needed) and draw network faults too (bench/chaos/network.py)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.print_schedule:
        plan = make_schedule(args.seed, args.minutes, args.lease_ms, args.cluster, args.node_timeout_ms,
                             faults_option(args), args.drain_grace_s, args.hosts)
        conditions = network.make_conditions(args.seed, args.minutes, args.lease_ms) if args.hosts else []
        print(json.dumps({"faults": plan, "conditions": conditions} if args.hosts else plan, indent=2))
        return 0
    chaos = Chaos(args)
    try:
        summary = asyncio.run(chaos.run())
    except HostsUnavailable as error:
        print(f"the run across hosts cannot run here: {error}", file=sys.stderr)
        return UNAVAILABLE_EXIT
    chaos.out.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    print(checker.render(chaos.report, examples=2))
    print(f"summary: {chaos.out}\nhistory: {chaos.history_path}\nlogs: {chaos.log_dir}")
    return 1 if summary["violations_total"] else 0


if __name__ == "__main__":
    sys.exit(main())
