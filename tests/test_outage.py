"""Redis away, as an operator meets it: a worker told to stop still stops within its bound,
the logs of a 30 s outage stay a few lines, the processes come back with Redis, and the
command line says in one line that it cannot reach Redis (docs/architecture.md, "The
lease" and "Operations").

Real redis-server processes of the tests' own (stopped with SIGSTOP: every reply times
out; killed: every connection is refused), real worker and API processes, the scripted
agent, whose history a later load reads.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from testbed.redis_server import RedisServer, free_port
from testbed.processes import ROOT, WorkerProcess
from tests.harness import Harness
from tests.helpers import SAFETY_STOP_S, create, eventually, load, proc_stat, prompt, recalled, status, turn_done

LEASE_MS = "1500"
OUTAGE_LEASE_MS = "8000"
GRACE_S = 3.0
# What a stop may take past its grace with Redis away: the store's silence judged (3 s),
# the agents stopped (their stdin closed, 2 s, then signals), a last try at the lease (1 s).
STOP_BOUND_S = 8.0


def _agents_of(worker: WorkerProcess) -> list[int]:
    """The pids of the worker's scripted agent children."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or (stat := proc_stat(int(name))) is None or stat[1] != worker.pid:
            continue
        try:
            if b"scripted_agent" in Path(f"/proc/{name}/cmdline").read_bytes():
                found.append(int(name))
        except (FileNotFoundError, ProcessLookupError):
            continue
    return found


def _running(pid: int) -> bool:
    stat = proc_stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


class Outage:
    """Takes a Redis away and brings it back, with its data: stopped (SIGSTOP) and
    continued, or killed and restarted from its append-only file."""

    def __init__(self, server: RedisServer, how: str) -> None:
        self.server = server
        self.how = how

    def begin(self) -> None:
        assert self.server.process is not None
        if self.how == "stalled":
            self.server.process.send_signal(signal.SIGSTOP)
        else:
            self.server.process.kill()
            self.server.process.wait()

    def end(self) -> None:
        assert self.server.process is not None
        if self.how == "stalled":
            self.server.process.send_signal(signal.SIGCONT)
        elif self.server.process.poll() is not None:
            self.server.process = RedisServer(port=self.server.port, folder=self.server.dir).start(
                ["--appendonly", "yes", "--appendfsync", "always"]
            ).process


@pytest.mark.parametrize("how", ["stalled", "down"])
async def test_a_worker_stopped_while_redis_is_away_exits_within_its_grace_and_its_session_resumes_elsewhere(
    how: str, workspace: str
) -> None:
    """SIGTERM with a session waiting on a permission and Redis away: the worker cannot hand
    the session over, so once its grace is spent it stops its agents and exits non-zero,
    saying why; once Redis is back the session is swept and loads on another worker with
    its conversation, and the turn that waited ends for its clients."""
    server = RedisServer().start(["--appendonly", "yes", "--appendfsync", "always"])
    outage = Outage(server, how)
    harness = Harness(server.url, workspace, free_port)
    try:
        leaving = await harness.worker("--lease-ms", LEASE_MS, "--drain-grace-s", str(GRACE_S))
        api = await harness.api()
        watcher = await harness.events()
        sid = (await create(api, workspace))["sessionId"]
        told = await prompt(api, sid, "remember PELICAN")
        assert (await turn_done(watcher, sid, told["promptId"]))["type"] == "turn_complete"
        asking = await prompt(api, sid, "#permission")
        await watcher.wait_type(sid, "permission_request")
        agents = _agents_of(leaving)
        assert agents, "the worker runs its agent"

        outage.begin()
        try:
            leaving.proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            code = await asyncio.wait_for(leaving.proc.wait(), SAFETY_STOP_S)
            took_s = time.monotonic() - signalled
            harness.processes.remove(leaving)  # (gone: not stopped again after the test)
            print(f"\nRedis {how}: the worker exited {code} {took_s:.1f} s after SIGTERM (grace {GRACE_S:.0f} s)")
            assert code != 0
            assert took_s <= GRACE_S + STOP_BOUND_S
            why = [line for line in leaving.log_path.read_text().splitlines() if "not handed over" in line]
            assert len(why) == 1 and f"127.0.0.1:{server.port}" in why[0], why
            await eventually(lambda: not any(_running(pid) for pid in agents), "the agents gone")
        finally:
            outage.end()

        await harness.worker("--lease-ms", LEASE_MS)
        # Its lease lapses with Redis back (a lease after the store's stall) and the sweep
        # ends the session for its clients; then it loads on the other worker.
        died = await watcher.wait_type(sid, "session_died", timeout=SAFETY_STOP_S)
        assert died["data"]["reason"] == "worker_lost"
        loaded = await load(api, sid)
        assert loaded.status_code == 200 and loaded.json()["attached"] is False, loaded.text
        assert "remember PELICAN" in await recalled(harness, api, sid)
        waited = (await api.client.get(f"/session/{sid}/turns/{asking['promptId']}")).json()
        assert waited["state"] == "error" and waited["error"]["code"] == "worker_lost", waited
        assert (await status(api, sid))["pendingInteractionCount"] == 0
    finally:
        outage.end()
        await harness.stop_all()
        server.stop()


