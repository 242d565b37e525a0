"""The bridge worker: holds a lease, takes commands from Redis, runs ACP agent children.

One process = one incarnation (a fresh id per start). Its lease is renewed by a heartbeat of
constant cost; its sessions are stamped with the incarnation, so when the lease lapses every
reader drops them at once and a sweeper deletes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import sys
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import REGISTRY, make_asgi_app

from acp_state import keys
from acp_state.clock import iso, now_ms
from acp_state.store import Store
from acp_state.summary import SESSION_STATES
from acp_state.sweeper import run_sweeper
from acp_state.votes import Vote

from .agent import AgentProcess
from .loop_guard import LoopLimits
from .metrics import COMMANDS, LEASE_RENEWALS, LEASES_LOST, WorkerCollector
from .session import LiveSession, Prompt

log = logging.getLogger("worker")

DEFAULT_AGENT = f"{sys.executable} -m worker.scripted_agent"


@dataclass
class WorkerConfig:
    agent: str = DEFAULT_AGENT
    max_sessions: int = 1000
    lease_ms: int = 10_000
    child_per: str = "workspace"  # or "session"
    session_mode: str | None = None
    agent_stderr: str | None = None
    name: str | None = None
    loop_limits: LoopLimits = field(default_factory=LoopLimits)
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"


def new_incarnation(name: str | None = None) -> str:
    """`<name>-<pid>-<random>`: unique per process start, safe inside a hash tag."""
    base = name or socket.gethostname()
    base = "".join(ch if ch.isalnum() or ch in "-_." else "-" for ch in base)[:40]
    return f"{base}-{os.getpid()}-{secrets.token_hex(4)}"


class Worker:
    def __init__(self, store: Store, config: WorkerConfig) -> None:
        self.store = store
        self.config = config
        self.incarnation = new_incarnation(config.name)
        self.sessions: dict[str, LiveSession] = {}
        self.agents: dict[str, AgentProcess] = {}
        self._creating = 0
        self._cursors: dict[str, str] = {keys.worker_control(self.incarnation): "0"}
        self._workspace_load: dict[str, int] = {}
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[Any]] = []
        self.started_ms = now_ms()
        self.renewed_ms = self.started_ms
        self.ready = asyncio.Event()
        self.state_counts: dict[str, int] = dict.fromkeys(SESSION_STATES, 0)
        self._collector = WorkerCollector(self)
        REGISTRY.register(self._collector)

    def _count_state(self, old: str | None, new: str | None) -> None:
        if old is not None:
            self.state_counts[old] -= 1
        if new is not None:
            self.state_counts[new] += 1

    # ---- lifecycle ----------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        """The load report stored with the lease: what placement and `acp-state status` read."""
        return {
            "incarnation": self.incarnation,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "startedAt": iso(self.started_ms),
            "sessions": len(self.sessions) + self._creating,
            "maxSessions": self.config.max_sessions,
            "agents": len(self.agents),
            "states": self.state_counts,
            "leaseMs": self.config.lease_ms,
            "renewedAt": now_ms(),
        }

    async def run(self) -> None:
        """Register, then serve until `stop()`; always leaves Redis clean on the way out."""
        await self.store.heartbeat(self.incarnation, self.report(), self.config.lease_ms)
        log.info("worker registered (lease %d ms)", self.config.lease_ms)
        self._tasks = [
            asyncio.ensure_future(self._heartbeat_loop()),
            asyncio.ensure_future(self._command_loop()),
            asyncio.ensure_future(run_sweeper(self.store, self.config.lease_ms / 2000, self._stop)),
        ]
        if self.config.metrics_port is not None:
            self._tasks.append(asyncio.ensure_future(self._serve_metrics()))
        self.ready.set()
        try:
            await self._stop.wait()
        finally:
            await self.shutdown()

    def stop(self) -> None:
        self._stop.set()

    async def shutdown(self) -> None:
        """SIGTERM path: close every session (deleting its keys), end children, drop the lease."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(
            *(s.close("worker_shutdown") for s in list(self.sessions.values())), return_exceptions=True
        )
        await asyncio.gather(*(a.stop() for a in list(self.agents.values())), return_exceptions=True)
        for ws in list(self._workspace_load):
            await self.store.drop_inbox(ws, self.incarnation)
        await self.store.release(self.incarnation)
        REGISTRY.unregister(self._collector)
        log.info("worker stopped")

    async def _heartbeat_loop(self) -> None:
        interval = self.config.lease_ms / 3000
        while True:
            await asyncio.sleep(interval)
            try:
                held = await self.store.heartbeat(self.incarnation, self.report(), self.config.lease_ms)
            except Exception:
                log.exception("heartbeat failed")
                continue
            LEASE_RENEWALS.inc()
            if not held:
                LEASES_LOST.inc()
                # Our lease lapsed (Redis restarted, or we stalled): Redis no longer holds our
                # sessions. Rewrite them all; fenced writes meanwhile closed any swept one.
                log.warning("lease was lost; republishing %d sessions", len(self.sessions))
                await asyncio.gather(*(s.republish() for s in list(self.sessions.values())))
                for sid, s in list(self.sessions.items()):
                    await self.store.index_session(self.incarnation, s.ws, sid, True)

    # ---- commands -----------------------------------------------------------------------

    async def _command_loop(self) -> None:
        while True:
            try:
                commands = await self.store.read_commands(dict(self._cursors), block_ms=1000)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("reading commands failed")
                await asyncio.sleep(0.5)
                continue
            for stream, entry_id, command in commands:
                if stream in self._cursors:
                    self._cursors[stream] = entry_id
                self._dispatch(command)

    def _dispatch(self, command: dict[str, Any]) -> None:
        """Route one command. Synchronous up to the hand-off, so per-session order holds."""
        kind = command.get("t")
        COMMANDS.labels(str(kind)).inc()
        if kind == "create":
            if len(self.sessions) + self._creating >= self.config.max_sessions:
                asyncio.ensure_future(self.store.reply(command["req"], {"ok": False, "code": "worker_full"}))
                return
            self._creating += 1  # capacity is reserved now, before the agent starts
            self._cursors.setdefault(keys.inbox(command["ws"], self.incarnation), "0")
            asyncio.ensure_future(self._create(command))
            return
        session = self.sessions.get(command.get("sid", ""))
        if session is None:
            if kind == "close":
                asyncio.ensure_future(self.store.reply(command["req"], {"ok": False, "code": "session_not_found"}))
            return
        if kind == "prompt":
            session.enqueue(
                Prompt(
                    prompt_id=command["promptId"],
                    blocks=command["prompt"],
                    text=command.get("text", ""),
                    meta=command.get("meta"),
                    client_id=command.get("clientId"),
                    kind=command.get("kind", "foreground"),
                )
            )
        elif kind == "cancel":
            asyncio.ensure_future(session.cancel())
        elif kind == "vote":
            vote = Vote(command["selected"], command.get("optionId"), command.get("metadata") or {})
            session.resolve_vote(command["rid"], vote.acp_response(), command.get("clientId"))
        elif kind == "attach":
            session.clients.add(command["clientId"])
        elif kind == "close":
            asyncio.ensure_future(self._close(session, command))

    async def _serve_metrics(self) -> None:
        """`GET /metrics` of this worker (Prometheus text), on its own small HTTP listener."""
        import uvicorn

        class Server(uvicorn.Server):
            def install_signal_handlers(self) -> None:  # the worker owns SIGTERM
                pass

            @contextlib.contextmanager
            def capture_signals(self):  # type: ignore[override]
                yield

        config = uvicorn.Config(
            make_asgi_app(), host=self.config.metrics_host, port=self.config.metrics_port or 0,
            log_level="warning", lifespan="off",
        )
        server = Server(config)
        try:
            await server.serve()
        except asyncio.CancelledError:
            server.should_exit = True
            raise

    async def _agent_for(self, cwd: str, sid: str) -> AgentProcess:
        """The child that will host the session: shared per workspace, or one per session."""
        key = cwd if self.config.child_per == "workspace" else sid
        agent = self.agents.get(key)
        if agent is not None and agent.alive:
            return agent
        agent = AgentProcess(
            self.config.agent,
            cwd,
            session_mode=self.config.session_mode,
            stderr_path=self.config.agent_stderr,
            on_exit=lambda a, key=key: self._agent_exited(key, a),
        )
        self.agents[key] = agent
        try:
            await agent.start()
        except BaseException:
            self.agents.pop(key, None)
            await agent.stop()
            raise
        return agent

    async def _agent_exited(self, key: str, agent: AgentProcess) -> None:
        if self.agents.get(key) is agent:
            del self.agents[key]

    async def _create(self, command: dict[str, Any]) -> None:
        ws, sid, cwd = command["ws"], command["sid"], command["cwd"]
        reserved = True
        try:
            agent = await self._agent_for(cwd, sid)
            agent_sid = await agent.new_session(cwd)
            session = LiveSession(
                store=self.store,
                incarnation=self.incarnation,
                ws=ws,
                sid=sid,
                cwd=cwd,
                agent=agent,
                agent_sid=agent_sid,
                single=command.get("scope") == "single",
                on_gone=self._session_gone,
                loop_limits=self.config.loop_limits,
                on_state=self._count_state,
            )
            agent.sessions[agent_sid] = session
            self.sessions[sid] = session
            self._creating -= 1  # the reservation is now a session: count it once
            reserved = False
            self._workspace_load[ws] = self._workspace_load.get(ws, 0) + 1
            await self.store.index_session(self.incarnation, ws, sid, True)
            result = await session.publish_created(command.get("clientId"))
            if result is None or result.applied != 1:
                await session.close("conflict", publish=False)
                await self.store.reply(command["req"], {"ok": False, "code": "session_conflict"})
                return
            await self.store.reply(
                command["req"], {"ok": True, "createdAt": iso(session.created_ms), "incarnation": self.incarnation}
            )
        except Exception as error:
            log.exception("creating the session failed", extra={"sessionId": sid})
            await self.store.reply(command["req"], {"ok": False, "code": "agent_unavailable", "error": str(error)})
        finally:
            if reserved:
                self._creating -= 1

    async def _close(self, session: LiveSession, command: dict[str, Any]) -> None:
        await session.close(command.get("reason", "closed_by_client"))
        await self.store.reply(command["req"], {"ok": True})

    async def _session_gone(self, session: LiveSession) -> None:
        """A session left (closed, died, swept): drop it here and in the worker's index."""
        if self.sessions.get(session.sid) is not session:
            return
        del self.sessions[session.sid]
        await self.store.index_session(self.incarnation, session.ws, session.sid, False)
        left = self._workspace_load.get(session.ws, 1) - 1
        if left <= 0:
            self._workspace_load.pop(session.ws, None)
        else:
            self._workspace_load[session.ws] = left
        agent = session.agent
        if self.config.child_per == "session" or (not agent.sessions and not agent.alive):
            await agent.stop()

