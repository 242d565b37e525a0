"""A deterministic ACP (Agent Client Protocol v1) agent for tests: ``python -m acp_state.testing.scripted_agent``.

It uses the standard library only, so it starts in a few tens of milliseconds. It speaks
newline-delimited JSON-RPC 2.0: one compact JSON object per line on stdin and stdout. Nothing
but protocol messages goes to stdout; logs go to stderr. One process can host many sessions,
and their prompts run concurrently.

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
``session/set_mode``    -> ``{}``.
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
``ACP_SCRIPTED_STATE_DIR``  where the history is kept (created on the first write); default
                        ``$HOME/.acp-state-scripted``.
``ACP_SCRIPTED_LOAD_DELAY_S``  seconds ``session/load`` waits after its replay before it answers.
``ACP_SCRIPTED_NO_LOAD``  ``1``: ``loadSession`` is false and ``session/load`` gets -32601, like an
                        agent without the capability. History is still written.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

JSON = dict[str, Any]

LINE_LIMIT = 50 * 1024 * 1024
TICK_SECONDS = 0.05
TOOL_CALL_SECONDS = 0.005
LOOP_FOREVER_LIMIT_SECONDS = 600.0
# Qwen core stops at the sixth identical call (GLOBAL_DUPLICATE_THRESHOLD = 6).
LOOP_DUPLICATE_THRESHOLD = 6

SCRIPTED_STOP_REASONS = ("end_turn", "max_tokens", "max_turn_requests", "refusal")

INITIALIZE_RESULT: JSON = {
    "protocolVersion": 1,
    "agentCapabilities": {"loadSession": True, "promptCapabilities": {}},
    "authMethods": [],
    "agentInfo": {"name": "acp-state-scripted", "version": "1"},
}

LOOP_ERROR_MESSAGE = (
    "Tool-call loop protection stopped this turn. The session is still available; "
    "send a more specific instruction to continue."
)
LOOP_SKIPPED_TEXT = "Skipped because loop detection stopped the current turn before this tool could run."

SHELL_INPUT: JSON = {"command": "touch perm_check.txt", "description": "create a file"}
SHELL_TITLE = "touch perm_check.txt (create a file)"
SHELL_OPTIONS: list[JSON] = [
    {"optionId": "proceed_once", "name": "Allow", "kind": "allow_once"},
    {"optionId": "cancel", "name": "Reject", "kind": "reject_once"},
]

QUESTIONS: list[JSON] = [
    {
        "question": "Which color?",
        "header": "Color",
        "multiSelect": False,
        "options": [
            {"label": "Red", "description": "warm"},
            {"label": "Blue", "description": "cool"},
        ],
    }
]
QUESTION_OPTIONS: list[JSON] = [
    {"optionId": "proceed_once", "name": "Submit", "kind": "allow_once"},
    {"optionId": "cancel", "name": "Cancel", "kind": "reject_once"},
]
QUESTION_META: JSON = {"toolName": "ask_user_question"}


def log(message: str) -> None:
    """Write one diagnostic line to stderr (stdout is reserved for the protocol)."""
    print(f"scripted_agent: {message}", file=sys.stderr, flush=True)


def dumps(message: Any) -> str:
    """Compact JSON; json escapes control characters, so the line holds no raw newline."""
    return json.dumps(message, separators=(",", ":"))


class RpcError(Exception):
    """A JSON-RPC error to answer a request with."""

    def __init__(self, code: int, message: str, data: Any = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.data = data

    def to_json(self) -> JSON:
        error: JSON = {"code": self.code, "message": self.message}
        if self.data is not None:
            error["data"] = self.data
        return error


def invalid_params(message: str, data: Any = None) -> RpcError:
    return RpcError(-32602, message, data)


# --------------------------------------------------------------------------- history on disk


def history_path(session_id: str) -> str:
    """`<state dir>/sessions/<id>.jsonl`; the directory is read from the environment each time."""
    state_dir = os.environ.get("ACP_SCRIPTED_STATE_DIR") or os.path.join(
        os.path.expanduser("~"), ".acp-state-scripted"
    )
    return os.path.join(state_dir, "sessions", session_id + ".jsonl")


def append_history(session_id: str, user_text: str, agent_text: str) -> None:
    """Append one turn, its two lines in one O_APPEND write so another writer cannot split them."""
    path = history_path(session_id)
    data = "".join(
        dumps({"role": role, "text": text}) + "\n" for role, text in (("user", user_text), ("agent", agent_text))
    )
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            # No fsync: the page cache is what other processes read, and a fsync per turn
            # would stall the event loop for every session.
            os.write(fd, data.encode())
        finally:
            os.close(fd)
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


# --------------------------------------------------------------------------- transport


class Channel:
    """The JSON-RPC plumbing: ordered writes to stdout and the agent's own requests."""

    def __init__(self, record_path: str | None) -> None:
        # One writer thread: writes keep their order, whole lines never interleave, and a
        # slow reader of our stdout never blocks the event loop that reads stdin.
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stdout")
        self._next_id = 1
        self._pending: dict[int, asyncio.Future[JSON]] = {}
        self._record_fd: int | None = None
        if record_path:
            self._record_fd = os.open(record_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def record(self, message: JSON) -> None:
        """Append a received message to the record file, if any (one write, so lines stay whole)."""
        if self._record_fd is not None:
            os.write(self._record_fd, (dumps(message) + "\n").encode())

    async def send(self, message: JSON) -> None:
        """Write one message; returns once it has been flushed to stdout."""
        message = {"jsonrpc": "2.0", **message}
        data = (dumps(message) + "\n").encode()
        await asyncio.get_running_loop().run_in_executor(self._writer, _write_stdout, data)

    async def respond(self, request_id: Any, result: JSON) -> None:
        await self.send({"id": request_id, "result": result})

    async def respond_error(self, request_id: Any, error: RpcError) -> None:
        await self.send({"id": request_id, "error": error.to_json()})

    async def notify(self, method: str, params: JSON) -> None:
        await self.send({"method": method, "params": params})

    async def request(self, method: str, params: JSON) -> JSON:
        """Send an agent-to-client request and wait for the whole response message."""
        request_id = self._next_id
        self._next_id += 1
        future: asyncio.Future[JSON] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        try:
            await self.send({"id": request_id, "method": method, "params": params})
            return await future
        finally:
            self._pending.pop(request_id, None)

    def resolve(self, response: JSON) -> None:
        """Hand a client response to whoever awaits that request id."""
        request_id = response.get("id")
        future = self._pending.get(request_id) if isinstance(request_id, int) else None
        if future is None or future.done():
            log(f"response to an unknown request id: {request_id!r}")
            return
        future.set_result(response)


def _write_stdout(data: bytes) -> None:
    """Runs in the writer thread. A vanished client is logged; stdin's EOF ends the process."""
    try:
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
    except (OSError, ValueError) as exc:
        log(f"cannot write to stdout: {exc}")


async def open_stdin() -> asyncio.StreamReader:
    """An asyncio reader over stdin with a 50 MB line limit."""
    reader = asyncio.StreamReader(limit=LINE_LIMIT)
    fd = sys.stdin.fileno()
    mode = os.fstat(fd).st_mode
    if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or os.isatty(fd):
        loop = asyncio.get_running_loop()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    else:
        # epoll refuses regular files (`< script.jsonl`) and /dev/null: read them whole.
        reader.feed_data(sys.stdin.buffer.read())
        reader.feed_eof()
    return reader


def parse_line(line: bytes) -> JSON | None:
    """The JSON object on a line, or None for anything else (which is ignored)."""
    try:
        message = json.loads(line)
    except ValueError:
        if line.strip():
            log(f"ignoring a line that is not JSON: {line[:80]!r}")
        return None
    if not isinstance(message, dict):
        log(f"ignoring a JSON value that is not an object: {line[:80]!r}")
        return None
    return message


# --------------------------------------------------------------------------- sessions and turns


@dataclass
class Turn:
    """One running prompt."""

    number: int
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)

    async def pause(self, seconds: float) -> bool:
        """Sleep up to `seconds`, waking at once on cancel; return whether the turn is cancelled."""
        try:
            await asyncio.wait_for(self.cancelled.wait(), seconds)
        except TimeoutError:
            pass
        return self.cancelled.is_set()


