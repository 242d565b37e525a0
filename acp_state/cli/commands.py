"""`acp-state`: the command line, and the composition root of the processes.

`api` and `worker` are imported only inside the subcommand that runs them, so the core
never depends on either side.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import logging
import os
import signal
import socket
from typing import Any, Awaitable, Callable

from . import logs
from .connection import MEMORY, UnsuitableRedis, connect, verify
from .store import RedisStore, Retention

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
            shown = host if host == address else f"{host} ({address})"
            raise ValueError(f"cannot listen on {shown} port {port}: {reason}") from None
    return address


def url_host(address: str) -> str:
    """An address as the host part of a URL (IPv6 in brackets)."""
    return f"[{address}]" if ":" in address else address


def _serve_http(app: Any, host: str, port: int, server: str = DEFAULT_SERVER) -> Any:
    """An HTTP server for `app` in this process and on this event loop, whose signals we
    handle ourselves (so shutdown can finish cleanly): `serve()`, `started`, `port`, `stop()`."""
    if server == "granian":
        return _GranianServer(app, host, port)
    if server != "uvicorn":
        raise SystemExit(f"acp-state: unknown --server {server!r} (one of {', '.join(SERVERS)})")
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):  # type: ignore[override]
            yield

        @property
        def port(self) -> int:
            """The bound port (the real one when asked for port 0)."""
            for listener in self.servers:
                for sock in listener.sockets:
                    return sock.getsockname()[1]
            return self.config.port

        def stop(self) -> None:
            self.should_exit = True

    config = uvicorn.Config(
        app, host=host, port=port, log_level="warning", access_log=False, lifespan="on", timeout_graceful_shutdown=5,
        # Longer than the usual client pool's idle time, so clients close idle connections
        # first and never write into one the server is closing.
        timeout_keep_alive=30,
    )
    return Server(config)


class _GranianServer:
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
                await self._server.serve()  # returns once every connection is closed
        finally:
            probe.cancel()
            if self._draining is not None:
                await self._draining
            await lifespan.shutdown()

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


async def _started(server: Any, serving: asyncio.Future[None]) -> None:
    """Return once the server accepts connections (or raise if it failed to start)."""
    while not server.started:
        if serving.done():
            serving.result()
            if getattr(server, "stopped", False):
                raise SystemExit(0)  # stopped (SIGTERM) before it served: a clean exit
            raise SystemExit("the HTTP server did not start")
        await asyncio.sleep(0.01)


async def _until_signal(run: Callable[[], Awaitable[None]], on_signal: Callable[[], None]) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    await run()


def _api_settings(args: argparse.Namespace) -> Any:
    from api.settings import Settings

    workspaces = [os.path.abspath(w) for w in (args.workspace or [os.getcwd()])]
    return Settings(
        redis_url=args.redis_url,
        host=args.host,
        port=args.port,
        workspaces=workspaces,
        tokens=_tokens(args),
        sse_send_timeout_s=args.sse_send_timeout_s,
    )


def _tokens(args: argparse.Namespace) -> list[Any]:
    from api.auth import Token, is_loopback

    try:
        tokens = [Token.parse(spec) for spec in args.token]
        tokens += [Token.parse(f"{secret},role=channel") for secret in args.channel_token]
    except ValueError as error:
        raise SystemExit(f"acp-state: bad --token: {error}") from None
    if not tokens and not is_loopback(args.host):
        raise SystemExit(f"acp-state: refusing to serve {args.host} without a bearer token (--token)")
    return tokens


def _worker_config(args: argparse.Namespace) -> Any:
    from worker.loop_guard import LoopLimits
    from worker.worker import DEFAULT_AGENT, WorkerConfig

    return WorkerConfig(
        loop_limits=LoopLimits(identical=args.loop_identical, max_tool_calls=args.loop_max_tool_calls),
        agent=args.agent or DEFAULT_AGENT,
        max_sessions=args.max_sessions,
        lease_ms=args.lease_ms,
        child_per=args.child_per,
        session_mode=args.session_mode,
        agent_stderr=args.agent_stderr,
        name=args.name,
        metrics_port=getattr(args, "metrics_port", None),
        metrics_host=getattr(args, "metrics_host", "127.0.0.1"),
    )


def _retention(args: argparse.Namespace) -> Retention:
    return Retention(
        catalog_ms=args.catalog_retention_ms,
        events_ms=args.event_retention_ms,
        events_max=args.event_log_max,
        transcript_ms=args.transcript_retention_ms,
        session_ttl_ms=getattr(args, "session_ttl_ms", Retention().session_ttl_ms),
    )


async def run_api(args: argparse.Namespace) -> None:
    from api.app import create_app, end_streams

    settings = _api_settings(args)
    app = create_app(settings)
    server = _serve_http(app, settings.host, settings.port, args.server)

    def stop() -> None:
        end_streams(app)  # open event streams end cleanly now, not when the grace period ends
        server.stop()

    async def serve() -> None:
        serving = asyncio.ensure_future(server.serve())
        await _started(server, serving)
        print(f"acp-state api listening on http://{url_host(settings.host)}:{server.port} ({args.server})", flush=True)
        await serving

    await _until_signal(serve, stop)


async def run_worker(args: argparse.Namespace) -> None:
    from worker.worker import Worker

    store = RedisStore.from_url(args.redis_url, _retention(args))
    worker = Worker(store, _worker_config(args))
    logs.stamp(workerId=worker.incarnation)

    async def serve() -> None:
        running = asyncio.ensure_future(worker.run())
        ready = asyncio.ensure_future(worker.ready.wait())
        await asyncio.wait([running, ready], return_when=asyncio.FIRST_COMPLETED)
        if ready.done():
            print(f"acp-state worker {worker.incarnation} serving {args.redis_url}", flush=True)
        else:
            ready.cancel()
        await running

    try:
        await _until_signal(serve, worker.stop)
    finally:
        await store.close()


async def run_dev(args: argparse.Namespace) -> None:
    """The embedded default: API + one worker in one process, on in-process Redis."""
    from api.app import create_app, end_streams
    from worker.worker import Worker

    store = RedisStore.from_url(args.redis_url, _retention(args))
    settings = _api_settings(args)
    worker = Worker(store, _worker_config(args))
    app = create_app(settings, store=store)
    server = _serve_http(app, settings.host, settings.port, args.server)

    def stop() -> None:
        end_streams(app)
        server.stop()
        worker.stop()

    async def both() -> None:
        worker_task = asyncio.ensure_future(worker.run())
        await worker.ready.wait()
        serving = asyncio.ensure_future(server.serve())
        await _started(server, serving)
        print(
            f"acp-state dev: open http://{url_host(settings.host)}:{server.port}/ (workspace {settings.workspaces[0]})",
            flush=True,
        )
        await serving
        worker.stop()
        await worker_task

    await _until_signal(both, stop)


async def run_status(args: argparse.Namespace) -> None:
    from .status import watch

    await watch(RedisStore.from_url(args.redis_url), once=args.once, interval_s=args.interval)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="acp-state", description=__doc__)
    parser.add_argument("--log-level", default=os.environ.get("ACP_STATE_LOG", "INFO"))
    parser.add_argument("--log-format", choices=["json", "text"], default=os.environ.get("ACP_STATE_LOG_FORMAT"),
                        help="default: json for api and worker, text for dev and status")
    commands = parser.add_subparsers(dest="command", required=True)

    def api_options(p: argparse.ArgumentParser, redis_default: str | None) -> None:
        p.add_argument("--redis-url", required=redis_default is None, default=redis_default)
        p.add_argument("--host", default="127.0.0.1")
        p.add_argument("--port", type=int, default=4170)
        p.add_argument("--server", choices=SERVERS, default=os.environ.get("ACP_STATE_SERVER", DEFAULT_SERVER),
                       help=f"the ASGI server (default: $ACP_STATE_SERVER or {DEFAULT_SERVER}; see docs/performance.md)")
        p.add_argument("--workspace", action="append", help="a workspace cwd (repeatable; default: .)")
        p.add_argument("--token", action="append", default=[], metavar="SECRET[,role=R][,workspace=PATH]",
                       help="a bearer token (repeatable); role user (default), channel or admin; "
                            "workspace scopes it to one workspace. Required off loopback.")
        p.add_argument("--channel-token", action="append", default=[],
                       help="a bearer token of the channel role (may mark prompts as channel prompts)")
        p.add_argument("--sse-send-timeout-s", type=float, default=10.0,
                       help="drop an SSE client whose socket stays full this long")

    def worker_options(p: argparse.ArgumentParser) -> None:
        p.add_argument("--agent", help="ACP agent command (default: the built-in scripted agent)")
        p.add_argument("--max-sessions", type=int, default=1000)
        p.add_argument("--lease-ms", type=int, default=10_000)
        p.add_argument("--child-per", choices=["workspace", "session"], default="workspace")
        p.add_argument("--session-mode", help="ACP session mode to set after session/new (e.g. default)")
        p.add_argument("--agent-stderr", help="append the agents' stderr to this file")
        p.add_argument("--name", help="worker name prefix of the incarnation id")
        defaults = Retention()
        p.add_argument("--event-log-max", type=int, default=defaults.events_max,
                       help="events kept per session for Last-Event-ID replay")
        p.add_argument("--event-retention-ms", type=int, default=defaults.events_ms)
        p.add_argument("--transcript-retention-ms", type=int, default=defaults.transcript_ms)
        p.add_argument("--catalog-retention-ms", type=int, default=defaults.catalog_ms,
                       help="how long closed sessions stay listed")
        p.add_argument("--session-ttl-ms", type=int, default=defaults.session_ttl_ms,
                       help="a live session's hash expires this long after its worker last refreshed it "
                       "(the bound for readers that skip the lease)")
        p.add_argument("--loop-identical", type=int, default=10,
                       help="stop a turn after N consecutive identical tool calls (0: off)")
        p.add_argument("--loop-max-tool-calls", type=int, default=150,
                       help="stop a turn after more than N tool calls (0: off)")

    api = commands.add_parser("api", help="run a stateless API process")
    api_options(api, None)
    worker = commands.add_parser("worker", help="run a bridge worker")
    worker.add_argument("--redis-url", required=True)
    worker.add_argument("--metrics-port", type=int, help="serve GET /metrics on this port")
    worker.add_argument("--metrics-host", default="127.0.0.1",
                        help="the address of --metrics-port, an IP or a name (default: 127.0.0.1)")
    worker_options(worker)
    status = commands.add_parser("status", help="a live table of workers and sessions by state")
    status.add_argument("--redis-url", required=True)
    status.add_argument("--once", action="store_true", help="print one table and exit")
    status.add_argument("--interval", type=float, default=1.0)
    dev = commands.add_parser("dev", help="API + worker in one process on embedded Redis")
    api_options(dev, MEMORY)
    worker_options(dev)
    return parser


async def _check_redis(url: str) -> None:
    """Refuse at once, with the reason, a Redis acp-state cannot use as given (too old, or a
    cluster node behind a single-node URL); an unreachable one is the runner's business."""
    client = connect(url)
    try:
        await verify(client)
    except UnsuitableRedis as error:
        raise SystemExit(f"acp-state: {url}: {error}") from None
    except Exception:
        pass
    finally:
        await client.aclose()


async def _run(runner: Callable[[argparse.Namespace], Awaitable[None]], args: argparse.Namespace) -> None:
    await _check_redis(args.redis_url)
    await runner(args)


def _resolve_listeners(args: argparse.Namespace) -> None:
    """Turn --host and --metrics-host into checked IP addresses (see `listen_address`)."""
    try:
        if args.command in ("api", "dev"):
            args.host = listen_address(args.host, args.port)
        if args.command == "worker":
            args.metrics_host = listen_address(args.metrics_host, args.metrics_port)
    except ValueError as error:
        option = "--metrics-host" if args.command == "worker" else "--host"
        raise ValueError(f"{option}: {error}") from None


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        _resolve_listeners(args)
    except ValueError as error:
        parser.exit(2, f"acp-state: {error}\n")  # a usage error, like argparse's own: exit code 2
    default_format = "json" if args.command in ("api", "worker") else "text"
    logs.configure(args.log_level, args.log_format or default_format)
    runner = {"api": run_api, "worker": run_worker, "dev": run_dev, "status": run_status}[args.command]
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(_run(runner, args))


if __name__ == "__main__":
    main()
