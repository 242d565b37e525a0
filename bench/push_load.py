"""The load side of `bench.push`, in a process of its own, so that the clients are not what
is measured: the fan-out subscribers are raw sockets under one epoll (each wake-up stamped
with the system-wide monotonic clock the driver stamps its changes with); the views are
raw asyncio streams on uvloop.

    python -m bench.push_load fanout-sse   --port P --path /workspaces/WS/sessions/live-state/events --clients 1000
    python -m bench.push_load fanout-redis --port P --channel C --clients 1000
    python -m bench.push_load views --port P --mode listing|live-state|feed --workspaces W1,W2 --views 100 \
        --interval-s 1 --seconds 30

Protocol with the driver: the process prints `ready` once every client is attached (fan-out)
or every view started (views), `window <start|end>` lines around a views window, then, for
the fan-out modes, records until a line arrives on stdin; it writes its JSON result to
`--out` and prints `done`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import resource
import select
import socket
import sys
import time
from collections import defaultdict
from typing import Any

import uvloop


def now_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


SSE_MARK = re.compile(rb'"updatedAt":"2099-01-01T(\d\d):(\d\d):(\d\d)')
REDIS_MARK = re.compile(rb"seq(\d+)x")


def mark(seq: int) -> str:
    """The `updatedAt` the driver's n-th change sets: every change makes a row of its own."""
    return f"2099-01-01T{seq // 3600:02d}:{seq // 60 % 60:02d}:{seq % 60:02d}.000Z"


def seq_of(match: re.Match[bytes]) -> int:
    groups = [int(g) for g in match.groups()]
    return groups[0] if len(groups) == 1 else groups[0] * 3600 + groups[1] * 60 + groups[2]


def resp_command(*parts: str) -> bytes:
    out = [f"*{len(parts)}\r\n".encode()]
    for part in parts:
        raw = part.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(raw), raw))
    return b"".join(out)


def fanout(args: argparse.Namespace) -> dict[str, Any]:
    """`clients` streaming sockets under one epoll, no event loop in between: each wake-up
    is stamped once, when epoll returns, so a socket's stamp does not wait for the reading
    of the sockets before it. A subscriber has change n when it got a frame of change >= n
    (the hub sends the newest row: changes close together may arrive as one frame)."""
    if args.command == "fanout-sse":
        pattern, ready = SSE_MARK, b"live_state_snapshot"
        request = (f"GET {args.path} HTTP/1.1\r\nHost: 127.0.0.1:{args.port}\r\n"
                   "Accept: text/event-stream\r\n\r\n").encode()
    else:
        pattern, ready = REDIS_MARK, b"ssubscribe"
        request = resp_command("SSUBSCRIBE", args.channel)
    started = time.monotonic()
    socks: list[socket.socket] = []
    for _ in range(args.clients):
        sock = socket.create_connection(("127.0.0.1", args.port), timeout=60)
        sock.sendall(request)
        socks.append(sock)
    for sock in socks:
        buf = b""
        while ready not in buf:
            data = sock.recv(65536)
            if not data:
                raise ConnectionError("closed before it was attached")
            buf += data
        sock.setblocking(False)
    attach_s = time.monotonic() - started
    poller = select.epoll()
    by_fd = {sock.fileno(): sock for sock in socks}
    bufs = {fd: b"" for fd in by_fd}
    last = {fd: -1 for fd in by_fd}
    for fd in by_fd:
        poller.register(fd, select.EPOLLIN)
    stdin = sys.stdin.fileno()
    poller.register(stdin, select.EPOLLIN)
    sink: dict[int, list[int]] = defaultdict(list)
    reads = nbytes = snapshots = lost = 0
    cpu0 = cpu_s()
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
                data = by_fd[fd].recv(65536)
            except BlockingIOError:
                continue
            if not data:
                poller.unregister(fd)
                lost += 1
                continue
            reads += 1
            nbytes += len(data)
            if b"live_state_snapshot" in data:
                snapshots += 1  # a listener that fell behind is sent one
            buf = bufs[fd] + data
            end = 0
            for match in pattern.finditer(buf):
                seq = seq_of(match)
                for n in range(last[fd] + 1, seq + 1):
                    sink[n].append(t)
                last[fd] = max(last[fd], seq)
                end = match.end()
            bufs[fd] = buf[max(end, len(buf) - 256):]
    cpu = cpu_s() - cpu0
    for sock in socks:
        sock.close()
    return {
        "clients": args.clients,
        "attach_s": round(attach_s, 2),
        "open_at_end": args.clients - lost,
        "reads": reads,
        "bytes": nbytes,
        "snapshots_after_ready": snapshots,
        "load_cpu_s": round(cpu, 3),
        "arrivals": {str(k): v for k, v in sink.items()},
    }


