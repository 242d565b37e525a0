"""Self-fencing (issue 37): a worker that can no longer vouch for its lease has its agents
stopped before any sweeper may declare it dead, whatever stopped it (the worker process
itself, its link to Redis), and once it learns it is dead no child of its ever runs the
lost turn on, nor hosts the session again (docs/architecture.md, "The lease").

Real redis-server, real worker and API processes, the scripted agent, whose history of each
session (the shared state dir) is what a later resume loads: what a user would notice is a
turn they were told ended `worker_lost` showing up in the conversation, or the turns of the
worker that resumed it missing. The evidence of each run (the moment the watchdog stopped the
agent, the lease's deadline, the death) is printed; `-s` shows it.
"""

from __future__ import annotations

import os
import re
import signal
import uuid
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from acp_state.store import keys
from testbed.processes import ApiProcess, WorkerProcess
from tests.harness import EventWatcher, Harness
from tests.helpers import create, eventually, load, proc_stat, prompt, recalled, turn_done
from tests.host_bed import across, bed, bed_redis  # noqa: F401 (the host test bed's fixtures)

LEASE_MS = 2000
STOPPED_LINE = re.compile(
    rb"worker\.reaper: (\d+) no renewal accepted in time; stopped agent groups \[([\d, ]*)\] ([\d.]+) ms after"
)


# ---- what /proc, the worker's log and Redis say ----------------------------------------------


def _agent_of(worker: WorkerProcess) -> int:
    """The pid of the worker's one scripted agent child (its process group's id too)."""
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    agents = []
    for pid in pids:
        stat = proc_stat(pid)
        if stat is None or stat[1] != worker.pid:
            continue
        try:
            if b"scripted_agent" in Path(f"/proc/{pid}/cmdline").read_bytes():
                agents.append(pid)
        except (FileNotFoundError, ProcessLookupError):
            continue
    assert len(agents) == 1, agents
    return agents[0]


def _group(pgid: int) -> list[tuple[int, str]]:
    """(pid, state) of every live member of process group `pgid`."""
    members = []
    for name in os.listdir("/proc"):
        if name.isdigit() and (stat := proc_stat(int(name))) and stat[2] == pgid and stat[0] not in ("Z", "X"):
            members.append((int(name), stat[0]))
    return members


def _stopped(pgid: int) -> bool:
    """Every member of the group is stopped (state T), or none is left."""
    return all(state == "T" for _, state in _group(pgid))


def _gone(pgid: int) -> bool:
    return not _group(pgid)


def _watchdog_stopped_at_ms(worker: WorkerProcess, pgid: int) -> tuple[int, float] | None:
    """When the worker's watchdog logged that it stopped the group (wall clock, ms; written
    right after its signals went out), and how late after its deadline it did (ms)."""
    for match in STOPPED_LINE.finditer(worker.log_path.read_bytes()):
        if str(pgid) in match.group(2).decode().replace(" ", "").split(","):
            return int(match.group(1)), float(match.group(3))
    return None


async def _redis_ms(client: aioredis.Redis) -> int:
    seconds, micros = await client.time()
    return seconds * 1000 + micros // 1000


def _history_of(state_dir: str, marker: str) -> str:
    """The scripted agent's history file of the session that was told `marker`."""
    sessions = Path(state_dir) / "sessions"
    found = [p for p in sessions.glob("*.jsonl") if marker in p.read_text()]
    assert len(found) == 1, found
    return found[0].read_text()


async def _slow_turn_running(api: ApiProcess, events: EventWatcher, sid: str) -> dict:
    slow = await prompt(api, sid, "#slow 10")
    await events.wait_type(sid, "session_update", promptId=slow["promptId"])
    return slow


async def _stopped_before_death(
    client: aioredis.Redis, worker: WorkerProcess, agent: int, events: EventWatcher, sid: str, cut_ms: int, cut: str
) -> dict[str, float]:
    """Wait for the agent's group to be stopped (/proc: state T) and for the worker to be
    declared dead; assert the stop came first, and before the lease's last deadline. The
    moment of the stop is the watchdog's own record, stamped right after its signals went
    out (the same machine's clock as Redis's): when the test's poll of /proc sees it depends
    on how soon a loaded machine runs the test. The figures, in ms after the cut."""
    incarnation = worker.incarnation
    await eventually(lambda: _stopped(agent), "the agent's stop", step=0.005)
    seen_ms = await _redis_ms(client)
    deadline = await client.zscore(keys.WORKERS, incarnation)  # (None if already declared dead)
    assert _group(agent), "the agent is stopped, not gone: the worker has not learnt it is dead"
    died = await events.wait_type(sid, "session_died", timeout=30)
    assert died["data"]["reason"] == "worker_lost"
    death = await client.zscore(keys.DEAD, incarnation)
    assert death is not None
    stopped_ms, late_ms = await eventually(lambda: _watchdog_stopped_at_ms(worker, agent), "the watchdog's log line")
    figures = {
        "watchdog_late_after_its_deadline": round(late_ms, 1),
        "watchdog_stopped": stopped_ms - cut_ms,
        "seen_stopped": seen_ms - cut_ms,
        "lease_deadline": int(deadline) - cut_ms if deadline is not None else -1,
        "declared_dead": int(death) - cut_ms,
    }
    print(f"self-fencing, {cut}, lease {LEASE_MS} ms: ms after the cut {figures}")
    assert stopped_ms < death, figures  # stopped before the sweeper declared the death
    if deadline is not None:  # the lease, on Redis's clock, still ran when the agent stopped
        assert stopped_ms < deadline, figures
    return figures


