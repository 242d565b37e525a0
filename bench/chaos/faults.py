"""How the chaos run injects each fault of its schedule (bench/chaos/schedule.py): on the
processes (kill -9, SIGSTOP of a worker or of the worker alone, a drain by SIGTERM or
`acp-state drain`), on Redis (DEBUG
SLEEP, CLIENT PAUSE, a restart empty, maxmemory, killed pub/sub clients, a cluster
failover) and, across hosts, on the network (bench/chaos/network.py). Each fault goes to
the history with what was done and when; docs/chaos.md's table says what each does.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from typing import Any, Protocol

from testbed.processes import ROOT

from . import network
from .history import RecordedProcess, Recorder, log, now
from .load import Load
from .redis_nodes import client as redis_client
from .schedule import FAULTS_HOSTS


class Run(Protocol):
    """What the fault lanes need of the run they inject into (`run.Chaos`)."""

    rec: Recorder
    cluster: bool
    redis: Any  # the run's Redis (`redis_nodes.ChaosRedis` or `ChaosRedisCluster`)
    workers: list[RecordedProcess | None]
    apis: list[RecordedProcess | None]
    load: Load | None
    schedule: list[dict[str, Any]]  # the faults planned (`schedule.make_schedule`)
    conditions: list[dict[str, Any]]  # the link conditions planned, across hosts
    t0: float  # when the run's clock started (time.time())

    def redis_url(self) -> str: ...

    async def start_worker(self, slot: int) -> RecordedProcess: ...

    async def start_api(self, slot: int) -> RecordedProcess: ...

# How long a drained worker may take to exit (its grace, every hand-off, the shutdown)
# before it is killed; the fault records the kill (the checker then counts it killed).
DRAIN_EXIT_TIMEOUT_S = 90.0


def children_of(pid: int) -> list[dict[str, Any]]:
    """The live children of a process (from /proc): pid, state letter (R, S, T stopped, Z)
    and the command line's start."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
            # `pid (comm) state ppid ...`: comm may hold spaces and parentheses.
            state, ppid = stat[stat.rindex(")") + 2:].split()[:2]
            if int(ppid) != pid:
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, ValueError):
            continue  # gone meanwhile
        found.append({"pid": int(entry), "state": state, "cmd": command[:120]})
    return sorted(found, key=lambda c: c["pid"])