@dataclass
class Session:
    session_id: str
    cwd: str
    prompt_count: int = 0
    turn: Turn | None = None
    # The prompt texts of the recorded turns, for #recall.
    user_texts: list[str] = field(default_factory=list)


@dataclass
class TurnContext:
    """What a scenario sees: its session, its turn, the prompt text and helpers to talk."""

    channel: Channel
    session_id: str
    turn: Turn
    text: str
    earlier: list[str] = field(default_factory=list)  # the session's earlier prompt texts
    replies: list[str] = field(default_factory=list)  # chunk texts sent, for the history

    @property
    def n(self) -> int:
        return self.turn.number

    @property
    def cancelled(self) -> bool:
        return self.turn.cancelled.is_set()

    async def pause(self, seconds: float) -> bool:
        return await self.turn.pause(seconds)

    async def update(self, update: JSON) -> None:
        await self.channel.notify("session/update", {"sessionId": self.session_id, "update": update})

    async def chunk(self, text: str) -> None:
        self.replies.append(text)
        await self.update({"sessionUpdate": "agent_message_chunk", "content": text_block(text)})

    async def tool_update(self, tool_call_id: str, status: str, text: str | None = None) -> None:
        update: JSON = {"sessionUpdate": "tool_call_update", "toolCallId": tool_call_id, "status": status}
        if text is not None:
            update["content"] = [tool_text(text)]
        await self.update(update)

    async def ask_permission(self, tool_call: JSON, options: list[JSON]) -> tuple[str | None, JSON]:
        """Ask the client; return (selected optionId or None when cancelled, the raw result).

        An optionId that was not offered fails the tool call and the prompt (-32602).
        """
        response = await self.channel.request(
            "session/request_permission",
            {"sessionId": self.session_id, "toolCall": tool_call, "options": options},
        )
        if "error" in response:
            # A client that cannot answer is treated like one that cancelled the request.
            log(f"request_permission failed: {response['error']!r}")
            return None, {}
        result = response.get("result")
        result = result if isinstance(result, dict) else {}
        try:
            return selected_option(result, options), result
        except RpcError:
            await self.tool_update(tool_call["toolCallId"], "failed")
            raise


