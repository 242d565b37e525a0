"""A scripted model endpoint on loopback that real coding agents talk to offline: the agent
matrix's agents, and Qwen Code under the reference daemon, our worker and the benches.

The standard library (and the scripted agent's question, acp_state.testing) only. One
threaded HTTP server speaks four model APIs, each streamed the way its agents require:

* OpenAI chat completions  ``POST …/chat/completions`` (SSE ``data:`` chunks, or JSON);
* OpenAI Responses         ``POST …/responses`` (SSE with ``event:`` lines);
* Anthropic Messages       ``POST …/messages`` (SSE with ``event:`` lines; ``count_tokens``);
* Gemini                   ``POST …/models/M:streamGenerateContent?alt=sse`` and
  ``…:generateContent`` (JSON; the router's JSON-mode side call).

Each request is read into one `Turn` (the last user text, whether the last item is a tool
result, the tools on offer) and answered by the same script, so every agent gets the same
story whatever API it speaks. The last user text picks it (see `Script.reply`):

``PERM``   one shell tool call ``touch perm_check.txt`` (the agent asks permission), then "done";
``QUESTION`` one ``ask_user_question`` call (Qwen Code asks the user the scripted agent's question);
``LOOP``   the same read-only tool call, identical every time, for ever;
``WRITE``  one write of a new file ``written.txt`` (the agent may ask permission), then "done";
``SLOW``   text, one short piece every 100 ms for up to a minute (cancel it mid-turn);
otherwise  the text ``hello from the scripted model``.

A tool result as the last item is answered "done" (except in a loop). A tool call is only
scripted when the request offers that tool; otherwise the reply is the text (agents make
some side calls without tools).

Every request is kept (`requests`, and `turns` as the script read them), so a test can ask
what an agent sent its model.
"""

from __future__ import annotations

import itertools
import json
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterator

from acp_state.testing.scenarios import QUESTIONS

MODEL = "fake-model"
HELLO = "hello from the scripted model"
DONE = "done"
SHELL_COMMAND = "touch perm_check.txt"
LOOP_FILE = "loop_target.txt"  # the file every loop call reads (the test creates it)
SLOW_PIECES = 600
SLOW_PIECE_S = 0.1

# Tool names, most specific first: the shell each agent offers, and a read-only tool.
SHELL_TOOLS = ("run_shell_command", "shell", "Bash", "bash", "execute_command", "shell_command", "exec_command",
               "run_commands")
READ_TOOLS = ("read_file", "Read", "read", "view", "read_text_file", "read_files")
WRITE_TOOLS = ("write_file", "Write", "write", "create")
QUESTION_TOOLS = ("ask_user_question",)
WRITE_FILE = "written.txt"  # a file that does not exist before the write (gemini reads it first)


# ---- what a request asks --------------------------------------------------------------


@dataclass
class Tool:
    name: str
    schema: dict[str, Any]


@dataclass
class Turn:
    """A model request in the script's terms, whatever API it came in."""

    api: str
    user_text: str
    after_tool_result: bool
    tools: list[Tool]
    stream: bool
    raw: dict[str, Any] = field(repr=False, default_factory=dict)

    def tool(self, names: tuple[str, ...]) -> Tool | None:
        by_name = {t.name: t for t in self.tools}
        return next((by_name[n] for n in names if n in by_name), None)


@dataclass
class Reply:
    """What the script answers: text (maybe slow), or one tool call."""

    text: str | None = None
    tool: str | None = None
    arguments: dict[str, Any] | None = None
    slow: bool = False


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(_text_of(p.get("text") or p.get("content") or "") for p in content if isinstance(p, dict))
    return ""


def message_text(message: dict[str, Any]) -> str:
    """The text of a chat message whose content is a string or a list of parts."""
    return _text_of(message.get("content"))


def _props(schema: dict[str, Any]) -> dict[str, Any]:
    return schema.get("properties") or {}


