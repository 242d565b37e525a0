"""One ACP agent child process and its connection; it may host many sessions.

The worker is the ACP *client*. The official SDK (`acp`) frames JSON-RPC; this module
spawns the child itself so that the child inherits the worker's whole environment (HOME,
API keys, base URLs) and its stderr never fills an unread pipe.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import shlex
import signal
from typing import Any, Awaitable, Callable, Protocol

import acp
from acp.schema import ClientCapabilities, FileSystemCapabilities, Implementation

from acp_state import __version__, tracing
from acp_state.commands import cancelled_response
from acp_state.interactions import CancelSentinelCollision

from .reaper import TAG_VARIABLE, parent_death_signal, reaper, tagged

tracing.quiet_acp_sdk()  # its own spans, one per message, even when acp-state does not trace

log = logging.getLogger("worker.agent")

PROTOCOL_VERSION = 1
STREAM_LIMIT = 50 * 1024 * 1024
INITIALIZE_TIMEOUT_S = 60.0
GROUP_GRACE_S = 2.0
# Updates for a session id not (yet) hosted here are kept, this many per id and for this many
# ids at most (the oldest id's go first): an agent may announce a new session's commands
# before its `session/new` answer names it (Copilot does), and they belong to the session.
EARLY_UPDATES_PER_SESSION = 50
EARLY_SESSIONS = 20
# What a session/new, load or resume answer says of the session, kept for GET /session/:id/context.
REPORTED_STATE = ("modes", "models", "configOptions")


class HostedSession(Protocol):
    """What a child says to a session it hosts (worker/session.py's `LiveSession`): the
    agent's updates, its permission requests, and its own exit."""

    sid: str

    async def on_update(self, update: dict[str, Any]) -> None: ...
    async def request_permission(self, tool_call: dict[str, Any], options: list[dict[str, Any]]) -> dict[str, Any]: ...
    async def die(self) -> None: ...


def _signal_group(pgid: int, sig: int) -> bool:
    """Send `sig` to process group `pgid`; whether it still had members."""
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _fenced(pid: int) -> bool:
    """The process is stopped (state T: the self-fence's SIGSTOP); False where /proc is not."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            raw = stat.read()
    except OSError:
        return False
    return raw[raw.rindex(b")") + 2 :][:1] == b"T"


def _signal_tagged(tag: str, sig: int) -> bool:
    """Send `sig` to every process carrying the agent's tag; whether there were any."""
    found = False
    for pid in tagged([tag]):
        try:
            os.kill(pid, sig)
            found = True
        except (ProcessLookupError, PermissionError):
            pass
    return found


def _dump(model: Any) -> Any:
    """An SDK model as the wire JSON (camelCase, `_meta` kept, unset fields dropped)."""
    if not hasattr(model, "model_dump"):
        return model
    data = model.model_dump(mode="json", by_alias=True, exclude_none=True)
    if "sessionUpdate" in data:  # the discriminator first, as agents write it
        data = {"sessionUpdate": data.pop("sessionUpdate"), **data}
    return data


class AgentProcess:
    """A running `--agent` command speaking ACP v1 over stdio."""

    def __init__(
        self,
        command: str,
        cwd: str,
        *,
        session_mode: str | None = None,
        stderr_path: str | None = None,
        on_exit: Callable[[AgentProcess], Awaitable[None]] | None = None,
        home: str | None = None,
    ) -> None:
        self.argv = shlex.split(command)
        self.cwd = cwd
        self.session_mode = session_mode
        self.stderr_path = stderr_path
        self._on_exit = on_exit
        self.sessions: dict[str, HostedSession] = {}
        self._early: dict[str, list[dict[str, Any]]] = {}  # updates for sessions not adopted yet
        self._replaying: dict[str, list[dict[str, Any]]] = {}  # early updates still on their way
        self.process: asyncio.subprocess.Process | None = None
        self.conn: Any = None
        self.supports_close = False
        self.supports_load = False  # it can resume a session: `loadSession` or `sessionCapabilities.resume`
        self.supports_resume = False  # `sessionCapabilities.resume`: it resumes without replaying
        self.home = home  # the agent's HOME: where it keeps its history (the worker's --state-dir)
        self._loading: set[str] = set()  # sessions being loaded: their replayed history is dropped
        self._watcher: asyncio.Task[None] | None = None
        self.stopping = False
        # Killed because the sessions it hosted were lost (worker fenced): nothing more is
        # said to it, and no session is placed on it again.
        self.killed = False
        # The ids of every session placed on it (ours, not the agent's): a resume or a move
        # is never placed on a child that hosted the session before, whose memory of it may
        # hold turns the session's clients were told failed (see Worker.agent_for).
        self.hosted: set[str] = set()
        # Agent session id -> (current mode id, the mode ids it offers), from its ACP `modes`.
        self.modes: dict[str, tuple[str | None, list[str]]] = {}
        # Agent session id -> what its session/new, load or resume answered of the session's
        # state (`modes`, `models`, `configOptions`, as sent), for `GET /session/:id/context`.
        self.reported: dict[str, dict[str, Any]] = {}
        # In the child's environment, inherited by its descendants: finds those that leave
        # its process group (a daemon, such as Cline's hub) when the agent is stopped.
        self.tag = secrets.token_hex(8)

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.returncode is None and not self.killed

    def kill(self) -> None:
        """SIGKILL the child's process group and every process carrying its tag, now and
        without a grace: the worker was fenced, and a turn it still runs must never write
        again (an agent stopped by the self-fence, continued to close its sessions, would
        first run its turn on). Its exit is then handled as any other (`_watch`)."""
        self.killed = True
        self.stopping = True
        if self.process is not None and self.process.returncode is None:
            _signal_group(self.process.pid, signal.SIGKILL)
            _signal_tagged(self.tag, signal.SIGKILL)

    async def start(self) -> None:
        """Spawn the child and run `initialize`; raises if it does not speak ACP v1."""
        stderr: Any = asyncio.subprocess.DEVNULL
        if self.stderr_path:
            stderr = open(self.stderr_path, "ab")  # noqa: SIM115 - owned by the child
        self.process = await asyncio.create_subprocess_exec(
            *self.argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=stderr,
            cwd=self.cwd,
            env={**os.environ, TAG_VARIABLE: self.tag, **({"HOME": self.home} if self.home else {})},
            # Its own process group, so a stop reaches wrappers' grandchildren too (qwen).
            start_new_session=True,
            # Linux kills the child if the worker dies; the reaper also covers grandchildren.
            preexec_fn=parent_death_signal(),
            limit=STREAM_LIMIT,
        )
        # Should this process die before the group is gone, even by SIGKILL, the reaper ends it.
        reaper().watch(self.process.pid, self.tag)
        if stderr is not asyncio.subprocess.DEVNULL:
            stderr.close()
        self.conn = acp.connect_to_agent(self, self.process.stdin, self.process.stdout)
        self._watcher = asyncio.ensure_future(self._watch())
        result = await asyncio.wait_for(
            self.conn.initialize(
                protocol_version=PROTOCOL_VERSION,
                client_capabilities=ClientCapabilities(
                    fs=FileSystemCapabilities(read_text_file=False, write_text_file=False),
                    terminal=False,
                ),
                client_info=Implementation(name="acp-state", version=__version__),
            ),
            INITIALIZE_TIMEOUT_S,
        )
        if result.protocol_version != PROTOCOL_VERSION:
            await self.stop()
            raise RuntimeError(f"agent speaks ACP v{result.protocol_version}, not v{PROTOCOL_VERSION}")
        capabilities = result.agent_capabilities
        session_caps = getattr(capabilities, "session_capabilities", None) if capabilities else None
        self.supports_close = getattr(session_caps, "close", None) is not None
        self.supports_resume = getattr(session_caps, "resume", None) is not None
        self.supports_load = bool(getattr(capabilities, "load_session", False)) or self.supports_resume

    async def _watch(self) -> None:
        assert self.process is not None
        code = await self.process.wait()
        if not self.stopping:
            log.warning("agent %s exited with %s", self.argv[0], code)
        try:
            for session in list(self.sessions.values()):
                await session.die()
            self.sessions.clear()
            if self._on_exit is not None:
                await self._on_exit(self)
        finally:
            await self._end_group()

    async def _end_group(self) -> None:
        """The child is gone: what it left in its process group (a wrapper's grandchildren),
        and its descendants that left the group (daemons), get SIGTERM, then SIGKILL after a
        grace period; then the reaper may forget the group. (Cancelled on the way out of the
        process, the group stays with the reaper.)"""
        assert self.process is not None
        pgid = self.process.pid
        loop = asyncio.get_running_loop()

        def remaining(sig: int) -> bool:
            in_group = _signal_group(pgid, sig)
            return _signal_tagged(self.tag, sig) or in_group

        for sig in (signal.SIGTERM, signal.SIGKILL):
            if not remaining(sig):
                break
            deadline = loop.time() + GROUP_GRACE_S
            while remaining(0) and loop.time() < deadline:
                await asyncio.sleep(0.05)  # a group's end is not an event we can await
        reaper().forget(pgid)

    async def new_session(self, cwd: str, mode: str | None = None) -> str:
        """A new agent session, in `mode` if the agent offers it, else in the worker's
        `--session-mode` if given."""
        response = await self.conn.new_session(cwd=cwd, mcp_servers=[])
        self._note_modes(response.session_id, response)
        wanted = mode if mode in self.modes.get(response.session_id, (None, []))[1] else self.session_mode
        if wanted:
            await self.set_mode(response.session_id, wanted)
        return response.session_id

    def _note_modes(self, agent_sid: str, response: Any) -> None:
        modes = getattr(response, "modes", None)
        if modes is not None:
            self.modes[agent_sid] = (modes.current_mode_id, [mode.id for mode in modes.available_modes])
        answered = _dump(response) if response is not None else {}
        self.reported[agent_sid] = {key: answered[key] for key in REPORTED_STATE if key in answered}

    async def set_mode(self, agent_sid: str, mode: str) -> None:
        """ACP `session/set_mode`; the mode is the session's current one once it answered."""
        await self.conn.set_session_mode(session_id=agent_sid, mode_id=mode)
        self.modes[agent_sid] = (mode, self.modes.get(agent_sid, (None, []))[1])
        reported = self.reported.get(agent_sid, {})
        if isinstance(reported.get("modes"), dict):
            reported["modes"]["currentModeId"] = mode
        for option in reported.get("configOptions") or []:  # the mode's selector says it too
            if isinstance(option, dict) and option.get("category") == "mode":
                option["currentValue"] = mode

    async def load_session(self, agent_sid: str, cwd: str) -> str:
        """Resume the agent's session `agent_sid` from its history: ACP `session/resume` where
        the agent advertises it (it replays nothing), else `session/load`, whose replay of the
        conversation as updates before its answer is dropped here: the session's clients have
        it already (its transcript outlives the worker)."""
        self._loading.add(agent_sid)
        try:
            restore = self.conn.resume_session if self.supports_resume else self.conn.load_session
            self._note_modes(agent_sid, await restore(cwd=cwd, mcp_servers=[], session_id=agent_sid))
        finally:
            self._loading.discard(agent_sid)
            self._early.pop(agent_sid, None)
        if self.session_mode:
            await self.set_mode(agent_sid, self.session_mode)
        return agent_sid

    async def prompt(self, agent_sid: str, blocks: list[dict[str, Any]], meta: dict[str, Any] | None) -> Any:
        request = acp.PromptRequest.model_validate({"sessionId": agent_sid, "prompt": blocks})
        return await self.conn.prompt(session_id=agent_sid, prompt=request.prompt, **(meta or {}))

    async def cancel(self, agent_sid: str) -> None:
        if self.alive:
            await self.conn.cancel(session_id=agent_sid)

    async def forget(self, agent_sid: str) -> bool:
        """A session left this child: stop its work there; a child with no session left the
        worker may stop (see Worker). Whether the child is rid of the session: it closed it
        (`session/close`), or it is gone or killed. If not, it may still hold the session in
        its memory, and run its turn on."""
        self.sessions.pop(agent_sid, None)
        self._early.pop(agent_sid, None)  # (updates sent after it left)
        self.modes.pop(agent_sid, None)
        self.reported.pop(agent_sid, None)
        if not self.alive:
            return True
        assert self.process is not None
        if _fenced(self.process.pid):  # stopped by the self-fence: it answers nothing, and stays stopped
            return False
        try:
            await self.conn.cancel(session_id=agent_sid)
            if self.supports_close:
                await asyncio.wait_for(self.conn.close_session(session_id=agent_sid), 5)
                return True
        except Exception:  # a child that cannot close a session is stopped by its owner
            log.debug("agent could not close session %s", agent_sid, exc_info=True)
        return False

    async def stop(self, grace_s: float = 2.0) -> None:
        """Close stdin, then TERM and KILL the whole process group if it lingers. A child
        the self-fence stopped (worker/reaper.py) is killed at once: stopped, it reads no
        EOF and acts on no SIGTERM, and it must not be continued to do so (it would first
        run its turn on)."""
        self.stopping = True
        process = self.process
        if process is None or process.returncode is not None:
            return
        try:
            if process.stdin:
                process.stdin.close()
            if not _fenced(process.pid):
                await asyncio.wait_for(process.wait(), grace_s)
                return
        except (asyncio.TimeoutError, ProcessLookupError, BrokenPipeError, ConnectionResetError):
            pass
        for sig in (signal.SIGKILL,) if _fenced(process.pid) else (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                return
            try:
                await asyncio.wait_for(process.wait(), grace_s)
                return
            except asyncio.TimeoutError:
                continue

    # ---- ACP client callbacks (called by the SDK) ---------------------------------------

    def adopt(self, agent_sid: str, session: HostedSession) -> None:
        """Host `session` under the agent's id; the updates the agent sent for it before it
        was adopted are relayed first, in order (they wait for its first snapshot)."""
        self.sessions[agent_sid] = session
        early = self._early.pop(agent_sid, None)
        if early:
            self._replaying[agent_sid] = early
            asyncio.ensure_future(self._replay(agent_sid, session))

    async def _replay(self, agent_sid: str, session: HostedSession) -> None:
        queue = self._replaying[agent_sid]
        try:
            while queue:
                await session.on_update(queue.pop(0))
        except Exception:
            log.exception("relaying a session's early updates failed", extra={"sessionId": session.sid})
        finally:
            del self._replaying[agent_sid]

    def _keep_early(self, agent_sid: str, update: dict[str, Any]) -> None:
        kept = self._early.setdefault(agent_sid, [])
        if len(kept) < EARLY_UPDATES_PER_SESSION:
            kept.append(update)
        while len(self._early) > EARLY_SESSIONS:
            del self._early[next(iter(self._early))]

    async def session_update(self, session_id: str, update: Any, **_: Any) -> None:
        if session_id in self._loading:
            return  # the history `session/load` replays
        session = self.sessions.get(session_id)
        if session is None:
            self._keep_early(session_id, _dump(update))
        elif session_id in self._replaying:  # behind the early ones
            self._replaying[session_id].append(_dump(update))
        else:
            await session.on_update(_dump(update))

    async def request_permission(self, session_id: str, tool_call: Any, options: Any, **_: Any) -> dict[str, Any]:
        session = self.sessions.get(session_id)
        if session is None:
            return cancelled_response()
        try:
            return await session.request_permission(_dump(tool_call), [_dump(o) for o in options])
        except CancelSentinelCollision as error:
            raise acp.RequestError.internal_error({"details": f"option id {error} is reserved"}) from error

    async def ext_notification(self, method: str, params: dict[str, Any]) -> None:
        """Vendor notifications (e.g. Qwen's `qwen/notify/*`) carry nothing the bridge needs."""

    async def ext_method(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        raise acp.RequestError.method_not_found(method)

    def on_connect(self, conn: Any) -> None:  # the SDK's hook; the connection is kept in start()
        pass