class Faults:
    """The fault lane of a run (`run_faults`), the link-condition lane of a run across hosts
    (`run_conditions`), and what each fault and condition did (`log`, `condition_log`)."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.network: network.Network | None = None  # across hosts, once the bed is up
        self.log: list[dict[str, Any]] = []
        self.condition_log: list[dict[str, Any]] = []
        self.drained: list[RecordedProcess] = []  # workers told to drain, replaced in their slot

    async def masters(self) -> list[int]:
        return await asyncio.to_thread(self.run.redis.masters)

    async def on_ports(self, ports: list[int], *command: Any, timeout: float = 5) -> dict[int, Any]:
        """`command` on each node (one thread each, a plain client of its own); an error is
        recorded as its answer."""

        def on_port(port: int) -> Any:
            try:
                return redis_client(port, socket_timeout=timeout).execute_command(*command)
            except Exception as error:  # noqa: BLE001 - recorded
                return f"error: {error!r}"

        results = await asyncio.gather(*(asyncio.to_thread(on_port, p) for p in ports))
        return dict(zip(ports, results, strict=True))

    async def inject(self, plan: dict[str, Any]) -> dict[str, Any]:
        """Inject one planned fault and wait for its end; returns its record (also written)."""
        kind, target, params = plan["kind"], plan["target"], plan["params"]
        detail: dict[str, Any] = {}
        record: dict[str, Any] = {"fault": kind, "target": target, "planned": plan}
        start = now()
        try:
            if kind in ("worker_kill9", "worker_stop"):
                process = self.run.workers[target]
                assert process is not None
                record["incarnations"] = list(process.incarnations)
                record["pid"] = process.pid
                if kind == "worker_kill9":
                    await process.kill9()
                    detail["killed_at"] = now()
                    replacement = await self.run.start_worker(target)
                    detail["replacement"] = replacement.inc
                else:
                    process.signal(signal.SIGSTOP)
                    try:
                        await asyncio.sleep(params["stop_s"])
                    finally:
                        process.signal(signal.SIGCONT)
            elif kind == "worker_stop_alone":
                process = self.run.workers[target]
                assert process is not None
                record["incarnations"] = list(process.incarnations)
                record["pid"] = process.pid
                await self.stop_alone(process, params, detail)
            elif kind == "worker_drain":
                process = self.run.workers[target]
                assert process is not None
                record["incarnations"] = list(process.incarnations)
                record["pid"] = process.pid
                await self.drain_worker(process, params, detail)
            elif kind in ("redis_sleep_2x", "redis_sleep_5x"):
                masters = await self.masters()
                port = masters[target % len(masters)] if masters else self.run.redis.ports[0]
                detail["node"] = port
                detail["result"] = (await self.on_ports([port], "DEBUG", "SLEEP", params["sleep_s"],
                                                        timeout=params["sleep_s"] + 15))[port]
            elif kind in ("client_pause_all", "client_pause_write"):
                masters = await self.masters()
                mode = "ALL" if kind.endswith("all") else "WRITE"
                detail["nodes"] = masters
                detail["result"] = await self.on_ports(masters, "CLIENT", "PAUSE", params["pause_ms"], mode)
                await asyncio.sleep(params["pause_ms"] / 1000)
            elif kind == "redis_restart_empty":
                await asyncio.to_thread(self.run.redis.kill9)
                detail["down_at"] = now()
                await asyncio.sleep(params["down_s"])
                await asyncio.to_thread(self.run.redis.restart_empty)
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
                detail["lifted"] = await self.on_ports(masters, "CONFIG", "SET", "maxmemory", 0)
            elif kind == "api_kill9":
                process = self.run.apis[target]
                assert process is not None
                record["pid"] = process.pid
                await process.kill9()
                detail["killed_at"] = now()
                await self.run.start_api(target)
            elif kind == "pubsub_kill":
                ports = self.run.redis.alive_ports()
                detail["killed"] = await self.on_ports(ports, "CLIENT", "KILL", "TYPE", "pubsub")
            elif kind in FAULTS_HOSTS:
                assert self.network is not None
                role, number = target.split("-")
                process = (self.run.workers if role == "worker" else self.run.apis)[int(number) - 1]
                if role == "worker" and process is not None:
                    # A worker cut from Redis past its lease is declared dead, as a stopped
                    # one is: the checker holds its sessions' deaths to these incarnations.
                    record["incarnations"] = list(process.incarnations)
                    record["pid"] = process.pid
                await self.network.cut(kind, target, params, detail)
            elif kind == "cluster_failover":
                masters = await self.masters()
                with_replica = [(m, r) for m in masters if (r := await asyncio.to_thread(self.run.redis.replica_of, m))]
                if not with_replica:
                    detail["skipped"] = "no master has a live replica"
                else:
                    old, replica = with_replica[target % len(with_replica)]
                    detail.update(killed=old, replica=replica)
                    await asyncio.to_thread(self.run.redis.kill9, old)
                    detail["killed_at"] = now()
                    deadline = time.monotonic() + 30
                    while time.monotonic() < deadline:
                        if await asyncio.to_thread(self.run.redis.promoted, old, replica):
                            detail["promoted_at"] = now()
                            break
                        await asyncio.sleep(0.1)
                    else:
                        detail["promoted_at"] = None
                    if params["restart_as_replica"]:
                        await asyncio.to_thread(self.run.redis.restart_node, old)
                        detail["restarted_at"] = now()
        except Exception as error:  # noqa: BLE001 - what was done so far is recorded with the error
            detail["error"] = repr(error)
        if kind == "worker_drain" and "signalled_at" in detail:
            start = detail["signalled_at"]  # the drain began then (the replacement came after)
        if kind == "worker_stop_alone" and "stopped_at" in detail:
            start = detail["stopped_at"]  # the stop began then (its turn was started before)
        record.update(t_start=start, t_end=now(), detail=detail)
        self.run.rec("fault", **record)
        self.log.append(record)
        log(f"fault {kind} target={target}: {round(record['t_end'] - start, 2)} s {json.dumps(detail, default=str)[:200]}")
        return record

    async def stop_alone(self, process: RecordedProcess, params: dict[str, Any], detail: dict[str, Any]) -> None:
        """SIGSTOP to the worker process only (never its process group: its agents and its
        watchdog run on), held `stop_s` (longer than the lease), then SIGCONT. Right before
        it, a turn as long as the stop starts on the worker (`detail.turn`, `Load.turn_on`).
        The fault's `t_start` is the SIGSTOP. Its children
        (each agent, the watchdog) are recorded with their state (`ps` letters: T is
        stopped) at the stop, a lease into it (when a sweeper may declare the worker dead)
        and at the SIGCONT: whether its fence stopped the agents in time."""
        if self.run.load is not None:
            # An agent mid-turn as its worker stops (the issue's `#slow 10`): the turn runs on
            # past the worker's deadline unless the fence stops the agent.
            try:
                detail["turn"] = await asyncio.wait_for(self.run.load.turn_on(process.inc, params["stop_s"]), 60)
            except asyncio.TimeoutError:
                detail["turn"] = {"error": "no turn started on it within 60 s"}
        detail["children"] = children_of(process.pid)
        process.signal(signal.SIGSTOP)
        detail["stopped_at"] = now()
        try:
            await asyncio.sleep(params["lease_s"])
            detail["children_at_lease"] = children_of(process.pid)
            await asyncio.sleep(max(0.0, params["stop_s"] - params["lease_s"]))
            detail["children_at_cont"] = children_of(process.pid)
        finally:
            process.signal(signal.SIGCONT)
            detail["continued_at"] = now()

    async def drain_worker(self, process: RecordedProcess, params: dict[str, Any], detail: dict[str, Any]) -> None:
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
                sys.executable, "-m", "acp_state.cli", "drain", process.inc or "", "--redis-url", self.run.redis_url(),
                "--no-wait", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, cwd=str(ROOT),
                env={**os.environ, "PYTHONPATH": str(ROOT)},
            )
            out, _ = await asyncio.wait_for(cli.communicate(), 30)
            detail["cli"] = {"code": cli.returncode, "output": out.decode(errors="replace").strip()[-300:]}
            self.run.rec("worker", slot=slot, pid=process.pid, inc=process.inc, incarnations=list(process.incarnations),
                         t=detail["signalled_at"], event="drain")
            if cli.returncode != 0:  # not told (e.g. its lease lapsed just now): stop it as an operator would
                process.sigterm()
        else:
            process.sigterm()
            detail["signalled_at"] = now()
        replacement = await self.run.start_worker(slot)
        detail["replacement"] = replacement.inc
        how = await process.wait_exit(DRAIN_EXIT_TIMEOUT_S)
        detail["exited_at"] = now()
        detail["exit"] = how
        if how.endswith("killed"):
            detail["killed_at"] = detail["exited_at"]
        if self.run.load is not None:
            await self.run.load.read_owners("drained")

    async def run_faults(self) -> None:
        """The schedule, each fault at its time from the start of the load (`run.t0`)."""
        for plan in self.run.schedule:
            wait = self.run.t0 + plan["at_s"] - now()
            if wait > 0:
                await asyncio.sleep(wait)
            try:
                await self.inject(plan)
            except Exception as error:  # noqa: BLE001 - a fault that could not be injected is recorded
                self.run.rec("fault", fault=plan["kind"], target=plan["target"], planned=plan, t_start=now(),
                             t_end=now(), detail={"error": repr(error)})
                log(f"fault {plan['kind']} failed: {error!r}")

    async def run_conditions(self) -> None:
        """The link-condition lane (a run across hosts), beside the fault schedule."""
        assert self.network is not None
        for plan in self.run.conditions:
            wait = self.run.t0 + plan["at_s"] - now()
            if wait > 0:
                await asyncio.sleep(wait)
            start = now()
            try:
                detail = await self.network.condition(plan)
            except Exception as error:  # noqa: BLE001 - recorded
                detail = {"error": repr(error)}
            record = {"condition": plan["kind"], "target": plan["target"], "planned": plan, "t_start": start,
                      "t_end": now(), "detail": detail}
            self.run.rec("condition", **record)
            self.condition_log.append(record)

    async def wait_redis_healthy(self, timeout: float = 60) -> bool:
        """Faults are over: lift any limit a fault left behind, restart dead nodes, and wait
        until every node answers (on a cluster: state ok, replicas linked)."""
        await self.on_ports(self.run.redis.alive_ports(), "CONFIG", "SET", "maxmemory", 0)
        await self.on_ports(self.run.redis.alive_ports(), "CLIENT", "UNPAUSE")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.run.cluster:
                # A killed node that was not restarted is started again as a replica here.
                for node in self.run.redis.nodes:
                    if node.process is None or node.process.poll() is not None:
                        await asyncio.to_thread(self.run.redis.restart_node, node.port)
            if await asyncio.to_thread(self.run.redis.healthy):
                return True
            await asyncio.sleep(0.2)
        return False
