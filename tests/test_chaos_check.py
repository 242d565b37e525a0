"""The chaos checker (bench/chaos/checker.py) on small hand-made histories: a clean history
passes, and each invariant's violation is reported, exactly that one. These prove the
checker can fail."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest

from bench.chaos import checker
from bench.chaos.schedule import make_schedule

from tests.chaos_histories import EPOCH, OWNER, SID, T0, History, invariants, scenario


def test_a_clean_history_has_no_violations_and_runs_every_check() -> None:
    report = checker.check(scenario())
    assert report.violations == []
    assert all(report.checks[k] > 0 for k in "abcdegh"), report.checks
    # An ending that is a death (not by a store outage): f checks it and passes.
    died = checker.check(scenario(ending="died", faulted_owner=True))
    assert died.violations == [] and died.checks["f"] == 1


def test_a_second_winner_with_another_key_is_a_violation() -> None:
    assert invariants(scenario(second_winner=True)) == ["a: several winners"]


def test_a_second_winner_after_redis_restarted_empty_is_unverifiable_not_a_violation() -> None:
    """The first winner's vote went with the store's data (answered just before the restart),
    and the request came back pending: only a winner on each side of the loss is excused."""
    records = scenario(second_winner=True)
    second = next(r for r in records if r.get("key") == "vote-3")
    second.update(t_sent=T0 + 1.55, t_answered=T0 + 1.6)
    records.append({"kind": "fault", "seq": 10_001, "fault": "redis_restart_empty", "target": 0,
                    "t_start": T0 + 1.0, "t_end": T0 + 1.5, "detail": {}})
    report = checker.check(records)
    assert not [v for v in report.violations if v["invariant"] == "a"]
    assert report.unverifiable["a: an earlier winner lost with the store"] == 1
    second.update(t_sent=T0 + 0.3, t_answered=T0 + 0.31)  # both before the loss: still a violation
    assert "a: several winners" in invariants(records)


def test_a_repeated_200_with_the_same_key_is_not() -> None:
    records = scenario()
    again = dict(next(r for r in records if r.get("route") == "vote" and r["status"] == 200), seq=10_000, attempt=1)
    records.append(again)
    assert invariants(records) == []


def test_b_an_unannounced_gap_is_a_violation() -> None:
    assert invariants(scenario(skip_event_id=True)) == ["b: unannounced gap"]


def test_b_a_gap_announced_by_history_truncated_is_not() -> None:
    assert invariants(scenario(skip_event_id=True, announce_gap=True)) == []


def test_b_an_id_going_back_in_one_epoch_is_a_violation() -> None:
    records = scenario()
    closing = next(r for r in records if r.get("type") == "session_closed")
    echo = dict(closing, seq=closing["seq"], data=dict(closing["data"], id=2), id=2)
    records[records.index(closing)] = echo
    found = invariants(records)
    assert "b: id not increasing" in found
    assert {v.split(":")[0] for v in found} == {"b"}


def test_b_a_live_stream_that_silently_misses_events_is_a_violation() -> None:
    assert invariants(scenario(second_reader_misses=True)) == ["b: events made while the stream was open never reached it"]


def test_b_one_event_under_two_epochs_is_a_violation() -> None:
    records = scenario()
    # A second reader resumes and is told nothing of a new epoch, yet labels the same event
    # with another epoch than the first reader (the product swapped epochs silently).
    first = next(r for r in records if r.get("type") == "turn_complete")
    seq = max(r["seq"] for r in records)
    records += [
        {"seq": seq + 1, "kind": "sse_open", "reader": "r9", "conn": 1, "sid": SID, "api": 1, "t": T0 + 0.21,
         "last_event_id": first["id"] - 1, "epoch_hint": "e2", "status": 200},
        dict(first, seq=seq + 2, reader="r9"),
        {"seq": seq + 3, "kind": "sse_close", "reader": "r9", "conn": 1, "sid": SID, "t": T0 + 0.25, "reason": "x"},
    ]
    assert invariants(records) == ["b: one event seen under two epochs (an unannounced epoch change)"]


def test_c_status_200_after_the_session_ended_is_a_violation() -> None:
    assert invariants(scenario(zombie_status=True)) == ["c: status 200 after the session ended"]


def test_c_a_read_within_the_invalidations_delivery_is_noted_not_a_violation() -> None:
    ended = checker.History.of(scenario()).endings()[SID]  # the session_closed frame's sighting
    report = checker.check(scenario(zombie_status=True, status_after_s=ended + 0.01 - (T0 + 2.0)))
    assert report.violations == []
    assert report.notes["c: read within the invalidation's delivery"] == 1


def test_d_an_acknowledged_prompt_without_a_terminal_is_a_violation() -> None:
    assert invariants(scenario(terminal_prompt="someone-else")) == ["d: acknowledged prompt without a terminal"]


def test_d_a_duplicate_terminal_is_a_violation() -> None:
    assert invariants(scenario(duplicate_terminal=True)) == ["d: duplicate terminals"]


def test_d_a_prompt_acknowledged_just_before_a_restart_empty_is_unverifiable() -> None:
    report = checker.check(scenario(restart_after_ack=True))
    assert report.violations == []
    assert report.unverifiable["d: lost with the store"] == 1


def test_e_a_winning_vote_that_never_reaches_the_agent_is_a_violation() -> None:
    assert invariants(scenario(resolved=False, ending=None)) == ["e: winning vote never reached the agent"]


def test_e_the_session_ending_resolves_a_winning_vote() -> None:
    assert invariants(scenario(resolved=False, ending="closed")) == []


def test_f_a_session_swept_while_its_worker_lived_is_a_violation() -> None:
    assert invariants(scenario(ending="died")) == [
        "f: live session swept (worker_lost) though its worker was never killed or stopped"
    ]


def test_f_a_session_swept_before_its_worker_was_killed_is_a_violation() -> None:
    records = scenario(ending="died", faulted_owner=True)
    fault = next(r for r in records if r["kind"] == "fault")
    fault["t_start"] = T0 + 5  # the kill came after the sweep: the sweep was not its doing
    assert invariants(records) == ["f: live session swept (worker_lost) before its worker was killed or stopped"]


@pytest.mark.parametrize("cut", ["host_partition", "host_partition_oneway", "half_open", "link_down"])
def test_f_a_session_swept_after_its_worker_was_cut_from_redis_is_not_a_violation(cut: str) -> None:
    """Across hosts a worker cut off from Redis past its lease is declared dead, as a
    stopped one is (bench/chaos/network.py)."""
    assert invariants(scenario(ending="died", faulted_owner=cut)) == []


def test_f_a_session_swept_under_a_link_condition_alone_is_a_violation() -> None:
    """Latency, jitter and loss are conditions, not cuts: a death under them alone is f."""
    records = scenario(ending="died")
    records.append({"seq": 10_000, "kind": "condition", "condition": "latency", "target": "worker-1",
                    "t_start": T0, "t_end": T0 + 5, "detail": {}})
    assert invariants(records) == ["f: live session swept (worker_lost) though its worker was never killed or stopped"]


def test_g_a_text_500_is_a_violation() -> None:
    assert invariants(scenario(text_500=True)) == ["g: 500 error that is not JSON"]


def test_g_an_error_without_a_code_is_a_violation() -> None:
    records = scenario()
    loser = next(r for r in records if r.get("route") == "vote" and r["status"] == 404)
    loser["body"] = {"error": "No pending permission request"}
    assert invariants(records) == ["g: 404 JSON error without a code"]


def test_g_an_outcome_left_unknown_is_a_violation() -> None:
    records = scenario()
    h = History()
    h._seq = itertools.count(10_000)
    for attempt in range(3):
        h.http("cancel", T0 + 3 + attempt, 503, {"error": "?", "code": "outcome_unknown"}, key="cancel-9", attempt=attempt)
    assert invariants(records + h.records) == ["g: outcome still unknown after retries with the same key"]


def test_g_a_retry_that_runs_the_prompt_twice_is_a_violation() -> None:
    records = scenario()
    prompt = next(r for r in records if r.get("route") == "prompt")
    # The first attempt's answer was lost (the connection broke after the request went
    # out); the retry with the same key was answered with a new prompt ...
    lost = dict(prompt, seq=prompt["seq"] - 0.5, status=None, body=None, error="ReadError", t_answered=None)
    records.insert(records.index(prompt), lost)
    # ... and the final read of the log shows that the first attempt ran too.
    chunk = next(r for r in records if r.get("type") == "session_update")
    first_run = json.loads(json.dumps(chunk))
    first_run["data"].update(id=100, promptId="p-0", _meta={"serverTimestamp": int((T0 - 10) * 1000)})
    first_run.update(seq=10_000, id=100, reader="final-end-x")
    records.append(first_run)
    assert invariants(records) == ["g: one idempotency key ran several prompts"]


def prompt_run_then_answered_404(restart_between: bool) -> list[dict[str, Any]]:
    """The prompt's first try went out and its answer was lost; it ran (its chunk is in the
    log), but the retry with the same key was answered 404."""
    records = scenario()
    prompt = next(r for r in records if r.get("route") == "prompt")
    retry = dict(prompt, seq=prompt["seq"] + 0.5, attempt=1, t_sent=T0 + 0.4, t_answered=T0 + 0.41, status=404,
                 body={"error": "session not found", "code": "session_not_found"})
    prompt.update(status=None, body=None, error="ReadError", t_answered=None)
    records.insert(records.index(prompt) + 1, retry)
    if restart_between:
        records.append({"kind": "fault", "seq": 10_001, "fault": "redis_restart_empty", "target": 0,
                        "t_start": T0 + 0.2, "t_end": T0 + 0.3, "detail": {}})
    return records


def test_g_a_prompt_that_ran_although_its_retry_was_answered_404_is_a_violation() -> None:
    violations = invariants(prompt_run_then_answered_404(restart_between=False))
    assert "g: prompt ran although its definite answer said it was not taken" in violations


def test_g_a_404_retry_after_redis_restarted_empty_is_unverifiable_not_a_violation() -> None:
    """The kept outcome went with the store's data between the try and its retry."""
    report = checker.check(prompt_run_then_answered_404(restart_between=True))
    assert not [v for v in report.violations if v["invariant"] == "g"]
    assert report.unverifiable["g: kept outcome lost with the store"] == 1


