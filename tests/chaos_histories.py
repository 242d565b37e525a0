"""Hand-made chaos histories for the checker's tests (tests/test_chaos_check*.py): a clean
scenario recorded the way bench/chaos/run.py records a run, to which each test adds its fault."""

from __future__ import annotations

import itertools
from typing import Any

from bench.chaos import checker

SID = "11111111-1111-4111-8111-111111111111"
PROMPT = "p-1"
RID = "r-1"
EPOCH = "e1"
OWNER = "w0-1-aaaa"
T0 = 1_000_000.0


class History:
    """Builds a history the way bench/chaos/run.py records one (same record kinds and fields)."""

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
        h.close("r2", 1, end_t + checker.DELIVERY_SLACK_S + 5)
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
    report = checker.check(records)
    return sorted(v["invariant"] + ": " + v["what"] for v in report.violations)
