"""The Redis key schema, in one place.

Every key of one workspace carries the hash tag `{<workspaceId>}` so that a state transition
(session hash + event log + listing set + catalog + command inbox) touches one cluster slot.
Worker-owned keys are tagged with the worker's incarnation instead. Ids reach this module
only after `acp_state.ids` validated them, so none can contain `{`, `}` or `:`.

See docs/architecture.md ("Key schema") for owners and TTLs.
"""

from __future__ import annotations

import binascii
import functools

PREFIX = "acp"

# The registry of worker incarnations. Its keys share one hash tag, so each lease decision
# (a heartbeat, a sweeper declaring a worker dead) is one atomic script on one slot.
REGISTRY_TAG = "{registry}"
# ZSET incarnation -> lease deadline, in epoch ms of Redis's own clock (TIME). The lease.
WORKERS = f"{PREFIX}:{REGISTRY_TAG}:workers"
# HASH incarnation -> JSON load report (placement, `acp-state status`).
REPORTS = f"{PREFIX}:{REGISTRY_TAG}:reports"
# ZSET incarnation -> lease ms: the shortest lease sets how long a silence of the store
# counts as a stall rather than a worker's death.
LEASES = f"{PREFIX}:{REGISTRY_TAG}:leases"
# ZSET incarnation -> when it was declared dead (tombstones: dead stays dead).
DEAD = f"{PREFIX}:{REGISTRY_TAG}:dead"
# ZSET incarnation -> claim expiry: the sweeper that is removing a dead worker's sessions.
SWEEPS = f"{PREFIX}:{REGISTRY_TAG}:sweeps"
# HASH {tick, stall} (fields: ClockField): when the store was last seen serving, and when it
# last came back from a silence (a stall, a pause, a restart, running out of memory).
CLOCK = f"{PREFIX}:{REGISTRY_TAG}:clock"
# ZSET agent name -> when a worker last offered it (Redis ms): the names a create may ask
# for, kept a day after the last worker offering one was seen (unknown vs. none alive).
AGENTS = f"{PREFIX}:{REGISTRY_TAG}:agents"
REGISTRY_KEYS = [WORKERS, REPORTS, LEASES, DEAD, SWEEPS, CLOCK, AGENTS]


def worker_sessions(incarnation: str) -> str:
    """SET of `<workspaceId>/<sessionId>` the worker hosts: the sweeper's index."""
    return f"{PREFIX}:w:{{{incarnation}}}:sessions"


def worker_control(incarnation: str) -> str:
    """STREAM of control commands (create) addressed to one worker."""
    return f"{PREFIX}:w:{{{incarnation}}}:ctl"


def session(ws: str, sid: str) -> str:
    """HASH of one live session's runtime state (fields below)."""
    return f"{PREFIX}:{{{ws}}}:s:{sid}"


def session_prefix(ws: str) -> str:
    return f"{PREFIX}:{{{ws}}}:s:"


def live(ws: str) -> str:
    """SET of the workspace's live session ids."""
    return f"{PREFIX}:{{{ws}}}:live"


def inbox(ws: str, incarnation: str) -> str:
    """STREAM of commands (prompt, cancel, vote, close) for one worker's sessions of a workspace."""
    return f"{PREFIX}:{{{ws}}}:in:{incarnation}"


def events(ws: str, sid: str) -> str:
    """STREAM replay log of a session's events; entry id = `<eventId>-0`. Also the sharded
    pub/sub channel its live events go out on."""
    return f"{PREFIX}:{{{ws}}}:ev:{sid}"


def transcript(ws: str, sid: str) -> str:
    """STREAM of a session's turn content (prompts and agent updates), kept past its worker."""
    return f"{PREFIX}:{{{ws}}}:tr:{sid}"


def invalidations(ws: str) -> str:
    """Sharded pub/sub channel: a session of the workspace changed (every transition, vote
    and attach announces it here first); the message is the session id. Readers that cache
    the workspace follow it and drop their cached copy."""
    return f"{PREFIX}:{{{ws}}}:inv"


def workspace_of_channel(channel: str) -> str:
    """The workspace id inside a channel's hash tag."""
    return channel[channel.index("{") + 1 : channel.index("}")]


def catalog(ws: str) -> str:
    """HASH sessionId -> persisted row JSON (durable, outside the lease)."""
    return f"{PREFIX}:{{{ws}}}:cat"


def catalog_order(ws: str) -> str:
    """ZSET sessionId -> updatedAt ms: listing order, pagination and retention."""
    return f"{PREFIX}:{{{ws}}}:cat:t"


