"""The chaos checker (bench/chaos_check.py) on small hand-made histories: a clean history
passes, and each invariant's violation is reported, exactly that one. These prove the
checker can fail."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest

from bench import chaos_check
from bench.chaos_schedule import make_schedule

SID = "11111111-1111-4111-8111-111111111111"
PROMPT = "p-1"
RID = "r-1"
EPOCH = "e1"
OWNER = "w0-1-aaaa"
T0 = 1_000_000.0


class History:
    """Builds a history the way bench/chaos.py records one (same record kinds and fields)."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self._seq = itertools.count(1)
        self._ids = itertools.count(1)
        self.event_ids: dict[str, int] = {}

    def add(self, kind: str, **fields: Any) -> dict[str, Any]:
        record = {"seq": next(self._seq), "kind": kind, **fields}
        self.records.append(record)
        return record

    def http(self, route: str, t: float, status: int | None, body: Any = None, *, key: str | None = None,
             sid: str | None = SID, rid: str | None = None, sent: Any = None, text: str | None = None,
             content_type: str = "application/json", error: str | None = None, chain: str | None = None,
             attempt: int = 0) -> None:
        self.add(
            "http", id=next(self._ids), chain=chain or key or f"g{next(self._ids)}", attempt=attempt, method="POST",
            route=route, path="/", api=0, sid=sid, rid=rid, key=key, sent=sent, text=text, t_sent=t,
            t_answered=None if status is None else t + 0.01, status=status, body=body,
            content_type=content_type if status is not None else None, error=error,
        )

    def open(self, reader: str, conn: int, t: float, last: int | None = None, hint: str | None = None) -> None:
        self.add("sse_open", reader=reader, conn=conn, sid=SID, api=0, t=t, last_event_id=last, epoch_hint=hint,
                 status=200)

    def control(self, reader: str, conn: int, t: float, event_type: str, payload: dict[str, Any]) -> None:
        self.add("sse", reader=reader, conn=conn, sid=SID, t=t, id=None, type=event_type,
                 data={"v": 1, "type": event_type, "data": payload})

    def event(self, reader: str, conn: int, t: float, event_id: int, event_type: str, data: dict[str, Any],
              prompt_id: str | None = None) -> dict[str, Any]:
        envelope: dict[str, Any] = {"id": event_id, "v": 1, "type": event_type}
        if prompt_id:
            envelope["promptId"] = prompt_id
        envelope["data"] = data
        envelope["_meta"] = {"serverTimestamp": int(t * 1000) - 1}
        self.add("sse", reader=reader, conn=conn, sid=SID, t=t, id=event_id, type=event_type, data=envelope)
        return envelope

    def close(self, reader: str, conn: int, t: float) -> None:
        self.add("sse_close", reader=reader, conn=conn, sid=SID, t=t, reason="ended")