def test_g_a_session_created_without_an_acknowledged_create_is_a_violation() -> None:
    records = scenario()
    listing = next(r for r in records if r["kind"] == "listing")
    listing["sids"] = [SID, "22222222-2222-4222-8222-222222222222"]
    assert invariants(records) == ["g: session created without an acknowledged create"]


def test_h_a_key_without_a_ttl_is_a_violation() -> None:
    assert invariants(scenario(ttl=-1)) == ["h: key without a TTL"]


@pytest.mark.parametrize("cluster", [False, True])
def test_chaos_schedule_comes_from_the_seed_alone(cluster: bool) -> None:
    plan = make_schedule(336, 1, 3000, cluster)
    assert plan == make_schedule(336, 1, 3000, cluster)
    assert plan != make_schedule(337, 1, 3000, cluster)
    assert len({f["kind"] for f in plan}) >= 4
    for earlier, later in zip(plan, plan[1:]):  # one at a time, with recovery in between
        assert earlier["at_s"] + earlier["estimated_s"] + 3.0 <= later["at_s"]
    assert plan[-1]["at_s"] + plan[-1]["estimated_s"] <= 60 - 10
    if cluster:
        assert "redis_restart_empty" not in {f["kind"] for f in plan}


@pytest.mark.parametrize("sleep_s, lost", [(15.0, True), (1.0, False)])
def test_d_a_prompt_acknowledged_just_before_a_master_stalled_past_its_failover_is_unverifiable(
    sleep_s: float, lost: bool
) -> None:
    """On a cluster a master stalled past the node timeout is replaced by its replica, which
    lacks the master's newest writes; a shorter stall fails nothing over."""
    records = scenario(restart_after_ack=True)
    meta = next(r for r in records if r["kind"] == "meta")
    meta.update(cluster=True, node_timeout_ms=2000)
    fault = next(r for r in records if r["kind"] == "fault")
    fault.update(fault="redis_sleep_5x", planned={"kind": "redis_sleep_5x", "params": {"sleep_s": sleep_s}})
    report = checker.check(records)
    if lost:
        assert report.violations == [] and report.unverifiable["d: lost with the store"] == 1
    else:
        assert invariants(records) == ["d: acknowledged prompt without a terminal"]


