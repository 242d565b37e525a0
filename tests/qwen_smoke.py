"""End-to-end smoke check: real ``qwen --acp`` driven by the scripted model endpoint
(testbed/model_endpoint.py).

Run with ``python tests/qwen_smoke.py``. Speaks raw newline-delimited JSON-RPC over the
agent's stdio, drives a permission turn (shell tool) and an ask_user_question turn, and
exits non-zero on any failure. Not a pytest module (no ``test_`` prefix).
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository: testbed/ and acp_state/
from testbed.model_endpoint import ModelEndpoint  # noqa: E402
from testbed.qwen import find_qwen, qwen_env  # noqa: E402

TIMEOUT = 60.0
PERMISSION = "session/request_permission"


class SmokeFailure(Exception):
    """Raised when the agent misbehaves or a wait times out."""


class AcpClient:
    """Minimal JSON-RPC client over a child process's stdin/stdout."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: str, stderr_path: Path) -> None:
        self._stderr = stderr_path.open("wb")
        self.proc = subprocess.Popen(
            argv, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._stderr, bufsize=0, start_new_session=True,
        )
        self._ids = itertools.count(1)
        self._write_lock = threading.Lock()
        self.inbox: "queue.Queue[dict[str, Any] | None]" = queue.Queue()
        self.updates: dict[str, int] = {}  # sessionUpdate kind -> count
        self.agent_requests: list[str] = []  # methods of unhandled agent requests
        self._reader = threading.Thread(target=self._read_loop, daemon=True)
        self._reader.start()

    def send(self, message: dict[str, Any]) -> None:
        """Write one JSON-RPC message as a line."""
        data = (json.dumps(message) + "\n").encode()
        with self._write_lock:
            assert self.proc.stdin is not None
            self.proc.stdin.write(data)
            self.proc.stdin.flush()

    def _read_loop(self) -> None:
        """Queue incoming messages; answer agent requests other than permissions with -32601."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.strip()
            if not line:
                continue
            try:
                msg = json.loads(line)
            except ValueError:
                print(f"  [non-JSON stdout] {line[:200]!r}")
                continue
            method = msg.get("method")
            if method and "id" in msg and method != PERMISSION:
                self.agent_requests.append(method)
                self.send({"jsonrpc": "2.0", "id": msg["id"],
                           "error": {"code": -32601, "message": f"Method not found: {method}"}})
                continue
            if method == "session/update":
                kind = msg.get("params", {}).get("update", {}).get("sessionUpdate", "?")
                self.updates[kind] = self.updates.get(kind, 0) + 1
            self.inbox.put(msg)
        self.inbox.put(None)  # EOF marker

    def call(self, method: str, params: dict[str, Any], timeout: float = TIMEOUT,
             on_request: Callable[[dict[str, Any]], None] | None = None) -> Any:
        """Send a request and wait for its response; agent permission requests go to ``on_request``."""
        req_id = next(self._ids)
        self.send({"jsonrpc": "2.0", "id": req_id, "method": method, "params": params})
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise SmokeFailure(f"timed out after {timeout:.0f}s waiting for {method}")
            try:
                msg = self.inbox.get(timeout=remaining)
            except queue.Empty:
                continue
            if msg is None:
                raise SmokeFailure(f"agent exited (rc={self.proc.poll()}) during {method}")
            if msg.get("id") == req_id and "method" not in msg:
                if "error" in msg:
                    raise SmokeFailure(f"{method} failed: {json.dumps(msg['error'])}")
                return msg.get("result")
            if msg.get("method") == PERMISSION:
                if on_request is None:
                    raise SmokeFailure(f"unexpected permission request during {method}")
                on_request(msg)

    def reply(self, request: dict[str, Any], result: dict[str, Any]) -> None:
        """Answer an agent request with a result."""
        self.send({"jsonrpc": "2.0", "id": request["id"], "result": result})

    def close(self) -> None:
        """Stop the whole agent process group (qwen relaunches itself as child node processes)."""
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()  # EOF first: lets qwen shut down on its own
        try:
            self.proc.wait(timeout=3)
        except subprocess.TimeoutExpired:
            pass
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break  # group is empty
            time.sleep(0.5)
        self.proc.wait(timeout=10)
        self._reader.join(timeout=5)
        if self.proc.stdout:
            self.proc.stdout.close()
        self._stderr.close()

def run_turn(client: AcpClient, session_id: str, text: str, answer: dict[str, Any],
             check: Callable[[dict[str, Any]], None]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Send one prompt, answer every permission request with ``answer``; return (result, requests)."""
    seen: list[dict[str, Any]] = []

    def on_request(msg: dict[str, Any]) -> None:
        params = msg["params"]
        seen.append(params)
        print(f"  permission toolCall: {json.dumps(params.get('toolCall'))}")
        print(f"  permission options: {json.dumps(params.get('options'))}")
        check(params)
        client.reply(msg, answer)

    result = client.call("session/prompt", {
        "sessionId": session_id, "prompt": [{"type": "text", "text": text}]}, on_request=on_request)
    return result, seen