async def _rejoined(client: aioredis.Redis, worker: WorkerProcess) -> str | None:
    for member in await client.zrange(keys.WORKERS, 0, -1):
        if f"-{worker.pid}-" in member and member != worker.incarnation:
            return member
    return None


# ---- (a) the worker process stalls; its agent is a process of its own ------------------------


async def _worker_in_a_session_of_its_own(harness: Harness, *args: str) -> WorkerProcess:
    """A worker started through `setsid`: its pid is its process group's id, and nothing
    of the test's shares that group (a harness worker shares the test runner's)."""
    process = WorkerProcess(
        ["worker", "--redis-url", harness.redis_url, *args, "--drain-grace-s", "0"],
        harness.logs / f"worker-{len(harness.processes)}.log", prefix=["setsid"],
    )
    await process.start()
    harness.processes.append(process)
    assert os.getpgid(process.pid) == process.pid
    return process


@pytest.mark.parametrize("stopped", ["the worker", "its process group"])
async def test_a_stopped_worker_has_its_agent_stopped_before_it_may_be_declared_dead(
    own_harness: Harness, own_client: aioredis.Redis, workspace: str, scripted_agent_state: str, stopped: str
) -> None:
    """`its process group`: `kill -STOP -<pgid>` (Ctrl-Z in a terminal) stops the worker and
    whatever shares its group, never its watchdog nor its agents (sessions of their own)."""
    harness, client = own_harness, own_client
    events = await harness.events()
    if stopped == "the worker":
        worker = await harness.worker("--lease-ms", str(LEASE_MS))
    else:
        worker = await _worker_in_a_session_of_its_own(harness, "--lease-ms", str(LEASE_MS))
    stop = os.kill if stopped == "the worker" else os.killpg
    api = await harness.api()  # its sweeper declares the worker dead
    sid = (await create(api, workspace))["sessionId"]
    marker = f"remember {uuid.uuid4().hex}"
    told = await prompt(api, sid, marker)
    assert (await turn_done(events, sid, told["promptId"]))["type"] == "turn_complete"
    slow = await _slow_turn_running(api, events, sid)
    agent = _agent_of(worker)

    cut_ms = await _redis_ms(client)
    stop(worker.pid, signal.SIGSTOP)  # its agent's group keeps running
    try:
        await _stopped_before_death(client, worker, agent, events, sid, cut_ms, f"SIGSTOP of {stopped}")
        ended = await events.wait_type(sid, "turn_error", promptId=slow["promptId"])
        assert ended["data"]["code"] == "worker_lost"
    finally:
        stop(worker.pid, signal.SIGCONT)

    # Woken, it learns it is dead: the stopped agent is killed, never continued, and the turn
    # its clients were told ended `worker_lost` never reaches the agent's history.
    await eventually(lambda: _rejoined(client, worker), "the woken worker's rejoin")
    await eventually(lambda: _gone(agent), "the fenced agent's end")
    history = _history_of(scripted_agent_state, marker)
    assert "#slow" not in history, history


# ---- (b) the worker's link to Redis is cut; the worker runs on --------------------------------


@pytest.mark.parametrize("direction", ["both", "in"])
async def test_a_worker_cut_off_from_redis_has_its_agent_stopped_before_it_may_be_declared_dead(
    bed, across: Harness, workspace: str, scripted_agent_state: str, direction: str  # noqa: F811
) -> None:
    """`both`: nothing crosses; `in`: what Redis sends is dropped (a renewal may still land,
    its answer never comes back, so the worker cannot know its lease holds)."""
    worker = await across.worker("--lease-ms", str(LEASE_MS), host=bed.hosts["worker-1"])
    api = await across.api(host=bed.hosts["api-1"])
    events = await across.events()
    client = aioredis.Redis.from_url(across.redis_url, decode_responses=True)
    try:
        sid = (await create(api, workspace))["sessionId"]
        marker = f"remember {uuid.uuid4().hex}"
        told = await prompt(api, sid, marker)
        assert (await turn_done(events, sid, told["promptId"]))["type"] == "turn_complete"
        await _slow_turn_running(api, events, sid)
        agent = _agent_of(worker)

        cut_ms = await _redis_ms(client)
        bed.partition("worker-1", direction)
        await _stopped_before_death(client, worker, agent, events, sid, cut_ms, f"partition {direction}")
        bed.heal("worker-1")

        await eventually(lambda: _rejoined(client, worker), "the healed worker's rejoin")
        await eventually(lambda: _gone(agent), "the fenced agent's end")
        history = _history_of(scripted_agent_state, marker)
        assert "#slow" not in history, history
    finally:
        await client.aclose()