# ---------------------------------------------------------------------------- moves (i)

NEW_OWNER = "w1-2-bbbb"
P_RUNNING = "p-run"  # the turn running on the old owner when it is told to drain
P_MOVED = "p-moved"  # acknowledged during the move; runs on the new owner
RID_MOVED = "r-moved"


def moved_scenario(
    *,
    drained: bool = True,
    stop_for_drain: bool = False,
    zombie_after_move: bool = False,
    lose_moved_prompt: bool = False,
    owner_read_after: str | None = NEW_OWNER,
    ending: str = "closed",
    killed: str | None = None,
    other_live: bool = True,
    exit_code: int = 0,
) -> list[dict[str, Any]]:
    """One session moved by a drain, as bench/chaos/run.py records it: created on OWNER (pid 1)
    with NEW_OWNER (pid 2) live, a turn running when OWNER is told to drain (it ends within
    the grace, or `stop_for_drain`: the grace ends it `worker_draining`), a #permission
    prompt acknowledged during the move, `session_moved` written by NEW_OWNER (its owner
    read after), the moved prompt run there and voted, then the session ends."""
    h = History()
    h.add("meta", seed=1, minutes=1, cluster=False, lease_ms=3000, schedule=[], drain_grace_s=2.0)
    h.add("worker", slot=0, pid=1, inc=OWNER, t=T0 - 5, event="started")
    h.add("worker", slot=1, pid=2, inc=NEW_OWNER, t=T0 - 5, event="started")
    h.http("create", T0, 200, {"sessionId": SID, "clientId": "c"}, key="create-1", sid=None)
    h.add("owner", sid=SID, inc=OWNER, t=T0 + 0.02, t_sent=T0 + 0.015, last_id=None, epoch=EPOCH, why="created")
    h.open("r1", 1, T0 + 0.05)
    h.control("r1", 1, T0 + 0.06, "session_snapshot", {"lastEventId": 0, "eventEpoch": EPOCH})
    ids = itertools.count(1)
    ticks = itertools.count(1)

    def ev(event_type: str, data: dict[str, Any], prompt_id: str | None = None, at: float | None = None) -> int:
        event_id = next(ids)
        h.event("r1", 1, at if at is not None else T0 + 0.2 + next(ticks) * 0.01, event_id, event_type, data, prompt_id)
        return event_id

    def chunk(text: str, prompt_id: str, kind: str = "user_message_chunk") -> dict[str, Any]:
        return {"sessionId": SID, "update": {"sessionUpdate": kind, "content": {"type": "text", "text": text}}}

    running = "#slow 1 k=prompt-run"
    h.http("prompt", T0 + 0.1, 200, {"promptId": P_RUNNING, "lastEventId": 0, "eventEpoch": EPOCH}, key="prompt-run",
           text=running)
    ev("session_update", chunk(running, P_RUNNING), P_RUNNING)
    ev("session_update", chunk("tick 0", P_RUNNING, "agent_message_chunk"), P_RUNNING)
    told = T0 + 1.0
    if drained:
        h.add("worker", slot=0, pid=1, inc=OWNER, incarnations=[OWNER], t=told, event="sigterm")
    moved_text = "#permission k=prompt-moved"
    h.http("prompt", told + 0.5, 202, {"promptId": P_MOVED, "lastEventId": 2, "eventEpoch": EPOCH}, key="prompt-moved",
           text=moved_text)
    ev("pending_prompt_added", {"sessionId": SID, "promptId": P_MOVED, "text": moved_text}, P_MOVED, at=told + 0.52)
    terminal = {"sessionId": SID, "stopReason": "end_turn", "promptId": P_RUNNING}
    if stop_for_drain:
        stopped = {"sessionId": SID, "message": "drained", "code": "worker_draining", "promptId": P_RUNNING}
        ev("turn_error", stopped, P_RUNNING, at=told + 2.0)
    elif not zombie_after_move:
        ev("turn_complete", terminal, P_RUNNING, at=told + 0.6)
    moved_at = told + 2.2
    move_id = ev("session_moved", {"sessionId": SID, "reason": "worker_draining"}, at=moved_at)
    if owner_read_after:
        h.add("owner", sid=SID, inc=owner_read_after, t=moved_at + 0.05, t_sent=moved_at + 0.04, last_id=move_id,
              epoch=EPOCH, why="moved")
    if zombie_after_move:  # the old owner still writes the turn it ran, after the move
        ev("turn_complete", terminal, P_RUNNING, at=moved_at + 0.1)
    h.add("worker", slot=0, pid=1, inc=OWNER, t=moved_at + 0.3, event="stopped", code=exit_code)
    if drained:
        h.add("fault", fault="worker_drain", target=0, pid=1, incarnations=[OWNER], t_start=told, t_end=moved_at + 0.4,
              detail={"grace_s": 2.0, "via": "sigterm", "replacement": "w0-3-cccc", "exit": f"exit {exit_code}"},
              planned={"kind": "worker_drain", "params": {"grace_s": 2.0, "via": "sigterm"}})
    h.add("http", id=998, chain="status-m", attempt=0, method="GET", route="status", path="/", api=1, sid=SID, rid=None,
          key=None, t_sent=moved_at + 0.2, t_answered=moved_at + 0.21, status=200, body={"sessionId": SID},
          content_type="application/json")  # a move is not an end: the session is still there
    # The moved prompt runs on the new owner, and its permission is voted there.
    ev("pending_prompt_started", {"sessionId": SID, "promptId": P_MOVED, "text": moved_text}, P_MOVED)
    ev("session_update", chunk(moved_text, P_MOVED), P_MOVED)
    ev("permission_request", {"requestId": RID_MOVED, "sessionId": SID}, P_MOVED)
    vote = {"outcome": {"outcome": "selected", "optionId": "proceed_once"}}
    h.http("vote", moved_at + 0.5, 200, {}, key="vote-m1", rid=RID_MOVED, sent=vote)
    h.http("vote", moved_at + 0.5, 404, {"error": "No pending permission request", "code": "request_not_found"},
           key="vote-m2", rid=RID_MOVED, sent=vote)
    ev("permission_resolved", {"requestId": RID_MOVED, "outcome": vote["outcome"]}, P_MOVED)
    if not lose_moved_prompt:
        ev("turn_complete", {"sessionId": SID, "stopReason": "end_turn", "promptId": P_MOVED}, P_MOVED)
    if killed:
        pid = 2 if killed == NEW_OWNER else 1
        h.add("fault", fault="worker_kill9", target=pid - 1, pid=pid, incarnations=[killed], t_start=moved_at + 1.0,
              t_end=moved_at + 1.5, detail={})
    if not other_live:  # the other worker stopped before the drain began
        h.add("worker", slot=1, pid=2, inc=NEW_OWNER, t=T0 + 0.5, event="stopped", code=0)
    end_t = moved_at + 4.0
    if ending == "closed":
        h.http("delete", end_t, 204, None, key="delete-1", content_type="")
        ev("session_closed", {"sessionId": SID, "reason": "closed_by_client"}, at=end_t + 0.01)
    elif ending == "died":
        ev("session_died", {"sessionId": SID, "reason": "worker_lost"}, at=end_t + 0.01)
    elif ending == "shutdown":  # the old owner (a zombie) closes the session it handed over
        ev("session_closed", {"sessionId": SID, "reason": "worker_shutdown"}, at=end_t + 0.01)
    h.close("r1", 1, end_t + 0.5)
    h.add("http", id=999, chain="status-x", attempt=0, method="GET", route="status", path="/", api=1, sid=SID,
          rid=None, key=None, t_sent=end_t + 1.0, t_answered=end_t + 1.01, status=404,
          body={"error": "gone", "code": "session_not_found"}, content_type="application/json")
    h.add("listing", t=end_t + 2, sids=[SID])
    h.add("keys", node=6390, t=end_t + 3, keys=[["acp:{ws}:cat", "hash", 60_000]])
    h.add("end", t=end_t + 4)
    return h.records


