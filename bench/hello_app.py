"""Baseline servers on the same stack as the API (Starlette on the ASGI server `acp-state api
--server` picks, served by the very code that serves the API: `acp_state.cli.serving.serve_http`,
on uvloop): `hello` answers a JSON constant; `hgetall` does one Redis HGETALL per request;
`/sse` is a bare event stream that sends one frame and then waits (`/raw-sse` the same,
below Starlette; `/raw-sse?first=N` then sends a frame of N bytes, as a stream's snapshot); `/body/<name>` answers
the bytes of a file given as `--body name=path` (an API answer of the same size, taken
from the API in the same run: the stack's own cost of sending it). With `--ping-url`,
`/raw-ping/<name>` answers the same bytes below Starlette once one Redis PING, written
after the request came, has come back: the least a linearizable cached read can cost on
this stack (the reads of one turn of the loop share a ping, as acp-state's syncs do).

    python -m bench.hello_app --port 8001 [--server granian|uvicorn] [--redis-url URL --key K]
                              [--body listing=/tmp/listing.json ...] [--ping-url URL]

`hello()` is the bare hello as an app factory, for servers run from their own command line
(e.g. `granian --interface asgi --factory bench.hello_app:hello`; bench/servers.py).
"""

from __future__ import annotations

import argparse
import asyncio
from collections import deque
from typing import AsyncIterator
from urllib.parse import urlparse

import orjson
import redis.asyncio as aioredis
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from acp_state.cli.serving import DEFAULT_SERVER, SERVERS, serve_http, settle_heap, started, until_signal


def build(redis_url: str | None, key: str, bodies: dict[str, bytes] | None = None) -> Starlette:
    client = aioredis.Redis.from_url(redis_url, decode_responses=True) if redis_url else None

    async def hello(_: Request) -> Response:
        return Response(orjson.dumps({"hello": "world"}), media_type="application/json")

    async def hgetall(_: Request) -> Response:
        assert client is not None
        return Response(orjson.dumps(await client.hgetall(key)), media_type="application/json")

    async def stream(_: Request) -> StreamingResponse:
        """A bare event stream: its first frame, then nothing until the client leaves (the
        stack's own cost of an open SSE connection)."""

        async def frames() -> AsyncIterator[bytes]:
            yield b"retry: 3000\n\n"
            await asyncio.Event().wait()

        return StreamingResponse(frames(), media_type="text/event-stream")

    async def body(request: Request) -> Response:
        return Response((bodies or {})[request.path_params["name"]], media_type="application/json")

    return Starlette(routes=[Route("/", hgetall if client else hello), Route("/sse", stream), Route("/body/{name}", body)])


class PingRounds(asyncio.Protocol):
    """One connection to Redis that answers `wait()` once a PING written after the call has
    come back: the calls of one turn of the loop share a ping written at its end, and pings
    are pipelined. A bare protocol, no client library: the floor of such a wait."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.rounds: deque[list[asyncio.Future[None]]] = deque()
        self.next_round: list[asyncio.Future[None]] = []
        self.buffer = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while b"\r\n" in self.buffer:
            _, _, self.buffer = self.buffer.partition(b"\r\n")  # +PONG
            for waiter in self.rounds.popleft():
                if not waiter.done():
                    waiter.set_result(None)

    def wait(self) -> asyncio.Future[None]:
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        if not self.next_round:
            loop.call_soon(self._write)
        self.next_round.append(waiter)
        return waiter

    def _write(self) -> None:
        assert self.transport is not None
        self.rounds.append(self.next_round)
        self.next_round = []
        self.transport.write(b"*1\r\n$4\r\nPING\r\n")


class RawStreams:
    """`GET /raw-sse` answered below Starlette, by the ASGI server's own interface alone: a
    stream's first frame, then nothing until the client leaves. What an open stream costs
    the server itself, whatever app it serves. Also `GET /raw-ping/<name>` (`PingRounds`)."""

    def __init__(self, app: Starlette, bodies: dict[str, bytes] | None = None, ping_url: str | None = None) -> None:
        self.app = app
        self.bodies = bodies or {}
        self.ping_url = ping_url
        self.pings: asyncio.Future[PingRounds] | None = None

    async def _connect(self) -> PingRounds:
        url = urlparse(self.ping_url)
        _, pings = await asyncio.get_running_loop().create_connection(PingRounds, url.hostname, url.port or 6379)
        return pings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/raw-ping/") and self.ping_url:
            await self._after_ping(scope["path"][10:], send)
            return
        if scope["type"] != "http" or scope["path"] != "/raw-sse":
            await self.app(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b"retry: 3000\n\n", "more_body": True})
        size = int(scope["query_string"].partition(b"first=")[2] or 0)  # `?first=N`: then a frame of N bytes
        if size > 0:
            first = b"event: first\ndata: " + b"x" * max(0, size - 21) + b"\n\n"
            await send({"type": "http.response.body", "body": first, "more_body": True})
            del first
        try:
            while (await receive())["type"] != "http.disconnect":
                pass
        except asyncio.CancelledError:  # the server ends it as the client leaves (granian)
            pass


    async def _after_ping(self, name: str, send: Send) -> None:
        if self.pings is None:  # the first requests share one connection
            self.pings = asyncio.ensure_future(self._connect())
        await (await self.pings).wait()
        body = self.bodies[name]
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(body)).encode()), (b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})


def hello() -> Starlette:
    return build(None, "")


async def serve(app: Starlette, port: int, server_name: str) -> None:
    server = serve_http(app, "127.0.0.1", port, server_name)

    async def run() -> None:
        serving = asyncio.ensure_future(server.serve())
        await started(server, serving)
        settle_heap()  # as `acp-state api` does
        print(f"listening on http://127.0.0.1:{server.port} ({server_name})", flush=True)
        await serving

    await until_signal(run, server.stop)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--server", choices=SERVERS, default=DEFAULT_SERVER)
    parser.add_argument("--redis-url")
    parser.add_argument("--key", default="bench:hash")
    parser.add_argument("--body", action="append", default=[], metavar="NAME=PATH")
    parser.add_argument("--ping-url", help="a Redis for /raw-ping/<name>")
    args = parser.parse_args()
    bodies = {name: open(path, "rb").read() for name, _, path in (b.partition("=") for b in args.body)}
    try:
        import uvloop

        uvloop.install()  # as `acp-state` does
    except ImportError:
        pass
    asyncio.run(serve(RawStreams(build(args.redis_url, args.key, bodies), bodies, args.ping_url), args.port, args.server))  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
