"""A scripted OpenAI-compatible chat-completions server for driving Qwen Code offline.

Standard library only. Replies are chosen from the last message of each request:

* last message is a tool result (role ``tool``)  -> plain text ``"done"``;
* last user text contains ``PERM``               -> one ``run_shell_command`` call
  (``touch perm_check.txt``), which needs a permission in ``default`` mode;
* last user text contains ``QUESTION``           -> one ``ask_user_question`` call;
* anything else                                  -> plain text ``"hello from fake llm"``.

A tool call is only scripted when the request offers that tool; otherwise the
reply falls back to plain text (Qwen makes some side calls without tools).
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from acp_state.testing.scenarios import QUESTIONS as SCRIPTED_QUESTIONS

MODEL = "fake-model"
# scripts/test installs the pinned reference (tests/node/package.json) here.
QWEN_LOCAL = Path(__file__).resolve().parent.parent / "tests" / "node" / "node_modules" / ".bin" / "qwen"
QWEN_FALLBACK = "/opt/qwen/node_modules/.bin/qwen"
SHELL_TOOL = "run_shell_command"
QUESTION_TOOL = "ask_user_question"
SHELL_COMMAND = "touch perm_check.txt"
# The same question the scripted agent asks, so both agents' flows read alike.
QUESTIONS = SCRIPTED_QUESTIONS


def message_text(message: dict[str, Any]) -> str:
    """Return the text of a chat message whose content is a string or a list of parts."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def tool_names(request: dict[str, Any]) -> list[str]:
    """Return the function names offered in a request's ``tools`` list."""
    return [t.get("function", {}).get("name", "") for t in request.get("tools") or []]


def tool_schema(request: dict[str, Any], name: str) -> dict[str, Any] | None:
    """Return the JSON schema of the parameters of tool ``name``, if offered."""
    for tool in request.get("tools") or []:
        function = tool.get("function", {})
        if function.get("name") == name:
            return function.get("parameters") or {}
    return None


def shell_arguments(schema: dict[str, Any]) -> dict[str, Any]:
    """Build shell-tool arguments that fit the advertised schema."""
    props = schema.get("properties", {})
    args: dict[str, Any] = {"command": SHELL_COMMAND}
    if "description" in props or not props:
        args["description"] = "create a file"
    if "is_background" in props:
        args["is_background"] = False
    return args


class _QuietServer(ThreadingHTTPServer):
    """Threaded server that ignores clients hanging up (Qwen aborts superseded requests)."""

    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)