def test_i_a_history_with_a_move_passes_every_invariant() -> None:
    report = checker.check(moved_scenario())
    assert report.violations == []
    assert report.checks["i"] >= 3 and report.counts["moves"] == 1, (report.checks, report.counts)
    assert all(report.checks[k] > 0 for k in "abcdegi"), report.checks
    # The grace ended the running turn (worker_draining) before the move: its one terminal.
    stopped = checker.check(moved_scenario(stop_for_drain=True))
    assert stopped.violations == [] and stopped.counts["turns ended worker_draining"] == 1


def test_i_an_event_of_the_old_owner_after_the_move_is_a_violation() -> None:
    assert invariants(moved_scenario(zombie_after_move=True)) == [
        "i: an event of a turn begun before a move came after it (the old owner wrote after the move)"
    ]


def test_d_a_prompt_acknowledged_during_a_move_and_lost_is_a_violation() -> None:
    assert invariants(moved_scenario(lose_moved_prompt=True)) == ["d: acknowledged prompt without a terminal"]


def test_i_a_drain_stop_or_a_move_off_a_worker_never_told_to_drain_is_a_violation() -> None:
    assert invariants(moved_scenario(drained=False, stop_for_drain=True)) == [
        "i: a session moved off a worker not told to drain",
        "i: a turn ended worker_draining on a worker not told to drain",
    ]