# ---- views ------------------------------------------------------------------------------


class Counts:
    def __init__(self) -> None:
        self.requests = 0
        self.errors = 0
        self.bytes = 0
        self.frames = 0
        self.counting = False

    def add(self, requests: int = 0, errors: int = 0, nbytes: int = 0, frames: int = 0) -> None:
        if self.counting:
            self.requests += requests
            self.errors += errors
            self.bytes += nbytes
            self.frames += frames


async def poll_view(args: argparse.Namespace, path: str, interval_s: float, counts: Counts, started: asyncio.Event) -> None:
    """A view that polls like the Web Shell: one keep-alive connection, GET, then wait the
    interval after the answer (setTimeout after the response)."""
    await asyncio.sleep(random.uniform(0, interval_s))  # views were not opened in one instant
    reader, writer = await asyncio.open_connection("127.0.0.1", args.port)
    request = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{args.port}\r\nAccept: application/json\r\n\r\n".encode()
    started.set()
    while True:
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = int(re.search(rb"(?i)content-length: (\d+)", head).group(1))  # type: ignore[union-attr]
        body = await reader.readexactly(length)
        counts.add(requests=1, errors=int(status >= 400), nbytes=len(head) + len(body))
        await asyncio.sleep(interval_s)


async def feed_view(args: argparse.Namespace, path: str, counts: Counts, started: asyncio.Event) -> None:
    """A view that follows the live feed: one request, then frames as they come."""
    await asyncio.sleep(random.uniform(0, 1.0))
    reader, writer = await asyncio.open_connection("127.0.0.1", args.port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{args.port}\r\nAccept: text/event-stream\r\n\r\n".encode())
    head = await reader.readuntil(b"\r\n\r\n")
    counts.add(requests=1, errors=int(int(head.split(b" ", 2)[1]) >= 400))
    started.set()
    while True:
        data = await reader.read(65536)
        if not data:
            raise ConnectionError("the feed ended")
        counts.add(nbytes=len(data), frames=data.count(b"event: live_state_changed"))


async def views(args: argparse.Namespace) -> dict[str, Any]:
    workspaces = args.workspaces.split(",")
    counts = Counts()
    events = [asyncio.Event() for _ in range(args.views)]
    tasks = []
    for n in range(args.views):
        ws = workspaces[n % len(workspaces)]
        if args.mode == "listing":  # the Web Shell's workspace view (api/static/js/workspace-view.js)
            tasks.append(poll_view(args, f"/workspace/{ws}/sessions?size=100", args.interval_s, counts, events[n]))
        elif args.mode == "live-state":  # the reference's sessionLiveStatePollIntervalMs poll
            tasks.append(poll_view(args, f"/workspaces/{ws}/sessions/live-state", args.interval_s, counts, events[n]))
        else:
            tasks.append(feed_view(args, f"/workspaces/{ws}/sessions/live-state/events", counts, events[n]))
    running = [asyncio.ensure_future(t) for t in tasks]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 60)
    print("ready", flush=True)
    await asyncio.sleep(args.interval_s)  # every view in its steady rhythm
    counts.counting = True
    cpu0, t0 = cpu_s(), time.monotonic()
    print("window start", flush=True)
    await asyncio.sleep(args.seconds)
    counts.counting = False
    elapsed = time.monotonic() - t0
    print("window end", flush=True)
    failed = [t.exception() for t in running if t.done() and not t.cancelled()]
    for t in running:
        t.cancel()
    return {
        "mode": args.mode,
        "views": args.views,
        "interval_s": args.interval_s if args.mode != "feed" else None,
        "window_s": round(elapsed, 2),
        "requests": counts.requests,
        "requests_per_s": round(counts.requests / elapsed, 2),
        "errors": counts.errors,
        "bytes_per_s": round(counts.bytes / elapsed),
        "frames": counts.frames,
        "views_failed": len(failed),
        "load_cpu_s": round(cpu_s() - cpu0, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["fanout-sse", "fanout-redis", "views"])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--path")
    parser.add_argument("--channel")
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--mode", choices=["listing", "live-state", "feed"])
    parser.add_argument("--workspaces")
    parser.add_argument("--views", type=int, default=100)
    parser.add_argument("--interval-s", type=float, default=1.0)
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    result = uvloop.run(views(args)) if args.command == "views" else fanout(args)
    result["pid"] = os.getpid()
    with open(args.out, "w") as out:
        json.dump(result, out)
    print("done", flush=True)


if __name__ == "__main__":
    main()
