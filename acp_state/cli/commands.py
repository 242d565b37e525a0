"""`acp-state`: the command line, and the composition root of the processes.

The only code that imports both the API and the worker (each only inside the subcommand
that runs it, so `acp-state status` loads neither).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from typing import Any, Awaitable, Callable

from .. import logs, tracing
from ..agents import PRESETS, offered_agents, session_modes, with_presets
from ..moves import default_state_store
from ..store import (
    MEMORY, STORE_ERRORS, MissingPermission, RedisStore, Retention, UnsuitableRedis, check_permissions, check_redis,
    outage_namer,
)
from ..testing import scripted_agent
from . import secrets
from .serving import DEFAULT_SERVER, SERVERS, listen_address, serve_http, settle_heap, started, until_signal, url_host

EXIT_SHUTDOWN_OVERRAN = 70  # EX_SOFTWARE: stopped, but a step of the shutdown overran (logged)
# EX_UNAVAILABLE: a worker stopped with sessions it could not hand over, the store being
# away past the drain's grace (logged; they are left to the sweep and a later load).
EXIT_STORE_UNREACHABLE = 69
# How long `acp-state status` and `acp-state drain` wait for any reply before saying the
# store is unreachable (a stalled or cut-off Redis otherwise holds a command line forever).
CLI_REPLY_TIMEOUT_S = 5.0
# The agent a worker runs when given no --agent: the scripted test double.
SCRIPTED_AGENT = f"{sys.executable} -m {scripted_agent.__name__}"


def _api_settings(args: argparse.Namespace) -> Any:
    from acp_state.api.settings import Settings

    workspaces = [os.path.abspath(w) for w in (args.workspace or [os.getcwd()])]
    tokens = _tokens(args)
    _check_origins(args.allow_origin, bool(tokens))
    return Settings(
        redis_url=args.redis_url,
        host=args.host,
        port=args.port,
        workspaces=workspaces,
        tokens=tokens,
        allow_origins=args.allow_origin,
        web_shell=_web_shell(args.web_shell),
        sse_send_timeout_s=args.sse_send_timeout_s,
        create_timeout_s=args.create_timeout_s,
        client_ttl_ms=args.client_ttl_ms,
    )


def _web_shell(path: str | None) -> str | None:
    """--web-shell: the folder of a Web Shell build, checked now rather than at the first page load."""
    if path is None:
        return None
    folder = os.path.abspath(path)
    if not os.path.isfile(os.path.join(folder, "index.html")) or not os.path.isdir(os.path.join(folder, "assets")):
        raise SystemExit(f"acp-state: --web-shell {path}: not a Web Shell build (no index.html and assets/ there; "
                         "the reference's is the web-shell/ folder of @qwen-code/qwen-code)")
    return folder


def _tokens(args: argparse.Namespace) -> list[Any]:
    from acp_state.api.auth import Token, is_loopback

    try:
        tokens = [Token.parse(spec) for spec in args.token_specs]
        tokens += [Token.parse(f"{secret},role=channel") for secret in args.channel_token]
    except ValueError as error:
        raise SystemExit(f"acp-state: bad --token: {error}") from None
    if not tokens and not is_loopback(args.host):
        raise SystemExit(f"acp-state: refusing to serve {args.host} without a bearer token (--token)")
    return tokens


def _check_origins(origins: list[str], has_token: bool) -> None:
    from acp_state.api.origins import OriginError, parse_allowed

    try:
        parse_allowed(origins, has_token)
    except OriginError as error:
        raise SystemExit(f"acp-state: {error}") from None


def _worker_config(args: argparse.Namespace) -> Any:
    from acp_state.worker.loop_guard import LoopLimits
    from acp_state.worker.config import WorkerConfig

    agents, modes = _agents(args)
    return WorkerConfig(
        loop_limits=LoopLimits(identical=args.loop_identical, max_tool_calls=args.loop_max_tool_calls),
        agents=agents,
        session_modes=modes,
        max_sessions=args.max_sessions,
        lease_ms=args.lease_ms,
        child_per=args.child_per,
        agent_stderr=args.agent_stderr,
        name=args.name,
        metrics_port=getattr(args, "metrics_port", None),
        metrics_host=getattr(args, "metrics_host", "127.0.0.1"),
        state_dir=args.state_dir,
        state_store=args.state_store or default_state_store(args.state_dir or os.path.expanduser("~")),
        drain_grace_s=args.drain_grace_s,
        handoff=getattr(args, "handoff", "eager"),
    )


def _agents(args: argparse.Namespace) -> tuple[dict[str, str], dict[str, str]]:
    """The agents on offer (`--agent`, `--agent-preset`) and their session modes."""
    try:
        agent_options, mode_options = with_presets(args.agent or [], args.agent_preset, args.session_mode or [])
        agents = offered_agents(agent_options, SCRIPTED_AGENT)
        return agents, session_modes(mode_options, agents)
    except ValueError as error:
        raise SystemExit(f"acp-state: {error}") from None


def _retention(args: argparse.Namespace) -> Retention:
    return Retention(
        catalog_ms=args.catalog_retention_ms,
        events_ms=args.event_retention_ms,
        events_max=args.event_log_max,
        transcript_ms=args.transcript_retention_ms,
        session_ttl_ms=getattr(args, "session_ttl_ms", Retention().session_ttl_ms),
    )


async def run_api(args: argparse.Namespace) -> None:
    from acp_state.api.app import create_app, end_streams

    settings = _api_settings(args)
    app = create_app(settings)
    server = serve_http(tracing.asgi(app), settings.host, settings.port, args.server)

    def stop() -> None:
        end_streams(app)  # open event streams end cleanly now, not when the grace period ends
        server.stop()

    async def serve() -> None:
        serving = asyncio.ensure_future(server.serve())
        await started(server, serving)
        settle_heap()
        print(f"acp-state api listening on http://{url_host(settings.host)}:{server.port} ({args.server})", flush=True)
        await serving

    await until_signal(serve, stop)


async def run_worker(args: argparse.Namespace) -> None:
    from acp_state.worker.worker import Worker

    store = RedisStore.from_url(args.redis_url, _retention(args), lease_ms=args.lease_ms)
    worker = Worker(store, _worker_config(args))
    logs.stamp(workerId=worker.incarnation)

    async def serve() -> None:
        running = asyncio.ensure_future(worker.run())
        ready = asyncio.ensure_future(worker.ready.wait())
        await asyncio.wait([running, ready], return_when=asyncio.FIRST_COMPLETED)
        if ready.done():
            settle_heap()
            print(f"acp-state worker {worker.incarnation} serving {secrets.redacted(args.redis_url)}", flush=True)
        else:
            ready.cancel()
        await running

    try:
        # SIGTERM drains (the sessions move to other workers, docs/architecture.md); a
        # second one stops at once.
        await until_signal(serve, worker.begin_drain)
    finally:
        if worker.overran:  # a task that did not end would hold up the loop's own cleanup
            logging.shutdown()
            os._exit(EXIT_SHUTDOWN_OVERRAN)
        await store.close()
    if worker.stranded:
        raise SystemExit(EXIT_STORE_UNREACHABLE)


async def run_dev(args: argparse.Namespace) -> None:
    """The embedded default: API + one worker in one process, on in-process Redis."""
    from acp_state.api.app import create_app, end_streams
    from acp_state.worker.worker import Worker

    store = RedisStore.from_url(args.redis_url, _retention(args), lease_ms=args.lease_ms)
    settings = _api_settings(args)
    worker = Worker(store, _worker_config(args))
    app = create_app(settings, store=store)
    server = serve_http(tracing.asgi(app), settings.host, settings.port, args.server)

    def stop() -> None:
        end_streams(app)
        server.stop()
        worker.stop()

    async def both() -> None:
        worker_task = asyncio.ensure_future(worker.run())
        await worker.ready.wait()
        serving = asyncio.ensure_future(server.serve())
        await started(server, serving)
        settle_heap()
        print(
            f"acp-state dev: open http://{url_host(settings.host)}:{server.port}/ (workspace {settings.workspaces[0]})",
            flush=True,
        )
        await serving
        worker.stop()
        await worker_task

    await until_signal(both, stop)


async def run_drain(args: argparse.Namespace) -> None:
    """Tell a worker to drain, then follow its report until it is gone (or `--no-wait`)."""
    from .. import commands
    from ..store import WorkerRegistry

    store = RedisStore.from_url(args.redis_url, reply_timeout_s=CLI_REPLY_TIMEOUT_S)
    try:
        registry = WorkerRegistry(store)
        if args.incarnation not in await registry.live():
            raise SystemExit(f"acp-state: no live worker {args.incarnation!r} (see acp-state status)")
        await store.send_control(args.incarnation, commands.Drain(grace_s=args.grace_s))
        print(f"told {args.incarnation} to drain", flush=True)
        while not args.no_wait and args.incarnation in await registry.live():
            await asyncio.sleep(0.5)
        if not args.no_wait:
            print(f"{args.incarnation} is gone", flush=True)
    finally:
        await store.close()


async def run_status(args: argparse.Namespace) -> None:
    from .status import watch

    store = RedisStore.from_url(args.redis_url, reply_timeout_s=CLI_REPLY_TIMEOUT_S)
    try:
        await watch(store, once=args.once, interval_s=args.interval)
    finally:
        await store.close()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="acp-state", description=__doc__)
    parser.add_argument("--log-level", default=os.environ.get("ACP_STATE_LOG", "INFO"))
    parser.add_argument("--log-format", choices=["json", "text"], default=os.environ.get("ACP_STATE_LOG_FORMAT"),
                        help="default: json for api and worker, text for dev and status")
    commands = parser.add_subparsers(dest="command", required=True)

    def api_options(p: argparse.ArgumentParser, redis_default: str | None) -> None:
        redis_url_option(p, redis_default)
        p.add_argument("--host", default="127.0.0.1")
        p.add_argument("--port", type=int, default=4170)
        p.add_argument("--server", choices=SERVERS, default=os.environ.get("ACP_STATE_SERVER", DEFAULT_SERVER),
                       help=f"the ASGI server (default: $ACP_STATE_SERVER or {DEFAULT_SERVER}; see docs/performance.md)")
        p.add_argument("--workspace", action="append", help="a workspace cwd (repeatable; default: .)")
        p.add_argument("--token", action="append", default=[], metavar="SECRET[,role=R][,workspace=PATH]",
                       help="a bearer token (repeatable); role user (default), channel or admin; "
                            "workspace scopes it to one workspace. Required off loopback. `ps` shows it: "
                            "prefer --token-file or $ACP_STATE_TOKENS")
        p.add_argument("--token-file", action="append", default=[], metavar="PATH",
                       help="token specs, one a line as --token takes them (# comments); a file its "
                            "group or others may read is refused (repeatable)")
        p.add_argument("--channel-token", action="append", default=[],
                       help="a bearer token of the channel role (may mark prompts as channel prompts)")
        p.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                       help="a web origin (scheme://host[:port]) whose pages may call this API (repeatable; "
                       "'*' any, with a token only); other origins' requests answer 403")
        p.add_argument("--web-shell", metavar="PATH",
                       help="serve this Web Shell build at / instead of acp-state's own: the web-shell/ folder "
                            "of an installed @qwen-code/qwen-code (docs/api.md)")
        p.add_argument("--sse-send-timeout-s", type=float, default=10.0,
                       help="drop an SSE client whose socket stays full this long")
        p.add_argument("--create-timeout-s", type=float, default=60.0,
                       help="how long a create waits for its worker's answer (an answer nobody took "
                            "is taken back this long plus 5 s after it was given, and the session undone)")
        p.add_argument("--client-ttl-ms", type=int, default=90_000,
                       help="a client that heartbeats (POST /session/:id/heartbeat) leaves its session this "
                            "long after its last heartbeat")

    def redis_url_option(p: argparse.ArgumentParser, default: str | None = None) -> None:
        p.set_defaults(redis_fallback=default)
        p.add_argument("--redis-url", metavar="URL",
                       help=f"default: ${secrets.REDIS_URL_VARIABLE}" + (f", else {default}" if default else "")
                       + f"; the password of its user may come from ${secrets.REDIS_PASSWORD_VARIABLE} "
                       "(`ps` shows a URL's password)")

    def worker_options(p: argparse.ArgumentParser) -> None:
        p.add_argument("--agent", action="append", metavar="[NAME=]COMMAND",
                       help="an ACP agent on offer (repeatable): NAME=COMMAND offers it under NAME, a "
                            "bare COMMAND is the default agent (default: the built-in scripted agent); "
                            "see docs/agents.md")
        p.add_argument("--agent-preset", action="append", default=[], choices=list(PRESETS), metavar="NAME",
                       help=f"offer a known agent under its name, as docs/agents.md launches it "
                            f"(repeatable; its executable on PATH): {', '.join(PRESETS)}")
        p.add_argument("--max-sessions", type=int, default=1000)
        p.add_argument("--lease-ms", type=int, default=10_000)
        p.add_argument("--child-per", choices=["workspace", "session"], default="workspace")
        p.add_argument("--session-mode", action="append", metavar="[NAME=]MODE",
                       help="ACP session mode to set after session/new (e.g. default): NAME=MODE for "
                            "agent NAME, a bare MODE for every other agent (repeatable)")
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
        p.add_argument("--state-dir", help="the agents' HOME, where they keep the history a resume "
                       "loads (default: this process's HOME)")
        p.add_argument("--state-store", help="the name of the agent-state store --state-dir is: workers "
                       "that give one name resume each other's sessions (default: <host>:<state dir>; "
                       "give one name on every host that mounts one shared volume)")
        p.add_argument("--drain-grace-s", type=float, default=30.0,
                       help="on SIGTERM or `acp-state drain`, how long running turns may finish before "
                       "the sessions move to other workers (0: close them at once)")
        p.add_argument("--handoff", choices=("eager", "paced"), default="eager",
                       help="how a session that moves here from a draining worker is taken: eager, live here at once and "
                       "its agent's session resumed after; paced, the agent loads it first (the stream waits)")

    api = commands.add_parser("api", help="run a stateless API process")
    api_options(api, None)
    worker = commands.add_parser("worker", help="run a bridge worker")
    redis_url_option(worker)
    worker.add_argument("--metrics-port", type=int,
                        help="serve GET /metrics, /health/live and /health/ready on this port")
    worker.add_argument("--metrics-host", default="127.0.0.1",
                        help="the address of --metrics-port, an IP or a name (default: 127.0.0.1)")
    worker_options(worker)
    status = commands.add_parser("status", help="a live table of workers and sessions by state")
    redis_url_option(status)
    status.add_argument("--once", action="store_true", help="print one table and exit")
    status.add_argument("--interval", type=float, default=1.0)
    drain = commands.add_parser("drain", help="move a worker's sessions to other workers, then stop it")
    drain.add_argument("incarnation", help="the worker's incarnation (acp-state status lists them)")
    redis_url_option(drain)
    drain.add_argument("--grace-s", type=float, help="how long its running turns may finish (default: its own)")
    drain.add_argument("--no-wait", action="store_true", help="do not wait for the worker to be gone")
    dev = commands.add_parser("dev", help="API + worker in one process on embedded Redis")
    api_options(dev, MEMORY)
    worker_options(dev)
    return parser


async def _check_redis(url: str) -> None:
    """Refuse at once, with the reason, a Redis acp-state cannot use as given (too old, or a
    cluster node behind a single-node URL); an unreachable one is the runner's business."""
    try:
        await check_redis(url)
    except UnsuitableRedis as error:
        raise SystemExit(f"acp-state: {secrets.redacted(url)}: {error}") from None


