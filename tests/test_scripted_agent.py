"""Drive the real scripted ACP agent (`python -m acp_state.testing.scripted_agent`) with raw JSON lines."""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import time
import uuid
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import pytest
import pytest_asyncio

pytestmark = pytest.mark.asyncio

REPO = Path(__file__).resolve().parent.parent
TIMEOUT = 5.0

JSON = dict[str, Any]


class AgentProcess:
    """A running scripted agent: send JSON lines, read JSON lines with a timeout."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self._next_id = 100  # clearly apart from the agent's own request ids, which start at 1

    @classmethod
    async def start(cls, env: dict[str, str] | None = None) -> AgentProcess:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "acp_state.testing.scripted_agent",
            cwd=REPO,
            env=env,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            limit=16 * 1024 * 1024,
        )
        return cls(proc)

    async def send(self, message: JSON | str) -> None:
        line = message if isinstance(message, str) else json.dumps(message)
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        await self.proc.stdin.drain()

    async def request(self, method: str, params: JSON | None = None) -> int:
        """Send a request and return its id (read the answer with `until_response`)."""
        self._next_id += 1
        await self.send({"jsonrpc": "2.0", "id": self._next_id, "method": method, "params": params or {}})
        return self._next_id

    async def notify(self, method: str, params: JSON) -> None:
        await self.send({"jsonrpc": "2.0", "method": method, "params": params})

    async def answer(self, request_id: int, result: JSON) -> None:
        await self.send({"jsonrpc": "2.0", "id": request_id, "result": result})

    async def recv(self, timeout: float = TIMEOUT) -> JSON:
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        assert line, "agent closed stdout"
        assert line.endswith(b"\n") and line.count(b"\n") == 1
        message = json.loads(line)
        assert message["jsonrpc"] == "2.0"
        return message

    async def until(self, predicate: Callable[[JSON], bool], timeout: float = TIMEOUT) -> list[JSON]:
        """All messages up to and including the first one matching `predicate`."""
        seen: list[JSON] = []
        async with asyncio.timeout(timeout):
            while True:
                seen.append(await self.recv())
                if predicate(seen[-1]):
                    return seen

    async def until_response(self, request_id: int, timeout: float = TIMEOUT) -> tuple[list[JSON], JSON]:
        """(messages before it, the response) for one of our requests."""
        seen = await self.until(lambda m: m.get("id") == request_id and "method" not in m, timeout)
        return seen[:-1], seen[-1]

    async def until_agent_request(self, method: str) -> tuple[list[JSON], JSON]:
        seen = await self.until(lambda m: m.get("method") == method and "id" in m)
        return seen[:-1], seen[-1]

    async def call(self, method: str, params: JSON | None = None) -> JSON:
        """A request whose response comes back right away; returns the response."""
        _, response = await self.until_response(await self.request(method, params))
        return response

    async def new_session(self) -> str:
        response = await self.call("session/new", {"cwd": str(REPO), "mcpServers": []})
        return response["result"]["sessionId"]

    async def prompt(self, session_id: str, text: str) -> int:
        params = {"sessionId": session_id, "prompt": [{"type": "text", "text": text}]}
        return await self.request("session/prompt", params)

    async def close(self) -> None:
        if self.proc.returncode is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                await asyncio.wait_for(self.proc.wait(), TIMEOUT)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


def scripted_env(state_dir: Path, **extra: str) -> dict[str, str]:
    """The environment with a private history directory: tests never write under the real HOME."""
    return {**os.environ, "ACP_SCRIPTED_STATE_DIR": str(state_dir), **extra}


@pytest_asyncio.fixture
async def agent(tmp_path: Path) -> AsyncIterator[AgentProcess]:
    process = await AgentProcess.start(env=scripted_env(tmp_path / "state"))
    await process.call("initialize", {"protocolVersion": 1, "clientCapabilities": {}})
    yield process
    await process.close()


def updates(messages: list[JSON], session_id: str) -> list[JSON]:
    """The `update` objects of the session/update notifications for one session."""
    found = []
    for message in messages:
        if message.get("method") == "session/update":
            assert "id" not in message
            if message["params"]["sessionId"] == session_id:
                found.append(message["params"]["update"])
    return found


def chunk_texts(messages: list[JSON], session_id: str) -> list[str]:
    chunks = [u for u in updates(messages, session_id) if u["sessionUpdate"] == "agent_message_chunk"]
    return [u["content"]["text"] for u in chunks]


async def test_initialize_and_new_session(tmp_path: Path) -> None:
    process = await AgentProcess.start(env=scripted_env(tmp_path))
    try:
        response = await process.call("initialize", {"protocolVersion": 1})
        assert response["result"] == {
            "protocolVersion": 1,
            "agentCapabilities": {"loadSession": True, "promptCapabilities": {}},
            "authMethods": [],
            "agentInfo": {"name": "acp-state-scripted", "version": "1"},
        }
        first, second = await process.new_session(), await process.new_session()
        assert first != second
        assert str(uuid.UUID(first)) == first
        response = await process.call("session/set_mode", {"sessionId": first, "modeId": "default"})
        assert response["result"] == {}
        assert (await process.call("session/close", {"sessionId": second}))["result"] == {}
    finally:
        await process.close()
    assert process.proc.returncode == 0


async def test_echo(agent: AgentProcess) -> None:
    session_id = await agent.new_session()
    request_id = await agent.request(
        "session/prompt",
        {
            "sessionId": session_id,
            "prompt": [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}],
        },
    )
    before, response = await agent.until_response(request_id)
    assert response["result"] == {"stopReason": "end_turn"}
    assert updates(before, session_id) == [
        {"sessionUpdate": "agent_message_chunk", "content": {"type": "text", "text": "hello world"}}
    ]


async def test_large_prompt_and_unknown_session(agent: AgentProcess) -> None:
    session_id = await agent.new_session()
    text = "x" * (3 * 1024 * 1024)  # far above asyncio's default 64 KB line limit
    before, response = await agent.until_response(await agent.prompt(session_id, text))
    assert response["result"] == {"stopReason": "end_turn"}
    assert chunk_texts(before, session_id) == [text]
    _, response = await agent.until_response(await agent.prompt(str(uuid.uuid4()), "hi"))
    assert response["error"]["code"] == -32004
    assert response["error"]["data"] == {"errorKind": "session_not_found"}


async def test_permission_approved(agent: AgentProcess) -> None:
    session_id = await agent.new_session()
    prompt_id = await agent.prompt(session_id, "#permission please")
    before, ask = await agent.until_agent_request("session/request_permission")
    [tool_call] = updates(before, session_id)
    assert tool_call["sessionUpdate"] == "tool_call"
    assert tool_call["status"] == "pending" and tool_call["kind"] == "execute"
    assert tool_call["_meta"] == {"toolName": "run_shell_command"}
    assert ask["id"] == 1  # the agent's own ids count from 1
    params = ask["params"]
    assert params["sessionId"] == session_id
    assert params["toolCall"]["toolCallId"] == tool_call["toolCallId"]
    assert params["toolCall"]["rawInput"] == {"command": "touch perm_check.txt", "description": "create a file"}
    assert [o["optionId"] for o in params["options"]] == ["proceed_once", "cancel"]

    await agent.answer(ask["id"], {"outcome": {"outcome": "selected", "optionId": "proceed_once"}})
    before, response = await agent.until_response(prompt_id)
    assert response["result"] == {"stopReason": "end_turn"}
    tool_update, _ = updates(before, session_id)
    assert tool_update["status"] == "completed"
    assert chunk_texts(before, session_id) == ["permission granted: proceed_once"]


async def test_permission_rejected(agent: AgentProcess) -> None:
    session_id = await agent.new_session()
    prompt_id = await agent.prompt(session_id, "#permission")
    _, ask = await agent.until_agent_request("session/request_permission")
    await agent.answer(ask["id"], {"outcome": {"outcome": "selected", "optionId": "cancel"}})
    before, response = await agent.until_response(prompt_id)
    assert response["result"] == {"stopReason": "end_turn"}
    assert updates(before, session_id)[0]["status"] == "failed"
    assert chunk_texts(before, session_id) == ["permission rejected"]


async def test_permission_option_not_offered(agent: AgentProcess) -> None:
    session_id = await agent.new_session()
    prompt_id = await agent.prompt(session_id, "#permission")
    _, ask = await agent.until_agent_request("session/request_permission")
    await agent.answer(ask["id"], {"outcome": {"outcome": "selected", "optionId": "proceed_always"}})
    _, response = await agent.until_response(prompt_id)
    assert response["error"]["code"] == -32602
    assert response["error"]["message"] == "optionId was not offered"


async def test_permission_cancelled_session(agent: AgentProcess) -> None:
    session_id = await agent.new_session()
    prompt_id = await agent.prompt(session_id, "#permission")
    _, ask = await agent.until_agent_request("session/request_permission")
    await agent.notify("session/cancel", {"sessionId": session_id})
    await agent.answer(ask["id"], {"outcome": {"outcome": "cancelled"}})
    before, response = await agent.until_response(prompt_id)
    assert response["result"] == {"stopReason": "cancelled"}
    assert updates(before, session_id)[-1]["status"] == "failed"


async def test_question_answers_echoed(agent: AgentProcess) -> None:
    session_id = await agent.new_session()
    prompt_id = await agent.prompt(session_id, "#question")
    before, ask = await agent.until_agent_request("session/request_permission")
    [tool_call] = updates(before, session_id)
    assert tool_call["kind"] == "think"
    assert tool_call["_meta"] == {"toolName": "ask_user_question", "provenance": "builtin", "phase": "preparing"}
    asked = ask["params"]["toolCall"]
    assert asked["title"] == "Ask user 1 question"
    assert asked["_meta"]["qwenInteractionKind"] == "user_question"
    assert asked["_meta"]["qwenQuestions"][0]["question"] == "Which color?"
    assert asked["rawInput"] == {"questions": asked["_meta"]["qwenQuestions"]}
    assert [o["name"] for o in ask["params"]["options"]] == ["Submit", "Cancel"]

    await agent.answer(
        ask["id"], {"outcome": {"outcome": "selected", "optionId": "proceed_once"}, "answers": {"0": "Blue"}}
    )
    before, response = await agent.until_response(prompt_id)
    assert response["result"] == {"stopReason": "end_turn"}
    assert updates(before, session_id)[0]["status"] == "completed"
    assert chunk_texts(before, session_id) == ['answers: {"0":"Blue"}']


async def test_question_declined(agent: AgentProcess) -> None:
    session_id = await agent.new_session()
    prompt_id = await agent.prompt(session_id, "#question")
    _, ask = await agent.until_agent_request("session/request_permission")
    await agent.answer(ask["id"], {"outcome": {"outcome": "selected", "optionId": "cancel"}})
    before, response = await agent.until_response(prompt_id)
    assert response["result"] == {"stopReason": "end_turn"}
    assert chunk_texts(before, session_id) == ["User declined to answer the questions."]


async def test_loop_error_shape(agent: AgentProcess) -> None:
    session_id = await agent.new_session()
    prompt_id = await agent.prompt(session_id, "#loop")
    before, response = await agent.until_response(prompt_id)
    assert response["error"] == {
        "code": -32603,
        "message": "Tool-call loop protection stopped this turn. The session is still available; "
        "send a more specific instruction to continue.",
        "data": {"code": "LOOP_DETECTED", "errorKind": "loop_detected", "loopType": "global_tool_call_duplicate"},
    }
    seen = updates(before, session_id)
    calls = [u for u in seen if u["sessionUpdate"] == "tool_call"]
    assert len(calls) == 7
    assert len({json.dumps(c["rawInput"]) for c in calls}) == 1
    finals = [u for u in seen if u["sessionUpdate"] == "tool_call_update"]
    assert [u["status"] for u in finals] == ["completed"] * 6 + ["failed"]
    assert finals[-1]["content"][0]["content"]["text"].startswith("Skipped because loop detection")
    # The session is still usable afterwards.
    _, response = await agent.until_response(await agent.prompt(session_id, "again"))
    assert response["result"] == {"stopReason": "end_turn"}


@pytest.mark.parametrize("flush", [False, True], ids=["plain", "flush"])
async def test_slow_cancelled(agent: AgentProcess, flush: bool) -> None:
    """Cancelled, `#slow` answers `cancelled`; with `flush` it first says one more word."""
    session_id = await agent.new_session()
    prompt_id = await agent.prompt(session_id, "#slow 30 flush" if flush else "#slow 30")
    await agent.until(lambda m: m.get("method") == "session/update")
    await agent.notify("session/cancel", {"sessionId": session_id})
    before, response = await agent.until_response(prompt_id, timeout=2.0)
    assert response["result"] == {"stopReason": "cancelled"}
    texts = chunk_texts(before, session_id)
    ticks = texts[:-1] if flush else texts
    assert all(text.startswith("tick ") for text in ticks), texts
    if flush:
        assert texts and re.fullmatch(r"stopped at tick \d+", texts[-1]), texts


async def test_loop_forever_cancelled(agent: AgentProcess) -> None:
    session_id = await agent.new_session()
    prompt_id = await agent.prompt(session_id, "#loop-forever")
    seen = await agent.until(lambda m: m.get("params", {}).get("update", {}).get("toolCallId") == "loop-1-3")
    completed = [u["toolCallId"] for u in updates(seen, session_id) if u["status"] == "completed"]
    assert completed == ["loop-1-1", "loop-1-2"]
    await agent.notify("session/cancel", {"sessionId": session_id})
    before, response = await agent.until_response(prompt_id, timeout=2.0)
    assert response["result"] == {"stopReason": "cancelled"}
    assert updates(before, session_id)[-1]["status"] == "failed"


async def test_fail_error_shape(agent: AgentProcess) -> None:
    session_id = await agent.new_session()
    _, response = await agent.until_response(await agent.prompt(session_id, "#fail"))
    assert response["error"] == {"code": -32603, "message": "Internal error", "data": {"details": "scripted failure"}}


async def test_error_and_stop_scenarios(agent: AgentProcess) -> None:
    session_id = await agent.new_session()
    _, response = await agent.until_response(await agent.prompt(session_id, '#error 429 {"retry": 1}'))
    assert response["error"] == {"code": 429, "message": "scripted error", "data": {"retry": 1}}
    before, response = await agent.until_response(await agent.prompt(session_id, "#stop refusal"))
    assert response["result"] == {"stopReason": "refusal"}
    assert len(chunk_texts(before, session_id)) == 1


async def test_noise(agent: AgentProcess) -> None:
    session_id = await agent.new_session()
    before, response = await agent.until_response(await agent.prompt(session_id, "#noise"))
    assert response["result"] == {"stopReason": "end_turn"}
    assert any(m.get("method") == "qwen/notify/session/mode-update" for m in before)
    assert {"sessionUpdate": "notice", "text": "hi"} in updates(before, session_id)
    assert chunk_texts(before, session_id) == ["", "noise done"]


async def test_crash_exit_code(agent: AgentProcess) -> None:
    session_id = await agent.new_session()
    await agent.prompt(session_id, "#crash")
    message = await agent.recv()
    assert message["params"]["update"]["content"]["text"] == "about to crash"
    assert await asyncio.wait_for(agent.proc.wait(), TIMEOUT) == 3


async def test_busy_second_prompt(agent: AgentProcess) -> None:
    session_id = await agent.new_session()
    first = await agent.prompt(session_id, "#slow 30")
    second = await agent.prompt(session_id, "hello")
    _, response = await agent.until_response(second)
    assert response["error"] == {
        "code": -32602,
        "message": "Session is busy processing a turn",
        "data": {"errorKind": "session_busy"},
    }
    await agent.notify("session/cancel", {"sessionId": session_id})
    _, response = await agent.until_response(first)
    assert response["result"] == {"stopReason": "cancelled"}


async def test_unknown_method_and_garbage(agent: AgentProcess) -> None:
    await agent.send("this is not json")
    await agent.send("[1, 2, 3]")
    await agent.notify("_vendor/unknown", {"x": 1})
    response = await agent.call("craft/drainMidTurnQueue", {})
    assert response["error"]["code"] == -32601
    assert response["error"]["message"] == "Method not found"


async def test_two_sessions_concurrently(agent: AgentProcess) -> None:
    held, other = await agent.new_session(), await agent.new_session()
    held_prompt = await agent.prompt(held, "#permission")
    _, ask = await agent.until_agent_request("session/request_permission")
    # The first session waits on its permission; the second still runs whole turns.
    _, response = await agent.until_response(await agent.prompt(other, "#slow 0.2"))
    assert response["result"] == {"stopReason": "end_turn"}
    await agent.answer(ask["id"], {"outcome": {"outcome": "selected", "optionId": "proceed_once"}})
    _, response = await agent.until_response(held_prompt)
    assert response["result"] == {"stopReason": "end_turn"}

    # Two streaming turns interleave.
    first, second = await agent.prompt(held, "#slow 0.3"), await agent.prompt(other, "#slow 0.3")
    seen = await agent.until(lambda m: m.get("id") in (first, second))
    assert updates(seen, held) and updates(seen, other)
    rest = await agent.until(lambda m: m.get("id") in (first, second))
    assert {seen[-1]["id"], rest[-1]["id"]} == {first, second}


async def test_record_file(tmp_path: Path) -> None:
    record = tmp_path / "received.jsonl"
    process = await AgentProcess.start(env=scripted_env(tmp_path / "state", ACP_SCRIPTED_RECORD=str(record)))
    try:
        await process.call("initialize", {"protocolVersion": 1})
        session_id = await process.new_session()
        await process.until_response(await process.prompt(session_id, "hi"))
    finally:
        await process.close()
    methods = [json.loads(line)["method"] for line in record.read_text().splitlines()]
    assert methods == ["initialize", "session/new", "session/prompt"]


# --------------------------------------------------------------------------- session/load


def replayed(text_pairs: list[tuple[str, str]]) -> list[JSON]:
    """The updates a load replays for these (user, agent) turns."""
    found = []
    for user, reply in text_pairs:
        found.append({"sessionUpdate": "user_message_chunk", "content": {"type": "text", "text": user}})
        found.append({"sessionUpdate": "agent_message_chunk", "content": {"type": "text", "text": reply}})
    return found


async def load(process: AgentProcess, session_id: str) -> tuple[list[JSON], JSON]:
    params = {"sessionId": session_id, "cwd": str(REPO), "mcpServers": []}
    return await process.until_response(await process.request("session/load", params))


async def test_load_after_the_first_process_exited(tmp_path: Path) -> None:
    first = await AgentProcess.start(env=scripted_env(tmp_path))
    try:
        await first.call("initialize", {"protocolVersion": 1})
        session_id = await first.new_session()
        for text in ("remember PELICAN", "#fail", "#stop max_tokens"):
            await first.until_response(await first.prompt(session_id, text))
    finally:
        await first.close()
    lines = (tmp_path / "sessions" / f"{session_id}.jsonl").read_text().splitlines()
    assert [json.loads(line)["role"] for line in lines] == ["user", "agent"] * 2  # the error left no turn

    second = await AgentProcess.start(env=scripted_env(tmp_path))
    try:
        response = await second.call("initialize", {"protocolVersion": 1})
        assert response["result"]["agentCapabilities"]["loadSession"] is True
        before, response = await load(second, session_id)
        assert response["result"] == {}
        history = [("remember PELICAN", "remember PELICAN"), ("#stop max_tokens", "stopping with max_tokens")]
        assert updates(before, session_id) == replayed(history)
        before, response = await second.until_response(await second.prompt(session_id, "#recall"))
        assert response["result"] == {"stopReason": "end_turn"}
        recall = "recall: remember PELICAN | #stop max_tokens"
        assert chunk_texts(before, session_id) == [recall]
        # Loading a session this process already hosts replays again, now with the new turn.
        before, response = await load(second, session_id)
        assert response["result"] == {}
        assert updates(before, session_id) == replayed([*history, ("#recall", recall)])
        # Tool call numbers go on from the recorded turns.
        await second.prompt(session_id, "#permission")
        _, ask = await second.until_agent_request("session/request_permission")
        assert ask["params"]["toolCall"]["toolCallId"] == "perm-4"
        await second.answer(ask["id"], {"outcome": {"outcome": "selected", "optionId": "cancel"}})
    finally:
        await second.close()


async def test_history_is_written_before_the_prompt_answer(tmp_path: Path) -> None:
    first = await AgentProcess.start(env=scripted_env(tmp_path))
    second = None
    try:
        await first.call("initialize", {"protocolVersion": 1})
        session_id = await first.new_session()
        _, response = await first.until_response(await first.prompt(session_id, "remember PELICAN"))
        assert response["result"] == {"stopReason": "end_turn"}
        # Read on the answer, with the first process still running: the turn is already there.
        assert len((tmp_path / "sessions" / f"{session_id}.jsonl").read_text().splitlines()) == 2
        second = await AgentProcess.start(env=scripted_env(tmp_path))
        await second.call("initialize", {"protocolVersion": 1})
        before, response = await load(second, session_id)
        assert response["result"] == {}
        assert updates(before, session_id) == replayed([("remember PELICAN", "remember PELICAN")])
        before, _ = await second.until_response(await second.prompt(session_id, "#recall"))
        assert chunk_texts(before, session_id) == ["recall: remember PELICAN"]
    finally:
        await first.close()
        if second is not None:
            await second.close()


async def test_load_unknown_session(agent: AgentProcess) -> None:
    unknown = str(uuid.uuid4())
    _, response = await load(agent, unknown)
    assert response["error"] == {
        "code": -32002,
        "message": f"Resource not found: {unknown}",
        "data": {"errorKind": "session_not_found"},
    }
    # It did not become hosted.
    _, response = await agent.until_response(await agent.prompt(unknown, "hi"))
    assert response["error"]["code"] == -32004
    # A session hosted here but without a completed prompt has no file, and still loads.
    session_id = await agent.new_session()
    before, response = await load(agent, session_id)
    assert response["result"] == {} and updates(before, session_id) == []
    _, response = await load(agent, "../escape")
    assert response["error"]["code"] == -32602


async def test_no_load_capability(tmp_path: Path) -> None:
    process = await AgentProcess.start(env=scripted_env(tmp_path, ACP_SCRIPTED_NO_LOAD="1"))
    try:
        response = await process.call("initialize", {"protocolVersion": 1})
        assert response["result"]["agentCapabilities"]["loadSession"] is False
        session_id = await process.new_session()
        await process.until_response(await process.prompt(session_id, "hi"))
        assert (tmp_path / "sessions" / f"{session_id}.jsonl").exists()  # still recorded
        _, response = await load(process, session_id)
        assert response["error"]["code"] == -32601
        assert response["error"]["message"] == "Method not found"
    finally:
        await process.close()


async def test_state_dir_defaults_to_home(tmp_path: Path) -> None:
    env = {**os.environ, "HOME": str(tmp_path)}
    env.pop("ACP_SCRIPTED_STATE_DIR", None)
    process = await AgentProcess.start(env=env)
    try:
        await process.call("initialize", {"protocolVersion": 1})
        session_id = await process.new_session()
        assert not (tmp_path / ".acp-state-scripted").exists()  # created on the first write only
        await process.until_response(await process.prompt(session_id, "hi"))
    finally:
        await process.close()
    assert (tmp_path / ".acp-state-scripted" / "sessions" / f"{session_id}.jsonl").exists()


async def test_every_history_write_is_logged_with_the_incarnation_that_sent_the_turn(tmp_path: Path) -> None:
    """`<state dir>/writes.log`: one `HistoryWrite` per turn written, stamped with the prompt's
    `_meta["acpState.incarnation"]` (else `$ACP_STATE_INCARNATION`), the time right after the
    write, its place in the file and the turns the writer knew of: a child that kept a
    session while another wrote to it (a stale child) is seen to lose that turn."""
    from acp_state.testing.scripted_agent import HistoryWrite, read_writes

    first = await AgentProcess.start(env=scripted_env(tmp_path, ACP_STATE_INCARNATION="w-env"))
    second = await AgentProcess.start(env=scripted_env(tmp_path))
    try:
        for process in (first, second):
            await process.call("initialize", {"protocolVersion": 1})
        session_id = await first.new_session()
        meta = {"sessionId": session_id, "prompt": [{"type": "text", "text": "one k=a"}], "_meta": {
            "acpState.incarnation": "w-1", "other": True}}
        before = time.time()
        await first.until_response(await first.request("session/prompt", meta))
        await first.until_response(await first.prompt(session_id, "#fail"))  # an error: no write
        await first.until_response(await first.prompt(session_id, "two"))  # no _meta: the environment's
        await load(second, session_id)
        third = {**meta, "prompt": [{"type": "text", "text": "three"}], "_meta": {"acpState.incarnation": "w-2"}}
        await second.until_response(await second.request("session/prompt", third))
        # The first child still hosts the session, and never heard of turn three.
        await first.until_response(await first.prompt(session_id, "four"))
    finally:
        await first.close()
        await second.close()
    writes = read_writes(str(tmp_path))
    assert [(w.incarnation, w.text, w.prior, w.session_id) for w in writes] == [
        ("w-1", "one k=a", 0, session_id), ("w-env", "two", 1, session_id), ("w-2", "three", 2, session_id),
        ("w-env", "four", 2, session_id),
    ]
    assert [w.pid for w in writes] == [first.proc.pid, first.proc.pid, second.proc.pid, first.proc.pid]
    history = (tmp_path / "sessions" / f"{session_id}.jsonl").read_bytes()
    ends = [w.end for w in writes]
    assert ends == sorted(ends) and ends[-1] == len(history)  # each write's place in the file
    # Turn "four" is the file's fourth, but its writer knew of two turns before it: it lost one.
    assert [sum(1 for other in writes if other.end < w.end) for w in writes] == [0, 1, 2, 3]
    assert before <= writes[0].t <= writes[1].t <= writes[2].t <= writes[3].t
    # The format: one compact JSON line per write, read back as it was packed.
    lines = (tmp_path / "writes.log").read_text().splitlines()
    assert [HistoryWrite.unpack(line) for line in lines] == writes
    assert json.loads(lines[0]).keys() == {"s", "by", "t", "end", "prior", "pid", "text"}
    assert HistoryWrite.unpack('{"s": "x", "by"') is None
    long = HistoryWrite("s", None, 1.5, 10, 0, 1, "x" * 1000)
    assert HistoryWrite.unpack(long.pack()) == HistoryWrite("s", None, 1.5, 10, 0, 1, "x" * 200)


async def test_a_worker_names_the_incarnation_that_sends_each_turn(harness: Any, workspace: str) -> None:
    """Through a real worker: the prompt's `_meta["acpState.incarnation"]` is the worker's
    incarnation (whatever the client's `_meta` said), so the agent's write log names it."""
    from acp_state.testing.scripted_agent import read_writes
    from tests.helpers import create

    worker = await harness.worker()
    api = await harness.api()
    watcher = await harness.events()
    sid = (await create(api, workspace))["sessionId"]
    text = f"note k={uuid.uuid4()}"
    body = {"prompt": [{"type": "text", "text": text}], "_meta": {"acpState.incarnation": "a client's claim"}}
    response = await api.client.post(f"/session/{sid}/prompt", json=body)
    assert response.status_code == 202, response.text
    prompt_id = response.json()["promptId"]
    done = await watcher.wait_for(lambda e: e["type"] in ("turn_complete", "turn_error")
                                  and e["data"].get("promptId") == prompt_id)
    assert done["type"] == "turn_complete"
    (written,) = [w for w in read_writes(os.environ["ACP_SCRIPTED_STATE_DIR"]) if w.text == text]
    assert written.incarnation == worker.incarnation and written.prior == 0
