"""The history checker of the chaos run: pure functions over the recorded history.

    python -m bench.chaos_check history.jsonl [--examples 5] [--json]

The history is JSON lines, one record each, in the order the run wrote them (`seq`). Kinds:

``meta``      {seed, minutes, cluster, lease_ms, schedule, workspace, ...}
``http``      one HTTP attempt: {id, chain, attempt, method, route, path, api, sid, rid, key,
              t_sent, t_answered, status (None: no answer), error (transport error class),
              content_type, body (JSON, or text), sent (the JSON body sent), text (prompt)}.
              `chain` groups the attempts of one logical request: the Idempotency-Key for
              mutating routes (retries keep it), a unique id otherwise.
``owner``     {sid, inc, t}: the `inc` field of the session hash read right after creation.
``sse_open``  {reader, conn, sid, api, t, last_event_id, epoch_hint, status}
``sse``       {reader, conn, sid, t, id, type, data}: one frame; `data` is the parsed JSON
              (the envelope for session events, which have an `id`; control frames have none).
``sse_close`` {reader, conn, sid, t, reason}
``worker``    {slot, pid, inc, t, event: started | incarnation | stopped}
``fault``     {fault, target, t_start, t_end, incarnations?, detail, planned}
``listing``   {t, sids}: every session id the workspace listing showed at the end.
``keys``      {node, t, keys: [[key, type, pttl], ...]}: the final TTL scan of one node.
``end``       {t}

Times are wall-clock seconds (time.time()) taken in the load process; event envelopes carry
the worker's `_meta.serverTimestamp` in ms (same machine).

Invariants (see `check()`): a one winner per vote, b event ids ordered and gaps announced,
c nothing visible after its death, d acknowledged prompts reach exactly one terminal,
e winning votes reach the agent, f no live session swept by a store outage, g unknown
outcomes are said and retries are consistent, h every `acp:` key has a TTL at the end.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable

INVARIANTS = {
    "a": "exactly one winner per vote",
    "b": "event ids strictly increasing per epoch on each SSE reader, every gap announced",
    "c": "no session visible after its death",
    "d": "every acknowledged prompt reaches exactly one terminal",
    "e": "every winning vote reaches the agent",
    "f": "no live session swept by a store outage",
    "g": "unknown outcomes are said; retries consistent with effects",
    "h": "every acp: key has a TTL at the end",
}

TERMINALS = ("turn_complete", "turn_error")
ENDINGS = ("session_died", "session_closed")
# Frames of one stream, not events of the session (a `history_truncated` may carry `id: 0`,
# which moves the client's resume point to a new epoch's start).
CONTROL_TYPES = ("session_snapshot", "state_resync_required", "history_truncated", "replay_complete")
VOTE_ROUTES = ("vote", "vote_legacy")
# Transport errors raised before the request could reach the server: nothing was done.
NOT_SENT_ERRORS = ("ConnectError", "ConnectTimeout", "PoolTimeout")
# How long before a restart-empty fault an acknowledged effect may be lost with the store.
LOST_WITH_STORE_S = 2.0
# How late the run may read a worker's log line that names a new incarnation.
INCARNATION_LOG_SLACK_S = 2.0
# How long an event may take from its worker to an open SSE stream before its absence counts.
DELIVERY_SLACK_S = 3.0
TAG = re.compile(r"\bk=([A-Za-z0-9._:-]{1,128})")


@dataclass
class Report:
    counts: dict[str, Any] = field(default_factory=dict)
    checks: Counter = field(default_factory=Counter)
    violations: list[dict[str, Any]] = field(default_factory=list)
    unverifiable: Counter = field(default_factory=Counter)
    notes: Counter = field(default_factory=Counter)

    def violation(self, invariant: str, what: str, **detail: Any) -> None:
        self.violations.append({"invariant": invariant, "what": what, **detail})

    def by_invariant(self) -> dict[str, int]:
        counted = Counter(v["invariant"] for v in self.violations)
        return {k: counted.get(k, 0) for k in INVARIANTS}

    def to_json(self, examples: int | None = None) -> dict[str, Any]:
        grouped: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for v in self.violations:
            grouped[v["invariant"]].append(v)
        kinds = {
            inv: dict(Counter(v["what"] for v in items)) for inv, items in sorted(grouped.items())
        }
        return {
            "counts": self.counts,
            "checks": {k: self.checks.get(k, 0) for k in INVARIANTS},
            "violations_total": len(self.violations),
            "violations_by_invariant": self.by_invariant(),
            "violation_kinds": kinds,
            "unverifiable": dict(self.unverifiable),
            "notes": dict(self.notes),
            "violations": {
                inv: (items if examples is None else items[:examples]) for inv, items in sorted(grouped.items())
            },
        }


# ---------------------------------------------------------------------------- reading


try:  # the project depends on orjson; plain json works too, slower
    import orjson

    def _loads(raw: bytes) -> Any:
        return orjson.loads(raw)

    def _canonical(value: Any) -> str:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS).decode()
except ImportError:  # pragma: no cover
    def _loads(raw: bytes) -> Any:
        return json.loads(raw)

    def _canonical(value: Any) -> str:
        return json.dumps(value, sort_keys=True, separators=(",", ":"))


def load(path: str) -> list[dict[str, Any]]:
    with open(path, "rb") as f:
        return [_loads(line) for line in f if line.strip()]


def _sorted(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(records, key=lambda r: r.get("seq", 0))


def envelope_prompt_id(env: dict[str, Any]) -> str | None:
    data = env.get("data") if isinstance(env.get("data"), dict) else {}
    return env.get("promptId") or data.get("promptId")


def envelope_key(sid: str, env: dict[str, Any]) -> str:
    """The identity of one event: the same envelope replayed or delivered live compares equal."""
    return sid + "|" + _canonical(env)


def _code(record: dict[str, Any]) -> str | None:
    body = record.get("body")
    return body.get("code") if isinstance(body, dict) else None


def is_unknown(record: dict[str, Any]) -> bool:
    """An answer that leaves the outcome unknown: 503 outcome_unknown, or a transport error
    after the request may have reached the server."""
    if record.get("status") is None:
        return record.get("error") not in NOT_SENT_ERRORS
    return record["status"] == 503 and _code(record) == "outcome_unknown"


def is_definite(record: dict[str, Any]) -> bool:
    status = record.get("status")
    if status is None or is_unknown(record):
        return False
    return not (status == 503 and _code(record) in ("store_unavailable", "store_full"))


@dataclass
class History:
    """Indexes over the records that every invariant uses."""

    records: list[dict[str, Any]]
    http: list[dict[str, Any]] = field(default_factory=list)
    chains: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    frames: list[dict[str, Any]] = field(default_factory=list)
    events: dict[str, dict[str, Any]] = field(default_factory=dict)  # identity -> first sighting
    faults: list[dict[str, Any]] = field(default_factory=list)
    owners: dict[str, str | None] = field(default_factory=dict)

    @classmethod
    def of(cls, records: list[dict[str, Any]]) -> History:
        h = cls(_sorted(records))
        chains: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for r in h.records:
            kind = r.get("kind")
            if kind == "http":
                h.http.append(r)
                chains[r.get("chain") or f"#{r.get('id')}"].append(r)
            elif kind in ("sse_open", "sse", "sse_close"):
                h.frames.append(r)
                if (
                    kind == "sse" and r.get("id") is not None and isinstance(r.get("data"), dict)
                    and r.get("type") not in CONTROL_TYPES
                ):
                    key = envelope_key(r["sid"], r["data"])
                    if key not in h.events:
                        h.events[key] = {"sid": r["sid"], "env": r["data"], "t": r["t"], "reader": r.get("reader")}
            elif kind == "fault":
                h.faults.append(r)
            elif kind == "owner":
                if r.get("inc") or r["sid"] not in h.owners:
                    h.owners[r["sid"]] = r.get("inc")
        h.chains = dict(chains)
        return h

    def final(self, chain: list[dict[str, Any]]) -> dict[str, Any]:
        return chain[-1]

    def events_of_type(self, *types: str) -> list[dict[str, Any]]:
        return [e for e in self.events.values() if e["env"].get("type") in types]

    def restart_windows(self) -> list[tuple[float, float]]:
        """When acknowledged writes may have gone with the store's data: a Redis restarted
        empty, or on a cluster a master replaced by its replica before it had replicated
        them (killed, or stalled past the cluster's node timeout): Redis replicates
        asynchronously, so the newest writes of a master that stops are not on its replica."""
        return [
            (f["t_start"] - LOST_WITH_STORE_S, f.get("t_end") or f["t_start"])
            for f in self.faults
            if f.get("fault") == "redis_restart_empty" or self._fails_a_master_over(f)
        ]

    def _fails_a_master_over(self, fault: dict[str, Any]) -> bool:
        if fault.get("fault") == "cluster_failover":
            return True
        meta = next((r for r in self.records if r.get("kind") == "meta"), {})
        node_timeout_ms = meta.get("node_timeout_ms")
        sleep_s = (fault.get("planned") or {}).get("params", {}).get("sleep_s")
        return (
            bool(meta.get("cluster")) and node_timeout_ms is not None and sleep_s is not None
            and fault.get("fault", "").startswith("redis_sleep") and sleep_s * 1000 > node_timeout_ms
        )

    def lost_with_store(self, t: float | None) -> bool:
        return t is not None and any(lo <= t <= hi for lo, hi in self.restart_windows())

    def endings(self) -> dict[str, float]:
        """The checker's earliest observation of each session's end: a session_died or
        session_closed frame received, or a 204 answer to DELETE."""
        ended: dict[str, float] = {}
        for r in self.frames:
            if r["kind"] == "sse" and r.get("type") in ENDINGS and r.get("id") is not None:
                ended[r["sid"]] = min(ended.get(r["sid"], r["t"]), r["t"])
        for r in self.http:
            if r.get("route") == "delete" and r.get("status") == 204 and r.get("t_answered") is not None:
                ended[r["sid"]] = min(ended.get(r["sid"], r["t_answered"]), r["t_answered"])
        return ended


# ---------------------------------------------------------------------------- invariants


def check_a_one_winner(h: History, report: Report) -> None:
    """At most one vote answered 200 per requestId among different Idempotency-Keys."""
    winners: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    voted: set[str] = set()
    for r in h.http:
        if r.get("route") not in VOTE_ROUTES or not r.get("rid"):
            continue
        voted.add(r["rid"])
        if r.get("status") == 200:
            winners[r["rid"]].setdefault(r.get("key") or r["chain"], r)
    for rid in sorted(voted):
        report.checks["a"] += 1
        keys = winners.get(rid, {})
        if len(keys) > 1 and _later_winners_follow_a_loss(h, list(keys.values())):
            # Each earlier winner was answered just before Redis restarted empty and the next
            # one after: the earlier vote's effect went with the store's data.
            report.unverifiable["a: an earlier winner lost with the store"] += 1
        elif len(keys) > 1:
            report.violation(
                "a", "several winners", requestId=rid, sessionId=next(iter(keys.values())).get("sid"),
                winners=[{"key": k, "api": r.get("api"), "route": r.get("route"), "sent": r.get("sent"),
                          "t_answered": r.get("t_answered")} for k, r in keys.items()],
            )


def _later_winners_follow_a_loss(h: History, winners: list[dict[str, Any]]) -> bool:
    answered = sorted(r.get("t_answered") or 0.0 for r in winners)
    return all(
        any(lo <= earlier <= hi and later >= hi for lo, hi in h.restart_windows())
        for earlier, later in zip(answered, answered[1:])
    )


def check_b_event_order(h: History, report: Report) -> None:
    """Per reader (across its connections): ids strictly increase from the position the
    connection declared (Last-Event-ID, or the snapshot's lastEventId), and any jump is
    preceded by `history_truncated`. Across readers: within one (session, epoch) an id names
    one event, and one event belongs to one epoch."""
    by_reader: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in h.frames:
        by_reader[r["reader"]].append(r)
    seen_at: dict[tuple[str, str, int], tuple[str, str]] = {}  # (sid, epoch, id) -> (identity, reader)
    epochs_of: dict[str, dict[str, str]] = defaultdict(dict)  # identity -> epoch -> reader
    for reader, frames in by_reader.items():
        last: int | None = None
        epoch: str | None = None
        truncated = False
        same_epoch_reset = False
        for r in frames:
            if r["kind"] == "sse_open":
                last = r.get("last_event_id")
                epoch = r.get("epoch_hint") or None
                truncated = same_epoch_reset = False
                continue
            if r["kind"] != "sse":
                continue
            data = r.get("data") if isinstance(r.get("data"), dict) else {}
            payload = data.get("data") if isinstance(data.get("data"), dict) else {}
            if r.get("type") == "session_snapshot" and r.get("id") is None:
                last = payload.get("lastEventId", last)
                epoch = payload.get("eventEpoch") or epoch
                truncated = False
                continue
            if r.get("type") == "history_truncated" and r.get("id") in (None, 0):
                new_epoch = payload.get("eventEpoch") or None
                reason = payload.get("reason")
                if reason == "unknown_event_id" and new_epoch is not None and new_epoch == epoch:
                    same_epoch_reset = True  # the ids of this epoch went back (lost writes)
                elif reason in ("epoch_changed", "unknown_event_id") or new_epoch != epoch:
                    last = None  # another epoch (or an unknown one): ids start over
                if r.get("id") == 0:
                    last = 0  # the stream moved the client's resume point to the epoch's start
                epoch = new_epoch
                truncated = True
                continue
            event_id = r.get("id")
            if event_id is None:
                continue
            report.checks["b"] += 1
            if last is not None:
                if event_id <= last and same_epoch_reset:
                    report.violation(
                        "b", "ids went back within one epoch (announced as unknown_event_id)", reader=reader,
                        sessionId=r["sid"], conn=r.get("conn"), previous=last, id=event_id, epoch=epoch,
                    )
                    last = None
                elif event_id <= last:
                    report.violation(
                        "b", "id not increasing", reader=reader, sessionId=r["sid"], conn=r.get("conn"),
                        previous=last, id=event_id, type=r.get("type"), epoch=epoch,
                    )
                elif event_id > last + 1 and not truncated:
                    report.violation(
                        "b", "unannounced gap", reader=reader, sessionId=r["sid"], conn=r.get("conn"),
                        previous=last, id=event_id, type=r.get("type"), epoch=epoch,
                    )
            last = event_id if last is None else max(last, event_id)
            truncated = same_epoch_reset = False
            if epoch:
                identity = envelope_key(r["sid"], data)
                slot = (r["sid"], epoch, event_id)
                other = seen_at.setdefault(slot, (identity, reader))
                if other[0] != identity:
                    report.violation(
                        "b", "two events with one id in one epoch", sessionId=r["sid"], epoch=epoch, id=event_id,
                        readers=[other[1], reader], types=[json.loads(other[0].split("|", 1)[1]).get("type"), r.get("type")],
                    )
                    seen_at[slot] = (identity, reader)
                epochs_of[identity][epoch] = reader
    _check_b_complete(h, report, by_reader)
    for identity, epochs in epochs_of.items():
        if len(epochs) > 1:
            sid, env = identity.split("|", 1)
            report.violation(
                "b", "one event seen under two epochs (an unannounced epoch change)", sessionId=sid,
                id=json.loads(env).get("id"), type=json.loads(env).get("type"), epochs=epochs,
            )


def _server_time(env: dict[str, Any]) -> float | None:
    meta = env.get("_meta") if isinstance(env.get("_meta"), dict) else {}
    ts = meta.get("serverTimestamp")
    return ts / 1000 if isinstance(ts, (int, float)) else None


def _check_b_complete(h: History, report: Report, by_reader: dict[str, list[dict[str, Any]]]) -> None:
    """No silent loss on an open stream: an event of the session made (serverTimestamp)
    while one of the reader's connections was open, more than DELIVERY_SLACK_S before that
    connection closed, reaches the reader (on that or a later connection), unless the
    reader was told of lost history (`history_truncated`) after it was made. This catches
    what ids alone cannot: a stream that keeps the old epoch's cursor and drops the new
    epoch's events."""
    per_sid: dict[str, list[tuple[float, str, dict[str, Any]]]] = defaultdict(list)
    for identity, e in h.events.items():
        ts = _server_time(e["env"])
        if ts is not None and e["env"].get("type") not in CONTROL_TYPES:
            per_sid[e["sid"]].append((ts, identity, e["env"]))
    for reader, frames in by_reader.items():
        if reader.startswith("final-") or not frames:
            continue
        sid = frames[0]["sid"]
        received: set[str] = set()
        truncations: list[float] = []
        opened: dict[Any, float] = {}
        intervals: list[tuple[float, float]] = []
        last_t = frames[-1]["t"]
        for r in frames:
            if r["kind"] == "sse_open" and r.get("status") == 200:
                opened[r.get("conn")] = r["t"]
            elif r["kind"] == "sse_close" and r.get("conn") in opened:
                intervals.append((opened.pop(r.get("conn")), r["t"]))
            elif r["kind"] == "sse":
                if r.get("id") is not None and isinstance(r.get("data"), dict):
                    received.add(envelope_key(sid, r["data"]))
                elif r.get("type") == "history_truncated":
                    truncations.append(r["t"])
        intervals += [(t, last_t) for t in opened.values()]
        missed = []
        for ts, identity, env in per_sid.get(sid, []):
            report.checks["b"] += 1
            if identity in received:
                continue
            if not any(start < ts < end - DELIVERY_SLACK_S for start, end in intervals):
                continue
            if any(t >= ts for t in truncations):
                continue
            missed.append({"id": env.get("id"), "type": env.get("type"), "serverTime": ts})
        if missed:
            report.violation(
                "b", "events made while the stream was open never reached it", reader=reader, sessionId=sid,
                missed=len(missed), first=missed[:3],
                connections=[[round(a, 3), round(b, 3)] for a, b in intervals],
            )


# Each API process caches status and drops an entry when the session's change reaches it
# over pub/sub. A read that another process serves a moment after the change can be that
# moment late: bounded staleness, counted apart (with the largest lag seen), never a zombie.
CROSS_PROCESS_LAG_S = 0.05


def check_c_no_zombies(h: History, report: Report) -> None:
    """A status read sent after the session's death was observed must not answer 200
    (beyond the invalidation's delivery, CROSS_PROCESS_LAG_S)."""
    ended = h.endings()
    for r in h.http:
        if r.get("route") != "status" or r.get("sid") not in ended:
            continue
        if r["t_sent"] <= ended[r["sid"]]:
            continue
        report.checks["c"] += 1
        lag = r["t_sent"] - ended[r["sid"]]
        if r.get("status") == 200 and lag <= CROSS_PROCESS_LAG_S:
            report.notes["c: read within the invalidation's delivery"] += 1
            report.notes["c: largest such lag, ms"] = max(report.notes.get("c: largest such lag, ms", 0), round(lag * 1000, 3))
        elif r.get("status") == 200:
            report.violation(
                "c", "status 200 after the session ended", sessionId=r["sid"], api=r.get("api"),
                ended_at=ended[r["sid"]], sent_at=r["t_sent"], after_s=round(r["t_sent"] - ended[r["sid"]], 3),
                body=r.get("body"),
            )


def _prompt_chains(h: History) -> list[tuple[str, list[dict[str, Any]]]]:
    return [(key, chain) for key, chain in h.chains.items() if chain[0].get("route") == "prompt"]


def acknowledged_prompts(h: History) -> dict[str, dict[str, Any]]:
    """promptId -> the final answer that acknowledged it (2xx with a promptId)."""
    acked: dict[str, dict[str, Any]] = {}
    for _, chain in _prompt_chains(h):
        for r in chain:  # a retry with the same key may repeat the first answer
            status, body = r.get("status"), r.get("body")
            if status is not None and 200 <= status < 300 and isinstance(body, dict) and body.get("promptId"):
                acked.setdefault(body["promptId"], r)
    return acked


def check_d_prompt_terminals(h: History, report: Report) -> None:
    """Every acknowledged prompt reaches exactly one terminal (turn_complete / turn_error);
    no promptId has two. Missing terminals of prompts acknowledged within 2 s before a
    restart-empty fault are 'unverifiable: lost with the store'."""
    terminals: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in h.events_of_type(*TERMINALS):
        pid = envelope_prompt_id(e["env"])
        if pid:
            terminals[pid].append(e)
    acked = acknowledged_prompts(h)
    ended = h.endings()
    for pid, answer in acked.items():
        report.checks["d"] += 1
        found = terminals.get(pid, [])
        if len(found) == 1:
            continue
        if not found:
            if h.lost_with_store(answer.get("t_answered")):
                report.unverifiable["d: lost with the store"] += 1
                continue
            report.violation(
                "d", "acknowledged prompt without a terminal", promptId=pid, sessionId=answer.get("sid"),
                text=answer.get("text"), acknowledged_at=answer.get("t_answered"),
                session_ended=answer.get("sid") in ended,
            )
    for pid, found in terminals.items():
        if len(found) > 1:
            report.violation(
                "d", "duplicate terminals", promptId=pid, sessionId=found[0]["sid"],
                terminals=[{"id": e["env"].get("id"), "type": e["env"].get("type"), "reader": e["reader"]} for e in found],
            )
    report.notes["terminals without an acknowledged prompt"] = sum(1 for pid in terminals if pid not in acked)


def _vote_outcome(record: dict[str, Any]) -> Any:
    sent = record.get("sent")
    return sent.get("outcome") if isinstance(sent, dict) else None


def check_e_votes_reach_agent(h: History, report: Report) -> None:
    """A vote answered 200 is followed by permission_resolved for its requestId with the
    winner's outcome, or by the session's end."""
    resolved: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in h.events_of_type("permission_resolved"):
        data = e["env"].get("data") or {}
        if data.get("requestId"):
            resolved[data["requestId"]].append(e)
    ended = h.endings()
    cancels: dict[str, list[float]] = defaultdict(list)
    for r in h.http:
        if r.get("route") == "cancel" and r.get("sid"):
            cancels[r["sid"]].append(r["t_sent"])
    winners: dict[str, dict[str, Any]] = {}
    for r in h.http:
        if r.get("route") in VOTE_ROUTES and r.get("status") == 200 and r.get("rid"):
            winners.setdefault(r["rid"], r)
    for rid, vote in winners.items():
        report.checks["e"] += 1
        outcome = _vote_outcome(vote)
        found = resolved.get(rid, [])
        if any((e["env"].get("data") or {}).get("outcome") == outcome for e in found):
            continue
        if vote.get("sid") in ended:
            report.notes["e: resolved by the session's end"] += 1
            continue
        if found and any(t <= (vote.get("t_answered") or 0) for t in cancels.get(vote.get("sid"), [])):
            report.notes["e: superseded by a cancel sent before the vote was answered"] += 1
            continue
        if h.lost_with_store(vote.get("t_answered")):
            report.unverifiable["e: lost with the store"] += 1
            continue
        report.violation(
            "e", "winning vote never reached the agent" if not found else "resolved with another outcome",
            requestId=rid, sessionId=vote.get("sid"), outcome=outcome,
            resolved=[(e["env"].get("data") or {}).get("outcome") for e in found], answered_at=vote.get("t_answered"),
        )


def check_f_no_outage_sweeps(h: History, report: Report) -> None:
    """session_died{worker_lost} only for sessions whose owner incarnation was kill -9'd or
    SIGSTOPped."""
    # incarnation -> when its process was first killed or stopped. An incarnation belongs to
    # the process that logged it (worker records), so one adopted just before the fault
    # counts too even if the fault record could not name it yet.
    adopted = {
        r["inc"]: (r.get("pid"), r["t"]) for r in h.records
        if r.get("kind") == "worker" and r.get("inc") and r.get("event") in ("started", "incarnation")
    }
    faulted: dict[str, float] = {}
    for f in h.faults:
        if f.get("fault") not in ("worker_kill9", "worker_stop"):
            continue
        named = set(f.get("incarnations") or [])
        named |= {
            inc for inc, (pid, t) in adopted.items()
            if pid is not None and pid == f.get("pid") and t <= (f.get("t_end") or f["t_start"]) + INCARNATION_LOG_SLACK_S
        }
        for inc in named:
            faulted[inc] = min(faulted.get(inc, f["t_start"]), f["t_start"])
    for e in h.events_of_type("session_died"):
        data = e["env"].get("data") or {}
        if data.get("reason") != "worker_lost":
            continue
        report.checks["f"] += 1
        owner = h.owners.get(e["sid"])
        if owner is None:
            report.unverifiable["f: owner unknown"] += 1
            continue
        died_at = min(t for t in (_server_time(e["env"]), e["t"]) if t is not None)
        if owner not in faulted:
            report.violation(
                "f", "live session swept (worker_lost) though its worker was never killed or stopped",
                sessionId=e["sid"], owner=owner, eventId=e["env"].get("id"), died_at=died_at,
            )
        elif faulted[owner] > died_at:
            report.violation(
                "f", "live session swept (worker_lost) before its worker was killed or stopped",
                sessionId=e["sid"], owner=owner, eventId=e["env"].get("id"), died_at=died_at,
                worker_fault_at=faulted[owner],
            )


def _effect_tags(h: History) -> dict[str, set[str]]:
    """Idempotency key (the `k=` tag in the prompt text) -> promptIds the events show for it."""
    tags: dict[str, set[str]] = defaultdict(set)
    for e in h.events.values():
        env = e["env"]
        data = env.get("data") or {}
        text = None
        if env.get("type") == "session_update":
            update = data.get("update") or {}
            if update.get("sessionUpdate") == "user_message_chunk":
                content = update.get("content") or {}
                text = content.get("text") if isinstance(content, dict) else None
        elif env.get("type") in ("pending_prompt_added", "pending_prompt_started"):
            text = data.get("text")
        pid = envelope_prompt_id(env)
        if isinstance(text, str) and pid:
            for tag in TAG.findall(text):
                tags[tag].add(pid)
    return tags


def check_g_outcomes(h: History, report: Report) -> None:
    """Errors are JSON with a `code`; an unknown outcome is resolved by retrying with the same
    key; the definite answer agrees with the effects observed."""
    for r in h.http:
        status = r.get("status")
        if status is None or status < 400:
            continue
        report.checks["g"] += 1
        body = r.get("body")
        is_json = str(r.get("content_type") or "").startswith("application/json") and isinstance(body, dict)
        if not (is_json and isinstance(body.get("code"), str)):
            report.violation(
                "g", f"{status} {'JSON error without a code' if is_json else 'error that is not JSON'}", route=r.get("route"), status=status, api=r.get("api"),
                content_type=r.get("content_type"), body=body if isinstance(body, dict) else str(body)[:200],
            )
    unresolved_creates = 0
    for key, chain in h.chains.items():
        route = chain[0].get("route")
        if not chain[0].get("key"):
            continue
        final = chain[-1]
        if any(is_unknown(r) for r in chain):
            report.checks["g"] += 1
            if not is_definite(final):
                if route == "create":
                    unresolved_creates += 1
                report.violation(
                    "g", "outcome still unknown after retries with the same key", route=route, key=key,
                    sessionId=final.get("sid"), attempts=len(chain), last_status=final.get("status"),
                    last_error=final.get("error"), last_code=_code(final),
                )
    # Prompts: the effects the events show for a key agree with the answer given for it.
    tags = _effect_tags(h)
    for key, chain in _prompt_chains(h):
        report.checks["g"] += 1
        final = chain[-1]
        effects = tags.get(key, set())
        answered = {
            r["body"]["promptId"] for r in chain
            if r.get("status") is not None and 200 <= r["status"] < 300 and isinstance(r.get("body"), dict)
            and r["body"].get("promptId")
        }
        if len(effects) > 1:
            report.violation(
                "g", "one idempotency key ran several prompts", key=key, sessionId=final.get("sid"),
                promptIds=sorted(effects), answered=sorted(answered), attempts=len(chain),
            )
        elif effects and not answered and is_definite(final):
            report.violation(
                "g", "prompt ran although its definite answer said it was not taken", key=key,
                sessionId=final.get("sid"), promptIds=sorted(effects), status=final.get("status"),
                code=_code(final), attempts=len(chain),
            )
        elif effects and answered and not effects <= answered:
            report.violation(
                "g", "answer names another prompt than the one that ran", key=key, sessionId=final.get("sid"),
                promptIds=sorted(effects), answered=sorted(answered),
            )
    # Creates: every session the workspace lists was named by some create answer.
    created = {
        r["body"]["sessionId"] for r in h.http
        if r.get("route") == "create" and r.get("status") == 200 and isinstance(r.get("body"), dict)
        and r["body"].get("sessionId")
    }
    listed: set[str] = set()
    for r in h.records:
        if r.get("kind") == "listing":
            listed.update(r.get("sids") or [])
    if listed:
        for sid in sorted(listed - created):
            report.checks["g"] += 1
            if unresolved_creates:
                report.unverifiable["g: listed session of an unresolved create"] += 1
                continue
            report.violation("g", "session created without an acknowledged create", sessionId=sid)
        report.checks["g"] += len(listed & created)
    # Deletes: a close that happened is not answered 404 to the key that asked for it.
    closed_by_client: set[str] = set()
    for e in h.events_of_type("session_closed"):
        if (e["env"].get("data") or {}).get("reason") == "closed_by_client":
            closed_by_client.add(e["sid"])
    deletes: dict[str, list[list[dict[str, Any]]]] = defaultdict(list)
    for key, chain in h.chains.items():
        if chain[0].get("route") == "delete" and chain[0].get("key"):
            deletes[chain[0].get("sid")].append(chain)
    for sid, chains in deletes.items():
        report.checks["g"] += 1
        if sid not in closed_by_client or any(c[-1].get("status") == 204 for c in chains):
            continue
        lost = [c for c in chains if any(is_unknown(r) for r in c) and c[-1].get("status") == 404]
        # A store that restarted empty between the first try and the retry took the kept
        # outcome with it: that retry cannot know.
        forgotten = [c for c in lost if any(c[0]["t_sent"] <= hi and c[-1]["t_sent"] >= lo for lo, hi in h.restart_windows())]
        if forgotten:
            report.unverifiable["g: kept outcome lost with the store"] += len(forgotten)
            lost = [c for c in lost if c not in forgotten]
        if lost:
            report.violation(
                "g", "session closed by a delete whose retry was answered 404", sessionId=sid,
                key=lost[0][0].get("key"), attempts=[r.get("status") or r.get("error") for r in lost[0]],
            )


def check_h_ttls(h: History, report: Report) -> None:
    """Every `acp:` key left at the end has a TTL."""
    scanned = 0
    for r in h.records:
        if r.get("kind") != "keys":
            continue
        for key, key_type, pttl in r.get("keys") or []:
            scanned += 1
            report.checks["h"] += 1
            if pttl is not None and pttl < 0 and pttl != -2:
                report.violation("h", "key without a TTL", key=key, type=key_type, node=r.get("node"))
    report.counts["keys scanned"] = scanned


CHECKS = (
    check_a_one_winner,
    check_b_event_order,
    check_c_no_zombies,
    check_d_prompt_terminals,
    check_e_votes_reach_agent,
    check_f_no_outage_sweeps,
    check_g_outcomes,
    check_h_ttls,
)


def check(records: list[dict[str, Any]]) -> Report:
    """Run every invariant over the history; the report lists checks and violations."""
    h = History.of(records)
    report = Report()
    report.counts.update({
        "requests": len(h.http),
        "logical requests": len(h.chains),
        "requests by route and status": dict(sorted(Counter(
            f"{r.get('route')} {r.get('status') if r.get('status') is not None else r.get('error')}" for r in h.http
        ).items())),
        "sse frames": sum(1 for r in h.frames if r["kind"] == "sse"),
        "sse connections": sum(1 for r in h.frames if r["kind"] == "sse_open"),
        "distinct events": len(h.events),
        "faults": len(h.faults),
        "faults by kind": dict(Counter(f.get("fault") for f in h.faults)),
        "sessions": len({r["sid"] for r in h.http if r.get("route") == "create" and r.get("sid")}),
    })
    for run in CHECKS:
        run(h, report)
    return report


def render(report: Report, examples: int = 3) -> str:
    out = report.to_json(examples)
    lines = ["chaos history check"]
    counts = out["counts"]
    lines.append(
        f"  requests {counts.get('requests')} ({counts.get('logical requests')} logical), "
        f"SSE frames {counts.get('sse frames')} on {counts.get('sse connections')} connections, "
        f"distinct events {counts.get('distinct events')}, faults {counts.get('faults')} {counts.get('faults by kind')}"
    )
    lines.append("  invariant                                                       checks  violations")
    for inv, title in INVARIANTS.items():
        lines.append(f"  {inv} {title:<62}{out['checks'][inv]:>7}  {out['violations_by_invariant'][inv]:>10}")
    if out["unverifiable"]:
        lines.append(f"  unverifiable: {out['unverifiable']}")
    if out["notes"]:
        lines.append(f"  notes: {out['notes']}")
    for inv, items in out["violations"].items():
        lines.append(f"  {inv}: {out['violation_kinds'][inv]}")
        for item in items:
            lines.append("    " + json.dumps(item, default=str)[:600])
    lines.append(f"  violations: {out['violations_total']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Check a chaos run's history against the invariants.")
    parser.add_argument("history", help="the history JSONL the chaos run wrote")
    parser.add_argument("--examples", type=int, default=3, help="violations shown per invariant")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    report = check(load(args.history))
    if args.json:
        print(json.dumps(report.to_json(args.examples), indent=2, default=str))
    else:
        print(render(report, args.examples))
    return 1 if report.violations else 0


if __name__ == "__main__":
    sys.exit(main())
