"""The store's domain types: what goes in (transitions), what comes out (views, outcomes).

Nothing here knows Redis. A `Transition` says what changed in a session's runtime state;
a `SessionView` is that state as a reader sees it; the outcome enums name every answer a
store call can give. `RedisStore` alone turns them into key names, hash fields and script
arguments, and back (one pack/unpack pair each, in `acp_state.store.codec`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import orjson

from ..turns import TurnRecord


class Standing(enum.Enum):
    """What a heartbeat learned about the worker's incarnation."""

    HELD = "held"  # renewed in time
    LATE = "late"  # renewed after its deadline, but nobody had declared it dead
    NEW = "new"  # the registry did not know it: a first registration, or the store lost it
    DEAD = "dead"  # declared dead (tombstoned): it must never act again


class ApplyOutcome(enum.IntEnum):
    """What became of one transition (an int, as the store answers it)."""

    APPLIED = 1
    MISSING = 0  # the session is not in the store (data loss, or swept: ask the registry)
    FOREIGN = -1  # another incarnation owns the session
    PRESENT = 2  # a restore (`Transition.restore`) found the session already there


class ReplyFate(enum.IntEnum):
    """What became of a create's answer, as its worker finds it past the API's wait."""

    UNTAKEN = 1  # nobody took it: taken back now, or lost and given up on since (nobody was told)
    TAKEN = 0  # an API took it (it told its client, or said the outcome is unknown)
    LOST = -1  # gone with its keys (Redis restarted empty, a failover), and no API gave up on it


class IdClaim(enum.IntEnum):
    """What a claim on a session id found (CLAIM_SID): ids are unique across workspaces."""

    FOREIGN = 0  # another workspace holds the id (a session of it is live or listed): refused
    NEW = 1  # the id was free: it is this workspace's now
    OURS = 2  # the id was this workspace's already


class AdmissionStatus(enum.StrEnum):
    """What became of a command handed to a session's owner."""

    OK = "ok"
    GONE = "gone"  # no such live session of that owner
    FULL = "full"  # the prompt queue is full


class VoteOutcome(enum.StrEnum):
    """How a vote was decided, in the reference's order of checks."""

    OK = "ok"  # it won, and is on its way to the owner
    GONE = "gone"  # no such live session of that owner
    UNKNOWN = "unknown"  # no such pending request (never, or already decided)
    CLIENT = "client"  # the voter's client id is not registered on the session
    OPTION = "option"  # not one of the offered option ids


class DeleteOutcome(enum.StrEnum):
    """What a DELETE of a listed session that is not live found (`delete_listed`)."""

    DELETED = "deleted"  # its row (and acp-state's records of it) went in this step
    REPEAT = "repeat"  # the idempotency key's kept first outcome: deleted before
    LIVE = "live"  # a session hash is there: live (a load resumed it), or its dead owner's
    LOADING = "loading"  # a load claimed it: the load wins
    MISSING = "missing"  # no catalog row (never, deleted, or past its retention)


class LoadClaim(enum.StrEnum):
    """What `claim_load` found: the claim is ours, another load's, or there is no row to
    resume (deleted: DELETE_LISTED won)."""

    OK = "ok"
    HELD = "held"
    GONE = "gone"


class Presence(enum.StrEnum):
    """What a client's heartbeat found: recorded, no live session, or a client id that is
    not registered on the session."""

    SEEN = "seen"
    GONE = "gone"
    UNKNOWN_CLIENT = "unknown_client"


class Mode(enum.Enum):
    """How a transition treats the session as a whole."""

    CREATE = "create"  # a whole snapshot: the session starts (again) from this transition
    UPDATE = "update"  # a change to a session that exists
    DELETE = "delete"  # the session's last transition: its state goes with it
    # A session another worker is moving here (a drain): the hash, its event log and its
    # epoch stay; the ownership passes from `Transition.takeover_from` to the writer.
    TAKEOVER = "takeover"


@dataclass(frozen=True)
class LeaseView:
    """The registry as a reader sees it, on Redis's clock."""

    deadlines: dict[str, int]  # incarnation -> lease deadline
    leases: dict[str, int]  # incarnation -> lease ms
    redis_now_ms: int
    tick_ms: int  # the store last served a lease decision
    stall_ms: int  # the store last came back from a silence

    def live_until(self) -> dict[str, int]:
        """Until when each registered incarnation counts as live.

        Its deadline, or, if the store itself was silent since (a stall, a pause, running out
        of memory, a failover), a whole lease after it came back: the grace in which no
        sweeper declares it dead either (the CLAIM_DEAD script), so that readers do not hide
        the sessions of a worker that only the store kept from renewing."""
        stall = self.stall_ms
        if self.leases and self.redis_now_ms - self.tick_ms > min(self.leases.values()) / 2:
            stall = self.redis_now_ms  # silent right now, as the next lease decision will find
        return {
            inc: max(deadline, stall + self.leases.get(inc, 0)) if stall else deadline
            for inc, deadline in self.deadlines.items()
        }