def test_i_a_move_that_kept_the_owner_is_a_violation() -> None:
    assert invariants(moved_scenario(owner_read_after=OWNER)) == ["i: a move kept the session on its worker"]
    report = checker.check(moved_scenario(owner_read_after=None))  # no read after it: cannot tell
    assert report.violations == [] and report.unverifiable["i: an owner around a move unknown"] == 1


def test_i_a_worker_shutdown_close_after_the_move_is_a_zombie() -> None:
    """The new owner was never told to stop: a worker_shutdown close there is the old one's."""
    assert invariants(moved_scenario(ending="shutdown")) == [
        "i: closed worker_shutdown by a worker not told to stop"
    ]


def test_i_a_drained_worker_that_exits_non_zero_is_a_violation() -> None:
    assert invariants(moved_scenario(exit_code=70)) == ["i: a worker told to stop did not exit 0"]


def test_f_holds_across_a_move_the_sweep_is_judged_by_the_new_owner() -> None:
    # The new owner was killed: its sweep of the moved session is legitimate ...
    assert invariants(moved_scenario(ending="died", killed=NEW_OWNER)) == []
    # ... the old owner's kill does not excuse it, nor does its drain.
    assert invariants(moved_scenario(ending="died", killed=OWNER)) == [
        "f: live session swept (worker_lost) though its worker was never killed or stopped"
    ]
    assert invariants(moved_scenario(ending="died")) == [
        "f: live session swept (worker_lost) though its worker was never killed or stopped"
    ]


