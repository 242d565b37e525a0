"""A userspace TCP fault proxy: latency, jitter, loss-like stalls and black holes between
processes and Redis, for the multi-host chaos run (this kernel has no `tc netem`).

    python -m testbed.fault_proxy --listen 127.0.0.1:7000 --upstream 127.0.0.1:6380 \\
        --control /tmp/fault.sock [--seed 1]
    python -m testbed.fault_proxy --listen 0.0.0.0:7000 --transparent \\
        --upstream-host 127.0.0.1 --control /tmp/fault.sock

`--upstream` forwards every connection to one address. `--transparent` serves connections
that an nftables `redirect` rule sent here and connects to their original destination
(SO_ORIGINAL_DST), or to `--upstream-host` at the original port.

Faults are set per client source IPv4 address, with a default for every other source,
over a Unix socket of JSON lines (`FaultProxyControl` below is its client):

    {"op": "set", "source": "10.1.2.3" | null, "latency_ms": 50, "jitter_ms": 10,
     "loss": 0.01, "blackhole": false}          omitted fields keep their value
    {"op": "clear", "source": "10.1.2.3" | null}   a source back to the default; null: the
                                                   default back to no fault
    {"op": "clear_all"}
    {"op": "stats"}

Each direction of a connection is a queue of chunks, each with its delivery time
max(previous delivery time, arrival + latency + U(0, jitter) [+ U(200, 400) ms when "lost"]),
and one writer task, so bytes stay in order. A black hole holds every chunk not yet written
(both sockets stay open, no FIN/RST) until it is cleared, as a healed link would.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import os
import random
import signal
import socket
import stat
import sys
from collections import deque
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import orjson

CHUNK = 64 * 1024
# A direction stops reading past this many queued bytes, so a black hole or a long delay
# pushes back on the sender (as a full TCP window would) instead of growing memory.
MAX_QUEUED = 4 * 1024 * 1024
# A "lost" chunk waits for a retransmission timeout; Linux's minimum RTO is 200 ms.
RTO_MS = (200.0, 400.0)
# Bounds delays to what a chaos run can mean (and what asyncio.sleep takes).
MAX_MS = 3_600_000
SO_ORIGINAL_DST = 80  # linux/netfilter_ipv4.h


@dataclass
class Faults:
    """The faults applied to one source address (or to every other one, the default)."""

    latency_ms: float = 0.0
    jitter_ms: float = 0.0
    loss: float = 0.0
    blackhole: bool = False


FIELDS = {f.name for f in fields(Faults)}


def validated(changes: dict[str, Any]) -> dict[str, Any]:
    """The fault fields of a `set` request, checked; raises ValueError or TypeError."""
    unknown = set(changes) - FIELDS
    if unknown:
        raise ValueError(f"unknown fields: {sorted(unknown)}")
    out: dict[str, Any] = {}
    for name, value in changes.items():
        if name == "blackhole":
            if not isinstance(value, bool):
                raise TypeError("blackhole must be true or false")
            out[name] = value
            continue
        # bool is an int subclass; "latency_ms": true is a mistake, not 1 ms.
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a number")
        if not 0 <= value <= (1 if name == "loss" else MAX_MS):
            raise ValueError(f"{name} out of range (0..{1 if name == 'loss' else MAX_MS})")
        out[name] = float(value)
    return out


def canonical_source(source: Any) -> str | None:
    if source is None:
        return None
    if not isinstance(source, str):
        raise TypeError("source must be an IPv4 address or null")
    try:
        return str(ipaddress.IPv4Address(source))
    except ValueError:
        raise ValueError(f"source is not an IPv4 address: {source!r}") from None


def parse_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def original_destination(sock: Any) -> tuple[str, int]:
    """Where a connection redirected by nftables was going (struct sockaddr_in)."""
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    return socket.inet_ntoa(raw[4:8]), int.from_bytes(raw[2:4], "big")


class Pipe:
    """One direction of a connection: a reader task fills the queue, a writer task
    delivers each chunk at its time, in order."""

    def __init__(self, conn: Connection, name: str, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.conn, self.name, self.reader, self.writer = conn, name, reader, writer
        self.queue: deque[tuple[float, bytes | None]] = deque()  # (delivery time, chunk; None = EOF)
        self.queued = 0
        self.last = 0.0  # the delivery time of the last chunk queued
        self.eof = False
        self.wake = asyncio.Event()  # set on a new chunk and on any fault change
        self.space = asyncio.Event()  # set when the writer took bytes off the queue

    def delivery_time(self, faults: Faults, now: float, lost: bool) -> float:
        rng = self.conn.proxy.rng
        delay = faults.latency_ms
        if faults.jitter_ms:
            delay += rng.uniform(0.0, faults.jitter_ms)
        if lost:
            delay += rng.uniform(*RTO_MS)
        self.last = max(self.last, now + delay / 1000.0)
        return self.last

    def push(self, chunk: bytes | None) -> None:
        faults = self.conn.faults()
        lost = chunk is not None and faults.loss > 0 and self.conn.proxy.rng.random() < faults.loss
        self.queue.append((self.delivery_time(faults, asyncio.get_running_loop().time(), lost), chunk))
        self.queued += len(chunk or b"")
        self.wake.set()

    async def read(self) -> None:
        try:
            while True:
                while self.queued >= MAX_QUEUED:
                    self.space.clear()
                    await self.space.wait()
                chunk = await self.reader.read(CHUNK)
                if not chunk:
                    break
                self.push(chunk)
        except OSError:
            pass  # a reset counts as an end, like EOF
        self.eof = True
        if self.conn.faults().blackhole:
            self.conn.drop()  # the link is down: nothing queued will ever be delivered
        else:
            self.push(None)

    async def write(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                if not self.queue:
                    self.wake.clear()
                    await self.wake.wait()
                    continue
                if self.conn.faults().blackhole:
                    if self.eof:
                        self.conn.drop()
                        return
                    self.wake.clear()
                    await self.wake.wait()
                    continue
                when, chunk = self.queue[0]
                if when > loop.time():
                    # Queued chunks keep their time; the black hole is checked again after.
                    await asyncio.sleep(when - loop.time())
                    continue
                self.queue.popleft()
                if chunk is None:
                    self.writer.close()
                    self.conn.pipe_done()
                    return
                self.queued -= len(chunk)
                self.space.set()
                self.writer.write(chunk)
                self.conn.proxy.bytes[self.name] += len(chunk)
                await self.writer.drain()
        except OSError:
            self.conn.drop()


class Connection:
    """A client connection and its upstream connection, two pipes between them."""

    def __init__(self, proxy: Proxy, source: str) -> None:
        self.proxy, self.source = proxy, source
        self.pipes: list[Pipe] = []
        self.done = asyncio.Event()
        self.finished = 0

    def faults(self) -> Faults:
        return self.proxy.faults_for(self.source)

    def wake(self) -> None:
        for pipe in self.pipes:
            pipe.wake.set()

    def pipe_done(self) -> None:
        self.finished += 1
        if self.finished == len(self.pipes):
            self.done.set()

    def drop(self) -> None:
        self.done.set()

    async def run(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter,
                  target: tuple[str, int]) -> None:
        tasks: list[asyncio.Task[None]] = []
        up_w: asyncio.StreamWriter | None = None
        try:
            try:
                up_r, up_w = await asyncio.open_connection(*target)
            except OSError as exc:
                print(f"fault-proxy: cannot reach {target[0]}:{target[1]}: {exc}", file=sys.stderr, flush=True)
                return
            up_w.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.pipes = [Pipe(self, "client_to_upstream", client_r, up_w),
                          Pipe(self, "upstream_to_client", up_r, client_w)]
            tasks = [asyncio.create_task(job()) for pipe in self.pipes for job in (pipe.read, pipe.write)]
            await self.done.wait()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            client_w.close()
            if up_w is not None:
                up_w.close()


class Proxy:
    def __init__(self, upstream: tuple[str, int] | None, upstream_host: str | None, seed: int | None) -> None:
        self.upstream, self.upstream_host = upstream, upstream_host
        self.rng = random.Random(seed)
        self.default = Faults()
        self.rules: dict[str, Faults] = {}
        self.connections: set[Connection] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self.total = 0
        self.bytes = {"client_to_upstream": 0, "upstream_to_client": 0}
        self.listen_address: tuple[str, int] = ("", 0)

    def faults_for(self, source: str) -> Faults:
        return self.rules.get(source, self.default)

    def changed(self) -> None:
        """Settings apply to open connections at once: wake every writer held by a black hole."""
        for conn in self.connections:
            conn.wake()

    def target(self, writer: asyncio.StreamWriter) -> tuple[str, int] | None:
        if self.upstream is not None:
            return self.upstream
        try:
            host, port = original_destination(writer.get_extra_info("socket"))
        except OSError as exc:
            print(f"fault-proxy: no original destination: {exc}", file=sys.stderr, flush=True)
            return None
        if (host, port) == writer.get_extra_info("sockname")[:2]:
            return None  # a connection made to the proxy itself, not redirected: it would loop
        return (self.upstream_host or host, port)

    async def accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # chunks are timed; Nagle would add to them
        source = writer.get_extra_info("peername")[0].removeprefix("::ffff:")
        target = self.target(writer)
        if target is None:
            writer.close()
            return
        conn = Connection(self, source)
        self.connections.add(conn)
        self.total += 1
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        try:
            await conn.run(reader, writer, target)
        except asyncio.CancelledError:
            # The shutdown cancels us; end normally, as Python 3.11's stream callback
            # would log a cancelled client task as an error.
            pass
        finally:
            self.connections.discard(conn)
            self.tasks.discard(task)

    def handle(self, request: Any) -> dict[str, Any]:
        """One control request to its reply; raises ValueError or TypeError for a bad one."""
        if not isinstance(request, dict):
            raise TypeError("a request is a JSON object")
        op = request.get("op")
        if op == "set":
            source = canonical_source(request.get("source"))
            changes = validated({k: v for k, v in request.items() if k not in ("op", "source")})
            # A new source's rule starts from the default as it is now ("omitted fields keep
            # their current value": the value this source had).
            current = self.default if source is None else self.rules.get(source, self.default)
            new = replace(current, **changes)
            if source is None:
                self.default = new
            else:
                self.rules[source] = new
            self.changed()
            return {"source": source, "faults": asdict(new)}
        if op == "clear":
            source = canonical_source(request.get("source"))
            if source is None:
                self.default = Faults()
            else:
                self.rules.pop(source, None)
            self.changed()
            return {"source": source}
        if op == "clear_all":
            self.default, self.rules = Faults(), {}
            self.changed()
            return {}
        if op == "stats":
            return {
                "connections_open": len(self.connections),
                "connections_total": self.total,
                "bytes": dict(self.bytes),
                "default": asdict(self.default),
                "rules": {source: asdict(f) for source, f in self.rules.items()},
            }
        raise ValueError(f"unknown op: {op!r}")

    async def control(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    line = await reader.readline()
                except ValueError:  # a line over the reader's limit: answer, then hang up
                    writer.write(orjson.dumps({"ok": False, "error": "request line too long"}) + b"\n")
                    break
                if not line:
                    break
                if not line.strip():
                    continue
                try:
                    reply = {"ok": True, **self.handle(orjson.loads(line))}
                except (ValueError, TypeError) as exc:  # orjson.JSONDecodeError is a ValueError
                    reply = {"ok": False, "error": str(exc)}
                except Exception as exc:  # a bug in one request must not end the proxy
                    reply = {"ok": False, "error": f"internal error: {exc!r}"}
                writer.write(orjson.dumps(reply) + b"\n")
                await writer.drain()
        except OSError:
            pass
        finally:
            writer.close()


async def serve(args: argparse.Namespace) -> None:
    proxy = Proxy(args.upstream, args.upstream_host, args.seed)
    host, port = args.listen
    server = await asyncio.start_server(proxy.accept, host, port, reuse_address=True)
    proxy.listen_address = server.sockets[0].getsockname()[:2]
    path = args.control
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(os.stat(path).st_mode):
            os.unlink(path)  # a stale socket of a proxy that was killed
    control = await asyncio.start_unix_server(proxy.control, path)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    bound_host, bound_port = proxy.listen_address
    print(f"fault-proxy listening on {bound_host}:{bound_port}", flush=True)
    try:
        await stop.wait()
    finally:
        server.close()
        control.close()
        for task in proxy.tasks:
            task.cancel()  # also those still connecting upstream
        await asyncio.gather(*proxy.tasks, return_exceptions=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testbed.fault_proxy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", type=parse_address, required=True, metavar="HOST:PORT")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--upstream", type=parse_address, metavar="HOST:PORT",
                      help="forward every connection to this address")
    mode.add_argument("--transparent", action="store_true",
                      help="connect to each connection's original destination (nftables redirect)")
    parser.add_argument("--upstream-host", metavar="HOST",
                        help="with --transparent: connect to HOST at the original port instead")
    parser.add_argument("--control", required=True, metavar="PATH", help="Unix socket for JSON-line control")
    parser.add_argument("--seed", type=int, default=None, help="seed of the jitter and loss draws")
    args = parser.parse_args(argv)
    if args.upstream_host and not args.transparent:
        parser.error("--upstream-host goes with --transparent")
    asyncio.run(serve(args))
    return 0


class FaultProxyError(RuntimeError):
    """The proxy answered ok: false."""


class FaultProxyControl:
    """A synchronous client of the control socket: one short connection per request."""

    def __init__(self, path: str, timeout: float = 5.0) -> None:
        self.path, self.timeout = path, timeout

    def request(self, payload: dict[str, Any]) -> dict[str, Any]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(self.timeout)
            sock.connect(self.path)
            sock.sendall(orjson.dumps(payload) + b"\n")
            data = b""
            while not data.endswith(b"\n"):
                more = sock.recv(65536)
                if not more:
                    raise FaultProxyError("the proxy closed the control connection")
                data += more
        reply = orjson.loads(data)
        if not reply.get("ok"):
            raise FaultProxyError(reply.get("error", "unknown error"))
        return reply

    def set(self, source: str | None = None, **faults: Any) -> dict[str, Any]:
        """Set `latency_ms`, `jitter_ms`, `loss`, `blackhole` for `source` (None: the default)."""
        return self.request({"op": "set", "source": source, **faults})

    def clear(self, source: str | None = None) -> dict[str, Any]:
        return self.request({"op": "clear", "source": source})

    def clear_all(self) -> dict[str, Any]:
        return self.request({"op": "clear_all"})

    def stats(self) -> dict[str, Any]:
        return self.request({"op": "stats"})


if __name__ == "__main__":
    sys.exit(main())
