"""The scripted agent's ACP plumbing (acp_state/testing/scripted_agent.py): newline-delimited
JSON-RPC 2.0 on its stdio, one compact JSON object per line. Writes keep their order, the
agent's own requests (`session/request_permission`) wait for their responses, and lines
that are not JSON objects are ignored. Standard library only, as the agent.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

JSON = dict[str, Any]

LINE_LIMIT = 50 * 1024 * 1024


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