def shell_arguments(schema: dict[str, Any]) -> dict[str, Any]:
    """Arguments that fit a shell tool's schema (a command string, or argv for codex)."""
    props = _props(schema)
    if "commands" in props:  # cline: a list of whole command lines
        return {"commands": [SHELL_COMMAND]}
    key = "command" if "command" in props or not props else next((k for k in ("cmd", "script") if k in props), "command")
    is_argv = (props.get(key) or {}).get("type") == "array"
    args: dict[str, Any] = {key: ["bash", "-lc", SHELL_COMMAND] if is_argv else SHELL_COMMAND}
    if "sandbox_permissions" in props:
        # codex: its sandbox needs bubblewrap, absent here; a model asks to run unsandboxed,
        # which codex turns into a permission request.
        args["sandbox_permissions"] = "require_escalated"
        args["justification"] = "create a file"
    for name, prop in props.items():
        if name in args or name not in (schema.get("required") or []) and name not in ("description",):
            continue
        kind = prop.get("type")
        if name == "requires_approval":
            args[name] = True  # cline: ask the user
        elif kind == "boolean":
            args[name] = False
        elif kind == "string":
            args[name] = "create a file"
        elif kind in ("integer", "number"):
            args[name] = 10_000
    return args


def read_arguments(schema: dict[str, Any], cwd: str | None) -> dict[str, Any]:
    """Arguments that fit a read tool's schema: the loop target, by absolute path."""
    props = _props(schema)
    path = f"{cwd}/{LOOP_FILE}" if cwd else LOOP_FILE
    if "files" in props:  # cline: a list of read requests
        return {"files": [{"path": path}]}
    key = next((k for k in ("absolute_path", "file_path", "filePath", "path") if k in props), "path")
    return {key: path}


def write_arguments(schema: dict[str, Any], cwd: str | None) -> dict[str, Any]:
    """Arguments that fit a write tool's schema: a new file, by absolute path."""
    props = _props(schema)
    path = f"{cwd}/{WRITE_FILE}" if cwd else WRITE_FILE
    key = next((k for k in ("file_path", "absolute_path", "filePath", "path") if k in props), "path")
    text = next((k for k in ("content", "contents", "file_text", "text") if k in props), "content")
    return {key: path, text: "written by the scripted model\n"}


class Script:
    """The default story (see the module docstring); a test may subclass it."""

    def __init__(self) -> None:
        self.cwd: str | None = None  # the workspace, for absolute paths in tool calls

    def reply(self, turn: Turn) -> Reply:
        text = turn.user_text
        if "LOOP" in text:
            tool = turn.tool(READ_TOOLS)
            if tool is not None:
                return Reply(tool=tool.name, arguments=read_arguments(tool.schema, self.cwd))
            shell = turn.tool(SHELL_TOOLS)
            if shell is not None:
                args = shell_arguments(shell.schema)
                key = next(iter(args))
                args[key] = ["cat", LOOP_FILE] if isinstance(args[key], list) else f"cat {LOOP_FILE}"
                return Reply(tool=shell.name, arguments=args)
        if turn.after_tool_result:
            return Reply(text=DONE)
        if "PERM" in text:
            tool = turn.tool(SHELL_TOOLS)
            if tool is not None:
                return Reply(tool=tool.name, arguments=shell_arguments(tool.schema))
        if "QUESTION" in text:
            tool = turn.tool(QUESTION_TOOLS)
            if tool is not None:  # the scripted agent's question, so both agents' flows read alike
                return Reply(tool=tool.name, arguments={"questions": QUESTIONS})
        if "WRITE" in text:
            tool = turn.tool(WRITE_TOOLS)
            if tool is not None:
                return Reply(tool=tool.name, arguments=write_arguments(tool.schema, self.cwd))
        if "SLOW" in text:
            return Reply(text="slow ", slow=True)
        return Reply(text=HELLO)


# ---- the four APIs: reading a request ------------------------------------------------


def openai_chat_turn(body: dict[str, Any]) -> Turn:
    messages = body.get("messages") or []
    tools = [Tool(t.get("function", {}).get("name", ""), t.get("function", {}).get("parameters") or {})
             for t in body.get("tools") or []]
    user = next((_text_of(m.get("content")) for m in reversed(messages) if m.get("role") == "user"), "")
    after = bool(messages) and messages[-1].get("role") == "tool"
    return Turn("openai-chat", user, after, tools, bool(body.get("stream")), body)


def responses_turn(body: dict[str, Any]) -> Turn:
    items = body.get("input") or []
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    tools = [Tool(t.get("name", ""), t.get("parameters") or {}) for t in body.get("tools") or [] if t.get("name")]
    user = next((_text_of(i.get("content")) for i in reversed(items)
                 if i.get("role") == "user" and "<environment_context>" not in _text_of(i.get("content"))), "")
    last = items[-1] if items else {}
    after = last.get("type") in ("function_call_output", "custom_tool_call_output", "local_shell_call_output")
    return Turn("responses", user, after, tools, bool(body.get("stream", True)), body)


