"""The load side of `bench.scale`, light enough not to be what is measured.

`Http` is one keep-alive HTTP/1.1 connection on raw asyncio streams (a request costs a few
tens of microseconds of the load's CPU, against about a millisecond for httpx). `Streams` holds
thousands of SSE connections under one epoll in a process of its own and stamps each frame
when it arrives:

    python -m bench.scale_load streams --port P --paths-file F [--out R.json] [--sequential]

Protocol with the driver: it prints `ready` once every stream got its first frame (the
`retry:` frame the route opens with), then stamps every `id:` line it reads, with the
system-wide monotonic clock, until a line arrives on stdin; it writes its JSON result to
`--out` and prints `done`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import resource
import select
import socket
import sys
import time
from typing import Any

import orjson


def now_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


class Http:
    """One keep-alive HTTP/1.1 connection; answers (status, body)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def request(self, method: str, path: str, body: Any = None) -> tuple[int, bytes]:
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_connection("127.0.0.1", self.port)
        assert self._reader is not None
        payload = orjson.dumps(body) if body is not None else b""
        head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(payload)}\r\n"
        if body is not None:
            head += "Content-Type: application/json\r\n"
        self._writer.write(head.encode() + b"\r\n" + payload)
        status_line = await self._reader.readline()
        status = int(status_line.split()[1])
        length, chunked = 0, False
        while True:
            line = await self._reader.readline()
            if line in (b"\r\n", b""):
                break
            name, _, value = line.decode().partition(":")
            if name.lower() == "content-length":
                length = int(value)
            elif name.lower() == "transfer-encoding" and "chunked" in value:
                chunked = True
        if not chunked:
            return status, await self._reader.readexactly(length)
        parts = []
        while True:
            size = int((await self._reader.readline()).strip(), 16)
            if size == 0:
                await self._reader.readline()
                return status, b"".join(parts)
            parts.append(await self._reader.readexactly(size))
            await self._reader.readline()

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


ID_LINE = re.compile(rb"^id: ?(\d+)", re.M)
DIED = b"session_died"


def first_frame(sock: socket.socket) -> str | None:
    """Read a stream's headers and its first frame (the `retry:` frame the route opens with);
    None, or why the answer is not a stream."""
    buf = b""
    while b"\n\n" not in buf.partition(b"\r\n\r\n")[2]:
        data = sock.recv(65536)
        if not data:
            return "closed before its first frame"
        buf += data
        if buf.startswith(b"HTTP/1.1 ") and not buf.startswith(b"HTTP/1.1 200") and b"\r\n\r\n" in buf:
            return buf.split(b"\r\n", 1)[0].decode() + " " + buf.partition(b"\r\n\r\n")[2][:160].decode(errors="replace")
    return None


def streams(args: argparse.Namespace) -> dict[str, Any]:
    """Open one SSE connection per path, all at once (or, `--sequential`, each once the one
    before got its first frame), all under one epoll; record per stream when each event id
    arrived and when a `session_died` arrived."""
    paths = [line.strip() for line in open(args.paths_file) if line.strip()]
    socks: list[socket.socket] = []
    refused: dict[str, str] = {}  # stream index -> the answer that was not a stream
    started = time.monotonic()
    for n, path in enumerate(paths):
        sock = socket.create_connection(("127.0.0.1", args.port), timeout=120)
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: text/event-stream\r\n\r\n".encode())
        socks.append(sock)
        if args.sequential and (why := first_frame(sock)) is not None:
            refused[str(n)] = why
    for n, sock in enumerate(socks):
        if not args.sequential and (why := first_frame(sock)) is not None:
            refused[str(n)] = why
        sock.setblocking(False)
    attach_s = time.monotonic() - started
    poller = select.epoll()
    index = {sock.fileno(): n for n, sock in enumerate(socks) if str(n) not in refused}
    for fd in index:
        poller.register(fd, select.EPOLLIN)
    stdin = sys.stdin.fileno()
    poller.register(stdin, select.EPOLLIN)
    arrivals: list[list[int]] = [[] for _ in socks]  # per stream: [event id, ns, ...]
    died: dict[int, int] = {}
    tails = {fd: b"" for fd in index}
    cpu0 = sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
    print("ready", flush=True)
    running = True
    while running:
        events = poller.poll()
        t = now_ns()
        for fd, _ in events:
            if fd == stdin:
                running = False
                continue
            try:
                data = socks[index[fd]].recv(65536)
            except BlockingIOError:
                continue
            if not data:
                poller.unregister(fd)
                continue
            buf = tails[fd] + data
            n = index[fd]
            for match in ID_LINE.finditer(buf):
                arrivals[n] += [int(match.group(1)), t]
            if DIED in buf and n not in died:
                died[n] = t
            tails[fd] = buf[-64:] if not buf.endswith(b"\n") else b""
    cpu = sum(resource.getrusage(resource.RUSAGE_SELF)[:2]) - cpu0
    for sock in socks:
        sock.close()
    return {"streams": len(socks) - len(refused), "refused": refused, "attach_s": round(attach_s, 2), "load_cpu_s": round(cpu, 3),
            "arrivals": arrivals, "died": {str(k): v for k, v in died.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("command", choices=["streams"])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--paths-file", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--sequential", action="store_true", help="open each stream once the one before is open")
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    result = streams(args)
    with open(args.out, "w") as out:
        json.dump(result, out)
    print("done", flush=True)


if __name__ == "__main__":
    main()
