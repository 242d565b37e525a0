"""A push stream's frames written by its hub straight to the server's send (no task step per
stream and frame), on both servers, over real HTTP on loopback: a client that stops reading
makes the writes wait, what the hub pushes meanwhile queues, and the client that reads again
gets every frame once, in order."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest

from acp_state.api import event_stream
from acp_state.api.push import Hub, Listener, frames, stream_response
from acp_state.cli.serving import SERVERS, serve_http
from tests.helpers import eventually

FRAME_BYTES = 32 * 1024
FRAMES = 200  # 6.4 MB: more than the sockets and the servers hold for a client that stops reading


def numbered(n: int) -> bytes:
    return b"data: n%06d " % n + b"x" * (FRAME_BYTES - 17) + b"\n\n"


class OneStream(Hub):
    """The hub of the test's one stream: its snapshot, and nothing to do as it leaves."""

    def snapshot_for(self, listener: Listener) -> bytes:
        return b"event: snapshot\ndata: {}\n\n"

    def remove(self, listener: Listener) -> None:
        pass


async def serve_one_stream(server: str) -> tuple[Any, asyncio.Future[None], list[Listener]]:
    listeners: list[Listener] = []

    async def app(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        scope[event_stream.DIRECT_SEND] = send  # as the API's app keeps it
        listener = Listener()
        listeners.append(listener)
        body = frames(listener, b"event: first\ndata: {}\n\n", OneStream())
        await stream_response(body, 60.0)(scope, receive, send)

    http = serve_http(app, "127.0.0.1", 0, server)
    serving = asyncio.ensure_future(http.serve())
    await eventually(lambda: http.started, f"{server} started")
    return http, serving, listeners


@pytest.mark.parametrize("server", SERVERS)
async def test_a_client_that_stops_reading_gets_every_frame_in_order_once_it_reads_again(server: str) -> None:
    http, serving, listeners = await serve_one_stream(server)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", http.port))
    reader, writer = await asyncio.open_connection(sock=sock)
    try:
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        await reader.readuntil(b"event: first")
        listener = await eventually(lambda: listeners and listeners[0].write and listeners[0], "the hub may write")

        queued = 0
        for n in range(FRAMES):  # the client reads nothing meanwhile
            listener.push(numbered(n))
            queued = max(queued, len(listener.frames))
            await asyncio.sleep(0)
        assert queued, "a write waited on the client: later frames queued for the stream's task"
        assert not listener.behind

        received = b""
        while received.count(b"data: n") < FRAMES:
            received += await asyncio.wait_for(reader.read(1 << 20), 30)
        got = [int(part[:6]) for part in received.split(b"data: n")[1:]]
        assert got == list(range(FRAMES))
        assert b"snapshot" not in received

        await eventually(lambda: listener.write is not None, "the hub writes directly again once the client reads")
        listener.push(numbered(FRAMES))
        await asyncio.wait_for(reader.readuntil(b"data: n%06d" % FRAMES), 10)
    finally:
        writer.close()
        http.stop()
        await asyncio.wait_for(serving, 30)