def anthropic_turn(body: dict[str, Any]) -> Turn:
    messages = body.get("messages") or []
    tools = [Tool(t.get("name", ""), t.get("input_schema") or {}) for t in body.get("tools") or []]

    def user_text(message: dict[str, Any]) -> str:
        content = message.get("content")
        if isinstance(content, str):
            return content
        return "".join(b.get("text", "") for b in content or [] if b.get("type") == "text")

    users = [m for m in messages if m.get("role") == "user"]
    user = next((user_text(m) for m in reversed(users) if user_text(m).strip()), "")
    last = messages[-1] if messages else {}
    content = last.get("content")
    after = last.get("role") == "user" and isinstance(content, list) and any(
        b.get("type") == "tool_result" for b in content)
    return Turn("anthropic", user, after, tools, bool(body.get("stream")), body)


def gemini_turn(body: dict[str, Any], stream: bool) -> Turn:
    contents = body.get("contents") or []
    tools = [Tool(d.get("name", ""), d.get("parametersJsonSchema") or d.get("parameters") or {})
             for t in body.get("tools") or [] for d in t.get("functionDeclarations") or []]

    def text(c: dict[str, Any]) -> str:
        return "".join(p.get("text", "") for p in c.get("parts") or [] if isinstance(p, dict))

    user = next((text(c) for c in reversed(contents) if c.get("role", "user") == "user" and text(c).strip()), "")
    last = contents[-1] if contents else {}
    after = any("functionResponse" in p for p in last.get("parts") or [])
    return Turn("gemini", user, after, tools, stream, body)


# ---- the four APIs: writing a reply ---------------------------------------------------


def _sse(data: Any, event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data)}\n\n".encode()


def _pieces(reply: Reply) -> Iterator[str]:
    """The reply's text as it streams: slowly, piece by piece, for a slow reply."""
    if reply.slow:
        for i in range(SLOW_PIECES):
            yield f"{reply.text}{i} "
            time.sleep(SLOW_PIECE_S)
    elif reply.text is not None:
        yield reply.text