def text_block(text: str) -> JSON:
    return {"type": "text", "text": text}


def tool_text(text: str) -> JSON:
    return {"type": "content", "content": text_block(text)}


def selected_option(result: JSON, options: list[JSON]) -> str | None:
    """The optionId the client selected, or None for a cancelled outcome."""
    outcome = result.get("outcome")
    kind = outcome.get("outcome") if isinstance(outcome, dict) else None
    if kind == "cancelled":
        return None
    if kind != "selected":
        raise invalid_params("Invalid permission outcome", {"outcome": outcome})
    option_id = outcome.get("optionId")
    if option_id not in [option["optionId"] for option in options]:
        raise invalid_params("optionId was not offered", {"optionId": option_id})
    return option_id


def prompt_text(blocks: list[Any]) -> str:
    """The concatenated text of the prompt's text blocks."""
    return "".join(
        block.get("text", "")
        for block in blocks
        if isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str)
    )


# --------------------------------------------------------------------------- scenarios

Scenario = Callable[[TurnContext, str], Awaitable[str]]


async def echo(ctx: TurnContext, _args: str) -> str:
    await ctx.chunk(ctx.text)
    return "end_turn"


async def permission(ctx: TurnContext, _args: str) -> str:
    tool_call_id = f"perm-{ctx.n}"
    await ctx.update(
        {
            "sessionUpdate": "tool_call",
            "toolCallId": tool_call_id,
            "title": SHELL_TITLE,
            "kind": "execute",
            "status": "pending",
            "rawInput": SHELL_INPUT,
            "_meta": {"toolName": "run_shell_command"},
        }
    )
    tool_call = {
        "toolCallId": tool_call_id,
        "title": SHELL_TITLE,
        "kind": "execute",
        "status": "pending",
        "content": [tool_text(SHELL_INPUT["command"])],
        "locations": [],
        "rawInput": SHELL_INPUT,
    }
    choice, _ = await ctx.ask_permission(tool_call, SHELL_OPTIONS)
    if choice == "proceed_once" and not ctx.cancelled:
        await ctx.tool_update(tool_call_id, "completed", "created perm_check.txt")
        await ctx.chunk("permission granted: proceed_once")
    elif choice == "cancel":
        await ctx.tool_update(tool_call_id, "failed", "Tool call was rejected by the user.")
        await ctx.chunk("permission rejected")
    else:
        await ctx.tool_update(tool_call_id, "failed", "Tool call was cancelled before execution.")
    # Like Qwen, a reject ends the turn; a cancelled session turns this into "cancelled".
    return "end_turn"


