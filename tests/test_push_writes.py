"""A push stream's frames written by its hub straight to the server's send (no task step per
stream and frame), on both servers, over real HTTP on loopback: a client that stops reading
makes the writes wait, what the hub pushes meanwhile queues, and the client that reads again
gets every frame once, in order."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any

import httpx
import pytest

from acp_state.api.streams.response import DIRECT_SEND
from acp_state.api.streams.hub import Hub, Listener, frames, stream_response
from acp_state.cli.serving import SERVERS, serve_http
from tests.helpers import eventually

FRAME_BYTES = 32 * 1024
FRAMES = 200  # 6.4 MB: more than the sockets and the servers hold for a client that stops reading


def numbered(n: int) -> bytes:
    return b"data: n%06d " % n + b"x" * (FRAME_BYTES - 17) + b"\n\n"


class ManyStreams(Hub):
    """The test's hub: its streams' snapshot; they leave it as they end."""

    def snapshot_for(self, listener: Listener) -> bytes:
        return b"event: snapshot\ndata: {}\n\n"


async def serve_streams(server: str, hub: Hub, send_timeout_s: float = 60.0) -> tuple[Any, asyncio.Future[None]]:
    async def app(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        scope[DIRECT_SEND] = send
        listener = Listener()
        hub.add(listener)
        await stream_response(frames(listener, b"event: first\ndata: {}\n\n", hub), send_timeout_s)(scope, receive, send)

    http = serve_http(app, "127.0.0.1", 0, server)
    serving = asyncio.ensure_future(http.serve())
    await eventually(lambda: http.started, f"{server} started")
    return http, serving


@pytest.mark.parametrize("server", SERVERS)
async def test_a_client_that_stops_reading_gets_every_frame_in_order_once_it_reads_again(server: str) -> None:
    hub = ManyStreams()
    http, serving = await serve_streams(server, hub)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", http.port))
    reader, writer = await asyncio.open_connection(sock=sock)
    try:
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        await reader.readuntil(b"event: first")
        listener = await eventually(lambda: next((one for one in hub.listeners if one.write), None), "the hub may write")

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



async def read_frames(response: httpx.Response, count: int) -> list[int]:
    """The numbers of the first `count` numbered frames of an event stream, as an HTTP client
    decodes its body (chunked transfer encoding)."""
    text = b""
    async for part in response.aiter_bytes():
        text += part
        if text.count(b"data: n") >= count and text.endswith(b"\n\n"):
            break
    return [int(part[:6]) for part in text.split(b"data: n")[1:]]


@pytest.mark.parametrize("server", SERVERS)
async def test_one_frame_written_by_the_hub_to_every_stream_reaches_each_once_in_order(server: str) -> None:
    """The hub's write to streams that wait (`Hub.broadcast_all`: one message for all; on
    uvicorn, the chunk framed once and written to each transport) is a valid HTTP body."""
    hub = ManyStreams()
    http, serving = await serve_streams(server, hub)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{http.port}", timeout=30) as client:
            async with contextlib.AsyncExitStack() as streams:
                responses = [await streams.enter_async_context(client.stream("GET", "/")) for _ in range(3)]
                await eventually(lambda: len(hub.listeners) == 3 and all(listener.write for listener in hub.listeners),
                                 "every stream waits, and the hub may write to it")
                for n in range(50):  # a burst: some writes may wait on the client, and what follows queues
                    hub.broadcast_all(numbered(n)[:40] + b"\n\n")
                for response in responses:
                    assert await read_frames(response, 50) == list(range(50))
    finally:
        http.stop()
        await asyncio.wait_for(serving, 30)


@pytest.mark.parametrize("server", SERVERS)
async def test_a_client_that_leaves_while_the_hub_writes_leaves_the_hub_and_the_others_go_on(server: str) -> None:
    hub = ManyStreams()
    http, serving = await serve_streams(server, hub)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{http.port}", timeout=30) as client:
            async with client.stream("GET", "/") as staying:
                await eventually(lambda: len(hub.listeners) == 1 and all(l.write for l in hub.listeners), "one stream waits")
                sock = socket.create_connection(("127.0.0.1", http.port))
                sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                await eventually(lambda: len(hub.listeners) == 2 and all(l.write for l in hub.listeners), "two streams wait")
                sock.close()
                n = 0
                while len(hub.listeners) > 1:  # the hub writes on to the one that left, until its stream ends
                    hub.broadcast_all(numbered(n)[:40] + b"\n\n")
                    n += 1
                    await asyncio.sleep(0.01)
                    assert n < 3000, "safety stop: the stream of the client that left never ended"
                hub.broadcast_all(numbered(n)[:40] + b"\n\n")
                assert await read_frames(staying, n + 1) == list(range(n + 1))
    finally:
        http.stop()
        await asyncio.wait_for(serving, 30)


@pytest.mark.parametrize("server", SERVERS)
async def test_a_client_that_stops_reading_is_dropped_and_the_others_get_every_frame(server: str) -> None:
    """The hub's write to a client that stopped reading waits on it (the server's send), the
    send watch ends that stream after its send timeout, and a reading client beside it gets
    every frame, in order."""
    hub = ManyStreams()
    http, serving = await serve_streams(server, hub, send_timeout_s=0.5)
    stopped = socket.socket()
    stopped.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{http.port}", timeout=30) as client:
            async with client.stream("GET", "/") as reading:
                await eventually(lambda: len(hub.listeners) == 1 and all(l.write for l in hub.listeners), "one stream waits")
                stopped.connect(("127.0.0.1", http.port))
                first = next(iter(hub.listeners))
                stopped.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # and reads nothing from here on
                await eventually(lambda: len(hub.listeners) == 2 and all(l.write for l in hub.listeners), "two streams wait")
                stopped_one = next(listener for listener in hub.listeners if listener is not first)
                received: list[int] = []

                async def read() -> None:
                    received.extend(await read_frames(reading, FRAMES))

                reader = asyncio.ensure_future(read())
                pushed = 0

                def push_while_writable() -> bool:
                    """Push a frame while the hub may write to the stopped client; nothing while a
                    write waits on it. A send that waited only on a busy server (granian's, under
                    load) completes and the hub may write again: pushing goes on. So the stream
                    can end only by the send watch seeing a write wait on that client."""
                    nonlocal pushed
                    if stopped_one not in hub.listeners:
                        return True
                    if stopped_one.write is not None:
                        assert pushed < FRAMES, "safety stop: the client that stopped reading took every frame"
                        hub.broadcast_all(numbered(pushed))
                        pushed += 1
                    return False

                await eventually(push_while_writable, "the stream of the client that stopped reading ended", step=0.01)
                n = pushed
                for m in range(n, FRAMES):
                    hub.broadcast_all(numbered(m))
                    await asyncio.sleep(0)
                await asyncio.wait_for(reader, 30)
                assert received == list(range(FRAMES))
    finally:
        stopped.close()
        http.stop()
        await asyncio.wait_for(serving, 30)