def drained_close(other_live: bool) -> list[dict[str, Any]]:
    """A session its drained owner could not hand over: closed worker_shutdown, no move."""
    h = History()
    h.add("meta", seed=1, minutes=1, cluster=False, lease_ms=3000, schedule=[], drain_grace_s=2.0)
    h.add("worker", slot=0, pid=1, inc=OWNER, t=T0 - 5, event="started")
    h.add("worker", slot=1, pid=2, inc=NEW_OWNER, t=T0 - 5, event="started")
    if not other_live:
        h.add("worker", slot=1, pid=2, inc=NEW_OWNER, incarnations=[NEW_OWNER], t=T0 + 0.9, event="sigterm")
    h.http("create", T0, 200, {"sessionId": SID, "clientId": "c"}, key="create-1", sid=None)
    h.add("owner", sid=SID, inc=OWNER, t=T0 + 0.02)
    h.open("r1", 1, T0 + 0.05)
    h.control("r1", 1, T0 + 0.06, "session_snapshot", {"lastEventId": 0, "eventEpoch": EPOCH})
    h.add("worker", slot=0, pid=1, inc=OWNER, incarnations=[OWNER], t=T0 + 1.0, event="sigterm")
    h.event("r1", 1, T0 + 3.1, 1, "session_closed", {"sessionId": SID, "reason": "worker_shutdown"})
    h.close("r1", 1, T0 + 3.5)
    h.add("worker", slot=0, pid=1, inc=OWNER, t=T0 + 3.3, event="stopped", code=0)
    h.add("worker", slot=1, pid=2, inc=NEW_OWNER, t=T0 + 3.3, event="stopped", code=0)
    h.add("end", t=T0 + 5)
    return h.records


def test_i_a_drain_closes_a_session_only_if_no_other_worker_could_take_it() -> None:
    assert invariants(drained_close(other_live=True)) == ["i: a drained worker closed a session another worker could take"]
    # Every worker stopping at once (the run's end): nobody could take it.
    report = checker.check(drained_close(other_live=False))
    assert report.violations == [] and report.checks["i"] >= 1


def test_drains_are_scheduled_without_overlap_and_record_their_grace() -> None:
    plan = make_schedule(35, 10, 3000, False, only=["worker_drain", "worker_kill9"], drain_grace_s=2.5)
    drains = [f for f in plan if f["kind"] == "worker_drain"]
    assert len(drains) >= 5
    assert all(f["params"]["grace_s"] == 2.5 and f["params"]["via"] in ("sigterm", "cli") for f in drains)
    assert {f["params"]["via"] for f in drains} == {"sigterm", "cli"}
    for earlier, later in zip(plan, plan[1:]):
        assert earlier["at_s"] + earlier["estimated_s"] + 3.0 <= later["at_s"]
    assert "worker_drain" in {f["kind"] for f in make_schedule(336, 1, 3000, True)}
