"""The scripted agent's scenarios (acp_state/testing/scripted_agent.py, "Scenarios"): what a
prompt does, picked by its first word, and what a scenario sees of its turn (its session,
the prompt text, and the calls that send updates and ask for a permission). Standard library
only, as the agent.
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from .acp_stdio import JSON, Channel, RpcError, invalid_params, log

TICK_SECONDS = 0.05
TOOL_CALL_SECONDS = 0.005
LOOP_FOREVER_LIMIT_SECONDS = 600.0
# Qwen core stops at the sixth identical call (GLOBAL_DUPLICATE_THRESHOLD = 6).
LOOP_DUPLICATE_THRESHOLD = 6

SCRIPTED_STOP_REASONS = ("end_turn", "max_tokens", "max_turn_requests", "refusal")

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


# --------------------------------------------------------------------------- turns


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
    words = args.split()
    try:
        seconds = float(words[0]) if words else 1.0
    except ValueError:
        raise invalid_params("#slow takes a number of seconds", {"args": args}) from None
    flush = words[1:] == ["flush"]
    end = asyncio.get_running_loop().time() + seconds
    tick = 0
    while (remaining := end - asyncio.get_running_loop().time()) > 0:
        tick += 1
        await ctx.chunk(f"tick {tick}")
        if await ctx.pause(min(TICK_SECONDS, remaining)):
            if flush:  # as an agent that flushes its stream: a last word after the cancel
                await ctx.chunk(f"stopped at tick {tick}")
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