def catalog_version(ws: str) -> str:
    """HASH {g: generation, r: revision} of the workspace's live state: the revision moves
    in the same script as every change announced on the change channel; a new generation
    starts when the hash is missing (Redis lost the workspace's state)."""
    return f"{PREFIX}:{{{ws}}}:ver"


def change_log(ws: str) -> str:
    """ZSET sessionId -> the revision of its last change (the newest 1,000 sessions), and
    CHANGE_LOG_FLOOR -> the oldest revision it answers from: what changed since a revision,
    for a resume on a process that did not follow the workspace then (changes.lua)."""
    return f"{PREFIX}:{{{ws}}}:chg"


# The change log's member that holds its floor (a session id never is "!").
CHANGE_LOG_FLOOR = "!"


def presence(ws: str) -> str:
    """ZSET `<sessionId> <clientId>` -> when that client's presence lapses (Redis ms): the
    clients of the workspace's live sessions that heartbeat (`POST /session/:id/heartbeat`);
    PRUNE_CLIENTS removes a lapsed one from its session. PX = twice the longest presence TTL
    given, refreshed per heartbeat."""
    return f"{PREFIX}:{{{ws}}}:pres"


def attention(ws: str) -> str:
    """ZSET `<sessionId>/<requestId>` (`<sessionId>/!` for a turn error) -> since (epoch ms):
    what the workspace's live sessions wait for a human for, kept by APPLY and VOTE."""
    return f"{PREFIX}:{{{ws}}}:attn"


def attention_details(ws: str) -> str:
    """HASH attention member -> `<owner incarnation>\n<the interaction's or turn error's JSON>`."""
    return f"{PREFIX}:{{{ws}}}:attn:d"


# The deployment's attention index: one on a single Redis; on a cluster one per hash slot,
# tagged so that it shares the slot of the workspaces it holds (the script that changes a
# workspace stays in one slot). Its tags never look like a workspace id (16 hex digits).
ATTENTION_TAG = "attn"
SLOTS = 16384


def _slot(tag: str) -> int:
    """The cluster slot of keys with this hash tag (Redis: CRC16-XMODEM mod 16384)."""
    return binascii.crc_hqx(tag.encode(), 0) % SLOTS


@functools.cache
def _slot_tags() -> tuple[str, ...]:
    """For each slot, the first tag `attn~<n>` that falls in it (about 170,000 CRCs, once)."""
    tags: list[str | None] = [None] * SLOTS
    left, n = SLOTS, 0
    while left:
        tag = f"{ATTENTION_TAG}~{n}"
        slot = _slot(tag)
        if tags[slot] is None:
            tags[slot] = tag
            left -= 1
        n += 1
    return tuple(tag for tag in tags if tag is not None)


def attention_tag(ws: str, per_slot: bool) -> str:
    """The hash tag of the deployment attention index that holds the workspace's waits."""
    return _slot_tags()[_slot(ws)] if per_slot else ATTENTION_TAG


def attention_all(tag: str) -> str:
    """ZSET `<workspaceId>/<sessionId>/<requestId>` (`.../!` for a turn error) -> since
    (epoch ms): the workspace index's entries of every workspace under this tag, kept by
    the same scripts in the same step."""
    return f"{PREFIX}:{{{tag}}}:attn:all"


def attention_all_details(tag: str) -> str:
    """HASH deployment attention member -> `<owner incarnation>\n<the JSON>`."""
    return f"{PREFIX}:{{{tag}}}:attn:all:d"


def turns(ws: str, sid: str) -> str:
    """HASH promptId -> turn record JSON (acp_state.turns) of a live session's recent turns."""
    return f"{PREFIX}:{{{ws}}}:t:{sid}"


def turns_ended(ws: str, sid: str) -> str:
    """LIST of the promptIds whose turns ended, oldest first, bounded (the newest is the
    `turns/current` of an idle session)."""
    return f"{PREFIX}:{{{ws}}}:t:{sid}:end"


def single(ws: str) -> str:
    """STRING: the id of the workspace's shared `sessionScope: single` session."""
    return f"{PREFIX}:{{{ws}}}:single"


def parked(ws: str, sid: str) -> str:
    """STREAM of the commands sent to a session while it moves between workers (field `mv`
    set): the new owner takes them, in order, once it holds the session."""
    return f"{PREFIX}:{{{ws}}}:park:{sid}"