async def question(ctx: TurnContext, _args: str) -> str:
    tool_call_id = f"ask-{ctx.n}"
    await ctx.update(
        {
            "sessionUpdate": "tool_call",
            "toolCallId": tool_call_id,
            "title": "ask_user_question",
            "kind": "think",
            "status": "pending",
            "_meta": {**QUESTION_META, "provenance": "builtin", "phase": "preparing"},
        }
    )
    tool_call = {
        "toolCallId": tool_call_id,
        "title": f"Ask user {len(QUESTIONS)} question",
        "kind": "think",
        "status": "pending",
        "rawInput": {"questions": QUESTIONS},
        "_meta": {**QUESTION_META, "qwenInteractionKind": "user_question", "qwenQuestions": QUESTIONS},
    }
    choice, result = await ctx.ask_permission(tool_call, QUESTION_OPTIONS)
    if choice == "proceed_once":
        # Qwen reads a non-schema `answers` object at the root of the response.
        answers = result.get("answers")
        if isinstance(answers, dict) and answers:
            text = "answers: " + json.dumps(answers, sort_keys=True, separators=(",", ":"))
        else:
            text = "No valid answers were provided."
        await ctx.tool_update(tool_call_id, "completed", text)
    else:
        text = "User declined to answer the questions."
        await ctx.tool_update(tool_call_id, "failed", text)
    await ctx.chunk(text)
    return "end_turn"


def read_tool_call(tool_call_id: str) -> JSON:
    """The identical `read_file notes.txt` call that the loop scenarios repeat."""
    return {
        "sessionUpdate": "tool_call",
        "toolCallId": tool_call_id,
        "title": "read_file notes.txt",
        "kind": "read",
        "status": "pending",
        "rawInput": {"path": "notes.txt"},
        "_meta": {"toolName": "read_file"},
    }


async def run_read_call(ctx: TurnContext, tool_call_id: str) -> bool:
    """Run one read_file call; on cancel fail it and return False."""
    await ctx.update(read_tool_call(tool_call_id))
    if await ctx.pause(TOOL_CALL_SECONDS):
        await ctx.tool_update(tool_call_id, "failed", "Tool call was cancelled.")
        return False
    await ctx.tool_update(tool_call_id, "completed", "notes")
    return True


async def loop(ctx: TurnContext, _args: str) -> str:
    for i in range(1, LOOP_DUPLICATE_THRESHOLD + 1):
        if not await run_read_call(ctx, f"loop-{ctx.n}-{i}"):
            return "cancelled"
    skipped_id = f"loop-{ctx.n}-{LOOP_DUPLICATE_THRESHOLD + 1}"
    await ctx.update(read_tool_call(skipped_id))
    await ctx.tool_update(skipped_id, "failed", LOOP_SKIPPED_TEXT)
    raise RpcError(
        -32603,
        LOOP_ERROR_MESSAGE,
        {"code": "LOOP_DETECTED", "errorKind": "loop_detected", "loopType": "global_tool_call_duplicate"},
    )


async def loop_forever(ctx: TurnContext, _args: str) -> str:
    deadline = asyncio.get_running_loop().time() + LOOP_FOREVER_LIMIT_SECONDS
    i = 0
    while asyncio.get_running_loop().time() < deadline:
        i += 1
        if not await run_read_call(ctx, f"loop-{ctx.n}-{i}"):
            return "cancelled"
    return "end_turn"  # safety net, so a forgotten test cannot spin for ever


async def slow(ctx: TurnContext, args: str) -> str:
    try:
        seconds = float(args.split()[0]) if args.split() else 1.0
    except ValueError:
        raise invalid_params("#slow takes a number of seconds", {"args": args}) from None
    end = asyncio.get_running_loop().time() + seconds
    tick = 0
    while (remaining := end - asyncio.get_running_loop().time()) > 0:
        tick += 1
        await ctx.chunk(f"tick {tick}")
        if await ctx.pause(min(TICK_SECONDS, remaining)):
            return "cancelled"
    return "end_turn"


async def burst(ctx: TurnContext, args: str) -> str:
    words = args.split()
    try:
        count = int(words[0]) if words else 100
        padding = " " + "x" * int(words[1]) if len(words) > 1 else ""
    except ValueError:
        raise invalid_params("#burst takes a number of chunks and a padding size", {"args": args}) from None
    for i in range(1, count + 1):
        await ctx.chunk(f"chunk {i}{padding}")
        if ctx.cancelled:
            return "cancelled"
    return "end_turn"


async def fail(ctx: TurnContext, _args: str) -> str:
    raise RpcError(-32603, "Internal error", {"details": "scripted failure"})


async def crash(ctx: TurnContext, _args: str) -> str:
    await ctx.chunk("about to crash")  # send() returns only after the flush
    log("crashing on purpose with exit code 3")
    os._exit(3)