def scenario(
    *,
    second_winner: bool = False,
    skip_event_id: bool = False,
    announce_gap: bool = False,
    zombie_status: bool = False,
    status_after_s: float = 1.0,
    terminal_prompt: str = PROMPT,
    duplicate_terminal: bool = False,
    resolved: bool = True,
    ending: str | None = "closed",
    faulted_owner: bool | str = False,
    text_500: bool = False,
    ttl: int = 60_000,
    restart_after_ack: bool = False,
    second_reader_misses: bool = False,
) -> list[dict[str, Any]]:
    """One session's life: create, a #permission prompt voted by two voters (one wins), the
    turn completes, the session is closed (or dies) and a status read after that says 404."""
    h = History()
    h.add("meta", seed=1, minutes=1, cluster=False, lease_ms=3000, schedule=[])
    h.add("worker", slot=0, pid=1, inc=OWNER, t=T0, event="started")
    h.http("create", T0, 200, {"sessionId": SID, "clientId": "c"}, key="create-1", sid=None)
    h.add("owner", sid=SID, inc=OWNER, t=T0 + 0.02)
    h.open("r1", 1, T0 + 0.05)
    h.control("r1", 1, T0 + 0.06, "session_snapshot", {"lastEventId": 0, "eventEpoch": EPOCH})
    if second_reader_misses:
        h.open("r2", 1, T0 + 0.05)
        h.control("r2", 1, T0 + 0.06, "session_snapshot", {"lastEventId": 0, "eventEpoch": EPOCH})
    text = "#permission k=prompt-1"
    h.http("prompt", T0 + 0.1, 200, {"promptId": PROMPT, "lastEventId": 0, "eventEpoch": EPOCH}, key="prompt-1", text=text)
    ids = itertools.count(1)
    t = itertools.count(1)

    def ev(event_type: str, data: dict[str, Any], prompt_id: str | None = None) -> None:
        event_id = next(ids)
        if skip_event_id and event_id == 3:
            event_id = next(ids)
            if announce_gap:
                h.control("r1", 1, T0 + 0.2, "history_truncated", {"reason": "trimmed", "eventEpoch": EPOCH})
        when = T0 + 0.2 + next(t) * 0.01
        envelope = h.event("r1", 1, when, event_id, event_type, data, prompt_id)
        if second_reader_misses and event_id == 1:  # the second stream silently stops after its first event
            h.add("sse", reader="r2", conn=1, sid=SID, t=when, id=event_id, type=event_type, data=envelope)

    ev("session_update", {"sessionId": SID, "update": {"sessionUpdate": "user_message_chunk",
                                                        "content": {"type": "text", "text": text}}}, PROMPT)
    ev("permission_request", {"requestId": RID, "sessionId": SID}, PROMPT)
    vote = {"outcome": {"outcome": "selected", "optionId": "proceed_once"}}
    h.http("vote", T0 + 0.3, 200, {}, key="vote-1", rid=RID, sent=vote)
    h.http("vote", T0 + 0.3, 404, {"error": "No pending permission request", "code": "request_not_found"},
           key="vote-2", rid=RID, sent=vote)
    if second_winner:
        h.http("vote", T0 + 0.3, 200, {}, key="vote-3", rid=RID, sent={"outcome": {"outcome": "cancelled"}})
    if resolved:
        ev("permission_resolved", {"requestId": RID, "outcome": vote["outcome"]}, PROMPT)
    else:
        ev("session_update", {"sessionId": SID, "update": {"sessionUpdate": "agent_message_chunk"}}, PROMPT)
    if restart_after_ack:
        h.add("fault", fault="redis_restart_empty", target=0, t_start=T0 + 1.0, t_end=T0 + 1.5, detail={})
    else:
        ev("turn_complete", {"sessionId": SID, "stopReason": "end_turn", "promptId": terminal_prompt}, terminal_prompt)
    if duplicate_terminal:
        ev("turn_error", {"sessionId": SID, "message": "closed", "promptId": PROMPT}, PROMPT)
    if faulted_owner:
        kind = faulted_owner if isinstance(faulted_owner, str) else "worker_kill9"
        h.add("fault", fault=kind, target=0, t_start=T0 + 0.15, t_end=T0 + 1.0, incarnations=[OWNER], detail={})
    end_t = T0 + 2.0
    if ending == "closed":
        h.http("delete", end_t, 204, None, key="delete-1", content_type="")
        ev("session_closed", {"sessionId": SID, "reason": "closed_by_client"})
    elif ending == "died":
        ev("session_died", {"sessionId": SID, "reason": "worker_lost"})
    h.close("r1", 1, end_t + 0.5)
    if second_reader_misses:  # open well past the delivery slack, and still nothing came
        h.close("r2", 1, end_t + chaos_check.DELIVERY_SLACK_S + 5)
    if ending:
        status = (200, {"sessionId": SID}) if zombie_status else (404, {"error": "gone", "code": "session_not_found"})
        h.add("http", id=999, chain="status-x", attempt=0, method="GET", route="status", path="/", api=1, sid=SID,
              rid=None, key=None, t_sent=end_t + status_after_s, t_answered=end_t + status_after_s + 0.01,
              status=status[0], body=status[1],
              content_type="application/json")
    if text_500:
        h.http("cancel", end_t + 1.2, 500, "Internal Server Error", key="cancel-1", content_type="text/plain; charset=utf-8")
    h.add("listing", t=end_t + 2, sids=[SID])
    h.add("keys", node=6390, t=end_t + 3, keys=[["acp:{ws}:cat", "hash", 60_000], ["acp:{ws}:ev:x", "stream", ttl]])
    h.add("end", t=end_t + 4)
    return h.records