async def _check_permissions(url: str, command: str) -> None:
    """Refuse at once, naming what is missing, a Redis user that may not run what this
    process runs (deploy/redis/users.acl), rather than fail later with a traceback."""
    try:
        await check_permissions(url, command)
    except MissingPermission as error:
        raise SystemExit(f"acp-state: {secrets.redacted(url)}: {error}") from None


async def _run(runner: Callable[[argparse.Namespace], Awaitable[None]], args: argparse.Namespace) -> None:
    if args.command in ("status", "drain"):
        await _run_briefly(runner, args)
        return
    await _check_redis(args.redis_url)
    await _check_permissions(args.redis_url, args.command)
    await runner(args)
    tracing.shutdown()  # the spans still buffered go out before the exit (a bounded wait)
    if args.command in ("api", "dev") and args.server == "granian":
        # Every request, stream and the lifespan have ended: exit here. Dropping granian's
        # server (with the loop, or at the interpreter's exit) joins its Rust connection
        # tasks, and one whose client sent part of a request and then nothing waits out the
        # header read timeout, 30 s (`acp-state dev` once overran a 20 s SIGTERM limit so).
        sys.stdout.flush()
        logging.shutdown()
        os._exit(0)


async def _run_briefly(runner: Callable[[argparse.Namespace], Awaitable[None]], args: argparse.Namespace) -> None:
    """A command line's run (`status`, `drain`): a Redis it cannot reach is said in one line
    and exit status 1, never a traceback, and never waited for (a server waits for it)."""
    try:
        await asyncio.wait_for(_check_redis(args.redis_url), CLI_REPLY_TIMEOUT_S)
        await asyncio.wait_for(_check_permissions(args.redis_url, args.command), CLI_REPLY_TIMEOUT_S)
        await runner(args)
    except asyncio.TimeoutError:
        raise SystemExit(f"acp-state: {outage_namer(args.redis_url)(TimeoutError())} "
                         f"(no answer in {CLI_REPLY_TIMEOUT_S:.0f} s)") from None
    except STORE_ERRORS as error:
        detail = " ".join(str(error).split())
        raise SystemExit(f"acp-state: {logs.describe(error)}" + (f": {detail}" if detail else "")) from None


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


