"""The API-to-worker command protocol: typed commands, their one wire form, and their handler.

An API process sends a command, through the store, to the worker that owns a session (its
inbox for the workspace) or, for a create, to a chosen worker (its control feed). Each
command travels as one JSON object: `{"t": <type>, <fields in declaration order>}`, every
field present (`null` when unset); where the store keeps it is the store's business.
`encode` and `decode` are the only Python code that reads or writes that JSON (the VOTE
and ATTACH scripts read a vote's and an attach's fields from it too: each acts on the very
command it enqueues). Sending is the store's call that carries each command, which takes it
typed (`send_control` a create or a drain, `send` a prompt, a cancel or a close, `vote`,
`attach`): the store imports these types, this module never imports the store. `dispatch`
hands a decoded command to the worker's `CommandHandler` (rq's `rq/command.py` shape on the
handling side). A worker answers a create or a close with a `Reply`, which has its own
encode/decode pair (arq's shape: one result type, one serializer pair).
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar, Protocol

import orjson

# Turn kinds a prompt carries. A caller names one in `turnKind`; a channel turn is never
# named, only granted to a channel caller's prompt marked `_meta["qwen.channel.prompt"]`.
FOREGROUND = "foreground"
CRON = "cron"
NOTIFICATION = "notification"
GOAL = "goal"
CHANNEL = "channel"
CALLER_TURN_KINDS = (FOREGROUND, CRON, NOTIFICATION, GOAL)
TURN_KINDS = (*CALLER_TURN_KINDS, CHANNEL)

# The mediator's internal "cancelled" vote: a vote may not select it, and an agent may never
# offer it as an option id (the VOTE script and `interactions.map_options` refuse it).
CANCEL_SENTINEL = "__cancelled__"

CLOSED_BY_CLIENT = "closed_by_client"

_NONE = type(None)


class MalformedCommand(ValueError):
    """A stream entry that is not a command this protocol knows; the worker logs and skips it."""

    def __init__(self, reason: str, command_type: str | None = None) -> None:
        super().__init__(reason)
        self.command_type = command_type


def _field(
    wire: str | None = None,
    *,
    types: type | tuple[type, ...] = str,
    default: Any = MISSING,
    default_factory: Any = MISSING,
    omit_none: bool = False,
) -> Any:
    """A command field: its JSON key (`wire`, else the attribute name) and accepted JSON types;
    `omit_none`: left off the wire when None (a field added later keeps old commands' bytes)."""
    metadata = {"wire": wire, "types": types, "omit_none": omit_none}
    return field(default=default, default_factory=default_factory, metadata=metadata)


@dataclass(frozen=True, kw_only=True)
class Create:
    """Start a session on this worker (control feed); answered by `store.reply(request_id)`."""

    TYPE: ClassVar[str] = "create"
    ws: str = _field()
    sid: str = _field()
    cwd: str = _field()
    scope: str = _field(default="thread")  # "single" or "thread"
    client_id: str | None = _field("clientId", types=(str, _NONE), default=None)
    # How long the API waits for the answer: one nobody took by then is taken back and the
    # session undone, even if the API could not say that it gave up.
    wait_ms: int | None = _field("waitMs", types=(int, _NONE), default=None)
    request_id: str = _field("req")
    # The agent the session runs (a name the worker offers); None: the worker's default.
    agent: str | None = _field(types=(str, _NONE), default=None, omit_none=True)
    # Resume the session (ACP `session/load` of `agent_sid`) instead of starting a new one:
    # a load of a persisted session, or a drain's move (`move_from`: the incarnation handing
    # it over, which still holds it). `carry`: the session state the new owner goes on from
    # (see `acp_state.moves.Carry`).
    load: bool | None = _field(types=(bool, _NONE), default=None, omit_none=True)
    agent_sid: str | None = _field("agentSessionId", types=(str, _NONE), default=None, omit_none=True)
    move_from: str | None = _field("from", types=(str, _NONE), default=None, omit_none=True)
    carry: dict[str, Any] | None = _field(types=(dict, _NONE), default=None, omit_none=True)
    # Where the session came from (the reference's `session_source_metadata`): stored in
    # its catalog row, listed, and filtered on; a resume or a move keeps it.
    source_type: str | None = _field("sourceType", types=(str, _NONE), default=None, omit_none=True)
    source_id: str | None = _field("sourceId", types=(str, _NONE), default=None, omit_none=True)
    # The session mode to start a new session in (the create's `approvalMode`), if the agent
    # offers it; else the worker's --session-mode.
    mode: str | None = _field(types=(str, _NONE), default=None, omit_none=True)


@dataclass(frozen=True, kw_only=True)
class Prompt:
    """Run (or queue) one admitted prompt; `prompt_id` was recorded by the SEND script."""

    TYPE: ClassVar[str] = "prompt"
    sid: str = _field()
    prompt_id: str = _field("promptId")
    blocks: list[dict[str, Any]] = _field("prompt", types=list)
    text: str = _field(default="")
    meta: dict[str, Any] | None = _field(types=(dict, _NONE), default=None)
    kind: str = _field(default=FOREGROUND)
    client_id: str | None = _field("clientId", types=(str, _NONE), default=None)
    queued_at: int = _field("queuedAt", types=int, default=0)  # epoch ms of its admission
    # The W3C trace context of its sending (`traceparent`, `tracestate`: acp_state.tracing),
    # when the API traces; absent otherwise, and a reader that does not know it ignores it.
    trace: dict[str, str] | None = _field(types=(dict, _NONE), default=None, omit_none=True)

    def __post_init__(self) -> None:
        if self.kind not in TURN_KINDS:
            raise ValueError(f"turn kind {self.kind!r} is not one of {', '.join(TURN_KINDS)}")


@dataclass(frozen=True, kw_only=True)
class Cancel:
    """Cancel the session's running turn."""

    TYPE: ClassVar[str] = "cancel"
    sid: str = _field()


@dataclass(frozen=True, kw_only=True)
class Close:
    """Close the session; answered by `store.reply(request_id)`."""

    TYPE: ClassVar[str] = "close"
    sid: str = _field()
    request_id: str = _field("req")
    reason: str = _field(default=CLOSED_BY_CLIENT)


@dataclass(frozen=True, kw_only=True)
class Vote:
    """A vote on pending request `rid`, one type from route to agent: `votes.parse` makes it
    from the HTTP body, the VOTE script decides it (reading these fields from its wire form)
    and enqueues it, and the owner answers the agent with `acp_response()`."""

    TYPE: ClassVar[str] = "vote"
    sid: str = _field()
    rid: str = _field()
    selected: bool = _field(types=bool)
    option_id: str | None = _field("optionId", types=(str, _NONE), default=None)
    metadata: dict[str, Any] = _field(types=dict, default_factory=dict)  # passed through to the agent
    client_id: str | None = _field("clientId", types=(str, _NONE), default=None)

    @property
    def is_sentinel(self) -> bool:
        """Selects the mediator's own cancel option (the VOTE script refuses it)."""
        return self.selected and self.option_id == CANCEL_SENTINEL

    def acp_response(self) -> dict[str, Any]:
        """The agent's `session/request_permission` result; `answers` and any other metadata
        sit at its root, as Qwen reads them."""
        if not self.selected:
            return cancelled_response()
        return {"outcome": {"outcome": "selected", "optionId": self.option_id}, **self.metadata}


def cancelled_response() -> dict[str, Any]:
    """The `session/request_permission` result of a request answered cancelled: by a vote,
    or by the worker itself (a cancel, a close, a structured turn error, a session it does
    not host). A new dict each time: callers may hand it on."""
    return {"outcome": {"outcome": "cancelled"}}


@dataclass(frozen=True, kw_only=True)
class Attach:
    """A client registered on the session (the ATTACH script already recorded it)."""

    TYPE: ClassVar[str] = "attach"
    sid: str = _field()
    client_id: str = _field("clientId")


@dataclass(frozen=True, kw_only=True)
class Detach:
    """A client left the session (`POST /session/:id/detach`, or its presence lapsed: the
    DETACH and PRUNE_CLIENTS scripts already removed it), so that a rewrite of the session
    (a move, a restore) does not register it again."""

    TYPE: ClassVar[str] = "detach"
    sid: str = _field()
    client_id: str = _field("clientId")


@dataclass(frozen=True, kw_only=True)
class RemovePrompt:
    """Take one accepted prompt out of the session's queue (a queued one ends `cancelled`
    without running; the running one is cancelled); answered by `store.reply(request_id)`,
    ok when the prompt was still pending (`DELETE /session/:id/pending-prompts/:promptId`)."""

    TYPE: ClassVar[str] = "remove_prompt"
    sid: str = _field()
    prompt_id: str = _field("promptId")
    request_id: str = _field("req")


@dataclass(frozen=True, kw_only=True)
class SetMode:
    """Switch the agent's session mode (ACP `session/set_mode`; `POST
    /session/:id/approval-mode`); answered by `store.reply(request_id)`: ok with `previous`,
    or `mode_not_offered` with the `modes` the agent offers."""

    TYPE: ClassVar[str] = "set_mode"
    sid: str = _field()
    mode: str = _field()
    request_id: str = _field("req")
    client_id: str | None = _field("clientId", types=(str, _NONE), default=None, omit_none=True)


@dataclass(frozen=True, kw_only=True)
class Drain:
    """Drain this worker (control feed; `acp-state drain`, or its own SIGTERM): no more
    creates or loads, running turns get `grace_s` to finish, then every session moves to
    another worker."""

    TYPE: ClassVar[str] = "drain"
    grace_s: float | None = _field("graceS", types=(int, float, _NONE), default=None)


@dataclass(frozen=True, kw_only=True)
class Moving:
    """The owner's own marker in its inbox, written when it started moving the session to
    `target` (the MOVE script): every command sent to it before the move is read by then;
    those sent after wait in the session's parked stream for the new owner."""

    TYPE: ClassVar[str] = "moving"
    sid: str = _field()
    target: str = _field()


@dataclass(frozen=True, kw_only=True)
class Released:
    """The old owner of a moved session let go of it (the new owner's control feed): its
    agent was told to forget the session. The new owner's agent resumes it only after this
    (or once `owner`'s lease lapsed): two workers never drive the agent's session at once."""

    TYPE: ClassVar[str] = "released"
    sid: str = _field()
    owner: str = _field()  # the incarnation that let go


@dataclass(frozen=True, kw_only=True)
class Warm:
    """Sessions of agent `agent` (None: the default) in workspace `cwd` are about to move
    here (a drain's control command to its targets): start that agent child now, before
    they arrive."""

    TYPE: ClassVar[str] = "warm"
    cwd: str = _field()
    agent: str | None = _field(types=(str, _NONE), default=None, omit_none=True)


Command = (Create | Prompt | Cancel | Close | Vote | Attach | Detach | RemovePrompt | SetMode | Drain | Moving
           | Released | Warm)


@dataclass(frozen=True, kw_only=True)
class Reply:
    """A worker's answer to a `Create` or a `Close` (`store.reply(command.request_id, ...)`),
    taken by the API (or the draining worker) that waits for it. Its JSON is `{"ok": ...}`
    and the fields that are set, in this order: the bytes workers wrote before this type."""

    ok: bool = _field(types=bool)
    # Why not: worker_full, worker_draining, agent_not_offered, not_resumable, resume_failed,
    # agent_unavailable, session_conflict (a create); session_not_found (a close).
    code: str | None = _field(types=(str, _NONE), default=None, omit_none=True)
    error: str | None = _field(types=(str, _NONE), default=None, omit_none=True)  # the agent's own reason
    # A created (or moved) session's: when it was created, and the worker that holds it.
    created_at: str | None = _field("createdAt", types=(str, _NONE), default=None, omit_none=True)
    incarnation: str | None = _field(types=(str, _NONE), default=None, omit_none=True)
    # A set_mode's: the mode before (ok), or the modes the agent offers (mode_not_offered).
    previous: str | None = _field(types=(str, _NONE), default=None, omit_none=True)
    modes: list[str] | None = _field(types=(list, _NONE), default=None, omit_none=True)

    def encode(self) -> bytes:
        """The JSON the reply list holds."""
        return orjson.dumps(_wire(self))

    @classmethod
    def decode(cls, payload: str | bytes) -> Reply:
        """The reply a reply list held. Raises ValueError: not a JSON object, a field
        missing or of the wrong JSON type (no worker writes one)."""
        wire = orjson.loads(payload)
        if not isinstance(wire, dict):
            raise ValueError("reply is not a JSON object")
        return cls(**_values(cls, wire, "reply"))

_BY_TYPE: dict[str, type[Command]] = {
    cls.TYPE: cls
    for cls in (Create, Prompt, Cancel, Close, Vote, Attach, Detach, RemovePrompt, SetMode, Drain, Moving, Released, Warm)
}


# ---- the wire form -----------------------------------------------------------------------


def encode(command: Command) -> bytes:
    """The JSON a command stream entry carries (field `c`)."""
    return orjson.dumps({"t": command.TYPE, **_wire(command)})


def decode(payload: str | bytes) -> Command:
    """The command a stream entry carries. Raises MalformedCommand: not JSON, not an
    object, an unknown type, a required field missing, a field of the wrong JSON type.
    Keys the command does not know are ignored."""
    try:
        wire = orjson.loads(payload)
    except orjson.JSONDecodeError as error:
        raise MalformedCommand(f"command is not JSON ({error})") from None
    if not isinstance(wire, dict):
        raise MalformedCommand("command is not a JSON object")
    command_type = wire.get("t") if isinstance(wire.get("t"), str) else None
    cls = _BY_TYPE.get(command_type or "")
    if cls is None:
        raise MalformedCommand(f"unknown command type {wire.get('t')!r}", command_type)
    try:
        values = _values(cls, wire, f"{command_type} command")
    except ValueError as error:
        raise MalformedCommand(str(error), command_type) from None
    try:
        return cls(**values)
    except ValueError as error:
        raise MalformedCommand(f"{command_type} command: {error}", command_type) from None


def _wire(value: Command | Reply) -> dict[str, Any]:
    """Every field under its wire key, in declaration order (left off: None where `omit_none`)."""
    wire: dict[str, Any] = {}
    for f in fields(value):
        item = getattr(value, f.name)
        if item is None and f.metadata["omit_none"]:
            continue
        wire[f.metadata["wire"] or f.name] = item
    return wire


def _values(cls: type[Command] | type[Reply], wire: dict[str, Any], what: str) -> dict[str, Any]:
    """`cls`'s constructor arguments read from `wire`. Raises ValueError, naming `what`: a
    required field missing, a field of the wrong JSON type. Keys `cls` does not know are ignored."""
    values: dict[str, Any] = {}
    for f in fields(cls):
        key = f.metadata["wire"] or f.name
        if key not in wire:
            if f.default is MISSING and f.default_factory is MISSING:
                raise ValueError(f"{what} lacks {key!r}")
            continue
        if not isinstance(wire[key], f.metadata["types"]):
            raise ValueError(f"{what} has {key!r} of the wrong type")
        values[f.name] = wire[key]
    return values


# ---- the handling side (workers) ---------------------------------------------------------


class CommandHandler(Protocol):
    """What a worker does with each command. Each method is synchronous up to its hand-off
    (it may start a task), so commands of one session are handled in stream order."""

    def on_create(self, command: Create) -> None: ...
    def on_prompt(self, command: Prompt) -> None: ...
    def on_cancel(self, command: Cancel) -> None: ...
    def on_close(self, command: Close) -> None: ...
    def on_vote(self, command: Vote) -> None: ...
    def on_attach(self, command: Attach) -> None: ...
    def on_detach(self, command: Detach) -> None: ...
    def on_remove_prompt(self, command: RemovePrompt) -> None: ...
    def on_set_mode(self, command: SetMode) -> None: ...
    def on_drain(self, command: Drain) -> None: ...
    def on_moving(self, command: Moving) -> None: ...
    def on_released(self, command: Released) -> None: ...
    def on_warm(self, command: Warm) -> None: ...


def dispatch(handler: CommandHandler, command: Command) -> None:
    """Hand one decoded command to the handler's method for its type."""
    match command:
        case Create():
            handler.on_create(command)
        case Prompt():
            handler.on_prompt(command)
        case Cancel():
            handler.on_cancel(command)
        case Close():
            handler.on_close(command)
        case Vote():
            handler.on_vote(command)
        case Attach():
            handler.on_attach(command)
        case Detach():
            handler.on_detach(command)
        case RemovePrompt():
            handler.on_remove_prompt(command)
        case SetMode():
            handler.on_set_mode(command)
        case Drain():
            handler.on_drain(command)
        case Moving():
            handler.on_moving(command)
        case Released():
            handler.on_released(command)
        case Warm():
            handler.on_warm(command)
        case _:
            raise TypeError(f"not a command: {command!r}")