def invariants(records: list[dict[str, Any]]) -> list[str]:
    report = chaos_check.check(records)
    return sorted(v["invariant"] + ": " + v["what"] for v in report.violations)


def test_a_clean_history_has_no_violations_and_runs_every_check() -> None:
    report = chaos_check.check(scenario())
    assert report.violations == []
    assert all(report.checks[k] > 0 for k in "abcdegh"), report.checks
    # An ending that is a death (not by a store outage): f checks it and passes.
    died = chaos_check.check(scenario(ending="died", faulted_owner=True))
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
    report = chaos_check.check(records)
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
    ended = chaos_check.History.of(scenario()).endings()[SID]  # the session_closed frame's sighting
    report = chaos_check.check(scenario(zombie_status=True, status_after_s=ended + 0.01 - (T0 + 2.0)))
    assert report.violations == []
    assert report.notes["c: read within the invalidation's delivery"] == 1


def test_d_an_acknowledged_prompt_without_a_terminal_is_a_violation() -> None:
    assert invariants(scenario(terminal_prompt="someone-else")) == ["d: acknowledged prompt without a terminal"]


def test_d_a_duplicate_terminal_is_a_violation() -> None:
    assert invariants(scenario(duplicate_terminal=True)) == ["d: duplicate terminals"]


def test_d_a_prompt_acknowledged_just_before_a_restart_empty_is_unverifiable() -> None:
    report = chaos_check.check(scenario(restart_after_ack=True))
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
    stopped one is (bench/chaos_network.py)."""
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
    report = chaos_check.check(prompt_run_then_answered_404(restart_between=True))
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
    report = chaos_check.check(records)
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
    """One session moved by a drain, as bench/chaos.py records it: created on OWNER (pid 1)
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
    report = chaos_check.check(moved_scenario())
    assert report.violations == []
    assert report.checks["i"] >= 3 and report.counts["moves"] == 1, (report.checks, report.counts)
    assert all(report.checks[k] > 0 for k in "abcdegi"), report.checks
    # The grace ended the running turn (worker_draining) before the move: its one terminal.
    stopped = chaos_check.check(moved_scenario(stop_for_drain=True))
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
    report = chaos_check.check(moved_scenario(owner_read_after=None))  # no read after it: cannot tell
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
    report = chaos_check.check(drained_close(other_live=False))
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
    report = chaos_check.check(with_agent(scenario()))
    assert report.violations == []
    # The write, the completed turn found in the history, the write's place in the file.
    assert report.checks["j"] == 3
    assert report.counts["agent history writes"] == 1 and report.counts["incarnations declared dead"] == 1
    # A write of an incarnation whose lease was never read, or that no incarnation sent, is
    # not taken for either.
    unknown = chaos_check.check(with_agent(scenario(), write(T0 + 0.25, inc="w9-9-ffff")))
    assert unknown.violations == [] and unknown.unverifiable["j: a write of an incarnation whose lease was never read"] == 1
    anonymous = chaos_check.check(with_agent(scenario(), write(T0 + 0.25, inc=None)))
    assert anonymous.violations == [] and anonymous.unverifiable["j: a write no incarnation sent"] == 1


def test_j_a_history_write_after_the_lease_ended_is_a_violation() -> None:
    """The issue's split brain: the worker stopped (SIGSTOP), its agent went on and wrote a
    turn to the shared history after a sweeper could declare the worker dead."""
    late = with_agent(scenario(ending="died", faulted_owner="worker_stop_alone"),
                      write(T0 + 0.25), write(DEADLINE + 0.4, "#slow 5 k=late", prior=1))
    report = chaos_check.check(late)
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
    held = chaos_check.check(with_agent(died, write(T0 + 0.25), told_worker_lost=True))
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
    report = chaos_check.check(records)
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
    """bench/chaos_history.py's LeaseWatch, on a real Redis: the registry's deadline of each
    incarnation when it first shows and whenever a renewal moves it (not at every read),
    and each tombstone once, with Redis's time of the read."""
    import asyncio

    import redis

    from acp_state.store import keys
    from bench.chaos_history import LeaseWatch

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
