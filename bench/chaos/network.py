"""The chaos run's network faults, for a run across hosts (`python -m bench.chaos --hosts`).

Two kinds of fault, on the hosts of testbed/hosts.py's test bed:

- **cuts** (in the fault schedule, never overlapping another fault): a host partitioned
  from Redis both ways (`host_partition`) or one way (`host_partition_oneway`: only what
  it sends is dropped, or only what it receives), its open connections to Redis black-holed
  while new ones still connect (`half_open`), its link down (`link_down`: an API's clients
  are cut too). Partitions are kernel drop rules in the host's namespace: no RST, no FIN.
- **link conditions** (a second lane that overlaps the cuts and the process faults):
  latency of up to a quarter lease each way (so an added round trip of up to half the
  lease), jitter, and loss (a lost segment costs a retransmission timeout, 200-400 ms), on
  one host's connections to Redis or on every host's, through the fault proxy.

Only `random.Random(seed)` picks kinds, targets, parameters and times, as for the other
faults (bench/chaos/schedule.py's make_schedule).
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

from testbed.hosts import TestBed

CUTS = ("host_partition", "host_partition_oneway", "half_open", "link_down")  # checker.STOPPING too
CONDITIONS = ("latency", "jitter", "packet_loss")
WORKER_HOSTS = ("worker-1", "worker-2")
API_HOSTS = ("api-1", "api-2")
HOSTS = WORKER_HOSTS + API_HOSTS
# How many times the schedule's bag holds each cut against each process fault: a 10-minute
# run draws every cut at least 10 times and still a few of each process fault.
CUT_WEIGHT = 7


def host_names() -> list[str]:
    return list(HOSTS)


def plan_cut(rng: random.Random, kind: str, lease: float) -> tuple[str, dict[str, Any], float]:
    """(target host, parameters, estimated seconds) of one cut."""
    target = rng.choice(HOSTS)
    params: dict[str, Any] = {}
    if kind == "host_partition_oneway":
        params["direction"] = rng.choice(("in", "out"))
    if kind == "half_open":
        # Black-holed connections are noticed by the process itself (keepalive ~4 s, or
        # TCP_USER_TIMEOUT 5 s under a write, acp_state/store/connection.py), so the cut
        # lasts long enough for that to be what recovers it.
        params["hold_s"] = round(rng.uniform(5.0, 7.0), 3)
    else:
        # Below the lease (the worker must survive it), or past it (it is declared dead and
        # joins again as a new incarnation after the heal).
        params["hold_s"] = round(rng.choice((0.5, 2.0)) * lease, 3)
    # The hold and a second; the schedule's gap after it (a lease and more) covers the
    # rejoin of a worker declared dead and the reconnections.
    est = params["hold_s"] + 1.0
    return target, params, est


def make_conditions(seed: int, minutes: float, lease_ms: int) -> list[dict[str, Any]]:
    """The link-condition lane: back to back from the warm-up to the cool-down, each 3-8 s
    with 0.5-2 s of a clean link between them."""
    rng = random.Random(f"conditions-{seed}")
    lease = lease_ms / 1000
    end = minutes * 60 - max(10.0, 3 * lease)
    plan: list[dict[str, Any]] = []
    t = 4.0 + rng.uniform(0, 2)
    bag: list[str] = []
    while True:
        if not bag:
            bag = list(CONDITIONS)
            rng.shuffle(bag)
        kind = bag.pop()
        hold = round(rng.uniform(3.0, 8.0), 3)
        if t + hold > end:
            break
        target = rng.choice(HOSTS + ("all",))
        if kind == "latency":
            params = {"latency_ms": round(rng.uniform(0.05, 0.25) * lease_ms), "jitter_ms": 0}
        elif kind == "jitter":
            params = {"latency_ms": round(rng.uniform(1, 10)), "jitter_ms": round(rng.uniform(0.05, 0.2) * lease_ms)}
        else:
            params = {"latency_ms": 1, "jitter_ms": 0, "loss": rng.choice((0.01, 0.03, 0.05, 0.1))}
        params["hold_s"] = hold
        plan.append({"n": len(plan), "at_s": round(t, 3), "kind": kind, "target": target, "params": params})
        t += hold + rng.uniform(0.5, 2.0)
    return plan


class Network:
    """Injects cuts and link conditions on a test bed; each returns its record's detail."""

    def __init__(self, bed: TestBed) -> None:
        self.bed = bed

    async def cut(self, kind: str, target: str, params: dict[str, Any], detail: dict[str, Any]) -> None:
        bed = self.bed
        hold = params["hold_s"]
        if kind == "host_partition":
            await asyncio.to_thread(bed.partition, target, "both")
        elif kind == "host_partition_oneway":
            await asyncio.to_thread(bed.partition, target, params["direction"])
        elif kind == "half_open":
            detail["connections_cut"] = await asyncio.to_thread(bed.half_open, target)
        elif kind == "link_down":
            await asyncio.to_thread(bed.link_down, target)
        else:  # pragma: no cover
            raise AssertionError(kind)
        detail["cut_at"] = time.time()
        try:
            await asyncio.sleep(hold)
        finally:
            if kind == "link_down":
                await asyncio.to_thread(bed.link_up, target)
            else:
                await asyncio.to_thread(bed.heal, target)
            detail["healed_at"] = time.time()

    async def condition(self, plan: dict[str, Any]) -> dict[str, Any]:
        """Put a link condition on, hold it, take it off."""
        params = dict(plan["params"])
        hold = params.pop("hold_s")
        sources = [self.bed.hosts[h].ip for h in HOSTS] if plan["target"] == "all" else [self.bed.hosts[plan["target"]].ip]
        control = self.bed.proxy()
        detail: dict[str, Any] = {"sources": sources}
        for source in sources:
            await asyncio.to_thread(control.set, source, **params)
        detail["on_at"] = time.time()
        try:
            await asyncio.sleep(hold)
        finally:
            for source in sources:
                await asyncio.to_thread(control.clear, source)
            detail["off_at"] = time.time()
        return detail
