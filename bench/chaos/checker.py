"""The history checker of the chaos run: pure functions over the recorded history.

    python -m bench.chaos.checker history.jsonl [--examples 5] [--json]

The history is JSON lines, one record each, in the order the run wrote them (`seq`). Kinds:

``meta``      {seed, minutes, cluster, lease_ms, schedule, workspace, ...}
``http``      one HTTP attempt: {id, chain, attempt, method, route, path, api, sid, rid, key,
              t_sent, t_answered, status (None: no answer), error (transport error class),
              content_type, body (JSON, or text), sent (the JSON body sent), text (prompt)}.
              `chain` groups the attempts of one logical request: the Idempotency-Key for
              mutating routes (retries keep it), a unique id otherwise.
``owner``     {sid, inc, t, t_sent?, last_id?, epoch?, why?}: the session hash's `inc` (its owner),
              read right after creation (`why: created`), after a reader saw `session_moved`
              (`moved`) and after each drain (`drained`); `last_id` and `epoch` (its last event
              id and event epoch, read in the same HMGET) place that owner in the session's log.
``sse_open``  {reader, conn, sid, api, t, last_event_id, epoch_hint, status}
``sse``       {reader, conn, sid, t, id, type, data}: one frame; `data` is the parsed JSON
              (the envelope for session events, which have an `id`; control frames have none).
``sse_close`` {reader, conn, sid, t, reason}
``worker``    {slot, pid, inc, t, event: started | incarnation | stopped | sigterm | drain}:
              `sigterm` (and `drain`: `acp-state drain` told it) with the process's
              `incarnations` so far; `stopped` with its exit `code`.
``fault``     {fault, target, t_start, t_end, incarnations?, pid?, detail, planned}; for a
              `worker_drain`, t_start is when it was told to drain and `detail` has
              `grace_s`, `via` (sigterm | cli), `replacement`, `exit`, `killed_at` (if it had
              to be killed).
``lease``     {inc, deadline, redis_ms, t}: the registry's deadline of an incarnation changed
              (its last accepted renewal + its lease, epoch ms of Redis's clock), read by the
              run's lease watch every twelfth of a lease.
``lease_dead`` {inc, at, redis_ms, t}: the incarnation showed among the tombstones; `at` is
              when it was declared dead (epoch ms, Redis's clock).
``agent_write`` {sid, inc, t, end, prior, pid, text}: one turn the scripted agent wrote to the
              session's shared history (its `writes.log`, read at the end): the incarnation
              that sent the turn, the wall-clock time right after the write, the file's size
              after it, the turns the writing process knew of before it, the prompt text.
``agent_history`` {sid, size, texts}: a session's history as left at the end (what a resume
              replays): the file's size and its turns' prompt texts.
``listing``   {t, sids}: every session id the workspace listing showed at the end.
``keys``      {node, t, keys: [[key, type, pttl], ...]}: the final TTL scan of one node.
``end``       {t}

Times are wall-clock seconds (time.time()) taken in the load process; event envelopes carry
the worker's `_meta.serverTimestamp` in ms (same machine).

Invariants (see `check()`): a one winner per vote, b event ids ordered and gaps announced,
c nothing visible after its death, d acknowledged prompts reach exactly one terminal,
e winning votes reach the agent, f no live session swept by a store outage, g unknown
outcomes are said and retries are consistent, h every `acp:` key has a TTL at the end,
i a drain moves sessions (the old owner writes nothing after a move; drain stops and
closes only where they must happen), j dead stays dead down to the agent (no history write
of an incarnation after a sweeper may declare it dead; a resumed conversation holds no turn
told `worker_lost` and loses none of the resumer's).

A move (`session_moved`, written by the new owner in the step that makes it the owner) is
not an end: the session keeps its id, its log and its epoch, and its owner changes there.
The owner of each stretch of a session's log between moves is read from the `owner`
records, and every invariant that ties an event to an owner (f, i) uses the owner of the
stretch the event is in.
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
    "i": "a move hands a session over whole; drains stop and close only where they must",
    "j": "dead stays dead down to the agent: no history write past the lease",
}

# Faults that stop a worker from reaching Redis for a while: SIGSTOP (of the worker alone
# for `worker_stop_alone`: its agents run on, to be stopped by its fence), and across hosts
# (bench/chaos/network.py) a cut of the worker's host from Redis. Past its lease either one
# is declared dead: its sessions may die `worker_lost`, as a killed worker's do.
STOPPING = ("worker_stop", "worker_stop_alone", "host_partition", "host_partition_oneway", "half_open", "link_down")
TERMINALS = ("turn_complete", "turn_error")
ENDINGS = ("session_died", "session_closed")
# A drain handed the session to another worker: not an end (worker/move.py).
MOVED = "session_moved"
# The `turn_error` code of a turn a drain's grace ended, and the close reason of a session a
# stopping worker could not hand over.
DRAINING = "worker_draining"
SHUTDOWN = "worker_shutdown"
# Events that start a turn on the worker that runs it (a queued prompt's
# `pending_prompt_added` is said where it was admitted, possibly before a move).
TURN_STARTS = ("pending_prompt_started",)
# How long another worker must have been live (and not draining) during a drain's grace for
# the drained worker's sessions to have had a target (it looks again every 0.25 s).
TARGET_LIVE_S = 1.0
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
    owners: dict[str, str | None] = field(default_factory=dict)  # the owner read after the create
    owner_reads: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    moves: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # sid -> session_moved sightings
    workers: list[dict[str, Any]] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

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
                h.owner_reads.setdefault(r["sid"], []).append(r)
                if r.get("why", "created") == "created" and (r.get("inc") or r["sid"] not in h.owners):
                    h.owners[r["sid"]] = r.get("inc")
            elif kind == "worker":
                h.workers.append(r)
            elif kind == "meta" and not h.meta:
                h.meta = r
        h.chains = dict(chains)
        h._track_epochs()
        for e in h.events.values():
            if e["env"].get("type") == MOVED:
                h.moves.setdefault(e["sid"], []).append(e)
        for found in h.moves.values():
            found.sort(key=lambda e: (_server_time(e["env"]) or e["t"], e["env"].get("id") or 0))
        return h

    # ---- epochs, owners and worker processes ---------------------------------------------

    def epoch_walk(self) -> dict[str, list[tuple[dict[str, Any], str | None]]]:
        """Each reader's session-event frames, with the event epoch its reader knew for
        each (from the connection's hint, the snapshot, `history_truncated`: as b reads it)."""
        walked: dict[str, list[tuple[dict[str, Any], str | None]]] = defaultdict(list)
        epoch_by_reader: dict[str, str | None] = {}
        for r in self.frames:
            reader = r["reader"]
            if r["kind"] == "sse_open":
                epoch_by_reader[reader] = r.get("epoch_hint") or None
                continue
            if r["kind"] != "sse":
                continue
            data = r.get("data") if isinstance(r.get("data"), dict) else {}
            payload = data.get("data") if isinstance(data.get("data"), dict) else {}
            if r.get("type") == "session_snapshot" and r.get("id") is None:
                epoch_by_reader[reader] = payload.get("eventEpoch") or epoch_by_reader.get(reader)
                continue
            if r.get("type") == "history_truncated" and r.get("id") in (None, 0):
                epoch_by_reader[reader] = payload.get("eventEpoch") or None
                continue
            if r.get("id") is None or r.get("type") in CONTROL_TYPES or not data:
                continue
            walked[reader].append((r, epoch_by_reader.get(reader)))
        return walked

    def _track_epochs(self) -> None:
        """Each event's epoch (`epoch` in `events`): the one a reader that knew it saw it in."""
        for frames in self.epoch_walk().values():
            for r, epoch in frames:
                event = self.events.get(envelope_key(r["sid"], r["data"]))
                if event is not None and epoch and not event.get("epoch"):
                    event["epoch"] = epoch

    def _moves_before(self, sid: str, epoch: str | None, event_id: int | None, t: float | None, inclusive: bool) -> int:
        """How many of the session's moves came before a point of its log: by event id in
        the same epoch, else by time (the move's serverTimestamp). `inclusive`: a move at
        that very id counts (an owner read whose `last_id` is the move's own event)."""
        n = 0
        for move in self.moves.get(sid, []):
            move_id = move["env"].get("id")
            if epoch is not None and move.get("epoch") == epoch and event_id is not None and move_id is not None:
                n += move_id <= event_id if inclusive else move_id < event_id
            else:
                moved_at = _server_time(move["env"]) or move["t"]
                n += t is not None and (moved_at <= t if inclusive else moved_at < t)
        return n

    def read_segment(self, read: dict[str, Any]) -> int:
        """The stretch of the session's log (0 before its first move) an owner read saw."""
        last_id = read.get("last_id")
        return self._moves_before(read["sid"], read.get("epoch"), int(last_id) if last_id is not None else None,
                                  read.get("t_sent") or read.get("t"), inclusive=True)

    def owner_of_segment(self, sid: str, segment: int) -> str | None:
        """The incarnation the first owner read of that stretch found (before any move: the
        read right after the create, as before moves)."""
        for read in self.owner_reads.get(sid, []):
            if read.get("inc") and self.read_segment(read) == segment:
                return read["inc"]
        return None

    def segment_of(self, event: dict[str, Any]) -> int:
        env = event["env"]
        return self._moves_before(event["sid"], event.get("epoch"), env.get("id"), _server_time(env) or event["t"],
                                  inclusive=False)

    def owner_at(self, event: dict[str, Any]) -> str | None:
        """The owner of the session where `event` is in its log (whoever wrote it, or swept it)."""
        return self.owner_of_segment(event["sid"], self.segment_of(event))

    def processes(self) -> dict[int, dict[str, Any]]:
        """Worker processes by pid: incarnations, when started, told to stop (SIGTERM or
        `acp-state drain`), killed, stopped (SIGSTOP windows), exited and with what code."""
        procs: dict[int, dict[str, Any]] = {}

        def proc(pid: int) -> dict[str, Any]:
            return procs.setdefault(pid, {"pid": pid, "incs": [], "started": None, "told": None, "killed": None,
                                          "exited": None, "code": None, "stops": []})

        for r in self.workers:
            if r.get("pid") is None:
                continue
            p = proc(r["pid"])
            for inc in [r.get("inc"), *(r.get("incarnations") or [])]:
                if inc and inc not in p["incs"]:
                    p["incs"].append(inc)
            event = r.get("event")
            if event == "started":
                p["started"] = r["t"] if p["started"] is None else min(p["started"], r["t"])
            elif event in ("sigterm", "drain"):
                p["told"] = r["t"] if p["told"] is None else min(p["told"], r["t"])
            elif event == "stopped" and p["exited"] is None:
                p["exited"], p["code"] = r["t"], r.get("code")
        for f in self.faults:
            if f.get("pid") is None:
                continue
            p = proc(f["pid"])
            for inc in f.get("incarnations") or []:
                if inc not in p["incs"]:
                    p["incs"].append(inc)
            detail = f.get("detail") or {}
            if f.get("fault") == "worker_kill9":
                p["killed"] = f["t_start"] if p["killed"] is None else min(p["killed"], f["t_start"])
            elif f.get("fault") in STOPPING:
                p["stops"].append((f["t_start"], (f.get("t_end") or f["t_start"]) + 1.0))
            elif f.get("fault") == "worker_drain":
                p["told"] = f["t_start"] if p["told"] is None else min(p["told"], f["t_start"])
                if detail.get("killed_at") is not None:
                    p["killed"] = detail["killed_at"] if p["killed"] is None else min(p["killed"], detail["killed_at"])
        return procs

    def live_for(self, proc: dict[str, Any], lo: float, hi: float) -> float:
        """How long within [lo, hi] a worker process was serving and not told to stop."""
        if proc["started"] is None:
            return 0.0
        ends = [t for t in (proc["told"], proc["killed"], proc["exited"]) if t is not None]
        start, end = max(lo, proc["started"]), min([hi, *ends])
        if end <= start:
            return 0.0
        stopped = sum(max(0.0, min(end, b) - max(start, a)) for a, b in proc["stops"])
        return end - start - stopped

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

    def outcome_lost_with_store(self, chain: list[dict[str, Any]]) -> bool:
        """A retried chain whose first try may have taken effect, with the store's data lost
        between that try and the last retry: the outcome kept under the key went with it,
        so the retry's answer cannot speak of the first try."""
        return any(is_unknown(r) for r in chain[:-1]) and any(
            chain[0]["t_sent"] <= hi and chain[-1]["t_sent"] >= lo for lo, hi in self.restart_windows()
        )

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
    SIGSTOPped. The owner is the session's at its death: after a move, the worker that took
    it (a drained worker is neither killed nor stopped: its sessions moved or closed)."""
    # incarnation -> when its process was first killed or stopped. An incarnation belongs to
    # the process that logged it (worker records), so one adopted just before the fault
    # counts too even if the fault record could not name it yet.
    adopted = {
        r["inc"]: (r.get("pid"), r["t"]) for r in h.records
        if r.get("kind") == "worker" and r.get("inc") and r.get("event") in ("started", "incarnation")
    }
    faulted: dict[str, float] = {}
    for f in h.faults:
        if f.get("fault") != "worker_kill9" and f.get("fault") not in STOPPING:
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
        owner = h.owner_at(e)
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
        if (len(effects) > 1 or (effects and not answered)) and h.outcome_lost_with_store(chain):
            report.unverifiable["g: kept outcome lost with the store"] += 1
        elif len(effects) > 1:
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
        forgotten = [c for c in lost if h.outcome_lost_with_store(c)]
        if forgotten:
            report.unverifiable["g: kept outcome lost with the store"] += len(forgotten)
            lost = [c for c in lost if c not in forgotten]
        if lost:
            report.violation(
                "g", "session closed by a delete whose retry was answered 404", sessionId=sid,
                key=lost[0][0].get("key"), attempts=[r.get("status") or r.get("error") for r in lost[0]],
            )


def _starts_turn(env: dict[str, Any]) -> bool:
    """The event says its prompt's turn began here (on the worker that runs it)."""
    if env.get("type") in TURN_STARTS:
        return True
    update = (env.get("data") or {}).get("update") if env.get("type") == "session_update" else None
    return isinstance(update, dict) and update.get("sessionUpdate") == "user_message_chunk"


def check_i_moves(h: History, report: Report) -> None:
    """A drain hands each session over whole, and stops or closes only where it must:

    * a move changes the owner, to another worker process, from one that was told to drain;
      the owner changes at a move only; the move keeps the session's epoch;
    * the old owner writes nothing after the move: no event of a turn begun before the
      move comes after it (the drain ends that turn first);
    * a `turn_error` `worker_draining` ends a turn on a worker told to drain;
    * `session_closed` `worker_shutdown` comes from a worker told to stop, and (with
      drains) only if no other worker was live, not stopping, while its drain's grace lasted;
    * a worker told to stop exits 0.
    The prompt terminals (d), votes (e), sweeps (f) and outcomes (g) hold across a move as
    everywhere: a move is not an end."""
    procs = h.processes()
    pid_of = {inc: pid for pid, p in procs.items() for inc in p["incs"]}

    def told_at(inc: str | None) -> float | None:
        proc = procs.get(pid_of.get(inc)) if inc else None
        return proc["told"] if proc else None

    # Moves: owners on both sides, the old one drained.
    for sid, moves in h.moves.items():
        for n, move in enumerate(moves):
            report.checks["i"] += 1
            segment = h.segment_of(move)  # the moves before this one
            before, after = h.owner_of_segment(sid, segment), h.owner_of_segment(sid, segment + 1)
            moved_at = _server_time(move["env"]) or move["t"]
            if before is None or after is None:
                report.unverifiable["i: an owner around a move unknown"] += 1
            elif pid_of.get(before) is not None and pid_of.get(before) == pid_of.get(after):
                report.violation("i", "a move kept the session on its worker", sessionId=sid,
                                 eventId=move["env"].get("id"), owner=before, after=after)
            if before is not None and (told_at(before) is None or told_at(before) > moved_at):
                report.violation("i", "a session moved off a worker not told to drain", sessionId=sid,
                                 eventId=move["env"].get("id"), owner=before, moved_at=moved_at, told_at=told_at(before))
    # Within one stretch between moves the owner is one worker process (an incarnation a
    # worker took after a stall is the same worker).
    for sid, reads in h.owner_reads.items():
        seen: dict[int, dict[str, Any]] = {}
        for read in reads:
            if not read.get("inc"):
                continue
            segment = h.read_segment(read)
            first = seen.setdefault(segment, read)
            a, b = pid_of.get(first["inc"]), pid_of.get(read["inc"])
            if a is not None and b is not None and a != b:
                report.violation("i", "the owner changed without a session_moved", sessionId=sid,
                                 owners=[first["inc"], read["inc"]], reads=[first.get("t"), read.get("t")],
                                 moves=len(h.moves.get(sid, [])))
                break
    # The epoch at a move: the event before it on the same connection is in the same epoch.
    for reader, frames in h.epoch_walk().items():
        previous: tuple[dict[str, Any], str | None] | None = None
        for r, epoch in frames:
            if r.get("type") == MOVED and previous is not None and previous[0].get("conn") == r.get("conn"):
                report.checks["i"] += 1
                if previous[1] and epoch and previous[1] != epoch:
                    report.violation("i", "a move changed the session's event epoch", sessionId=r["sid"], reader=reader,
                                     eventId=r.get("id"), epochs=[previous[1], epoch])
            previous = (r, epoch)
    # The old owner writes nothing after the move: a turn begun before a move ends before it.
    logs: dict[tuple[str, str], dict[int, dict[str, Any]]] = defaultdict(dict)
    for e in h.events.values():
        if e.get("epoch") and isinstance(e["env"].get("id"), int):
            logs[(e["sid"], e["epoch"])].setdefault(e["env"]["id"], e)
    for (sid, epoch), log in logs.items():
        ids = sorted(log)
        move_ids = [i for i in ids if log[i]["env"].get("type") == MOVED]
        previous_move = 0
        for move_id in move_ids:
            begun = {
                envelope_prompt_id(log[i]["env"]) for i in ids
                if previous_move < i < move_id and _starts_turn(log[i]["env"]) and envelope_prompt_id(log[i]["env"])
            }
            report.checks["i"] += len(begun)
            late = [log[i]["env"] for i in ids if i > move_id and envelope_prompt_id(log[i]["env"]) in begun]
            if late:
                report.violation(
                    "i", "an event of a turn begun before a move came after it (the old owner wrote after the move)",
                    sessionId=sid, epoch=epoch, moveId=move_id, promptId=envelope_prompt_id(late[0]),
                    late=[{"id": env.get("id"), "type": env.get("type")} for env in late[:3]],
                    owner_before=h.owner_of_segment(sid, h.segment_of(log[move_id])),
                )
            previous_move = move_id
    # A drain's stops: on a worker told to drain, after it was told.
    for e in h.events_of_type("turn_error"):
        if (e["env"].get("data") or {}).get("code") != DRAINING:
            continue
        report.checks["i"] += 1
        owner = h.owner_at(e)
        at = _server_time(e["env"]) or e["t"]
        if owner is None:
            report.unverifiable["i: owner of a drain's turn_error unknown"] += 1
        elif told_at(owner) is None or told_at(owner) > at:
            report.violation("i", "a turn ended worker_draining on a worker not told to drain", sessionId=e["sid"],
                             eventId=e["env"].get("id"), promptId=envelope_prompt_id(e["env"]), owner=owner, at=at,
                             told_at=told_at(owner))
    # A drain's closes: from a worker told to stop, and only with no other worker to take them.
    grace = h.meta.get("drain_grace_s")
    if grace:
        for e in h.events_of_type("session_closed"):
            if (e["env"].get("data") or {}).get("reason") != SHUTDOWN:
                continue
            report.checks["i"] += 1
            owner = h.owner_at(e)
            at = _server_time(e["env"]) or e["t"]
            told = told_at(owner)
            if owner is None:
                report.unverifiable["i: owner of a worker_shutdown close unknown"] += 1
                continue
            if told is None or told > at:
                report.violation("i", "closed worker_shutdown by a worker not told to stop", sessionId=e["sid"],
                                 eventId=e["env"].get("id"), owner=owner, at=at, told_at=told)
                continue
            others = [
                {"pid": pid, "incarnations": p["incs"], "live_s": round(live, 2)} for pid, p in procs.items()
                if pid != pid_of.get(owner) and (live := h.live_for(p, told, told + grace)) >= TARGET_LIVE_S
            ]
            if others:
                report.violation("i", "a drained worker closed a session another worker could take", sessionId=e["sid"],
                                 eventId=e["env"].get("id"), owner=owner, told_at=told, closed_at=at, grace_s=grace,
                                 live_workers=others)
    # Told to stop, a worker exits 0 (its drain and shutdown done, its lease released).
    for pid, p in procs.items():
        if p["told"] is None or p["exited"] is None:
            continue
        report.checks["i"] += 1
        if p["code"] != 0:
            report.violation("i", "a worker told to stop did not exit 0", pid=pid, incarnations=p["incs"],
                             code=p["code"], told_at=p["told"], exited_at=p["exited"])
    report.counts["moves"] = sum(len(m) for m in h.moves.values())
    report.counts["sessions moved"] = len(h.moves)
    report.counts["turns ended worker_draining"] = sum(
        1 for e in h.events_of_type("turn_error") if (e["env"].get("data") or {}).get("code") == DRAINING
    )
    report.counts["sessions closed worker_shutdown"] = sum(
        1 for e in h.events_of_type("session_closed") if (e["env"].get("data") or {}).get("reason") == SHUTDOWN
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


def check_j_dead_down_to_the_agent(h: History, report: Report) -> None:
    """Dead stays dead down to the agent. Against the history the agents wrote (`agent_write`,
    `agent_history`, both named by the agent's own session id, which the prompts' `k=` tags
    tie to the session) and the leases the registry held (`lease`, `lease_dead`):

    * no write stamped with incarnation I comes after I's deadline, the moment from which a
      sweeper may declare I dead (its last accepted renewal + its lease, Redis's clock; the
      agent stamps a write right after it, on the same machine's clock);
    * a history (what a resume replays) holds no turn whose clients were told it ended
      `worker_lost`, unless the agent wrote it before its worker's deadline (the turn ended
      at the agent while the lease held, and its end was lost with the worker: noted);
    * every turn a client was told completed (`end_turn`) is in a history, and each write
      knew of every turn the file held before it (`prior` equals its place): a child that
      kept a session while another wrote to it would lose the resumer's turns."""
    writes = [r for r in h.records if r.get("kind") == "agent_write"]
    histories = {r["sid"]: r for r in h.records if r.get("kind") == "agent_history"}
    if not writes and not histories:
        return  # a run that recorded no agent history (older histories)
    deadlines: dict[str, float] = {}
    for r in h.records:
        if r.get("kind") == "lease" and r.get("inc") and r.get("deadline") is not None:
            deadlines[r["inc"]] = max(deadlines.get(r["inc"], 0.0), r["deadline"] / 1000)
    declared = {r["inc"]: r["at"] / 1000 for r in h.records if r.get("kind") == "lease_dead" and r.get("inc")}
    report.counts["agent history writes"] = len(writes)
    report.counts["incarnations declared dead"] = len(declared)

    # Each prompt by its key (the `k=` tag of its text): its session, and what its clients
    # were told of its end.
    acked = acknowledged_prompts(h)
    asked = {tag: answer for answer in acked.values() for tag in TAG.findall(answer.get("text") or "")[:1]}
    told: dict[str, dict[str, Any]] = {}
    for e in h.events_of_type(*TERMINALS):
        answer = acked.get(envelope_prompt_id(e["env"]) or "")
        for tag in TAG.findall(answer.get("text") or "")[:1] if answer else []:
            told.setdefault(tag, {"promptId": envelope_prompt_id(e["env"]), "sid": answer.get("sid"), "env": e["env"]})

    def session_of(text: str | None) -> str | None:
        return next((asked[tag].get("sid") for tag in TAG.findall(text or "") if tag in asked), None)

    def late_by(w: dict[str, Any]) -> float | None:
        deadline = deadlines.get(w.get("inc") or "")
        return None if deadline is None else w["t"] - deadline

    for w in writes:
        report.checks["j"] += 1
        if not w.get("inc"):
            report.unverifiable["j: a write no incarnation sent"] += 1
            continue
        late = late_by(w)
        if late is None:
            report.unverifiable["j: a write of an incarnation whose lease was never read"] += 1
        elif late > 0:
            report.violation(
                "j", "the agent wrote to the history after its worker's lease ended (a sweeper could declare it dead)",
                sessionId=session_of(w.get("text")), agentSessionId=w["sid"], incarnation=w["inc"],
                written_at=w["t"], deadline=deadlines[w["inc"]], late_by_s=round(late, 3),
                declared_dead_at=declared.get(w["inc"]), agent_pid=w.get("pid"), text=w.get("text"),
            )

    writes_by_tag: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for w in writes:
        for tag in TAG.findall(w.get("text") or ""):
            writes_by_tag[(w["sid"], tag)].append(w)
    in_histories: set[str] = set()
    for agent_sid, history in histories.items():
        for text in history.get("texts") or []:
            for tag in TAG.findall(text):
                in_histories.add(tag)
                end = told.get(tag)
                data = (end or {}).get("env", {}).get("data") or {}
                if end is None or end["env"].get("type") != "turn_error" or data.get("code") != "worker_lost":
                    continue
                report.checks["j"] += 1
                found = writes_by_tag.get((agent_sid, tag), [])
                late = [late_by(w) for w in found]
                if found and all(x is not None and x <= 0 for x in late):
                    report.notes["j: a turn told worker_lost in the history, written while its lease held"] += 1
                    continue
                report.violation(
                    "j", "a resumed conversation holds a turn its clients were told ended worker_lost",
                    sessionId=end["sid"], agentSessionId=agent_sid, promptId=end["promptId"], text=text,
                    written=[{"inc": w.get("inc"), "t": w["t"], "late_by_s": None if x is None else round(x, 3)}
                             for w, x in zip(found, late, strict=True)],
                )
    for tag, end in told.items():
        env = end["env"]
        if env.get("type") != "turn_complete" or (env.get("data") or {}).get("stopReason") != "end_turn":
            continue
        report.checks["j"] += 1
        if tag not in in_histories:
            report.violation("j", "a turn its client was told completed is not in the session's history",
                             sessionId=end["sid"], promptId=end["promptId"], key=tag)
    by_session: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for w in writes:
        by_session[w["sid"]].append(w)
    for agent_sid, found in by_session.items():
        found.sort(key=lambda w: w["end"])
        for place, w in enumerate(found):
            report.checks["j"] += 1
            if w["prior"] < place:
                report.violation(
                    "j",
                    "an agent wrote a turn without knowing turns the history held before it (it lost the resumer's turns)",
                    sessionId=session_of(w.get("text")), agentSessionId=agent_sid, incarnation=w.get("inc"),
                    agent_pid=w.get("pid"), written_at=w["t"], knew=w["prior"], history_held=place,
                    missed=[o.get("text") for o in found[w["prior"]:place]], text=w.get("text"),
                )
            elif w["prior"] > place:
                report.notes["j: a write that knew of turns not logged before it"] += 1
        size = (histories.get(agent_sid) or {}).get("size")
        if size is not None and found and size != found[-1]["end"]:
            report.notes["j: a history whose last write was not logged"] += 1


CHECKS = (
    check_a_one_winner,
    check_b_event_order,
    check_c_no_zombies,
    check_d_prompt_terminals,
    check_e_votes_reach_agent,
    check_f_no_outage_sweeps,
    check_g_outcomes,
    check_h_ttls,
    check_i_moves,
    check_j_dead_down_to_the_agent,
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
