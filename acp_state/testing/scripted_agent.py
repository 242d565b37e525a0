"""A deterministic ACP (Agent Client Protocol v1) agent for tests: ``python -m acp_state.testing.scripted_agent``.

It uses the standard library only, so it starts in a few tens of milliseconds. It speaks
newline-delimited JSON-RPC 2.0: one compact JSON object per line on stdin and stdout. Nothing
but protocol messages goes to stdout; logs go to stderr. One process can host many sessions,
and their prompts run concurrently.

This module holds the agent: its methods, its sessions and their history on disk. The
JSON-RPC plumbing on stdio is `acp_stdio`, the scenarios a prompt runs are `scenarios`.

Methods
-------
``initialize``          protocol version 1, ``loadSession`` true (see ``ACP_SCRIPTED_NO_LOAD``), no
                        auth methods.
``session/new``         ``{cwd (absolute), mcpServers: []}`` -> ``{"sessionId": <uuid4>}``.
``session/load``        ``{sessionId, cwd (absolute), mcpServers}``: hosts the session under the
                        same id, replays its recorded history as ``session/update`` notifications
                        (per turn a ``user_message_chunk`` then an ``agent_message_chunk``, one
                        text block each), then answers ``{}``. A session already hosted here is
                        replayed the same way. Neither hosted nor recorded: -32002 "Resource not
                        found: <id>" (``data.errorKind == "session_not_found"``).
``session/resume``      with ``ACP_SCRIPTED_RESUME=1`` (``sessionCapabilities.resume``): as
                        ``session/load``, without the replay; else -32601.
``session/set_mode``    -> ``{}`` (with ``ACP_SCRIPTED_MODES``: a ``modeId`` not offered is -32602).
``session/close``       -> ``{}``; cancels a running prompt and forgets the session (its history
                        stays on disk, so ``session/load`` brings it back).
``session/prompt``      runs a scenario, see below.
``session/cancel``      notification; the running prompt of that session answers ``cancelled``.
anything else           requests get -32601 "Method not found"; notifications are ignored,
                        and so are lines that are not JSON objects.

An unknown ``sessionId`` gets Qwen's -32004 "Session not found: <id>"
(``data.errorKind == "session_not_found"``).

History
-------
Every prompt answered with a ``stopReason`` (``cancelled`` included) appends two JSON lines to
``<state dir>/sessions/<sessionId>.jsonl``: ``{"role": "user", "text": <prompt text>}`` and
``{"role": "agent", "text": <its agent_message_chunk texts, joined>}``. They are written before
the prompt is answered, so another process started on that answer already sees them. Prompts
answered with an error, and ``#crash``, leave no trace, and a session with no such prompt has
no file. A failed write is only logged.

Each such write is also logged, one line appended to ``<state dir>/writes.log`` (one
``HistoryWrite``, packed as a compact JSON object, after the turn is on disk; ``read_writes``
reads them back): the session, the worker incarnation that sent the turn (the prompt's
``_meta["acpState.incarnation"]``, which an acp-state worker sets; else
``$ACP_STATE_INCARNATION``; else null), the wall-clock time right after the history write, the
history file's size after it (its place in the file), the turns this process knew of before
it, the agent's pid and the prompt text (its first 200 characters). The chaos checker holds
them to "dead stays dead down to the agent" (docs/chaos.md, invariant j).

Scenarios
---------
The prompt text is the concatenation of the ``text`` blocks; its first whitespace-separated
word picks the scenario. ``<n>`` in tool call ids is the prompt's number within its session
(after a load, counting on from the recorded turns).

``#permission``        Qwen-like shell tool ``perm-<n>``: a pending ``tool_call``, then
                       ``session/request_permission`` with options ``proceed_once`` (Allow) and
                       ``cancel`` (Reject). Allow -> tool completed, chunk "permission granted:
                       proceed_once"; Reject -> tool failed, chunk "permission rejected"; a
                       ``cancelled`` outcome -> tool failed. All end with ``end_turn``. An optionId
                       that was not offered -> error -32602 "optionId was not offered".
``#question``          Qwen's ask_user_question ``ask-<n>`` (one question, "Which color?"). The
                       root-level ``answers`` of the client's response is echoed as the chunk
                       ``answers: {"0":"Blue"}`` (sorted keys, compact); no answers -> "No valid
                       answers were provided."; Cancel or ``cancelled`` -> "User declined to
                       answer the questions.". ``end_turn``.
``#loop``              six identical ``read_file`` tool calls ``loop-<n>-<i>`` (pending, then
                       completed), a seventh that is skipped (failed), then Qwen's loop
                       protection error: -32603 with ``data.code == "LOOP_DETECTED"``.
``#loop-forever``      the same identical tool call every ~5 ms until ``session/cancel`` (the
                       in-flight call is failed); gives up with ``end_turn`` after 10 minutes.
``#slow [N]``          a chunk "tick <i>" every 50 ms for N seconds (default 1), ``end_turn``.
``#slow N flush``      the same; cancelled, it sends one more chunk "stopped at tick <i>"
                       before answering ``cancelled`` (an update after the cancel, as ACP allows).
``#burst [N [SIZE]]``  N chunks "chunk <i>" as fast as possible (default 100), each padded
                       with SIZE more characters, ``end_turn``.
``#fail``              error -32603 "Internal error", ``data: {"details": "scripted failure"}``.
``#crash``             one chunk "about to crash", then the process exits with code 3.
``#stop R``            one chunk, then ``stopReason`` R: end_turn, max_tokens,
                       max_turn_requests or refusal.
``#noise``             an unknown ``sessionUpdate`` variant (``notice``), a non-underscore
                       notification ``qwen/notify/session/mode-update``, an empty text chunk,
                       then the chunk "noise done" and ``end_turn``.
``#error CODE [JSON]`` error with that integer code, message "scripted error" and the JSON as data.
``#recall``            one chunk "recall: " followed by the prompt texts of all earlier recorded
                       turns of the session (loaded ones included), joined with " | ";
                       ``end_turn``.
anything else          echoes the prompt text in one ``agent_message_chunk``, ``end_turn``.

Whatever the scenario, a prompt whose session was cancelled answers ``stopReason: cancelled``
(never an error). A second prompt on a busy session gets -32602 "Session is busy processing a
turn" with ``data.errorKind == "session_busy"``. After ``session/cancel`` the agent still waits
for the client's answer to a pending permission request: the spec says the client MUST answer
it ``cancelled``, and tests should see that it does.

Environment
-----------
``ACP_SCRIPTED_RECORD``  a file path; every message received is appended to it as one JSON line.
``ACP_SCRIPTED_EAGER_UPDATE``  set: an ``available_commands_update`` for each new session right
                        after the ``session/new`` answer; ``before``: right before it.
``ACP_SCRIPTED_MODES``  comma-separated session modes ``session/new`` offers (``modes``), the first
                        current; default none.
``ACP_SCRIPTED_COMMANDS``  a JSON list of ACP ``AvailableCommand``s that update names (default ``[]``).
``ACP_SCRIPTED_STATE_DIR``  where the history (and its ``writes.log``) is kept (created on the
                        first write); default ``$HOME/.acp-state-scripted``.
``ACP_STATE_INCARNATION``  the incarnation a history write is logged with when the prompt's
                        ``_meta`` names none.
``ACP_SCRIPTED_LOAD_DELAY_S``  seconds ``session/load`` (and a resume) waits after its replay before it
                        answers, or before it says it found no such session.
``ACP_SCRIPTED_NO_LOAD``  ``1``: ``loadSession`` is false and ``session/load`` gets -32601, like an
                        agent without the capability. History is still written.
``ACP_SCRIPTED_RESUME``  ``1``: ``sessionCapabilities.resume`` is advertised and ``session/resume`` served.
``ACP_SCRIPTED_CLOSE``  ``1``: ``sessionCapabilities.close`` is advertised (``session/close`` is
                        served either way): a client that closes a session awaits its answer.
``ACP_SCRIPTED_CONTEXT_SIZE``  a context window in tokens: each prompt ends (before its answer) with
                        an ACP ``usage_update`` ``{used, size}``, ``used`` 1000 tokens per turn the
                        session has had (the recorded ones after a load included).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from .acp_stdio import JSON, LINE_LIMIT, Channel, RpcError, dumps, invalid_params, log, open_stdin, parse_line
from .scenarios import Turn, TurnContext, pick_scenario, prompt_text, text_block

INITIALIZE_RESULT: JSON = {
    "protocolVersion": 1,
    "agentCapabilities": {"loadSession": True, "promptCapabilities": {}},
    "authMethods": [],
    "agentInfo": {"name": "acp-state-scripted", "version": "1"},
}


# --------------------------------------------------------------------------- history on disk


def state_dir() -> str:
    """`$ACP_SCRIPTED_STATE_DIR`, default `~/.acp-state-scripted`; read from the environment each time."""
    return os.environ.get("ACP_SCRIPTED_STATE_DIR") or os.path.join(os.path.expanduser("~"), ".acp-state-scripted")


def history_path(session_id: str) -> str:
    """`<state dir>/sessions/<id>.jsonl`."""
    return os.path.join(state_dir(), "sessions", session_id + ".jsonl")


def writes_log_path(directory: str | None = None) -> str:
    """`<state dir>/writes.log`: one line per history write (`HistoryWrite`)."""
    return os.path.join(directory or state_dir(), "writes.log")


# The prompt `_meta` key a worker names itself with, and the fallback from the environment.
INCARNATION_META = "acpState.incarnation"
INCARNATION_ENV = "ACP_STATE_INCARNATION"
LOGGED_TEXT_CHARS = 200  # a line stays well under PIPE_BUF, so one O_APPEND write is one line


@dataclass(frozen=True)
class HistoryWrite:
    """One write of a turn to a session's history, as `<state dir>/writes.log` keeps it.

    `t` is taken right after the write (wall clock, `time.time()`), so a write is never
    stamped earlier than it was made; `end` is the history file's size right after it (the
    file is append-only, so sorting a session's writes by `end` gives their order in the
    file); `prior` is how many turns of the session this process knew of before it (what a
    `#recall` of that turn would list)."""

    session_id: str
    incarnation: str | None
    t: float
    end: int
    prior: int
    pid: int
    text: str

    def pack(self) -> str:
        """One line, no newline: `{"s","by","t","end","prior","pid","text"}`, compact JSON."""
        return dumps({"s": self.session_id, "by": self.incarnation, "t": round(self.t, 6), "end": self.end,
                      "prior": self.prior, "pid": self.pid, "text": self.text[:LOGGED_TEXT_CHARS]})

    @classmethod
    def unpack(cls, line: str | bytes) -> HistoryWrite | None:
        """The write on one line of the log, or None for a line that is not one (cut short)."""
        try:
            d = json.loads(line)
            return cls(str(d["s"]), d["by"] if isinstance(d["by"], str) else None, float(d["t"]), int(d["end"]),
                       int(d["prior"]), int(d["pid"]), str(d["text"]))
        except (ValueError, TypeError, KeyError):
            return None


def read_writes(directory: str | None = None) -> list[HistoryWrite]:
    """Every history write logged under a state dir (default: this process's), in log order."""
    try:
        with open(writes_log_path(directory), "rb") as file:
            lines = file.read().splitlines()
    except FileNotFoundError:
        return []
    return [w for w in map(HistoryWrite.unpack, lines) if w is not None]


def _append(path: str, data: bytes) -> int:
    """One O_APPEND write (creating the file and its folder); the file's size right after it."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        # No fsync: the page cache is what other processes read, and a fsync per turn
        # would stall the event loop for every session.
        os.write(fd, data)
        return os.lseek(fd, 0, os.SEEK_CUR)  # O_APPEND put our bytes at the end: where they end
    finally:
        os.close(fd)


def append_history(session_id: str, user_text: str, agent_text: str, incarnation: str | None = None,
                   prior: int = 0) -> None:
    """Append one turn, its two lines in one O_APPEND write so another writer cannot split
    them; then log the write (`HistoryWrite`) to `<state dir>/writes.log`."""
    data = "".join(
        dumps({"role": role, "text": text}) + "\n" for role, text in (("user", user_text), ("agent", agent_text))
    )
    try:
        end = _append(history_path(session_id), data.encode())
        write = HistoryWrite(session_id, incarnation, time.time(), end, prior, os.getpid(), user_text)
        _append(writes_log_path(), (write.pack() + "\n").encode())
    except OSError as exc:
        # An unwritable HOME must not break the prompts of tests that never load.
        log(f"cannot record the history of {session_id}: {exc}")


def read_history(session_id: str) -> list[JSON] | None:
    """The recorded messages of a session, or None when it has no history file.

    Lines that are not whole messages (a write still under way) are skipped.
    """
    try:
        with open(history_path(session_id), encoding="utf-8") as file:
            lines = file.read().splitlines()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:  # answered, so the client does not wait for ever
        raise RpcError(-32603, "Internal error", {"details": f"cannot read the history: {exc}"}) from None
    messages = [parse_line(line.encode()) for line in lines]
    return [m for m in messages if m and m.get("role") in ("user", "agent") and isinstance(m.get("text"), str)]


# --------------------------------------------------------------------------- sessions


@dataclass
class Session:
    session_id: str
    cwd: str
    prompt_count: int = 0
    turn: Turn | None = None
    # The prompt texts of the recorded turns, for #recall.
    user_texts: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- the agent


def offered_modes() -> list[str]:
    """The session modes a new session offers (``ACP_SCRIPTED_MODES``, comma-separated; the
    first is current), none by default."""
    return [mode for mode in (os.environ.get("ACP_SCRIPTED_MODES") or "").split(",") if mode]


def advertised_commands() -> list[JSON]:
    """The commands a new session's ``available_commands_update`` names (``ACP_SCRIPTED_MODES``  comma-separated session modes ``session/new`` offers (``modes``), the first
                        current; default none.
``ACP_SCRIPTED_COMMANDS``)."""
    commands = json.loads(os.environ.get("ACP_SCRIPTED_COMMANDS") or "[]")
    if not isinstance(commands, list):
        raise SystemExit("ACP_SCRIPTED_COMMANDS must be a JSON list")
    return commands


def modes_answer() -> JSON:
    """`{modes}` of a session/new or resume answer (``ACP_SCRIPTED_MODES``), or nothing."""
    modes = offered_modes()
    if not modes:
        return {}
    return {"modes": {"currentModeId": modes[0], "availableModes": [{"id": m, "name": m.title()} for m in modes]}}


def checked_cwd(params: JSON) -> str:
    """The absolute `cwd` of session/new or session/load, whose `mcpServers` must be a list."""
    cwd = params.get("cwd")
    if not isinstance(cwd, str) or not os.path.isabs(cwd):
        raise invalid_params("cwd must be an absolute path", {"cwd": cwd})
    if not isinstance(params.get("mcpServers"), list):
        raise invalid_params("mcpServers must be a list", {"mcpServers": params.get("mcpServers")})
    return cwd


class ScriptedAgent:
    """Dispatches incoming messages and runs prompts as tasks."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.sessions: dict[str, Session] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.can_load = os.environ.get("ACP_SCRIPTED_NO_LOAD") != "1"
        self.can_resume = os.environ.get("ACP_SCRIPTED_RESUME") == "1"
        self.handlers: dict[str, Callable[[JSON], JSON]] = {
            "initialize": self.initialize,
            "session/new": self.new_session,
            "session/set_mode": self.set_mode,
            "session/close": self.close_session,
        }

    async def handle(self, message: JSON) -> None:
        method = message.get("method")
        if isinstance(method, str):
            params = message.get("params")
            params = params if isinstance(params, dict) else {}
            if "id" in message:
                await self.on_request(message["id"], method, params)
            else:
                self.on_notification(method, params)
        elif "id" in message and ("result" in message or "error" in message):
            self.channel.resolve(message)
        else:
            log(f"ignoring a message that is no request, notification or response: {dumps(message)[:200]}")

    async def on_request(self, request_id: Any, method: str, params: JSON) -> None:
        try:
            if method == "session/prompt":
                self.start_prompt(request_id, params)  # its task answers later
                return
            if method == "session/load" and self.can_load:
                await self.load_session(params)  # replays, so it sends before its answer
                await self.channel.respond(request_id, {})
                return
            if method == "session/resume" and self.can_resume:
                await self.load_session(params, replay=False)
                await self.channel.respond(request_id, modes_answer())  # as Qwen Code: the session's modes
                return
            handler = self.handlers.get(method)
            if handler is None:
                raise RpcError(-32601, "Method not found", {"method": method})
            result = handler(params)
        except RpcError as err:
            await self.channel.respond_error(request_id, err)
        else:
            eager = os.environ.get("ACP_SCRIPTED_EAGER_UPDATE") if method == "session/new" else None
            update = {"sessionUpdate": "available_commands_update", "availableCommands": advertised_commands()}
            if eager == "before":
                # As Copilot does: an update for the new session before the answer that names it.
                await self.channel.notify("session/update", {"sessionId": result["sessionId"], "update": update})
            await self.channel.respond(request_id, result)
            if eager and eager != "before":
                # As Qwen Code, Claude Code and Copilot do: an update right behind the answer,
                # which reaches the client before it has published the session.
                await self.channel.notify("session/update", {"sessionId": result["sessionId"], "update": update})

    def on_notification(self, method: str, params: JSON) -> None:
        if method == "session/cancel":
            session = self.find_session(params)
            if session is not None and session.turn is not None:
                session.turn.cancelled.set()
        else:
            log(f"ignoring notification {method}")

    # ------------------------------------------------------------------ plain methods

    def initialize(self, params: JSON) -> JSON:
        capabilities = {**INITIALIZE_RESULT["agentCapabilities"], "loadSession": self.can_load}
        session_capabilities: JSON = {}
        if self.can_resume:
            session_capabilities["resume"] = {}
        if os.environ.get("ACP_SCRIPTED_CLOSE") == "1":
            session_capabilities["close"] = {}
        if session_capabilities:
            capabilities["sessionCapabilities"] = session_capabilities
        return {**INITIALIZE_RESULT, "agentCapabilities": capabilities}

    def new_session(self, params: JSON) -> JSON:
        session = Session(session_id=str(uuid.uuid4()), cwd=checked_cwd(params))
        self.sessions[session.session_id] = session
        return {"sessionId": session.session_id, **modes_answer()}

    async def load_session(self, params: JSON, replay: bool = True) -> None:
        """Host a recorded session (or keep hosting it) and replay its history (`session/resume`: not)."""
        cwd = checked_cwd(params)
        session_id = params.get("sessionId")
        # The id becomes a file name: refuse anything that could leave the sessions directory.
        if not isinstance(session_id, str) or not session_id or os.sep in session_id or "\0" in session_id:
            raise invalid_params("sessionId must be a plain identifier", {"sessionId": session_id})
        history = read_history(session_id)
        if history is None and session_id not in self.sessions:
            # A slow load is as slow to find nothing (a test's resume that fails stays under
            # way while the test sends what must wait for it).
            await asyncio.sleep(float(os.environ.get("ACP_SCRIPTED_LOAD_DELAY_S") or 0))
            # The error kind of the -32004 for an unknown session, so clients treat both alike.
            raise RpcError(-32002, f"Resource not found: {session_id}", {"errorKind": "session_not_found"})
        history = history or []  # a hosted session without a completed prompt has no file yet
        if session_id not in self.sessions:
            user_texts = [m["text"] for m in history if m["role"] == "user"]
            self.sessions[session_id] = Session(session_id, cwd, len(user_texts), user_texts=user_texts)
        for message in history if replay else []:
            kind = "user_message_chunk" if message["role"] == "user" else "agent_message_chunk"
            update = {"sessionUpdate": kind, "content": text_block(message["text"])}
            await self.channel.notify("session/update", {"sessionId": session_id, "update": update})
        # A slow load (a long history to read) keeps a session mid-move for as long.
        await asyncio.sleep(float(os.environ.get("ACP_SCRIPTED_LOAD_DELAY_S") or 0))

    def set_mode(self, params: JSON) -> JSON:
        self.session(params)
        modes = offered_modes()
        if modes and params.get("modeId") not in modes:
            raise invalid_params("modeId is not one of the session's modes", {"modeId": params.get("modeId")})
        return {}

    def close_session(self, params: JSON) -> JSON:
        session = self.find_session(params)
        if session is not None:
            del self.sessions[session.session_id]
            if session.turn is not None:
                session.turn.cancelled.set()
        return {}

    def find_session(self, params: JSON) -> Session | None:
        session_id = params.get("sessionId")
        return self.sessions.get(session_id) if isinstance(session_id, str) else None

    def session(self, params: JSON) -> Session:
        """The session named in `params`, or Qwen's error for an unknown session."""
        session = self.find_session(params)
        if session is None:
            session_id = params.get("sessionId")
            raise RpcError(-32004, f"Session not found: {session_id}", {"errorKind": "session_not_found"})
        return session

    # ------------------------------------------------------------------ prompts

    def start_prompt(self, request_id: Any, params: JSON) -> None:
        """Check the prompt at once (so a busy session is seen in order) and run it as a task."""
        session = self.session(params)
        blocks = params.get("prompt")
        if not isinstance(blocks, list):
            raise invalid_params("prompt must be a list of content blocks")
        if session.turn is not None:
            raise invalid_params("Session is busy processing a turn", {"errorKind": "session_busy"})
        session.prompt_count += 1
        turn = Turn(number=session.prompt_count)
        session.turn = turn
        ctx = TurnContext(self.channel, session.session_id, turn, prompt_text(blocks), list(session.user_texts))
        meta = params.get("_meta") if isinstance(params.get("_meta"), dict) else {}
        incarnation = meta.get(INCARNATION_META) or os.environ.get(INCARNATION_ENV) or None
        task = asyncio.create_task(self.run_prompt(request_id, session, ctx, incarnation))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def run_prompt(
        self, request_id: Any, session: Session, ctx: TurnContext, incarnation: str | None = None
    ) -> None:
        scenario, args = pick_scenario(ctx.text)
        response: JSON
        try:
            stop_reason = await scenario(ctx, args)
            response = {"id": request_id, "result": {"stopReason": stop_reason}}
        except RpcError as err:
            response = {"id": request_id, "error": err.to_json()}
        except Exception as exc:  # a bug here must still answer the prompt
            log(f"scenario raised {exc!r}")
            internal = RpcError(-32603, "Internal error", {"details": str(exc)})
            response = {"id": request_id, "error": internal.to_json()}
        if ctx.cancelled:
            # The spec: after session/cancel the answer MUST be "cancelled", never an error.
            response = {"id": request_id, "result": {"stopReason": "cancelled"}}
        if "result" in response:
            # Before the answer: a process started on it must already find the turn on disk.
            prior = len(session.user_texts)
            session.user_texts.append(ctx.text)
            append_history(session.session_id, ctx.text, "".join(ctx.replies),
                           incarnation if isinstance(incarnation, str) else None, prior)
        size = os.environ.get("ACP_SCRIPTED_CONTEXT_SIZE")
        if size and "result" in response:  # how full the context window is now
            used = {"sessionUpdate": "usage_update", "used": 1000 * len(session.user_texts), "size": int(size)}
            await self.channel.notify("session/update", {"sessionId": session.session_id, "update": used})
        # Free the session before answering: the client may send its next prompt at once.
        session.turn = None
        await self.channel.send(response)


async def serve() -> None:
    """Read stdin line by line until EOF and dispatch every message."""
    reader = await open_stdin()
    channel = Channel(os.environ.get("ACP_SCRIPTED_RECORD"))
    agent = ScriptedAgent(channel)
    while True:
        try:
            line = await reader.readline()
        except ValueError:
            log(f"ignoring a line longer than {LINE_LIMIT} bytes")
            continue
        if not line:
            break
        message = parse_line(line)
        if message is None:
            continue
        channel.record(message)
        try:
            await agent.handle(message)
        except Exception as exc:  # one odd message must not take the other sessions down
            log(f"failed to handle {dumps(message)[:200]}: {exc!r}")
    log("stdin closed, exiting")


def main() -> None:
    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