# A worker's load report: attribute, its JSON key (the order the bytes have always had).
_REPORT_WIRE = (
    ("incarnation", "incarnation"), ("host", "host"), ("pid", "pid"), ("started_at", "startedAt"),
    ("sessions", "sessions"), ("max_sessions", "maxSessions"), ("agents", "agents"), ("agent_names", "agentNames"),
    ("default_agent", "defaultAgent"), ("states", "states"), ("lease_ms", "leaseMs"), ("renewed_at", "renewedAt"),
    ("state_store", "stateStore"), ("draining", "draining"), ("children", "children"),
)


@dataclass(frozen=True)
class WorkerReport:
    """The load report a worker stores with each renewal of its lease: what placement
    (`acp_state.placement`), `GET /workers`, `/capabilities`, the deployment's metrics and
    `acp-state status` read. Its JSON is one object of these fields, in this order (`pack`);
    a report stored without some of them (an older worker's) reads as their defaults."""

    incarnation: str
    host: str | None = None
    pid: int | None = None
    started_at: str | None = None  # ISO
    sessions: int = 0  # live, and creates under way (their capacity reserved)
    max_sessions: int = 0
    agents: int | None = None  # running agent children
    agent_names: list[str] = field(default_factory=list)  # the agents on offer, the default first
    default_agent: str | None = None
    states: dict[str, int] = field(default_factory=dict)  # live sessions by state (SESSION_STATES)
    lease_ms: int | None = None
    renewed_at: int | None = None  # epoch ms, the worker's clock
    state_store: str | None = None  # the agent-state store its agents read (acp_state.moves)
    draining: bool = False  # moving its sessions away: placement sends it nothing
    # Its running agent children, each as `acp_state.placement.child_key` (agent and
    # workspace, a few bytes each, at most CHILDREN_REPORTED): placement prefers a worker
    # whose child for a session's agent and workspace runs (no cold start under the wait).
    children: list[str] = field(default_factory=list)

    def pack(self) -> str:
        """The JSON the registry keeps for the incarnation."""
        return orjson.dumps({wire: getattr(self, name) for name, wire in _REPORT_WIRE}).decode()

    @classmethod
    def unpack(cls, incarnation: str, payload: str | bytes) -> WorkerReport:
        """The report the registry kept for `incarnation`. Raises ValueError: not a JSON
        object, or a field of the wrong JSON type (no worker writes one)."""
        wire = orjson.loads(payload)
        if not isinstance(wire, dict):
            raise ValueError("worker report is not a JSON object")
        values: dict[str, Any] = {}
        for name, key in _REPORT_WIRE:
            value = wire.get(key)
            if value is None:
                continue
            if not isinstance(value, _REPORT_TYPES[name]) or (isinstance(value, bool) and _REPORT_TYPES[name] is int):
                raise ValueError(f"worker report field {key!r} is of the wrong type")
            values[name] = value
        values.setdefault("incarnation", incarnation)
        return cls(**values)


_REPORT_TYPES: dict[str, type] = {
    "incarnation": str, "host": str, "pid": int, "started_at": str, "sessions": int, "max_sessions": int,
    "agents": int, "agent_names": list, "default_agent": str, "states": dict, "lease_ms": int, "renewed_at": int,
    "state_store": str, "draining": bool, "children": list,
}


@dataclass(frozen=True)
class DeadClaims:
    """One sweeper round's claim (SweeperStore.claim_dead_workers): the dead workers handed
    to this caller, the shortest registered lease (ms, 0 if none), and how long until the
    soonest live lease lapses (ms, None if none does)."""

    claimed: list[str]
    shortest_lease_ms: int
    next_lapse_ms: int | None


@dataclass(frozen=True)
class Applied:
    """The result of one state transition."""

    applied: ApplyOutcome
    last_event_id: int
    epoch: str


@dataclass(frozen=True)
class Admission:
    """The result of handing a command to a session's owner."""

    status: AdmissionStatus
    last_event_id: int = 0
    epoch: str = ""
    prompt_id: str = ""  # the admitted prompt's id (the first one's, for a repeated key)
    repeated: bool = False  # the kept first outcome of the same idempotency key


@dataclass(frozen=True)
class CreateKey:
    """Where a create's `Idempotency-Key` is kept: per workspace and per principal, so a
    caller of another workspace, or another principal of the same one, that sends the same
    key gets a create of its own, never the first one's session or client id. `principal` is
    a stable name of who called (`api.auth.Principal.name`: role and token scope), made of
    `[A-Za-z0-9._*+-]`."""

    ws: str
    principal: str
    key: str