def _written_since(path: Path, offset: int) -> bytes:
    return path.read_bytes()[offset:]


async def test_a_30_s_redis_outage_costs_a_worker_and_an_api_a_few_log_lines_and_both_recover(
    own_redis: RedisServer, workspace: str
) -> None:
    """Each kind of failure is said once (with its traceback), then counted every few
    seconds, and its end is said; a client polling meanwhile gets 503s and, once Redis is
    back (restarted empty), answers again."""
    harness = Harness(own_redis.url, workspace, free_port)
    try:
        # A worker whose own process froze past half its lease while Redis was away ends its
        # sessions when Redis comes back empty rather than rewrite them (worker.py, `_act_on`:
        # it cannot vouch nobody swept it). A loaded CI machine froze a 1.5 s lease's worker
        # that long once; this test is about logs and recovery, so its lease leaves room.
        worker = await harness.worker("--lease-ms", OUTAGE_LEASE_MS)
        api = await harness.api()
        sid = (await create(api, workspace))["sessionId"]
        await prompt(api, sid, "#permission")  # a session with state to rewrite once Redis is back

        async def waiting() -> bool:
            response = await api.client.get(f"/session/{sid}/status")
            return response.status_code == 200 and response.json()["isWaitingForPermission"]

        await eventually(waiting, "the session waiting on a permission")
        logs = {process.log_path: process.log_path.stat().st_size for process in (worker, api)}

        assert own_redis.process is not None
        own_redis.process.kill()
        own_redis.process.wait()
        outage_ends = time.monotonic() + 30
        answers = []
        while time.monotonic() < outage_ends:  # a client polling the session's status meanwhile
            answers.append((await api.client.get(f"/session/{sid}/status")).status_code)
            await asyncio.sleep(0.5)
        written = {path.name: _written_since(path, offset) for path, offset in logs.items()}
        own_redis.process = RedisServer(port=own_redis.port, folder=own_redis.dir).start().process

        assert set(answers) == {503}
        for name, text in written.items():
            lines = text.splitlines()
            print(f"\n{name}: {len(lines)} lines, {len(text)} bytes in a 30 s outage")
            assert len(lines) <= 12 and len(text) <= 16_000, text.decode()[-3000:]
            assert text.count(b'"exc":') <= 2  # a traceback per kind of failure (refused, timed out)
            assert f"127.0.0.1:{own_redis.port}".encode() in text

        await eventually(waiting, "the session's status answered again (the worker rewrote it)")
        for process in (worker, api):  # each says the outage ended
            await eventually(lambda process=process: b"over: redis unreachable" in process.log_path.read_bytes(),
                             f"{process.log_path.name} saying the outage ended")
    finally:
        await harness.stop_all()