async def stop(ctx: TurnContext, args: str) -> str:
    reason = args.strip()
    if reason not in SCRIPTED_STOP_REASONS:
        raise invalid_params("#stop takes one of " + ", ".join(SCRIPTED_STOP_REASONS), {"args": args})
    await ctx.chunk(f"stopping with {reason}")
    return reason


async def noise(ctx: TurnContext, _args: str) -> str:
    await ctx.update({"sessionUpdate": "notice", "text": "hi"})
    await ctx.channel.notify(
        "qwen/notify/session/mode-update", {"sessionId": ctx.session_id, "modeId": "default"}
    )
    await ctx.chunk("")
    await ctx.chunk("noise done")
    return "end_turn"


async def error(ctx: TurnContext, args: str) -> str:
    parts = args.split(maxsplit=1)
    try:
        code = int(parts[0])
        data = json.loads(parts[1]) if len(parts) > 1 else None
    except (IndexError, ValueError):
        raise invalid_params("#error takes an integer code and optional JSON data", {"args": args}) from None
    raise RpcError(code, "scripted error", data)


async def recall(ctx: TurnContext, _args: str) -> str:
    await ctx.chunk("recall: " + " | ".join(ctx.earlier))
    return "end_turn"


SCENARIOS: dict[str, Scenario] = {
    "#permission": permission,
    "#question": question,
    "#loop": loop,
    "#loop-forever": loop_forever,
    "#slow": slow,
    "#burst": burst,
    "#fail": fail,
    "#crash": crash,
    "#stop": stop,
    "#noise": noise,
    "#error": error,
    "#recall": recall,
}


def pick_scenario(text: str) -> tuple[Scenario, str]:
    """The scenario named by the first word, and the rest of the text as its arguments."""
    words = text.split(maxsplit=1)
    if words and words[0] in SCENARIOS:
        return SCENARIOS[words[0]], words[1] if len(words) > 1 else ""
    return echo, text


# --------------------------------------------------------------------------- the agent


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
            handler = self.handlers.get(method)
            if handler is None:
                raise RpcError(-32601, "Method not found", {"method": method})
            result = handler(params)
        except RpcError as err:
            await self.channel.respond_error(request_id, err)
        else:
            eager = os.environ.get("ACP_SCRIPTED_EAGER_UPDATE") if method == "session/new" else None
            update = {"sessionUpdate": "available_commands_update", "availableCommands": []}
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
        return {**INITIALIZE_RESULT, "agentCapabilities": capabilities}

    def new_session(self, params: JSON) -> JSON:
        session = Session(session_id=str(uuid.uuid4()), cwd=checked_cwd(params))
        self.sessions[session.session_id] = session
        return {"sessionId": session.session_id}

    async def load_session(self, params: JSON) -> None:
        """Host a recorded session (or keep hosting it) and replay its history."""
        cwd = checked_cwd(params)
        session_id = params.get("sessionId")
        # The id becomes a file name: refuse anything that could leave the sessions directory.
        if not isinstance(session_id, str) or not session_id or os.sep in session_id or "\0" in session_id:
            raise invalid_params("sessionId must be a plain identifier", {"sessionId": session_id})
        history = read_history(session_id)
        if history is None and session_id not in self.sessions:
            # The error kind of the -32004 for an unknown session, so clients treat both alike.
            raise RpcError(-32002, f"Resource not found: {session_id}", {"errorKind": "session_not_found"})
        history = history or []  # a hosted session without a completed prompt has no file yet
        if session_id not in self.sessions:
            user_texts = [m["text"] for m in history if m["role"] == "user"]
            self.sessions[session_id] = Session(session_id, cwd, len(user_texts), user_texts=user_texts)
        for message in history:
            kind = "user_message_chunk" if message["role"] == "user" else "agent_message_chunk"
            update = {"sessionUpdate": kind, "content": text_block(message["text"])}
            await self.channel.notify("session/update", {"sessionId": session_id, "update": update})
        # A slow load (a long history to read) keeps a session mid-move for as long.
        await asyncio.sleep(float(os.environ.get("ACP_SCRIPTED_LOAD_DELAY_S") or 0))

    def set_mode(self, params: JSON) -> JSON:
        self.session(params)
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
        task = asyncio.create_task(self.run_prompt(request_id, session, ctx))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def run_prompt(self, request_id: Any, session: Session, ctx: TurnContext) -> None:
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
            session.user_texts.append(ctx.text)
            append_history(session.session_id, ctx.text, "".join(ctx.replies))
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