def load_claim(ws: str, sid: str) -> str:
    """STRING: the request id of the one load resuming a session that is not live; the
    other loads of it wait for that one (PX the create timeout)."""
    return f"{PREFIX}:{{{ws}}}:load:{sid}"


def locator(sid: str) -> str:
    """STRING sessionId -> workspaceId, so session-scoped routes find the workspace slot.
    Written only by CLAIM_SID: a session id belongs to one workspace (unique across them)."""
    return f"{PREFIX}:sid:{{{sid}}}"


def request_locator(rid: str) -> str:
    """STRING requestId -> `<workspaceId>/<sessionId>` for the legacy vote route."""
    return f"{PREFIX}:rq:{{{rid}}}"


def idempotency(ws: str, sid: str, key: str) -> str:
    """STRING: the first outcome of a command sent with an `Idempotency-Key` (PX 24 h)."""
    return f"{PREFIX}:{{{ws}}}:idem:{sid}:{key}"


def create_idempotency(ws: str, principal: str, key: str) -> str:
    """STRING: `<sessionId> <clientId> ...` of the create sent to workspace `ws` by
    `principal` with an `Idempotency-Key` (scoped to both: another workspace's or another
    principal's same key is another create). The segment `cidem` differs from `idem`, so no
    command record's name (`idem:<sid>:<key>`) can equal one."""
    return f"{PREFIX}:{{{ws}}}:cidem:{principal}:{key}"


def stream_ticket(nonce: str) -> str:
    """STRING: a stream ticket was used (api/stream_tickets.py); PX its life left + 1 s."""
    return f"{PREFIX}:ticket:{{{nonce}}}"


def reply(request: str) -> str:
    """LIST a worker pushes one reply onto for a create/close command."""
    return f"{PREFIX}:reply:{{{request}}}"


def reply_given(request: str) -> str:
    """LIST made once a worker gave its reply (the GIVEN marker, with the reply's TTL): a
    retried REPLY gives nothing twice, and an API's take moves the answer here, the record
    that it was taken."""
    return f"{PREFIX}:reply:{{{request}}}:given"


class F:
    """Field names of the session hash."""

    OWNER = "inc"  # incarnation of the owning worker: the fence for every write
    # The session's meta {sessionId, workspaceCwd, createdAt, displayName?}, a field each and
    # the id from the key: short values keep an idle session's hash a listpack (every value
    # within Redis's hash-max-listpack-value, 64 bytes by default), half the memory of a
    # hashtable.
    CREATED = "ct"  # createdAt ISO string
    CWD = "wd"  # workspaceCwd
    TITLE = "dn"  # displayName, once set
    META = "meta"  # read only: the meta as one JSON field, as workers before 2026-12-01 wrote it
    UPDATED = "up"  # updatedAt ISO string
    ACTIVE = "act"  # "1" while a prompt runs
    ADMITTED = "n"  # prompts admitted and not yet terminal (running + queued)
    PROMPT = "p:"  # + promptId -> "1" from admission until its terminal event
    TURN_ERROR = "te"  # JSON turnError, absent when unset
    TURN_ERROR_EVENT = "tev"  # the turn_error envelope kept for refresh-append
    SEQ = "seq"  # last event id
    EPOCH = "epoch"  # event epoch: changes when the history is lost
    OP = "op"  # running number of the owner's last transition (a retry applies once)
    REQUEST = "rq"  # the create's request id, until an API took its answer (told its creator)
    MOVING = "mv"  # the incarnation a draining owner is handing the session to
    MODE = "am"  # the agent's current session mode (status approvalMode), when it has modes
    COMMANDS = "cmds"  # JSON {availableCommands, availableSkills}: the agent's last available_commands_update
    # JSON {modes?, configOptions?}: the session's state as the agent's new/load/resume said
    # it; absent when it reported neither (read as {})
    AGENT_STATE = "ast"
    USAGE = "use"  # JSON {used, size, cost?}: the agent's last ACP usage_update (its context window)
    CLIENT = "c:"  # + clientId -> "1": a registered client (its presence, if it heartbeats: keys.presence)
    INTERACTION = "pi:"  # + requestId -> PendingInteraction JSON
    VOTABLE = "pv:"  # + requestId -> JSON [order, [allowed option ids]]


class VersionField:
    """Field names of the catalog version hash (catalog_version)."""

    GENERATION = "g"
    REVISION = "r"


class ClockField:
    """Field names of the registry's clock hash (CLOCK)."""

    TICK = "tick"  # the store last served a lease decision (epoch ms of Redis's clock)
    STALL = "stall"  # the store last came back from a silence