async def _command_line(*args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "acp_state.cli", *args, cwd=str(ROOT),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), SAFETY_STOP_S)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_status_and_drain_facing_a_redis_they_cannot_reach_say_so_in_one_line(own_redis: RedisServer) -> None:
    """Refused (nothing listens) or stalled (SIGSTOP: nothing answers): one line on stderr
    naming the Redis, exit status 1, no traceback."""
    closed = f"redis://127.0.0.1:{free_port()}/0"
    assert own_redis.process is not None
    own_redis.process.send_signal(signal.SIGSTOP)
    try:
        runs = await asyncio.gather(*(
            _command_line(*command, "--redis-url", url)
            for url in (closed, own_redis.url)
            for command in (("status", "--once"), ("drain", "some-worker"))
        ))
    finally:
        own_redis.process.send_signal(signal.SIGCONT)
    for code, out, err in runs:
        assert code == 1 and out == "", (code, out, err)
        lines = err.splitlines()
        assert len(lines) == 1 and "unreachable" in lines[0], err
    for (_, _, err), url in zip(runs, (closed, closed, own_redis.url, own_redis.url)):
        assert url.removeprefix("redis://").removesuffix("/0") in err
    # Once Redis answers, the same command works.
    code, out, _ = await _command_line("status", "--once", "--redis-url", own_redis.url)
    assert code == 0 and "live workers: 0" in out


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    @property
    def texts(self) -> list[str]:
        return [record.getMessage() for record in self.records]


def test_recurring_failures_are_said_once_per_kind_then_counted_at_a_backoff() -> None:
    """Unit: the loops of one process meeting one outage make one line, a traceback once,
    then a count every 5, 10, 20 ... s; its end is said; a store that flaps within the
    interval is not announced again; a bug is its own kind, per task."""
    from acp_state.logs import RecurringFailures

    now = [0.0]
    failures = RecurringFailures(clock=lambda: now[0])
    failures.outage_name = lambda error: "redis unreachable at 10.0.0.1:6390" if isinstance(error, ConnectionError) else None
    lines = _Lines()
    log = logging.getLogger("test.recurring")
    log.addHandler(lines)
    log.propagate = False
    log.setLevel(logging.INFO)
    try:
        for _ in range(60):  # four loops failing once a second each, for a minute
            for task in ("heartbeat", "command loop", "sweeper", "refresh"):
                failures.failed(log, task, ConnectionError("refused"))
            now[0] += 1.0
        assert sum(1 for record in lines.records if record.exc_info) == 1
        assert lines.texts[0].startswith("redis unreachable at 10.0.0.1:6390 (ConnectionError): heartbeat failed")
        counted = lines.texts[1:]
        assert len(counted) == 3  # at 5, 15 and 35 s
        assert counted[0].startswith("redis unreachable at 10.0.0.1:6390 (ConnectionError) \u2014 20 more in the last 5 s")
        for task in ("heartbeat", "command loop", "sweeper"):
            failures.succeeded(task)
        assert len(lines.texts) == 4  # one loop still fails: not over
        failures.succeeded("refresh")
        assert lines.texts[-1].startswith("over: redis unreachable at 10.0.0.1:6390 (ConnectionError), after 60 s")
        for _ in range(10):  # it flaps within its interval: counted, not announced again
            failures.failed(log, "heartbeat", ConnectionError("refused"))
            now[0] += 0.5
            failures.succeeded("heartbeat")
        assert len(lines.texts) == 5
        failures.failed(log, "command loop", KeyError("x"))  # a bug: its own kind, with its traceback
        failures.failed(log, "sweeper", KeyError("x"))
        assert lines.texts[-2:] == ["command loop failed (KeyError); repeats are counted, not logged each",
                                    "sweeper failed (KeyError); repeats are counted, not logged each"]
        assert all(record.exc_info for record in lines.records[-2:])
        failures.succeeded("command loop")  # a bug met once: no line for its end
        assert len(lines.texts) == 7
    finally:
        log.removeHandler(lines)
