"""The chaos run's fault schedule: which fault, on which target, when, with what parameters.

Only `random.Random(seed)` decides, within the run's shape (its length, the lease, single
Redis or cluster, the kinds allowed, the drain grace, across hosts or not), so a seed names
one schedule; `python -m bench.chaos --seed N --print-schedule` prints it. Targets are
indexes (worker slot, API slot, master number in port order), resolved when a fault is
injected (bench/chaos/faults.py). The network cuts of a run across hosts are drawn here too;
how each is planned is bench/chaos/network.py's.
"""

from __future__ import annotations

import argparse
import random
from typing import Any

from . import network

WORKERS = 2
APIS = 2
WARMUP_S = 4.0
# The workers' --drain-grace-s: how long a drained worker's running turns may finish before
# its sessions move. The load's turns run 0.05-1 s (an echo, `#slow 1`) or wait for votes
# its voters send within moments, so 2 s lets the turns running at the SIGTERM end on
# their own, while its long turns (`#slow 5`, load.LONG_TURN_S) and a turn whose voters are
# slow are stopped with `turn_error` `worker_draining`: both ways are taken. Short
# against the schedule too: a drain's grace, hand-offs and exit fit in its estimate, so
# no other fault overlaps one; and the final SIGTERM (both workers draining, no target)
# costs only the grace.
DRAIN_GRACE_S = 2.0

FAULTS_SINGLE = (
    "worker_kill9", "worker_stop", "worker_stop_alone", "worker_drain", "redis_sleep_2x", "redis_sleep_5x",
    "client_pause_all", "client_pause_write", "redis_restart_empty", "maxmemory", "api_kill9", "pubsub_kill",
)
FAULTS_CLUSTER = tuple(k for k in FAULTS_SINGLE if k != "redis_restart_empty") + ("cluster_failover",)
# A run across hosts (--hosts) draws these too (bench/chaos/network.py), and runs a lane of
# link conditions (latency, jitter, loss) beside the schedule.
FAULTS_HOSTS = network.CUTS


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
    kinds += cuts * network.CUT_WEIGHT
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
        elif kind == "worker_stop_alone":
            # SIGSTOP of the worker process alone, its agents left running, for longer than
            # the lease (1.5-3 leases): a sweeper declares it dead meanwhile, and only the
            # worker's own fence (its watchdog) can stop the agents before they write on.
            target = rng.randrange(WORKERS)
            params["stop_s"] = round(lease * rng.uniform(1.5, 3.0), 3)
            params["lease_s"] = lease
            est = params["stop_s"] + 6.0  # and a session on it with a turn running, first
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
            target, params, est = network.plan_cut(rng, kind, lease)
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
    """One line per planned fault (or link condition), as the run prints it before it starts."""
    lines = []
    for f in plan:
        params = " ".join(f"{k}={v}" for k, v in f["params"].items())
        lines.append(f"  #{f['n']:<2} t+{f['at_s']:>6.2f}s  {f['kind']:<20} target={f['target']!s:<8} {params}")
    return "\n".join(lines) or "  (no faults fit)"


def faults_option(args: argparse.Namespace) -> list[str] | None:
    """The kinds `--faults` allows: None for every kind that applies, [] for `none`."""
    if not args.faults:
        return None
    if args.faults.strip() == "none":
        return []
    chosen = [k.strip() for k in args.faults.split(",") if k.strip()]
    unknown = [k for k in chosen if k not in FAULTS_SINGLE + FAULTS_CLUSTER + FAULTS_HOSTS]
    if unknown:
        raise SystemExit(f"unknown fault kinds: {', '.join(unknown)}")
    return chosen
