"""The bridge worker: holds a lease, takes commands from Redis, runs ACP agent children.

One process holds one incarnation at a time (a fresh id per start). Its lease is renewed by a
heartbeat of constant cost; its sessions are stamped with the incarnation, so when the lease
lapses every reader drops them at once and a sweeper deletes them. A worker that finds its
incarnation declared dead (it stalled past its lease) ends the sessions it still hosts and
joins again as a new incarnation with none: dead stays dead. Its parts are given what they
use, never the worker: its creates (worker/creates.py), its drain (worker/move.py, which
also takes over the sessions other workers move here), its gauges (worker/metrics.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import math
import os
import secrets
import socket
import time
from typing import Any, Awaitable

from prometheus_client import REGISTRY

from acp_state import commands, tracing
from acp_state.commands import Reply
from acp_state.placement import CHILDREN_REPORTED, child_key
from acp_state.clock import iso, now_ms
from acp_state.store import ApplyOutcome, Standing, WorkerReport, WorkerStore, run_sweeper
from acp_state.summary import SESSION_STATES
from acp_state.tasks import cancel_until_done, survive

from . import health
from .agent import AgentProcess
from .config import WorkerConfig
from .creates import Creates
from .metrics import COMMANDS, LEASE_RENEWALS, LEASES_LOST, WorkerCollector
from .move import Drain, leave_stranded
from .prompt import Prompt
from .reaper import fence_clock, reaper
from .session import LiveSession

log = logging.getLogger("worker")

# Each live session's TTL is refreshed once per this fraction of the TTL, spread evenly.
REFRESH_FRACTION = 0.5
REFRESH_TICK_S = 1.0
PULSE_S = 0.1
# Renewals the heartbeat may have out at once (see `_heartbeat_loop`).
RENEWALS_OUT = 3
# On SIGTERM, how long each session's last write may wait for a store that is away (the
# sweeper removes what is left once the lease lapses).
SHUTDOWN_PATIENCE_S = 3.0
SHUTDOWN_STEP_S = 4.0  # each other step of a shutdown; all of them well inside a supervisor's 20-30 s
# Handled commands are dropped from their streams at most this often (one round trip).
FORGET_EVERY_S = 1.0
# Self-fencing (docs/architecture.md, "The lease"): the worker's agents are stopped once no
# renewal was accepted for `lease - margin`, counted from the moment the last accepted one
# was sent. The margin is what keeps that stop before the earliest moment a sweeper may
# declare the worker dead: the watchdog's wake-up and its signals, and the clocks' rates.
SELF_FENCE_MARGIN = 0.1  # of the lease
SELF_FENCE_MARGIN_MIN_MS = 100


def self_fence_margin_ms(lease_ms: int) -> int:
    return max(SELF_FENCE_MARGIN_MIN_MS, int(lease_ms * SELF_FENCE_MARGIN))


def new_incarnation(name: str | None = None) -> str:
    """`<name>-<pid>-<random>`: unique per process start, safe inside a hash tag."""
    base = name or socket.gethostname()
    base = "".join(ch if ch.isalnum() or ch in "-_." else "-" for ch in base)[:40]
    return f"{base}-{os.getpid()}-{secrets.token_hex(4)}"


class Worker:
    def __init__(self, store: WorkerStore, config: WorkerConfig) -> None:
        self.store = store
        self.config = config
        self.incarnation = new_incarnation(config.name)
        self.sessions: dict[str, LiveSession] = {}
        self.agents: dict[str, AgentProcess] = {}
        self._starting: dict[str, asyncio.Future[AgentProcess]] = {}  # children being started
        self._cursors: dict[str, str] = {self.store.control_feed(self.incarnation): "0"}
        self._read: dict[str, str] = {}  # streams read since their handled commands were dropped
        self._forgotten_at = 0.0
        self._registered = False
        self._unrewritten: set[str] = set()  # sessions a rewrite could not index yet
        # The longest this process was frozen (SIGSTOP, a blocked event loop) since its
        # last accepted renewal: what tells "the store lost us" from "we may have been swept".
        self._frozen_s = 0.0
        self._standing: asyncio.Task[None] | None = None
        self._renewals: set[asyncio.Task[bool]] = set()  # the heartbeat's
        self._renewals_out = 0  # renewals sent and not answered yet
        self._acting = asyncio.Lock()  # one renewal at a time acts on what the store said
        # When the latest renewal the store accepted for this incarnation was sent (on
        # fence_clock): its lease runs at least `lease` from then, on any clock that keeps time.
        self._renewal_sent_at: float | None = None
        self.retired: set[AgentProcess] = set()  # children no session may be placed on again
        self._workspace_load: dict[str, int] = {}
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[Any]] = []
        self.started_ms = now_ms()
        self.renewed_ms = self.started_ms
        self.ready = asyncio.Event()
        self.overran: list[str] = []  # the shutdown steps that overran their time limit
        self.draining = False
        self._draining: asyncio.Task[None] | None = None
        self.drain: Drain | None = None
        self.creates = Creates(
            store=store, config=config, sessions=self.sessions, draining=lambda: self.draining,
            agent_for=self.agent_for, new_session=self.new_session, host=self.host,
            follow_inbox=lambda ws: self.follow_inbox(ws, self.incarnation),
            dispatch=lambda command: commands.dispatch(self, command),
        )
        self.state_counts: dict[str, int] = dict.fromkeys(SESSION_STATES, 0)
        self._collector = WorkerCollector(
            sessions=self.sessions, state_counts=self.state_counts, agents=self.agents, max_sessions=config.max_sessions,
            draining=lambda: self.draining,
        )
        REGISTRY.register(self._collector)
        self.stranded: str | None = None  # why a drain could not hand over (worker/move.py)

    def _count_state(self, old: str | None, new: str | None) -> None:
        if old is not None:
            self.state_counts[old] -= 1
        if new is not None:
            self.state_counts[new] += 1

    # ---- lifecycle ----------------------------------------------------------------------

    def report(self) -> WorkerReport:
        """The load report stored with the lease: what placement and `acp-state status` read."""
        return WorkerReport(
            self.incarnation,
            host=socket.gethostname(),
            pid=os.getpid(),
            started_at=iso(self.started_ms),
            sessions=len(self.sessions) + self.creates.under_way,
            max_sessions=self.config.max_sessions,
            agents=len(self.agents),
            agent_names=list(self.config.agents),
            default_agent=self.config.default_agent,
            states=dict(self.state_counts),
            lease_ms=self.config.lease_ms,
            renewed_at=now_ms(),
            state_store=self.config.state_store,
            draining=self.draining,
            children=[child_key(key.split("\0")[0], agent.cwd) for key, agent in self.agents.items()
                      if "\0" in key and agent.alive and key not in self._starting][:CHILDREN_REPORTED],
        )

    async def run(self) -> None:
        """Register, then serve until `stop()`; always leaves Redis clean on the way out."""
        if self.config.metrics_port is not None:  # (live, not ready, while it registers)
            self._tasks.append(asyncio.ensure_future(
                health.serve(self, self.config.metrics_host, self.config.metrics_port)))
        while not self._registered and not self._stop.is_set():
            # Registered as soon as Redis accepts writes (it may still be starting, or full).
            if not await survive("heartbeat", self.check_standing):
                await asyncio.sleep(min(1.0, self.config.lease_ms / 3000))
        log.info("worker registered (lease %d ms)", self.config.lease_ms)
        sweep_interval_s = self.config.lease_ms / 6000
        self._tasks += [
            asyncio.ensure_future(self._pulse()),
            asyncio.ensure_future(self._heartbeat_loop()),
            asyncio.ensure_future(self._command_loop()),
            asyncio.ensure_future(run_sweeper(self.store, sweep_interval_s, self._stop)),
            asyncio.ensure_future(self._refresh_loop()),
            asyncio.ensure_future(self.creates.reclaim_loop()),
        ]
        self.ready.set()
        try:
            await self._stop.wait()
        finally:
            await self.shutdown()

    @property
    def registered(self) -> bool:
        """Whether this incarnation holds a lease the store accepted (its readiness)."""
        return self._registered

    def stop(self) -> None:
        self._stop.set()

    def begin_drain(self, grace_s: float | None = None) -> None:
        """Drain (worker/move.py), then stop. A second call stops at once; so does a drain
        of a worker that was told to drain in no time."""
        grace_s = self.config.drain_grace_s if grace_s is None else grace_s
        if self._draining is not None or grace_s <= 0 or not self.ready.is_set():
            self.stop()
            return
        self.draining = True
        self._draining = asyncio.ensure_future(self._drain(grace_s))

    async def _drain(self, grace_s: float) -> None:
        began = time.monotonic()  # the grace runs from the signal: a store away holds up no renewal past it
        try:
            renewal = asyncio.ensure_future(survive("heartbeat", self.check_standing))  # placement reads `draining` now
            await asyncio.wait({renewal}, timeout=grace_s)
            self.drain = Drain(
                store=self.store, sessions=self.sessions, own=lambda: self.incarnation,
                default_agent=self.config.default_agent, grace_s=grace_s - (time.monotonic() - began),
                check_standing=self.check_standing, eager=self.config.handoff == "eager",
            )
            self.stranded = await self.drain.run()
        except Exception:
            log.exception("the drain failed; stopping")
        finally:
            self.stop()

    async def shutdown(self) -> None:
        """SIGTERM path: close every session (deleting its keys), end children, drop the lease.

        Each step has a time limit: a step that overruns it (a task that does not end when
        cancelled, a store call that never answers) is logged with the stacks of what is
        still running, and the shutdown goes on; its process then exits at once (`overran`),
        rather than wait on a task that does not end, so SIGTERM always ends the process."""
        log.info("worker stopping: %d sessions, %d agent children", len(self.sessions), len(self.agents))
        if self._draining is not None:  # (a second SIGTERM: the sessions not moved yet close now)
            await within_limit("the drain", SHUTDOWN_STEP_S, cancel_until_done([self._draining]), self.overran)
        await within_limit("background tasks", SHUTDOWN_STEP_S, cancel_until_done([*self._tasks, *self._renewals]),
                           self.overran)
        for session in self.sessions.values():
            session.write_patience_s = SHUTDOWN_PATIENCE_S  # a store that is away does not hold us up
        closing = asyncio.gather(*(s.close("worker_shutdown") for s in list(self.sessions.values())), return_exceptions=True)
        await within_limit("closing sessions", SHUTDOWN_PATIENCE_S + SHUTDOWN_STEP_S, closing, self.overran)
        stopping = asyncio.gather(*(a.stop() for a in [*self.agents.values(), *self.retired]), return_exceptions=True)
        await within_limit("stopping agent children", SHUTDOWN_STEP_S, stopping, self.overran)
        try:
            if self.stranded:  # its sessions stay indexed for the sweeper (worker/move.py)
                await leave_stranded(self.store, self.incarnation)
            else:
                await within_limit("releasing the lease", SHUTDOWN_STEP_S, self._release(), self.overran)
        except Exception:  # Redis is away: the sweeper removes what is left once the lease lapses
            log.warning("could not release the lease on the way out", exc_info=True)
        REGISTRY.unregister(self._collector)
        log.info("worker stopped")

    async def _release(self) -> None:
        for ws in list(self._workspace_load):
            await self.store.drop_inbox(ws, self.incarnation)
        await self.store.release(self.incarnation)

    # ---- the lease ------------------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        """A renewal every third of the lease, each on its own: one that waits on a dead
        connection (a half-open link: only its socket timeout ends it) or on a slow network
        does not hold up the next, which takes another connection. Waiting for each in turn,
        one black-holed renewal (its socket timeout, then the gap before the next) cost a
        3 s lease (python -m bench.chaos --hosts, `half_open`; tests/test_partitions.py)."""
        interval = self.config.lease_ms / 3000
        while True:
            await asyncio.sleep(interval)
            if self._renewals_out < RENEWALS_OUT:
                renewal = asyncio.ensure_future(survive("heartbeat", self._renew))
                self._renewals.add(renewal)
                renewal.add_done_callback(self._renewals.discard)

    async def _pulse(self) -> None:
        """Notice when this process itself was frozen: a short sleep that overslept."""
        while True:
            before = time.monotonic()
            await asyncio.sleep(PULSE_S)
            self._frozen_s = max(self._frozen_s, time.monotonic() - before - PULSE_S)

    async def check_standing(self) -> None:
        """Renew the lease now and act on what it says (single-flight: a heartbeat and any
        number of sessions whose writes were refused share one renewal)."""
        if self._standing is None or self._standing.done():
            self._standing = asyncio.ensure_future(self._renew())
        await asyncio.shield(self._standing)

    async def _renew(self) -> None:
        frozen_s = self._frozen_s
        retry = set(self._unrewritten)
        incarnation = self.incarnation
        # Whether the store knew this incarnation when the renewal went out: `new` for one
        # it did not know yet (sent while `_rejoin` registered it) is its registration, not a
        # store that lost our state.
        registered = self._registered
        # Only renewals on their way count against RENEWALS_OUT: one whose answer waits for
        # an earlier one's acting (a rewrite of every session after Redis lost them, slow
        # under latency) must not keep the next ones from going out, or the lease lapses
        # while the worker is busy rewriting (python -m bench.chaos --hosts: a restart empty
        # under latency).
        self._renewals_out += 1
        report = self.report()
        sent_at = fence_clock()  # before it is sent: the lease it renews runs from later on
        try:
            standing = await self.store.heartbeat(incarnation, report, self.config.lease_ms)
        finally:
            self._renewals_out -= 1
        LEASE_RENEWALS.inc()
        async with self._acting:
            if incarnation == self.incarnation:  # (else an overlapping renewal found it dead)
                await self._act_on(standing, frozen_s, retry, registered, sent_at)

    async def _act_on(
        self, standing: Standing, frozen_s: float, retry: set[str], registered: bool, sent_at: float
    ) -> None:
        if standing is Standing.DEAD:
            LEASES_LOST.inc()
            await self._rejoin("it was declared dead after its lease lapsed")
            return
        if standing is Standing.NEW and registered and self._registered:
            LEASES_LOST.inc()
            if frozen_s > self.config.lease_ms / 2000:
                # The store lost its record of us, and we were frozen long enough to have been
                # declared dead before it did: we cannot vouch that nobody swept us, so we end
                # our sessions rather than bring back any whose clients were told they died.
                await self.store.resign(self.incarnation)
                await self._rejoin("the store lost its lease while it was past its deadline")
                return
            # Redis lost our state (restarted empty, or failed over to a replica that had not
            # seen it), and nobody can have declared us dead: rewrite every session.
            log.warning("the store lost our lease; rewriting %d sessions", len(self.sessions))
            await self._rewrite(list(self.sessions.values()))
        elif standing is Standing.LATE:
            log.warning("lease renewed after its deadline (nobody had declared it dead)")
        self._registered = True
        self._renewed(sent_at)
        self._unrewritten.intersection_update(self.sessions)
        again = retry & self._unrewritten  # not indexed by an earlier renewal's rewrite, nor by this one's
        if again:
            await self._rewrite([self.sessions[sid] for sid in again])
        if self._frozen_s == frozen_s:  # (a freeze during this renewal counts next time)
            self._frozen_s = 0.0

    def _renewed(self, sent_at: float) -> None:
        """The store accepted a renewal sent at `sent_at`: nobody may declare this incarnation
        dead before `sent_at + lease`, so the watchdog (worker/reaper.py) is told to stop the
        agents at `sent_at + lease - margin` unless a later renewal is accepted first. It
        holds the deadline, not this process: a worker stopped or cut off still has its
        agents stopped in time. A renewal answered out of order moves nothing back."""
        if self._renewal_sent_at is not None and sent_at <= self._renewal_sent_at:
            return
        self._renewal_sent_at = sent_at
        lease_ms = self.config.lease_ms
        reaper().fence_at(sent_at + (lease_ms - self_fence_margin_ms(lease_ms)) / 1000)

    async def _rewrite(self, sessions: list[LiveSession]) -> None:
        """Write sessions the store lost again, under new event epochs.

        Each is indexed first, as a create is, so the sweeper finds whatever of it is
        written should this incarnation die meanwhile (the index also holds the session's
        locator, without which no other API process finds it). A session whose index
        could not be written is tried again at the next heartbeat: a store back from a
        restart can still fail a write or two (a pooled connection to the old server)."""

        async def one(session: LiveSession) -> None:
            if session.closed or session.moving:  # (a moving session is the drain's)
                return
            try:
                if not await self.store.index_session(session.incarnation, session.ws, session.sid, True):
                    # Another workspace claimed the id while the store had lost its locator:
                    # the session is rewritten all the same (API processes that cached its
                    # workspace still find it); docs/api.md, "Tenants".
                    log.error("a rewritten session's id is another workspace's", extra={"sessionId": session.sid})
            except Exception as error:  # (redis-py can fail oddly on a connection torn mid-write)
                log.warning("could not index a session to rewrite (%r); again at the next heartbeat", error,
                            extra={"sessionId": session.sid})
                self._unrewritten.add(session.sid)
                return
            self._unrewritten.discard(session.sid)
            await session.republish()

        await asyncio.gather(*(one(s) for s in sessions))

    async def _rejoin(self, reason: str) -> None:
        """Our incarnation is dead: end what it hosted, then join as a new one with nothing."""
        old = self.incarnation
        sessions = list(self.sessions.values())
        log.warning("incarnation %s is dead (%s): ending its %d sessions and joining again", old, reason, len(sessions))
        # One step, no await in between: a renewal sent from here on is the new
        # incarnation's, unregistered yet, and not frozen (the old one died of that).
        self.incarnation = new_incarnation(self.config.name)
        self._registered = False
        self._frozen_s = 0.0
        self._renewal_sent_at = None
        self._cursors = {self.store.control_feed(self.incarnation): "0"}
        self._workspace_load.clear()
        # No stale child: every child hosted sessions of the dead incarnation, and the
        # watchdog stopped it at the self-fence deadline, which passed before anyone could
        # declare us dead. Continued, even to close its sessions, it would first run its
        # turn on and write the agent's history after the clients were told that turn
        # ended `worker_lost`: it is killed before anything is said to it, and whatever
        # comes next (a resume of the same session included) gets a fresh child.
        children = [*self.agents.values(), *self.retired]
        for agent in children:
            agent.kill()
        if children:
            log.warning("killed the %d agent children of the dead incarnation", len(children))
        await asyncio.gather(*(s.abandon() for s in sessions), return_exceptions=True)
        report = self.report()
        sent_at = fence_clock()
        standing = await self.store.heartbeat(self.incarnation, report, self.config.lease_ms)
        self._registered = standing is not Standing.DEAD
        if self._registered:
            self._renewed(sent_at)
        log.warning("joined again as %s", self.incarnation)

    async def _session_fenced(self, session: LiveSession, applied: ApplyOutcome) -> None:
        """The store refused a session's write: were we declared dead, or did it lose it?"""
        await survive("heartbeat", self.check_standing)
        if session.closed or session.incarnation != self.incarnation:
            return  # we were dead: _rejoin ended it
        if applied == ApplyOutcome.FOREIGN:
            log.warning("another worker owns the session now; ending it here", extra={"sessionId": session.sid})
            if not await session.abandon():
                # The agent could not close it: it may run the lost turn on, and write it
                # into the history the new owner reads. No stale child: it is stopped (its
                # other sessions end `channel_closed`, as when an agent exits).
                log.warning("the agent could not close the lost session; stopping it", extra={"sessionId": session.sid})
                session.agent.kill()
        else:
            # Our lease holds, yet the store has no such session: it lost it (a failover to a
            # replica that had not seen it, an expired key). Write it again.
            log.warning("the store lost the session; rewriting it", extra={"sessionId": session.sid})
            await self._rewrite([session])

    async def _refresh_loop(self) -> None:
        """Refresh every live session's TTL once per REFRESH_FRACTION of it, a slice each
        second: the added command rate is sessions / (TTL * REFRESH_FRACTION), whatever the
        session count, and no burst. A session the store lost is found here too."""
        period_s = self.store.retention.session_ttl_ms / 1000 * REFRESH_FRACTION
        queue: list[LiveSession] = []
        while True:
            await asyncio.sleep(REFRESH_TICK_S)
            if not queue:
                queue = list(self.sessions.values())
                per_tick = max(1, math.ceil(len(queue) * REFRESH_TICK_S / period_s))
            batch, queue = queue[:per_tick], queue[per_tick:]
            await survive("session refresh", lambda: self._touch(batch))

    async def _touch(self, batch: list[LiveSession]) -> None:
        live = [s for s in batch if not s.closed and s.incarnation == self.incarnation and s.published and not s.moving]
        if not live:
            return
        missing = await self.store.touch_sessions(self.incarnation, [(s.ws, s.sid, s.single) for s in live])
        if missing:
            lost = [s for s in live if (s.ws, s.sid) in missing]
            await self.check_standing()
            await self._rewrite([s for s in lost if s.incarnation == self.incarnation])

    # ---- commands -----------------------------------------------------------------------

    async def _command_loop(self) -> None:
        while True:
            if not await survive("command loop", self._read_commands):
                await asyncio.sleep(0.5)

    async def _read_commands(self) -> None:
        received = await self.store.read_commands(dict(self._cursors), block_ms=1000)
        for stream, entry_id, command in received:
            if stream in self._cursors:
                self._cursors[stream] = entry_id
                self._read[stream] = entry_id
            if isinstance(command, commands.MalformedCommand):
                COMMANDS.labels(str(command.command_type)).inc()
                log.error("dropping a command that could not be handled: %s", command)
                continue
            COMMANDS.labels(command.TYPE).inc()
            try:
                with tracing.processing(command, stream):  # a span when its sender's trace came along
                    commands.dispatch(self, command)
            except Exception:  # one command that fails must not cost the ones behind it
                log.exception("dropping a command that could not be handled: %r", command)
        now = asyncio.get_running_loop().time()
        if self._read and now - self._forgotten_at >= FORGET_EVERY_S:
            read, self._read = self._read, {}
            self._forgotten_at = now
            await self.store.forget_commands(read)

    # The worker is the commands.CommandHandler: each method is synchronous up to its
    # hand-off, so per-session order holds. A session gone here owes nothing: a prompt
    # admitted meanwhile got its terminal from the transition that removed the session (its
    # p:<promptId> field); only a close is answered, for the API that waits.

    def on_create(self, command: commands.Create) -> None:
        self.creates.start(command)

    def on_prompt(self, command: commands.Prompt) -> None:
        session = self.sessions.get(command.sid)
        if session is not None:
            session.enqueue(Prompt.of(command))

    def on_cancel(self, command: commands.Cancel) -> None:
        session = self.sessions.get(command.sid)
        if session is not None:
            asyncio.ensure_future(session.cancel())

    def on_close(self, command: commands.Close) -> None:
        session = self.sessions.get(command.sid)
        if session is None:
            asyncio.ensure_future(self.store.reply(command.request_id, Reply(ok=False, code="session_not_found")))
        else:
            asyncio.ensure_future(self._close(session, command))

    def on_vote(self, command: commands.Vote) -> None:
        session = self.sessions.get(command.sid)
        if session is not None:
            session.resolve_vote(command)

    def on_attach(self, command: commands.Attach) -> None:
        session = self.sessions.get(command.sid)
        if session is not None:
            session.clients.add(command.client_id)

    def on_detach(self, command: commands.Detach) -> None:
        session = self.sessions.get(command.sid)
        if session is not None:
            session.clients.discard(command.client_id)

    def on_remove_prompt(self, command: commands.RemovePrompt) -> None:
        session = self.sessions.get(command.sid)
        asyncio.ensure_future(self._reply(command.request_id, session and session.remove_prompt(command.prompt_id)))

    def on_set_mode(self, command: commands.SetMode) -> None:
        session = self.sessions.get(command.sid)
        asyncio.ensure_future(self._reply(command.request_id, session and session.set_mode(command.mode, command.client_id)))

    async def _reply(self, request_id: str, answer: Awaitable[Reply] | None) -> None:
        reply = await answer if answer is not None else Reply(ok=False, code="session_not_found")
        with contextlib.suppress(Exception):  # the API's wait ends in outcome_unknown
            await self.store.reply(request_id, reply)

    def on_drain(self, command: commands.Drain) -> None:
        log.info("told to drain")
        self.begin_drain(command.grace_s)

    def on_moving(self, command: commands.Moving) -> None:
        if self.drain is not None:
            self.drain.marker_read(command.sid)

    def on_released(self, command: commands.Released) -> None:
        session = self.sessions.get(command.sid)
        if session is not None and session.bring_up is not None:
            session.bring_up.let_go(command.owner)

    def on_warm(self, command: commands.Warm) -> None:
        """A drain's sessions of this agent and workspace are coming: start its child now."""
        name = command.agent or self.config.default_agent
        if self.draining or name not in self.config.agents or self.config.child_per != "workspace":
            return
        survive_start = survive("warming an agent child", lambda: self.agent_for(name, command.cwd, ""))
        asyncio.ensure_future(survive_start)

    async def agent_for(self, name: str, cwd: str, sid: str, returning: bool = False) -> AgentProcess:
        """The child of agent `name` that will host the session: shared per agent and
        workspace, or one per session. Creates that arrive while it starts wait for that
        start: one child per workspace, however many creates come at once.

        `returning`: the session comes back (a resume, a move). It is never placed on a
        child that hosted it before: that child's memory of it may be stale (the turns it
        had then, not those another worker ran since), and an agent answers a load of a
        session it holds from its memory. Such a child is retired: it keeps the sessions
        it hosts and gets no more, and stops once they are gone."""
        key = f"{name}\0{cwd}" if self.config.child_per == "workspace" else sid
        agent = self.agents.get(key)
        if agent is not None and returning and sid in agent.hosted and key not in self._starting:
            self._retire(key, agent)
            agent = None
        if agent is not None and agent.alive and key not in self._starting:
            return agent
        starting = self._starting.get(key)
        if starting is None:
            starting = asyncio.ensure_future(self._start_agent(name, cwd, key))
            self._starting[key] = starting
            starting.add_done_callback(lambda _, key=key: self._starting.pop(key, None))
        # Shielded: a create that stops waiting does not stop the start the others wait for.
        return await asyncio.shield(starting)

    async def _start_agent(self, name: str, cwd: str, key: str) -> AgentProcess:
        agent = AgentProcess(
            self.config.agents[name],
            cwd,
            session_mode=self.config.session_modes.get(name),
            stderr_path=self.config.agent_stderr,
            on_exit=lambda a, key=key: self._agent_exited(key, a),
            home=self.config.state_dir,
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
        self.retired.discard(agent)

    def _retire(self, key: str, agent: AgentProcess) -> None:
        del self.agents[key]
        log.info("a session returns to a child that hosted it before; starting a fresh one")
        self.retired.add(agent)  # (until it exits: a shutdown stops it too)
        if not agent.sessions:  # else stopped when its last session leaves (_session_gone)
            asyncio.ensure_future(agent.stop())  # the resume does not wait for its grace

    def new_session(self, command: commands.Create, name: str, agent: AgentProcess, agent_sid: str) -> LiveSession:
        """The session a create started on `agent` (a child of agent `name`), with this
        worker's hooks; not hosted yet (see host)."""
        session = LiveSession(
            store=self.store,
            incarnation=self.incarnation,
            ws=command.ws,
            sid=command.sid,
            cwd=command.cwd,
            agent=agent,
            agent_sid=agent_sid,
            single=command.scope == "single",
            on_gone=self._session_gone,
            on_fenced=self._session_fenced,
            loop_limits=self.config.loop_limits,
            on_state=self._count_state,
        )
        session.agent_name = name
        session.state_store = self.config.state_store
        session.resumable = agent.supports_load
        session.source = (command.source_type, command.source_id)
        return session

    def host(self, session: LiveSession) -> None:
        """The session is ours from now on: its agent hands it its updates, and its
        workspace's inbox is read under the session's incarnation (ours may have changed
        while the agent started)."""
        session.agent.adopt(session.agent_sid, session)
        session.agent.hosted.add(session.sid)
        self.sessions[session.sid] = session
        self._workspace_load[session.ws] = self._workspace_load.get(session.ws, 0) + 1
        self.follow_inbox(session.ws, session.incarnation)

    def follow_inbox(self, ws: str, incarnation: str) -> None:
        """Read the commands sent to `incarnation`'s sessions of workspace `ws` (once)."""
        self._cursors.setdefault(self.store.inbox_feed(ws, incarnation), "0")

    async def _close(self, session: LiveSession, command: commands.Close) -> None:
        await session.close(command.reason)
        with contextlib.suppress(Exception):  # the API's wait ends in outcome_unknown; a retry sees it gone
            await self.store.reply(command.request_id, Reply(ok=True))

    async def _session_gone(self, session: LiveSession) -> None:
        """A session left (closed, died, swept): drop it here and in the worker's index."""
        if self.sessions.get(session.sid) is not session:
            return
        del self.sessions[session.sid]
        # A dead incarnation's index is its sweeper's, not ours: the sweeper ends each session
        # in it (its prompts' `worker_lost`, its clients' `session_died`), and it may not have
        # yet when we learn of the death. Taken out of it now, a session would never be ended
        # for its clients (chaos invariant d found nine so, on a cluster, once the fence had
        # our children killed first and the rejoin no longer waited on them).
        if session.incarnation == self.incarnation:
            try:
                await self.store.index_session(session.incarnation, session.ws, session.sid, False)
            except Exception:  # the index has a TTL, and a sweeper of a dead incarnation drops it
                log.warning("could not unindex the session", extra={"sessionId": session.sid}, exc_info=True)
        left = self._workspace_load.get(session.ws, 1) - 1
        if left <= 0:
            self._workspace_load.pop(session.ws, None)
        else:
            self._workspace_load[session.ws] = left
        agent = session.agent
        retired = agent in self.retired and not agent.sessions
        if self.config.child_per == "session" or (not agent.sessions and not agent.alive) or retired:
            self.retired.discard(agent)
            await agent.stop()


async def within_limit(step: str, limit_s: float, work: Awaitable[Any], overran: list[str]) -> None:
    """Run one step of the shutdown for at most `limit_s`; past it, log the stacks of every
    task still running (the trace of what held the shutdown up), note the step in `overran`
    and go on without it."""
    task = asyncio.ensure_future(work)
    done, _ = await asyncio.wait({task}, timeout=limit_s)
    if done:
        task.result()
        return
    overran.append(step)
    stacks = io.StringIO()
    for running in asyncio.all_tasks():
        if running is not asyncio.current_task():
            running.print_stack(limit=12, file=stacks)
    log.error("shutdown: %s took longer than %.0f s; going on without it. Tasks still running:\n%s",
              step, limit_s, stacks.getvalue())