@dataclass(frozen=True)
class CreateRecord:
    """What an idempotency key of a create holds: the first create's session and client,
    and how far it got."""

    sid: str
    client_id: str
    attached: bool
    request: str | None  # the request sent to a worker, while its answer is not taken
    kept: bool  # its outcome was told: the key answers with this session


@dataclass(frozen=True)
class Retention:
    """How long things outside the lease are kept."""

    catalog_ms: int = 7 * 24 * 3600 * 1000
    events_ms: int = 30 * 60 * 1000
    events_max: int = 1000
    transcript_ms: int = 7 * 24 * 3600 * 1000
    transcript_max: int = 10_000
    # A live session's hash expires this long after its last refresh: the bound on how long
    # a reader that skips the lease can see a session whose worker is gone.
    session_ttl_ms: int = 15 * 60 * 1000


@dataclass(frozen=True)
class PendingInteraction:
    """A request the agent awaits, as the session projects it."""

    rid: str
    interaction: dict[str, Any]  # exactly the wire `PendingInteraction`
    order: int  # insertion order: the status lists pending interactions in it
    allowed: list[str]  # the option ids a vote may select


@dataclass(frozen=True)
class CatalogRow:
    """A session's durable listing row (its id and cwd are the catalog's, not the row's)."""

    created_at: str
    updated_at: str
    updated_ms: int  # the listing order
    display_name: str | None = None
    # What a later load needs to resume the session on any worker (absent in rows written
    # before 2026-12-03): the agent's name, the agent-state store its history lives in, the
    # agent's own id of the session, and whether the agent can load sessions at all.
    agent: str | None = None
    state_store: str | None = None
    agent_sid: str | None = None
    resumable: bool | None = None
    # The reference's session source (`sourceType`, `sourceId`), given on create.
    source_type: str | None = None
    source_id: str | None = None


@dataclass(frozen=True)
class EndAdmitted:
    """A deleting transition ends every prompt the store admitted that it does not end itself
    (the owner never saw it, or is dead) with a `turn_error` of this code and message."""

    code: str
    message: str


@dataclass
class Transition:
    """One atomic change of a session: its state, its events, its listing row, together.

    Every field left at its default changes nothing. A CREATE starts the session from the
    state given here (first publish, or a rewrite after the store lost it); fields at their
    zero value (inactive, nothing admitted, no turn error) are then simply absent.
    """

    mode: Mode = Mode.UPDATE
    meta: dict[str, Any] | None = None  # {sessionId, workspaceCwd, createdAt, displayName?}
    epoch: str | None = None  # a new event epoch (CREATE)
    updated_at: str | None = None  # updatedAt
    active: bool | None = None  # a prompt runs (True) or ended (False); None: unchanged
    admitted: int = 0  # CREATE: prompts admitted and not yet terminal
    admitted_change: int = 0  # UPDATE: change of that count
    prompts_admitted: list[str] = field(default_factory=list)  # prompt ids (CREATE)
    prompts_ended: list[str] = field(default_factory=list)  # prompt ids that got their terminal
    clients: list[str] = field(default_factory=list)  # attached client ids (CREATE)
    turn_error: dict[str, Any] | None = None  # the status's turnError, set
    clear_turn_error: bool = False
    clear_turn_error_event: bool = False  # the kept turn_error envelope is superseded
    interactions_added: list[PendingInteraction] = field(default_factory=list)
    interactions_removed: list[str] = field(default_factory=list)  # request ids
    events: list[str] = field(default_factory=list)  # envelope bodies (events.body)
    keep_turn_error_event: int | None = None  # 1-based index in `events` of the one to keep
    catalog: CatalogRow | None = None  # write the listing row
    uncatalog: bool = False  # DELETE: leave no listing row (nobody was told of the session)
    uncatalog_untold: bool = False  # DELETE: leave no listing row if no API took the create's answer
    untold_request: str | None = None  # CREATE: the create's request id, until an API took its answer
    single: bool = False  # CREATE: the session holds its workspace's single-scope slot
    restore: bool = False  # CREATE after a loss: only if the session is missing
    resumed: bool = False  # CREATE of a resumed session: its ended turns of before stay
    end_admitted: EndAdmitted | None = None  # DELETE: end the prompts left admitted
    op: int | None = None  # the owner's running number (a retry applies once)
    turns: list[TurnRecord] = field(default_factory=list)  # turn records to write whole
    told: bool = False  # the create's answer was taken: its request id goes (see SessionView.told)
    takeover_from: str | None = None  # TAKEOVER: the incarnation that is handing the session over
    available_commands: dict[str, Any] | None = None  # set: {availableCommands, availableSkills} the agent advertised
    approval_mode: str | None = None  # set: the agent's current session mode (approvalMode)
    agent_state: dict[str, Any] | None = None  # set: {modes?, configOptions?} as the agent reported them
    usage: dict[str, Any] | None = None  # set: the agent's last usage_update {used, size, cost?}