def main() -> int:
    """Run the smoke scenario; return a process exit code."""
    qwen = find_qwen()
    if qwen is None:
        print("qwen executable not found")
        return 2
    scratch = Path(tempfile.mkdtemp(prefix="qwen-smoke-"))
    home, work = scratch / "home", scratch / "work"
    work.mkdir(parents=True)
    stderr_path = scratch / "qwen-stderr.log"
    fake = ModelEndpoint().start()
    client: AcpClient | None = None
    ok = False
    try:
        env = qwen_env(home, fake.openai_url)
        env["TMPDIR"] = str(scratch)  # qwen leaves qwen-socks-* folders in the temp dir
        t0 = time.monotonic()
        client = AcpClient([qwen, "--acp"], env, str(work), stderr_path)
        init = client.call("initialize", {
            "protocolVersion": 1,
            "clientCapabilities": {"fs": {"readTextFile": False, "writeTextFile": False},
                                   "terminal": False}})
        t_init = time.monotonic()
        print(f"initialize: {t_init - t0:.2f}s agentInfo={init.get('agentInfo')} "
              f"protocolVersion={init.get('protocolVersion')}")
        session = client.call("session/new", {"cwd": str(work), "mcpServers": []})
        session_id = session["sessionId"]
        t_new = time.monotonic()
        modes = session.get("modes") or {}
        print(f"session/new: {t_new - t_init:.2f}s sessionId={session_id} "
              f"currentMode={modes.get('currentModeId')} "
              f"modes={[m.get('id') for m in modes.get('availableModes', [])]}")
        client.call("session/set_mode", {"sessionId": session_id, "modeId": "default"})
        t_ready = time.monotonic()
        print(f"session/set_mode default: {t_ready - t_new:.2f}s (agent ready after {t_ready - t0:.2f}s)")

        # Turn 1: shell tool that needs a permission.
        def check_perm(params: dict[str, Any]) -> None:
            option_ids = [o.get("optionId") for o in params.get("options", [])]
            if "proceed_once" not in option_ids:
                raise SmokeFailure(f"no proceed_once option: {option_ids}")

        n_llm = len(fake.chat_requests)
        t1 = time.monotonic()
        result, seen = run_turn(client, session_id, "PERM please run",
                                {"outcome": {"outcome": "selected", "optionId": "proceed_once"}},
                                check_perm)
        print(f"turn PERM: {time.monotonic() - t1:.2f}s result={json.dumps(result)} "
              f"llm_calls={len(fake.chat_requests) - n_llm}")
        if not seen:
            raise SmokeFailure("no session/request_permission for the shell tool")
        if not (work / "perm_check.txt").exists():
            raise SmokeFailure("perm_check.txt was not created")
        print("  perm_check.txt created")

        # Turn 2: ask_user_question answered through the root-level `answers` field.
        def check_question(params: dict[str, Any]) -> None:
            kind = ((params.get("toolCall") or {}).get("_meta") or {}).get("qwenInteractionKind")
            if kind != "user_question":
                raise SmokeFailure(f"expected qwenInteractionKind user_question, got {kind!r}")

        n_llm = len(fake.chat_requests)
        t2 = time.monotonic()
        result, seen = run_turn(client, session_id, "QUESTION ask me",
                                {"outcome": {"outcome": "selected", "optionId": "proceed_once"},
                                 "answers": {"0": "Blue"}},
                                check_question)
        print(f"turn QUESTION: {time.monotonic() - t2:.2f}s result={json.dumps(result)} "
              f"llm_calls={len(fake.chat_requests) - n_llm}")
        if not seen:
            raise SmokeFailure("no session/request_permission for ask_user_question")
        tool_msgs = [m for m in fake.chat_requests[-1].get("messages", []) if m.get("role") == "tool"]
        if tool_msgs:
            print(f"  tool result the LLM saw: {tool_msgs[-1].get('content')!r}")

        summarize(fake, client)
        ok = True
        print("SMOKE OK")
        return 0
    except SmokeFailure as exc:
        print(f"SMOKE FAILED: {exc}")
        return 1
    finally:
        if client is not None:
            t_close = time.monotonic()
            client.close()
            print(f"agent shutdown: {time.monotonic() - t_close:.2f}s")
        fake.stop()
        if not ok and stderr_path.exists():
            tail = stderr_path.read_text(errors="replace")[-3000:]
            print(f"--- qwen stderr tail ({stderr_path}) ---\n{tail}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)


def summarize(fake: ModelEndpoint, client: AcpClient) -> None:
    """Print what the LLM requests looked like and what the agent sent besides responses."""
    print(f"LLM requests: {len(fake.chat_requests)}")
    for i, req in enumerate(fake.chat_requests, 1):
        last = (req.get("messages") or [{}])[-1]
        print(f"  #{i} stream={req.get('stream')} tools={len(req.get('tools') or [])} "
              f"messages={len(req.get('messages') or [])} last_role={last.get('role')}")
    with_tools = next((r for r in fake.chat_requests if r.get("tools")), None)
    if with_tools:
        names = [t.get("function", {}).get("name") for t in with_tools["tools"]]
        print(f"tool names offered: {names}")
    print(f"session/update kinds: {client.updates}")
    print(f"agent requests answered -32601: {client.agent_requests}")


if __name__ == "__main__":
    sys.exit(main())
