"""The chaos checker's invariant j, dead stays dead down to the agent (bench/chaos/checker.py):
hand-made histories with the agents' history writes and the leases, each violation reported;
and the worker_stop_alone fault and the lease watch the run records j with."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from bench.chaos import checker
from bench.chaos.schedule import make_schedule
from tests.chaos_histories import OWNER, PROMPT, SID, T0, invariants, scenario


# ---- j: dead stays dead down to the agent -------------------------------------------------

LEASE_S = 3.0
RENEWED = T0 + 0.5  # the owner's last accepted renewal: its lease ends at DEADLINE
DEADLINE = RENEWED + LEASE_S
TEXT = "#permission k=prompt-1"  # the scenario's prompt
AGENT_SID = "9d2e0c1a-agent"  # the agent's own id of the session: its history file's name


def with_agent(records: list[dict[str, Any]], *writes: dict[str, Any], texts: list[str] | None = None,
               told_worker_lost: bool = False) -> list[dict[str, Any]]:
    """The scenario's history with what the run records for j: the owner's leases (renewed
    at T0 and at RENEWED, then declared dead a little after its deadline), the agents'
    history writes (by default the prompt's turn, written at T0 + 0.25 while the lease held)
    and the session's history as left. `told_worker_lost`: the prompt's clients were told
    it ended `turn_error` `worker_lost` (a sweep) instead of `turn_complete`."""
    records = [dict(r) for r in records]
    seq = itertools.count(max(r["seq"] for r in records) + 1)
    if told_worker_lost:
        for r in records:
            if r.get("kind") == "sse" and r.get("type") == "turn_complete":
                r["type"] = "turn_error"
                r["data"] = {**r["data"], "type": "turn_error", "data": {
                    "sessionId": SID, "promptId": PROMPT, "code": "worker_lost", "message": "lost"}}
    writes = writes or (write(T0 + 0.25),)
    end = 0
    for w in writes:
        end = w["end"] if w.get("end") is not None else end + 100
        records.append({"seq": next(seq), "kind": "agent_write", **{**w, "end": end}})
    records += [
        {"seq": next(seq), "kind": "lease", "inc": OWNER, "deadline": int((T0 + LEASE_S) * 1000),
         "redis_ms": int(T0 * 1000), "t": T0},
        {"seq": next(seq), "kind": "lease", "inc": OWNER, "deadline": int(DEADLINE * 1000),
         "redis_ms": int(RENEWED * 1000), "t": RENEWED},
        {"seq": next(seq), "kind": "lease_dead", "inc": OWNER, "at": int((DEADLINE + 0.1) * 1000),
         "redis_ms": int((DEADLINE + 0.2) * 1000), "t": DEADLINE + 0.2},
        {"seq": next(seq), "kind": "agent_history", "sid": AGENT_SID, "size": end,
         "texts": [w["text"] for w in writes] if texts is None else texts, "t": T0 + 9},
    ]
    return records


def write(t: float, text: str = TEXT, inc: str | None = OWNER, prior: int = 0, end: int | None = None) -> dict[str, Any]:
    return {"sid": AGENT_SID, "inc": inc, "t": t, "end": end, "prior": prior, "pid": 4242, "text": text}


def test_j_history_writes_within_the_lease_pass() -> None:
    report = checker.check(with_agent(scenario()))
    assert report.violations == []
    # The write, the completed turn found in the history, the write's place in the file.
    assert report.checks["j"] == 3
    assert report.counts["agent history writes"] == 1 and report.counts["incarnations declared dead"] == 1
    # A write of an incarnation whose lease was never read, or that no incarnation sent, is
    # not taken for either.
    unknown = checker.check(with_agent(scenario(), write(T0 + 0.25, inc="w9-9-ffff")))
    assert unknown.violations == [] and unknown.unverifiable["j: a write of an incarnation whose lease was never read"] == 1
    anonymous = checker.check(with_agent(scenario(), write(T0 + 0.25, inc=None)))
    assert anonymous.violations == [] and anonymous.unverifiable["j: a write no incarnation sent"] == 1


def test_j_a_history_write_after_the_lease_ended_is_a_violation() -> None:
    """The issue's split brain: the worker stopped (SIGSTOP), its agent went on and wrote a
    turn to the shared history after a sweeper could declare the worker dead."""
    late = with_agent(scenario(ending="died", faulted_owner="worker_stop_alone"),
                      write(T0 + 0.25), write(DEADLINE + 0.4, "#slow 5 k=late", prior=1))
    report = checker.check(late)
    assert invariants(late) == [
        "j: the agent wrote to the history after its worker's lease ended (a sweeper could declare it dead)"]
    (found,) = report.violations
    assert found["agentSessionId"] == AGENT_SID and found["sessionId"] is None  # "#slow 5 k=late" was never asked
    assert found["incarnation"] == OWNER and found["late_by_s"] == pytest.approx(0.4, abs=0.002)
    assert found["deadline"] == pytest.approx(DEADLINE) and found["declared_dead_at"] == pytest.approx(DEADLINE + 0.1)
    # The last renewal is what counts: the same write before that renewal's deadline passes.
    assert invariants(with_agent(scenario(), write(T0 + 0.25), write(DEADLINE - 0.01, "x", prior=1))) == []


def test_j_a_turn_told_worker_lost_held_in_the_history_is_a_violation_unless_written_in_the_lease() -> None:
    died = scenario(ending="died", faulted_owner="worker_stop_alone")
    # Written after the lease ended: every client was told the turn was lost, a resume
    # replays it.
    late = with_agent(died, write(DEADLINE + 1.0), told_worker_lost=True)
    assert invariants(late) == [
        "j: a resumed conversation holds a turn its clients were told ended worker_lost",
        "j: the agent wrote to the history after its worker's lease ended (a sweeper could declare it dead)",
    ]
    # Written while the lease held (the turn ended at the agent, the worker froze before it
    # said so): noted, not a violation: no fence can stop an agent before its lease ends.
    held = checker.check(with_agent(died, write(T0 + 0.25), told_worker_lost=True))
    assert held.violations == []
    assert held.notes["j: a turn told worker_lost in the history, written while its lease held"] == 1
    # In the history with no write logged for it: nothing vouches for it.
    unlogged = with_agent(died, write(T0 + 0.25, "other k=x"), texts=["other k=x", TEXT], told_worker_lost=True)
    assert invariants(unlogged) == ["j: a resumed conversation holds a turn its clients were told ended worker_lost"]


def test_j_a_stale_child_that_loses_the_resumers_turns_is_a_violation() -> None:
    """A child that kept the session while another worker resumed it and ran a turn writes
    as if that turn never happened: a #recall on it would not list it."""
    resumer = "w1-2-bbbb"
    records = with_agent(scenario(), write(T0 + 0.25), write(T0 + 0.6, "b's turn k=b", inc=resumer, prior=1),
                         write(T0 + 0.7, "stale k=s", prior=1))
    records.append({"seq": 10_000, "kind": "lease", "inc": resumer, "deadline": int((T0 + 9) * 1000),
                    "redis_ms": int(T0 * 1000), "t": T0})
    report = checker.check(records)
    assert invariants(records) == [
        "j: an agent wrote a turn without knowing turns the history held before it (it lost the resumer's turns)"]
    assert report.violations[0]["missed"] == ["b's turn k=b"] and report.violations[0]["knew"] == 1
    assert report.violations[0]["agentSessionId"] == AGENT_SID


def test_j_a_completed_turn_missing_from_the_history_is_a_violation() -> None:
    records = with_agent(scenario(), write(T0 + 0.25, "other k=x"))
    assert invariants(records) == ["j: a turn its client was told completed is not in the session's history"]


@pytest.mark.parametrize("cluster, hosts", [(False, False), (True, False), (False, True)])
def test_a_sigstop_of_the_worker_alone_is_drawn_held_past_the_lease(cluster: bool, hosts: bool) -> None:
    """`worker_stop_alone` is drawn by the seed like every other kind, on a single Redis, a
    cluster and across hosts, and holds the worker stopped for longer than its lease."""
    stops = [f for seed in range(30, 40) for f in make_schedule(seed, 10, 3000, cluster, hosts=hosts)
             if f["kind"] == "worker_stop_alone"]
    assert len(stops) >= 10
    assert all(4.5 <= f["params"]["stop_s"] <= 9.0 and f["params"]["lease_s"] == 3.0 for f in stops)
    assert {f["target"] for f in stops} == {0, 1}
    assert make_schedule(35, 10, 3000, cluster, hosts=hosts, only=["worker_stop_alone"])[0]["kind"] == "worker_stop_alone"


async def test_the_lease_watch_records_each_deadline_as_it_moves_and_each_death(own_redis: Any) -> None:
    """bench/chaos/history.py's LeaseWatch, on a real Redis: the registry's deadline of each
    incarnation when it first shows and whenever a renewal moves it (not at every read),
    and each tombstone once, with Redis's time of the read."""
    import asyncio

    import redis

    from acp_state.store import keys
    from bench.chaos.history import LeaseWatch

    got: list[tuple[str, dict[str, Any]]] = []
    client = redis.Redis(port=own_redis.port)
    client.zadd(keys.WORKERS, {"w-1": 1_000})
    watch = LeaseWatch(lambda kind, **fields: got.append((kind, fields)), lambda: [own_redis.port], 0.02,
                       asyncio.get_running_loop()).start()
    try:
        await asyncio.sleep(0.2)
        client.zadd(keys.WORKERS, {"w-1": 2_000})  # renewed
        await asyncio.sleep(0.2)
        client.zrem(keys.WORKERS, "w-1")
        client.zadd(keys.DEAD, {"w-1": 2_005})  # declared dead
        await asyncio.sleep(0.2)
    finally:
        watch.stop()
    await asyncio.sleep(0)
    assert [(kind, f["inc"], f.get("deadline", f.get("at"))) for kind, f in got] == [
        ("lease", "w-1", 1_000), ("lease", "w-1", 2_000), ("lease_dead", "w-1", 2_005)]
    assert watch.reads >= 10
    assert all(abs(f["redis_ms"] / 1000 - f["t"]) < 1 for _, f in got)  # one machine, one clock