@dataclass(frozen=True)
class CatalogVersion:
    """A workspace's live-state version: `revision` counts its changes within `generation`."""

    generation: str
    revision: int


@dataclass(frozen=True)
class SessionView:
    """A live session's runtime state as readers see it (one read of the store)."""

    owner: str  # the owning incarnation (its lease says whether the session is live)
    meta: dict[str, Any]  # {sessionId, workspaceCwd, createdAt, displayName?}
    updated_at: str  # updatedAt (createdAt until a prompt reached its terminal)
    active: bool  # a prompt runs
    admitted: int  # prompts admitted and not yet terminal
    client_count: int
    turn_error: dict[str, Any] | None
    turn_error_event: dict[str, Any] | None  # the kept turn_error envelope (refresh-append)
    pending: list[dict[str, Any]]  # pending interactions (wire JSON), in insertion order
    last_event_id: int
    epoch: str
    # Its creator was told of it (an API took the create's answer). Until then the session
    # is no one's yet: listings leave it out, since its create may still be undone.
    told: bool = True
    # A draining worker is handing the session to another (`mv`): prompts sent meanwhile
    # wait for the new owner.
    moving: bool = False
    # What the agent advertised last (`available_commands_update`): {availableCommands,
    # availableSkills}; None: nothing yet.
    available_commands: dict[str, Any] | None = None
    approval_mode: str | None = None  # the agent's current session mode, when it has modes
    # The session's state as its agent reported it (session/new, load or resume: `modes`,
    # `configOptions`), and its last ACP `usage_update` ({used, size, cost?}); None: none.
    agent_state: dict[str, Any] | None = None
    usage: dict[str, Any] | None = None


@dataclass(frozen=True)
class Change:
    """A session of a workspace changed, moving the workspace's catalog version to
    (`generation`, `revision`): what the change channel announces (Fanout.on_change)."""

    ws: str
    sid: str
    revision: int
    generation: str


def attention_member(sid: str, request_id: str | None) -> str:
    """A wait's name among its workspace's, in the index's order: `<sessionId>/<requestId>`,
    `<sessionId>/!` for the session's turn error."""
    return f"{sid}/{request_id or '!'}"


@dataclass(frozen=True)
class AttentionCursor:
    """A place in the attention order: oldest wait first, then by workspace, then by the
    session and request (a turn error sorts as request `!`)."""

    since_ms: int
    ws: str
    sid: str
    request_id: str | None  # None: the session's turn error

    @property
    def member(self) -> str:
        return attention_member(self.sid, self.request_id)

    @property
    def order(self) -> tuple[int, str, str]:
        return self.since_ms, self.ws, self.member


class AttentionEntry(NamedTuple):
    """One thing a live session waits for a human for: a pending interaction (its
    `request_id`, `detail` its wire JSON) or its turn error (`request_id` None, `detail` the
    turnError), waiting since `since_ms` (epoch ms, Redis's clock).

    A tuple, and `detail` decoded only when read: a page reads many entries to show a few."""

    ws: str
    sid: str
    request_id: str | None
    since_ms: int
    owner: str  # the session's owning incarnation: the entry counts while its lease holds
    raw_detail: str

    @property
    def detail(self) -> dict[str, Any]:
        try:
            value = orjson.loads(self.raw_detail)
        except orjson.JSONDecodeError:
            return {}
        return value if isinstance(value, dict) else {}

    @property
    def order(self) -> tuple[int, str, str]:
        return self.since_ms, self.ws, attention_member(self.sid, self.request_id)

    @property
    def cursor(self) -> AttentionCursor:
        return AttentionCursor(self.since_ms, self.ws, self.sid, self.request_id)


@dataclass(frozen=True)
class ListedSession:
    """One row of a workspace listing page: the durable row and, if live, its state."""

    sid: str
    row: dict[str, Any] | None  # {createdAt, updatedAt, displayName?} if still kept
    view: SessionView | None  # None: not live in the store


@dataclass(frozen=True)
class LoadSnapshot:
    """One consistent read for a reload: the session, its newest transcript page, its log."""

    view: SessionView | None
    page: list[tuple[str, str]]  # (entry id, envelope) newest first, up to limit + 1
    log: list[str]  # the replay log's envelopes, oldest first



# Stands for each session's id in a transition that `Store.sweep` applies to many sessions.
SESSION_ID_SLOT = "@SID@"

# What take_reply answers for a reply an API gave up on (the worker then undoes the create).
ABANDONED = "abandoned"
# The first entry of a reply's given list (the record of its taking: taken answers go
# before it). Never an answer: answers are JSON objects.
GIVEN = "given"