def openai_chat_stream(reply: Reply, n: int, model: str, usage: bool = True) -> Iterator[bytes]:
    base = {"id": f"chatcmpl-{n}", "object": "chat.completion.chunk", "created": int(time.time()), "model": model}

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        return _sse({**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})

    yield chunk({"role": "assistant", "content": ""})
    if reply.tool:
        call = {"index": 0, "id": f"call_{n}", "type": "function",
                "function": {"name": reply.tool, "arguments": json.dumps(reply.arguments)}}
        yield chunk({"tool_calls": [call]})
    for piece in _pieces(reply):
        yield chunk({"content": piece})
    yield chunk({}, "tool_calls" if reply.tool else "stop")
    if usage:  # as OpenAI: a last chunk with the usage, only when the request asks for it
        yield _sse({**base, "choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}})
    yield b"data: [DONE]\n\n"


def openai_chat_json(reply: Reply, n: int, model: str) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": "".join(_pieces(reply)) if not reply.tool else None}
    if reply.tool:
        message["tool_calls"] = [{"id": f"call_{n}", "type": "function",
                                  "function": {"name": reply.tool, "arguments": json.dumps(reply.arguments)}}]
    return {"id": f"chatcmpl-{n}", "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if reply.tool else "stop"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}}


def responses_stream(reply: Reply, n: int, model: str) -> Iterator[bytes]:
    rid = f"resp_{n}"
    response = {"id": rid, "object": "response", "created_at": int(time.time()), "model": model,
                "status": "in_progress", "output": []}
    seq = itertools.count()

    def event(kind: str, **data: Any) -> bytes:
        return _sse({"type": kind, "sequence_number": next(seq), **data}, kind)

    yield event("response.created", response=response)
    if reply.tool:
        item = {"type": "function_call", "id": f"fc_{n}", "call_id": f"call_{n}", "name": reply.tool,
                "arguments": json.dumps(reply.arguments), "status": "completed"}
        yield event("response.output_item.added", output_index=0, item={**item, "arguments": ""})
        yield event("response.function_call_arguments.done", output_index=0, item_id=item["id"],
                    arguments=item["arguments"])
        yield event("response.output_item.done", output_index=0, item=item)
        output = [item]
    else:
        mid = f"msg_{n}"
        yield event("response.output_item.added", output_index=0,
                    item={"type": "message", "id": mid, "role": "assistant", "status": "in_progress", "content": []})
        text = ""
        for piece in _pieces(reply):
            text += piece
            yield event("response.output_text.delta", output_index=0, content_index=0, item_id=mid, delta=piece)
        part = {"type": "output_text", "text": text, "annotations": []}
        item = {"type": "message", "id": mid, "role": "assistant", "status": "completed", "content": [part]}
        yield event("response.output_text.done", output_index=0, content_index=0, item_id=mid, text=text)
        yield event("response.output_item.done", output_index=0, item=item)
        output = [item]
    usage = {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 5,
             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 15}
    yield event("response.completed", response={**response, "status": "completed", "output": output, "usage": usage})


def anthropic_stream(reply: Reply, n: int, model: str) -> Iterator[bytes]:
    message = {"id": f"msg_{n}", "type": "message", "role": "assistant", "model": model, "content": [],
               "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 10, "output_tokens": 1}}
    yield _sse({"type": "message_start", "message": message}, "message_start")
    if reply.tool:
        block = {"type": "tool_use", "id": f"toolu_{n}", "name": reply.tool, "input": {}}
        yield _sse({"type": "content_block_start", "index": 0, "content_block": block}, "content_block_start")
        delta = {"type": "input_json_delta", "partial_json": json.dumps(reply.arguments)}
        yield _sse({"type": "content_block_delta", "index": 0, "delta": delta}, "content_block_delta")
    else:
        block = {"type": "text", "text": ""}
        yield _sse({"type": "content_block_start", "index": 0, "content_block": block}, "content_block_start")
        for piece in _pieces(reply):
            delta = {"type": "text_delta", "text": piece}
            yield _sse({"type": "content_block_delta", "index": 0, "delta": delta}, "content_block_delta")
    yield _sse({"type": "content_block_stop", "index": 0}, "content_block_stop")
    stop = "tool_use" if reply.tool else "end_turn"
    yield _sse({"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None},
                "usage": {"output_tokens": 5}}, "message_delta")
    yield _sse({"type": "message_stop"}, "message_stop")


def anthropic_json(reply: Reply, n: int, model: str) -> dict[str, Any]:
    content: list[dict[str, Any]]
    if reply.tool:
        content = [{"type": "tool_use", "id": f"toolu_{n}", "name": reply.tool, "input": reply.arguments}]
    else:
        content = [{"type": "text", "text": "".join(_pieces(reply))}]
    return {"id": f"msg_{n}", "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": "tool_use" if reply.tool else "end_turn", "stop_sequence": None,
            "usage": {"input_tokens": 10, "output_tokens": 5}}


def _gemini_chunk(parts: list[dict[str, Any]], finish: str | None) -> dict[str, Any]:
    candidate: dict[str, Any] = {"content": {"role": "model", "parts": parts}, "index": 0}
    if finish:
        candidate["finishReason"] = finish
    return {"candidates": [candidate], "modelVersion": MODEL,
            "usageMetadata": {"promptTokenCount": 10, "candidatesTokenCount": 5, "totalTokenCount": 15}}


def gemini_stream(reply: Reply) -> Iterator[bytes]:
    if reply.tool:
        yield _sse(_gemini_chunk([{"functionCall": {"name": reply.tool, "args": reply.arguments}}], "STOP"))
        return
    pieces = list(_pieces(reply)) if not reply.slow else None
    if pieces is not None:
        yield _sse(_gemini_chunk([{"text": "".join(pieces)}], "STOP"))
        return
    for piece in _pieces(reply):
        yield _sse(_gemini_chunk([{"text": piece}], None))
    yield _sse(_gemini_chunk([{"text": ""}], "STOP"))


def gemini_json(turn: Turn, reply: Reply) -> dict[str, Any]:
    config = turn.raw.get("generationConfig") or {}
    if config.get("responseMimeType") == "application/json":
        # A side call (the model router, a next-speaker check): a JSON object that fits any
        # schema we have seen: pick the flash model, and the user speaks next.
        answer = {"reasoning": "scripted", "model_choice": "flash", "next_speaker": "user",
                  "complexity_reasoning": "scripted", "complexity_score": 1}
        return _gemini_chunk([{"text": json.dumps(answer)}], "STOP")
    if reply.tool:
        return _gemini_chunk([{"functionCall": {"name": reply.tool, "args": reply.arguments}}], "STOP")
    return _gemini_chunk([{"text": "".join(_pieces(reply))}], "STOP")


# ---- the server ----------------------------------------------------------------------


class _QuietServer(ThreadingHTTPServer):
    """Threaded; ignores clients hanging up (agents abort superseded and cancelled requests)."""

    daemon_threads = True
    allow_reuse_address = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)


class ModelEndpoint:
    """The scripted endpoint: `with ModelEndpoint() as model:` serves on a free loopback port."""

    def __init__(self, script: Script | None = None, host: str = "127.0.0.1") -> None:
        self.script = script or Script()
        self.requests: list[tuple[str, dict[str, Any]]] = []  # (path, body), in order
        self.turns: list[Turn] = []
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._server = _QuietServer((host, 0), self._handler_class())
        self._thread: threading.Thread | None = None
        self.slow_started = threading.Event()  # a slow reply began streaming

    @property
    def url(self) -> str:
        """`http://127.0.0.1:PORT` (agents append their own API paths, or take one below)."""
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def openai_url(self) -> str:
        """The `OPENAI_BASE_URL` of an agent that speaks OpenAI chat completions (Qwen Code)."""
        return f"{self.url}/v1"

    @property
    def chat_requests(self) -> list[dict[str, Any]]:
        """The bodies of the OpenAI chat-completions requests, in order (all Qwen Code sends)."""
        with self._lock:
            return [body for path, body in self.requests if path.split("?")[0].rstrip("/").endswith("/chat/completions")]

    def start(self) -> ModelEndpoint:
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> ModelEndpoint:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _turn(self, turn: Turn) -> tuple[Reply, int]:
        with self._lock:
            self.turns.append(turn)
            n = next(self._ids)
        reply = self.script.reply(turn)
        if reply.slow:
            self.slow_started.set()
        return reply, n

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass

            def _json(self, status: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _stream(self, events: Iterator[bytes]) -> None:
                # No length: the stream ends when the connection closes (HTTP/1.1 allows it).
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Connection", "close")
                self.end_headers()
                self.close_connection = True
                for data in events:
                    self.wfile.write(data)
                    self.wfile.flush()

            def do_GET(self) -> None:
                path = self.path.split("?")[0].rstrip("/")
                if path.endswith("/models"):
                    model = {"id": MODEL, "object": "model", "created": 0, "owned_by": "scripted",
                             "name": f"models/{MODEL}", "display_name": MODEL, "type": "model"}
                    self._json(200, {"object": "list", "data": [model], "models": [model]})
                else:
                    self._json(404, {"error": {"message": f"no route for GET {self.path}", "type": "not_found"}})

            def do_HEAD(self) -> None:
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                try:
                    body = json.loads(raw or b"{}")
                except ValueError:
                    self._json(400, {"error": {"message": "invalid JSON body", "type": "invalid_request_error"}})
                    return
                path, _, query = self.path.partition("?")
                path = path.rstrip("/")
                with endpoint._lock:
                    endpoint.requests.append((self.path, body))
                model = body.get("model") or MODEL
                if path.endswith("/chat/completions"):
                    reply, n = endpoint._turn(turn := openai_chat_turn(body))
                    if turn.stream:
                        usage = bool((body.get("stream_options") or {}).get("include_usage"))
                        self._stream(openai_chat_stream(reply, n, model, usage))
                    else:
                        self._json(200, openai_chat_json(reply, n, model))
                elif path.endswith("/responses"):
                    reply, n = endpoint._turn(responses_turn(body))
                    self._stream(responses_stream(reply, n, model))
                elif path.endswith("/messages/count_tokens"):
                    self._json(200, {"input_tokens": 10})
                elif path.endswith("/messages"):
                    reply, n = endpoint._turn(turn := anthropic_turn(body))
                    if turn.stream:
                        self._stream(anthropic_stream(reply, n, model))
                    else:
                        self._json(200, anthropic_json(reply, n, model))
                elif ":streamGenerateContent" in path:
                    reply, _ = endpoint._turn(gemini_turn(body, True))
                    self._stream(gemini_stream(reply))
                elif ":generateContent" in path:
                    turn = gemini_turn(body, False)
                    json_mode = (body.get("generationConfig") or {}).get("responseMimeType") == "application/json"
                    reply = Reply(text=HELLO) if json_mode else endpoint._turn(turn)[0]
                    self._json(200, gemini_json(turn, reply))
                elif ":countTokens" in path:
                    self._json(200, {"totalTokens": 10})
                else:
                    self._json(404, {"error": {"message": f"no route for POST {self.path}", "type": "not_found"}})

        return Handler