# ---- (c) the conversation after two moves ------------------------------------------------------


async def test_a_resumed_conversation_never_holds_the_lost_turn_nor_loses_the_resumers_turns(
    own_harness: Harness, own_client: aioredis.Redis, workspace: str, scripted_agent_state: str
) -> None:
    """A's session is mid-turn when A stops; declared dead, it is resumed on B, which runs a
    turn. A wakes. Then B dies and the session is resumed again, on A (the only worker left):
    its agent knows the turns before A stopped and B's, never the turn that ended
    `worker_lost` (before: A's agent ran that turn on, wrote it after B's turn, and the
    second resume landed on A's old child, which answered from its memory without B's turn)."""
    harness, client = own_harness, own_client
    events = await harness.events()
    first = await harness.worker("--lease-ms", str(LEASE_MS))
    api = await harness.api()
    sid = (await create(api, workspace))["sessionId"]
    before = f"remember ALPHA-{uuid.uuid4().hex}"
    told = await prompt(api, sid, before)
    assert (await turn_done(events, sid, told["promptId"]))["type"] == "turn_complete"
    slow = await _slow_turn_running(api, events, sid)
    agent = _agent_of(first)

    os.kill(first.pid, signal.SIGSTOP)
    try:
        ended = await events.wait_type(sid, "turn_error", promptId=slow["promptId"], timeout=30)
        assert ended["data"]["code"] == "worker_lost"
        await events.wait_type(sid, "session_died")
        second = await harness.worker("--lease-ms", str(LEASE_MS))
        resumed = await load(api, sid)
        assert resumed.status_code == 200, resumed.text
        during = "remember BETA"
        on_second = await prompt(api, sid, during)
        assert (await turn_done(events, sid, on_second["promptId"]))["type"] == "turn_complete"
    finally:
        os.kill(first.pid, signal.SIGCONT)
    await eventually(lambda: _rejoined(client, first), "the woken worker's rejoin")

    await second.kill9()  # the second move: back to the first worker, the only one left
    await eventually(lambda: _session_swept(client, workspace, sid), "the second worker's sweep")
    again = await load(api, sid)
    assert again.status_code == 200, again.text
    recall = await recalled(harness, api, sid)
    assert before in recall and during in recall, recall
    assert "#slow" not in recall, recall
    assert "#slow" not in _history_of(scripted_agent_state, before)
    await eventually(lambda: _gone(agent), "the fenced agent's end")  # it can write nothing later


async def _session_swept(client: aioredis.Redis, workspace: str, sid: str) -> bool:
    from acp_state.ids import workspace_id

    return not await client.exists(keys.session(workspace_id(workspace), sid))


# ---- a stall of the store pauses the agents, and kills nothing -------------------------------


async def test_a_store_stall_past_the_deadline_pauses_the_agent_and_its_turn_goes_on(
    own_harness: Harness, own_client: aioredis.Redis, own_redis, workspace: str, scripted_agent_state: str
) -> None:
    """Why SIGSTOP first and not SIGKILL: from inside, a stall of the store looks like a cut.
    The agent is stopped at the deadline, continued when a renewal is accepted again (the
    store declares nobody dead for its own stall), and its turn completes."""
    harness, client = own_harness, own_client
    events = await harness.events()
    worker = await harness.worker("--lease-ms", str(LEASE_MS))
    api = await harness.api()
    sid = (await create(api, workspace))["sessionId"]
    marker = f"remember {uuid.uuid4().hex}"
    told = await prompt(api, sid, marker)
    assert (await turn_done(events, sid, told["promptId"]))["type"] == "turn_complete"
    slow = await prompt(api, sid, "#slow 3")
    await events.wait_type(sid, "session_update", promptId=slow["promptId"])
    agent = _agent_of(worker)

    await client.execute_command("CLIENT", "PAUSE", 3 * LEASE_MS, "ALL")
    await eventually(lambda: _stopped(agent) and _group(agent), "the agent's stop during the stall", step=0.01)
    await eventually(lambda: not _stopped(agent), "the agent's continuation after the stall", step=0.01)
    ended = await turn_done(events, sid, slow["promptId"])
    assert ended["type"] == "turn_complete", ended
    assert not [e for e in events.of(sid) if e["type"] == "session_died"]
    assert worker.incarnation in await client.zrange(keys.WORKERS, 0, -1)
    assert "#slow 3" in _history_of(scripted_agent_state, marker)
    log = worker.log_path.read_text()
    assert "continued agent groups" in log, log[-2000:]


