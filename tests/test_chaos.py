"""Seeded chaos runs (bench/chaos/run.py), 60 s each: one on a single Redis, one on a 3-master
cluster with a replica per master. Faults of several kinds are injected while a load
creates sessions, prompts, votes, answers, cancels, deletes, polls status and reads event
streams; the recorded history must show no violation of any invariant
(bench/chaos/checker.py). Among the faults, a worker drain (its sessions move to the other
worker). A third runs across hosts (`--hosts`, network namespaces; skipped where they are
not available) with the network faults among them. Each draws a SIGSTOP of a worker alone
(`worker_stop_alone`: its agents run on), which invariant j holds to "dead stays dead down to
the agent". Select them with `-k chaos`.

The summary, history and process logs of a run stay in the test's tmp folder; a failure
message names them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from testbed.hosts import UNAVAILABLE_EXIT

ROOT = Path(__file__).resolve().parent.parent
SEED = 391  # its schedules: pub/sub kill, API kill -9, a drain, a SIGSTOP of a worker alone
# (its agents run on, one of them mid-turn), restart-empty / on the cluster: a failover,
# pub/sub kill, a drain, a SIGSTOP of a worker alone
RUN_TIMEOUT_S = 170
# Fewer actors than a bench run's 24: each actor sends its next request as soon as the last
# is answered, so a run takes all the CPU it is given, and in the suite it shares the machine
# with the other runners. Its schedule (the faults, by seed) is the same at any load.
ACTORS = 8


def run_chaos(tmp_path: Path, *extra: str, seed: int = SEED) -> tuple[dict, subprocess.CompletedProcess[str]]:
    out = tmp_path / "chaos.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "bench.chaos", "--seed", str(seed), "--minutes", "1", "--out", str(out),
         "--log-dir", str(tmp_path / "logs"), "--actors", str(ACTORS), *extra],
        cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
    )
    if done.returncode == UNAVAILABLE_EXIT:
        pytest.skip(done.stderr.strip()[-300:])
    if not out.exists():
        pytest.fail(f"the chaos run wrote no summary (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(out.read_text()), done


def assert_clean(summary: dict, done: subprocess.CompletedProcess[str]) -> None:
    injected = summary["faults_injected_by_kind"]
    assert len(injected) >= 4, f"too few kinds of faults injected: {injected}"
    # The load did each thing a user does, acknowledged, and streams carried events (what is
    # asked of a run is what it covered, never how much it did in its minute).
    acknowledged = {"create 200", "prompt 202", "vote 200", "cancel 204", "delete 204", "status 200"}
    assert acknowledged <= set(summary["requests_by_route_and_status"]), summary["requests_by_route_and_status"]
    assert summary["events"]["distinct_events"] > 0
    assert all(summary["checks"][k] > 0 for k in "abcdeghj"), summary["checks"]
    examples = "\n".join(
        f"  {inv}: {json.dumps(items[0], default=str)[:500]}" for inv, items in summary["violations"].items() if items
    )
    assert summary["violations_total"] == 0, (
        f"violations by invariant {summary['violations_by_invariant']}\n"
        f"kinds {json.dumps(summary['violation_kinds'])}\none example each:\n{examples}\n"
        f"history: {summary['history']} (python -m bench.chaos.checker <history>)\nlogs: {summary['logs']}"
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_chaos_single_redis(tmp_path: Path) -> None:
    summary, done = run_chaos(tmp_path)
    assert {"redis_restart_empty", "worker_drain", "worker_stop_alone"} <= set(summary["faults_injected_by_kind"])
    assert_moved(summary)
    assert_clean(summary, done)


def test_chaos_cluster(tmp_path: Path) -> None:
    summary, done = run_chaos(tmp_path, "--cluster")
    assert {"cluster_failover", "worker_drain", "worker_stop_alone"} <= set(summary["faults_injected_by_kind"])
    assert_moved(summary)
    assert_clean(summary, done)


HOSTS_SEED = 4198  # its first minute: a worker's host partitioned, its replies dropped (one
# way), an API's connections black-holed, a SIGSTOP of a worker alone, an API's link down


def test_chaos_across_hosts(tmp_path: Path) -> None:
    summary, done = run_chaos(tmp_path, "--hosts", seed=HOSTS_SEED)
    cuts = {"host_partition", "host_partition_oneway", "half_open", "link_down", "worker_stop_alone"}
    assert cuts <= set(summary["faults_injected_by_kind"]), summary["faults_injected_by_kind"]
    assert summary["conditions_by_kind"], "no link condition was put on"
    assert summary["checks"]["f"] > 0  # sessions of a worker cut off past its lease died
    assert_clean(summary, done)


def assert_moved(summary: dict) -> None:
    """The drain moved sessions (each a `session_moved` the checker held to invariant i)."""
    assert summary["counts"].get("moves", 0) > 0, summary["counts"]
    assert summary["checks"]["i"] > 0, summary["checks"]
