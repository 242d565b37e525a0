"""The HTTP servers an `acp-state` process runs its ASGI app with, on its own event loop:
granian (embedded) or uvicorn, the address they listen on, and the signals that stop them."""

from __future__ import annotations

import asyncio
import errno
import gc
import ipaddress
import logging
import signal
import socket
from typing import Any, Awaitable, Callable

from .port_holders import port_holders

log = logging.getLogger("acp_state")


# The ASGI servers `acp-state api --server` offers. granian, the default, answers ~40% more
# requests/s on the status route than uvicorn on the same machine (docs/performance.md).
SERVERS = ("granian", "uvicorn")
DEFAULT_SERVER = "granian"


def listen_address(host: str, port: int | None) -> str:
    """`host` as the one IP address a server binds, once checked that it can listen there;
    ValueError with the reason otherwise.

    A name is resolved here, once, because granian binds IP addresses only (it fails on
    `localhost`), and because the loopback check of a tokenless API must judge the address
    actually bound: any name that resolves to loopback is as private as `localhost`. IPv4 is
    preferred when a name has both, like `localhost` with its 127.0.0.1 and ::1.
    """
    name = host.strip()
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]  # the URL form of an IPv6 address
    if not name:
        name = "0.0.0.0"  # what uvicorn and asyncio take "" for: every IPv4 interface
    try:
        address = str(ipaddress.ip_address(name))
    except ValueError:
        try:
            found = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as error:
            reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
            raise ValueError(f"{host!r} does not resolve to an address ({reason})") from None
        addresses = [str(info[4][0]) for info in found if info[0] in (socket.AF_INET, socket.AF_INET6)]
        if not addresses:
            raise ValueError(f"{host!r} does not resolve to an IP address")
        address = next((a for a in addresses if ":" not in a), addresses[0])
    if port is not None:
        # Bind once now, as the server will, so that a foreign address or a taken port is a
        # one-line error here rather than a traceback from inside the server.
        try:
            with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers do
                probe.bind((address, port))
        except (OSError, OverflowError) as error:
            reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
            if isinstance(error, OSError) and error.errno == errno.EADDRINUSE and (holders := port_holders(port)):
                reason += f" (held by {', '.join(holders)})"
            shown = host if host == address else f"{host} ({address})"
            raise ValueError(f"cannot listen on {shown} port {port}: {reason}") from None
    return address


def url_host(address: str) -> str:
    """An address as the host part of a URL (IPv6 in brackets)."""
    return f"[{address}]" if ":" in address else address


def serve_http(app: Any, host: str, port: int, server: str = DEFAULT_SERVER) -> Any:
    """An HTTP server for `app` in this process and on this event loop, whose signals we
    handle ourselves (so shutdown can finish cleanly): `serve()`, `started`, `port`, `stop()`."""
    if server == "granian":
        return GranianServer(app, host, port)
    if server != "uvicorn":
        raise SystemExit(f"acp-state: unknown --server {server!r} (one of {', '.join(SERVERS)})")
    import uvicorn

    from ..uvicorn_server import UvicornServer

    config = uvicorn.Config(
        app, host=host, port=port, log_level="warning", access_log=False, lifespan="on", timeout_graceful_shutdown=5,
        # Longer than the usual client pool's idle time, so clients close idle connections
        # first and never write into one the server is closing.
        timeout_keep_alive=30,
    )
    return UvicornServer(config)