def _read_secrets(args: argparse.Namespace) -> None:
    """The Redis URL and the tokens, from the options, files and environment variables that
    keep them out of `ps` (`secrets`); then those variables leave the environment, so no
    agent child inherits them."""
    args.redis_url = secrets.redis_url(args.redis_url, os.environ) or args.redis_fallback
    if args.redis_url is None:
        raise secrets.SecretError(f"--redis-url (or ${secrets.REDIS_URL_VARIABLE}) is required")
    if args.command in ("api", "dev"):
        args.token_specs = secrets.token_specs(args.token, args.token_file, os.environ)
    secrets.scrub_environment()
    # A worker's agents run as its user, and so may other processes of the host: a process
    # that holds a Redis password or tokens keeps its environment and memory to root.
    if args.command in ("worker", "api", "dev") and (secrets.url_password(args.redis_url)
                                                      or getattr(args, "token_specs", None)):
        secrets.shield()


def _warn_of_visible_secrets(args: argparse.Namespace, argv: list[str]) -> None:
    if any(a == "--redis-url" or a.startswith("--redis-url=") for a in argv) and secrets.url_password(args.redis_url):
        logging.warning("the Redis password is on the command line, where `ps` shows it: give it in $%s "
                        "(or the whole URL in $%s)", secrets.REDIS_PASSWORD_VARIABLE, secrets.REDIS_URL_VARIABLE)
    if getattr(args, "token", None) or getattr(args, "channel_token", None):
        logging.warning("bearer tokens are on the command line, where `ps` shows them: give them in "
                        "--token-file or $%s", secrets.TOKENS_VARIABLE)


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    try:
        _resolve_listeners(args)
        _read_secrets(args)
    except ValueError as error:
        parser.exit(2, f"acp-state: {error}\n")  # a usage error, like argparse's own: exit code 2
    default_format = "json" if args.command in ("api", "worker") else "text"
    logs.configure(args.log_level, args.log_format or default_format)
    logs.name_outages(outage_namer(args.redis_url))  # a store that is away: a line, then counts
    if args.command in ("api", "worker", "dev"):  # on from the OTEL_* variables (docs/tracing.md)
        tracing.setup(f"acp-state-{args.command}")
    _warn_of_visible_secrets(args, argv)
    runner = {"api": run_api, "worker": run_worker, "dev": run_dev, "status": run_status, "drain": run_drain}[args.command]
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(_run(runner, args))