# ---- the watchdog on its own ----------------------------------------------------------------


async def test_the_watchdog_stops_at_the_deadline_continues_on_a_later_one_and_kills_on_eof_when_fenced() -> None:
    """The protocol between a worker and its watchdog (worker/reaper.py), with a group that
    ignores SIGTERM and a grace far longer than the test: a worker that dies while its agents
    are fenced has them killed at once, never continued nor given a grace to run in."""
    import asyncio
    import subprocess
    import sys

    from acp_state.worker.reaper import Reaper, fence_clock

    group = subprocess.Popen(
        [sys.executable, "-c", "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
         "while True: time.sleep(0.01)"],
        start_new_session=True,
    )
    handle = Reaper(grace_s=600)
    try:
        handle.watch(group.pid)
        handle.fence_at(fence_clock() + 0.2)
        await eventually(lambda: _stopped(group.pid), "the stop at the deadline", step=0.005)
        handle.fence_at(fence_clock() + 60)  # a renewal accepted after all
        await eventually(lambda: not _stopped(group.pid), "the continuation", step=0.005)
        handle.fence_at(fence_clock())  # past at once
        await eventually(lambda: _stopped(group.pid), "the stop at the new deadline", step=0.005)
        watchdog = handle.process
        assert watchdog is not None
        handle.close()  # EOF: what the worker's death does
        assert await asyncio.to_thread(group.wait, 15) == -signal.SIGKILL
        assert await asyncio.to_thread(watchdog.wait, 15) == 0
    finally:
        handle.close()
        if group.poll() is None:
            group.kill()
            group.wait()


# ---- no stale child, without any fence ---------------------------------------------------------


async def test_a_session_that_returns_to_a_worker_gets_a_fresh_child_not_the_one_that_hosted_it(
    own_harness: Harness, own_client: aioredis.Redis, workspace: str
) -> None:
    """The scripted agent, like many, cannot close a session (`session/close` is not in its
    capabilities): a session closed on worker A stays in the memory of A's workspace child.
    Resumed on B, it gets a turn there; resumed on A again, it must not land on that child,
    whose memory lacks B's turn (an agent answers a load of a session it holds from memory)."""
    from acp_state.ids import workspace_id

    harness, client = own_harness, own_client
    events = await harness.events()
    # A small capacity: one session more makes A fuller than placement's preference for a
    # worker already running the workspace's child (acp_state.placement.WARM_PREFERENCE).
    capacity = ("--max-sessions", "10")
    first = await harness.worker("--lease-ms", str(LEASE_MS), *capacity)
    api = await harness.api()
    sid = (await create(api, workspace))["sessionId"]
    await create(api, workspace)  # keeps A the busier worker, so the first resume goes to B
    before = f"remember ALPHA-{uuid.uuid4().hex}"
    told = await prompt(api, sid, before)
    assert (await turn_done(events, sid, told["promptId"]))["type"] == "turn_complete"
    child = _agent_of(first)
    second = await harness.worker("--lease-ms", str(LEASE_MS), *capacity)

    closed = await api.client.delete(f"/session/{sid}")
    assert closed.status_code == 204, closed.text
    await eventually(lambda: _reported_sessions(api, first.incarnation, 1), "A's report of its one session left")
    assert (await load(api, sid)).status_code == 200
    owner = await client.hget(keys.session(workspace_id(workspace), sid), keys.F.OWNER)
    assert owner == second.incarnation, "placed on the least loaded worker"
    during = "remember BETA"
    on_second = await prompt(api, sid, during)
    assert (await turn_done(events, sid, on_second["promptId"]))["type"] == "turn_complete"

    await second.kill9()
    await eventually(lambda: _session_swept(client, workspace, sid), "the second worker's sweep")
    assert (await load(api, sid)).status_code == 200  # back on A, the only worker left
    recall = await recalled(harness, api, sid)
    assert before in recall and during in recall, recall
    assert _group(child), "the old child keeps hosting A's other session"


async def _reported_sessions(api: ApiProcess, incarnation: str, count: int) -> bool:
    workers = (await api.client.get("/workers")).json()["workers"]
    return any(w["incarnation"] == incarnation and w.get("sessions") == count for w in workers)