class GranianServer:
    """Granian's embedded server: its Rust HTTP/1 stack drives the ASGI app on this process's
    event loop (no worker process, no signal handlers of its own).

    We run the app's lifespan ourselves around it, so that shutdown goes in uvicorn's order:
    stop accepting, let running requests finish within the grace period (then cancel them:
    an SSE stream only ends that way), and only then the lifespan shutdown. `started` turns
    true once the port accepts connections, which is after the lifespan startup completed."""

    GRACE_S = 5.0

    def __init__(self, app: Any, host: str, port: int) -> None:
        from granian.constants import HTTPModes, Interfaces
        from granian.http import HTTP1Settings
        from granian.log import LogLevels
        from granian.server.embed import Server

        if port == 0:  # granian cannot report the port it bound: pick a free one first
            import socket

            with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
                probe.bind((host, 0))
                port = probe.getsockname()[1]
        self.app, self.host, self.port, self.started = app, host, port, False
        self._draining: asyncio.Future[None] | None = None
        self._stopping = asyncio.Event()
        self._server = Server(
            app, address=host, port=port, interface=Interfaces.ASGINL, http=HTTPModes.http1, websockets=False,
            # No cap on concurrent requests below the kernel's (uvicorn has none): an SSE stream holds one.
            backlog=2048, backpressure=1 << 20,
            # The idle keep-alive limit: longer than the usual client pool's idle time (as with uvicorn).
            http1_settings=HTTP1Settings(header_read_timeout=30_000),
            # Granian's own records go through our handlers (JSON lines); errors only.
            log_level=LogLevels.error,
            log_dictconfig={"loggers": {"_granian": {"propagate": True}, "granian.access": {"propagate": True}}},
        )

    async def serve(self) -> None:
        from granian.asgi import LifespanProtocol

        lifespan = LifespanProtocol(self.app)
        await lifespan.startup()
        if lifespan.interrupt:
            log.error("ASGI lifespan startup failed", exc_info=lifespan.exc)
            return
        probe = asyncio.ensure_future(self._probe())
        try:
            if not self.stopped:  # (a stop during the lifespan startup: do not serve at all)
                serving = asyncio.ensure_future(self._server.serve())  # ends once every connection is closed
                stopping = asyncio.ensure_future(self._stopping.wait())
                await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
                stopping.cancel()
                await self._until_served(serving)
        finally:
            probe.cancel()
            if self._draining is not None:
                await self._draining
            await lifespan.shutdown()

    async def _until_served(self, serving: asyncio.Future[None]) -> None:
        """Granian ends once its connections close, and one whose client sent part of a
        request and then nothing is closed only by the header read timeout (30 s). So once
        stopped, and the running requests have had their grace, such connections get
        `GRACE_S` more and are then left to the process's exit (`acp-state` exits at once
        after serving: see `cli.commands._run`); `acp-state dev` once overran a 20 s
        SIGTERM limit waiting on one."""
        if self._draining is not None:
            await self._draining
            await asyncio.wait({serving}, timeout=self.GRACE_S)
        if serving.done():
            serving.result()
        else:
            log.warning("the HTTP server still holds a connection %.0f s after it stopped; not waiting for it",
                        self.GRACE_S)

    async def _probe(self) -> None:
        target = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(self.host, self.host)
        while True:
            try:
                _, writer = await asyncio.open_connection(target, self.port)
            except OSError:
                await asyncio.sleep(0.01)
                continue
            writer.close()
            self.started = True
            return

    @property
    def stopped(self) -> bool:
        return self._draining is not None

    def stop(self) -> None:
        self._server.stop()  # no new connections; granian waits for the open ones to close
        if self._draining is None:
            self._draining = asyncio.ensure_future(self._drain())
            self._stopping.set()

    async def _drain(self) -> None:
        """Running requests get the grace period, then are cancelled (an SSE stream only
        ends that way), which closes their connections and lets granian's shutdown finish."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.GRACE_S
        while running := [t for t in asyncio.all_tasks() if not t.done() and _is_granian_request(t)]:
            left = deadline - loop.time()
            if left > 0:
                await asyncio.wait(running, timeout=left)
                continue
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)


def _is_granian_request(task: asyncio.Task[Any]) -> bool:
    """A task granian started for a request (its coroutine is granian's `future_watcher`)."""
    return getattr(task.get_coro(), "__name__", "") == "future_watcher"


async def started(server: Any, serving: asyncio.Future[None]) -> None:
    """Return once the server accepts connections (or raise if it failed to start)."""
    while not server.started:
        if serving.done():
            serving.result()
            if getattr(server, "stopped", False):
                raise SystemExit(0)  # stopped (SIGTERM) before it served: a clean exit
            raise SystemExit("the HTTP server did not start")
        await asyncio.sleep(0.01)


def settle_heap() -> None:
    """Once started: move what startup made (modules, routes, the OpenAPI document...) out of
    the garbage collector's sight. Its full collections otherwise walked all of it, pausing
    the loop for milliseconds: an API's status p99 fell from 20 ms to 5 ms with this."""
    gc.collect()
    gc.freeze()


async def until_signal(run: Callable[[], Awaitable[None]], on_signal: Callable[[], None]) -> None:
    """Run `run()`, calling `on_signal()` on SIGTERM and SIGINT (which then stop nothing else)."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    await run()