class FakeOpenAI:
    """Threaded loopback server implementing ``/v1/chat/completions`` and ``/v1/models``."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.requests: list[dict[str, Any]] = []  # every chat request body, in order
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._server = _QuietServer((host, port), self._handler_class())
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        """The ``OPENAI_BASE_URL`` to hand to Qwen."""
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/v1"

    def start(self) -> "FakeOpenAI":
        """Serve in a daemon thread; returns self."""
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Shut the server down and close its socket."""
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> "FakeOpenAI":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- scripting -------------------------------------------------------

    def reply_for(self, request: dict[str, Any]) -> dict[str, Any]:
        """Return ``{"content": str}`` or ``{"tool_call": (name, args)}`` for a request."""
        messages = request.get("messages") or []
        if messages and messages[-1].get("role") == "tool":
            return {"content": "done"}
        text = next((message_text(m) for m in reversed(messages) if m.get("role") == "user"), "")
        if "PERM" in text:
            schema = tool_schema(request, SHELL_TOOL)
            if schema is not None:
                return {"tool_call": (SHELL_TOOL, shell_arguments(schema))}
        if "QUESTION" in text and tool_schema(request, QUESTION_TOOL) is not None:
            return {"tool_call": (QUESTION_TOOL, {"questions": QUESTIONS})}
        return {"content": "hello from fake llm"}

    def _next_id(self) -> int:
        with self._lock:
            return next(self._ids)

    def completion(self, request: dict[str, Any]) -> tuple[str, bytes]:
        """Build the response (content type, body) for one chat-completions request."""
        with self._lock:
            self.requests.append(request)
        reply = self.reply_for(request)
        n = self._next_id()
        base = {"id": f"chatcmpl-{n}", "created": int(time.time()), "model": request.get("model", MODEL)}
        usage = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
        tool_calls = None
        if "tool_call" in reply:
            name, args = reply["tool_call"]
            tool_calls = [{
                "index": 0,
                "id": f"call_{n}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(args)},
            }]
        finish = "tool_calls" if tool_calls else "stop"

        if not request.get("stream"):
            message: dict[str, Any] = {"role": "assistant", "content": reply.get("content")}
            if tool_calls:
                message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in tool_calls]
            body = {**base, "object": "chat.completion", "usage": usage,
                    "choices": [{"index": 0, "message": message, "finish_reason": finish}]}
            return "application/json", json.dumps(body).encode()

        def chunk(delta: dict[str, Any], finish_reason: str | None = None, **extra: Any) -> str:
            body = {**base, "object": "chat.completion.chunk",
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}], **extra}
            return f"data: {json.dumps(body)}\n\n"

        parts = [chunk({"role": "assistant", "content": ""})]
        if tool_calls:
            parts.append(chunk({"tool_calls": tool_calls}))
        else:
            parts.append(chunk({"content": reply["content"]}))
        parts.append(chunk({}, finish))
        if (request.get("stream_options") or {}).get("include_usage"):
            usage_chunk = {**base, "object": "chat.completion.chunk", "choices": [], "usage": usage}
            parts.append(f"data: {json.dumps(usage_chunk)}\n\n")
        parts.append("data: [DONE]\n\n")
        return "text/event-stream", "".join(parts).encode()

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            """Routes the two endpoints; everything else is 404."""

            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass

            def _send(self, status: int, ctype: str, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                if ctype == "text/event-stream":
                    self.send_header("Cache-Control", "no-cache")
                self.end_headers()
                self.wfile.write(body)

            def _error(self, status: int, message: str) -> None:
                body = json.dumps({"error": {"message": message, "type": "invalid_request_error"}})
                self._send(status, "application/json", body.encode())

            def do_GET(self) -> None:
                if self.path.rstrip("/").endswith("/models"):
                    body = {"object": "list", "data": [
                        {"id": MODEL, "object": "model", "created": 0, "owned_by": "fake"}]}
                    self._send(200, "application/json", json.dumps(body).encode())
                else:
                    self._error(404, f"no route for GET {self.path}")

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                if not self.path.split("?")[0].rstrip("/").endswith("/chat/completions"):
                    self._error(404, f"no route for POST {self.path}")
                    return
                try:
                    request = json.loads(raw or b"{}")
                except ValueError:
                    self._error(400, "invalid JSON body")
                    return
                self._send(200, *fake.completion(request))

        return Handler


def qwen_env(home_dir: str | os.PathLike[str], base_url: str,
             background_llm_calls: bool = False) -> dict[str, str]:
    """Write ``<home>/.qwen/settings.json`` (auth type ``openai``) and return the env for ``qwen --acp``.

    Only ``security.auth.selectedType`` is required. Unless ``background_llm_calls`` is set,
    the follow-up suggestion and managed auto-memory side calls that Qwen makes after each
    turn are switched off, so every LLM request belongs to a prompt turn.
    """
    settings_dir = Path(home_dir) / ".qwen"
    settings_dir.mkdir(parents=True, exist_ok=True)
    settings: dict[str, Any] = {
        "security": {"auth": {"selectedType": "openai"}},
        "general": {"enableAutoUpdate": False},
        "privacy": {"usageStatisticsEnabled": False},
    }
    if not background_llm_calls:
        settings["ui"] = {"enableFollowupSuggestions": False}
        settings["memory"] = {"enableManagedAutoMemory": False, "enableManagedAutoDream": False}
    (settings_dir / "settings.json").write_text(json.dumps(settings, indent=2))
    env = dict(os.environ)
    env.update({
        "HOME": str(home_dir),
        "OPENAI_API_KEY": "sk-fake",
        "OPENAI_BASE_URL": base_url,
        "OPENAI_MODEL": MODEL,
        # As the reference runs its ACP children (and the worker's `qwen` preset): one node
        # process per agent, not a second one qwen would start for more heap.
        "QWEN_CODE_NO_RELAUNCH": "true",
    })
    return env


def find_qwen() -> str | None:
    """Return the path of the ``qwen`` executable (the project's pinned install, then PATH,
    then the /opt install) or None."""
    if os.access(QWEN_LOCAL, os.X_OK):
        return str(QWEN_LOCAL)
    found = shutil.which("qwen")
    if found:
        return found
    return QWEN_FALLBACK if os.access(QWEN_FALLBACK, os.X_OK) else None
