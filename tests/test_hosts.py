"""The host test bed itself (testbed/hosts.py): what it cuts, and that nothing of it outlives a
run, a failed one or one whose driver was killed. Skipped where it cannot run here."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterator

import pytest
import redis

from testbed.hosts import UNAVAILABLE_EXIT, TestBed, leftovers, unavailable_reason
from testbed.redis_server import RedisServer, bind_args
from tests.helpers import eventually_sync

ROOT = Path(__file__).resolve().parent.parent
REASON = unavailable_reason()
needs_bed = pytest.mark.skipif(REASON is not None, reason=f"no host test bed here: {REASON}")


def nothing_left(run_id: str) -> dict[str, list]:
    return {kind: found for kind, found in leftovers(run_id).items() if found}


@pytest.fixture(scope="module")
def bed() -> Iterator[TestBed]:
    if REASON is not None:
        pytest.skip(f"no host test bed here: {REASON}")
    with TestBed(["worker-1"]) as test_bed:
        yield test_bed


@pytest.fixture(scope="module")
def bed_redis(bed: TestBed) -> Iterator[RedisServer]:
    server = RedisServer().start(bind_args(bed.redis_ip))
    yield server
    server.stop()


def on_host(bed: TestBed, bed_redis: RedisServer, *command: str, timeout: float = 5) -> subprocess.CompletedProcess[str]:
    """redis-cli on worker-1, against the bed's Redis (through its fault proxy)."""
    return subprocess.run(
        [*bed.hosts["worker-1"].exec_prefix, "redis-cli", "-h", bed.redis_ip, "-p", str(bed_redis.port), *command],
        capture_output=True, text=True, timeout=timeout,
    )


def local(bed_redis: RedisServer) -> redis.Redis:
    """A client of the bed's Redis from the root namespace, which no fault cuts."""
    return redis.Redis(port=bed_redis.port, decode_responses=True)


@needs_bed
def test_a_host_reaches_redis_through_the_fault_proxy(bed: TestBed, bed_redis: RedisServer) -> None:
    before = bed.proxy().stats()["connections_total"]
    assert on_host(bed, bed_redis, "PING").stdout.strip() == "PONG"
    assert bed.proxy().stats()["connections_total"] == before + 1


@needs_bed
def test_a_partition_of_what_a_host_sends_delivers_nothing_until_healed(bed: TestBed, bed_redis: RedisServer) -> None:
    redis = local(bed_redis)
    redis.delete("sent-out")
    bed.partition("worker-1", "out")
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            on_host(bed, bed_redis, "SET", "sent-out", "1", timeout=3)
    finally:
        bed.heal("worker-1")
    assert redis.get("sent-out") is None
    assert on_host(bed, bed_redis, "PING").stdout.strip() == "PONG"


# On a host: open a connection to Redis and PING on it, say "open", wait for a line, send
# one more command (argv[3]) on the same connection, and say whether an answer came in 2 s.
OPEN_THEN_SEND = (
    "import socket,sys\n"
    "s=socket.create_connection((sys.argv[1],int(sys.argv[2])))\n"
    "s.sendall(b'PING\\r\\n'); s.recv(64)\n"
    "print('open',flush=True); sys.stdin.readline()\n"
    "s.sendall(sys.argv[3].encode()+b'\\r\\n'); s.settimeout(2)\n"
    "try: s.recv(64); print('answered')\n"
    "except socket.timeout: print('no answer')\n"
)


@contextlib.contextmanager
def open_connection(bed: TestBed, bed_redis: RedisServer, command: str) -> Iterator[Callable[[], str]]:
    """A connection worker-1 opened to Redis before the fault; call the value to send
    `command` on it (after the fault) and learn whether it was answered. Healed after."""
    host = subprocess.Popen(
        [*bed.hosts["worker-1"].exec_prefix, sys.executable, "-c", OPEN_THEN_SEND, bed.redis_ip, str(bed_redis.port),
         command],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )

    def send() -> str:
        host.stdin.write("go\n")
        host.stdin.flush()
        return host.stdout.readline().strip()

    try:
        assert host.stdout.readline().strip() == "open"
        yield send
    finally:
        bed.heal("worker-1")
        host.kill()
        host.wait()


@needs_bed
def test_a_one_way_partition_in_lets_writes_of_an_open_connection_arrive(bed: TestBed, bed_redis: RedisServer) -> None:
    """A host whose replies are dropped still changes Redis: an outcome it cannot know."""
    redis = local(bed_redis)
    redis.delete("written-blind")
    with open_connection(bed, bed_redis, "SET written-blind 1") as send:
        bed.partition("worker-1", "in")
        assert send() == "no answer"
        assert redis.get("written-blind") == "1"


@needs_bed
def test_half_open_silences_open_connections_while_new_ones_connect(bed: TestBed, bed_redis: RedisServer) -> None:
    with open_connection(bed, bed_redis, "PING") as send:
        assert bed.half_open("worker-1") >= 1
        assert send() == "no answer"  # no RST either: it just waits
        assert on_host(bed, bed_redis, "PING").stdout.strip() == "PONG"  # a new connection


DRIVER = (
    "import subprocess,sys\n"
    "from testbed.hosts import TestBed\n"
    "from testbed.redis_server import RedisServer\n"
    "bed=TestBed(['api-1','worker-1']).start()\n"
    "sleeper=subprocess.Popen([*bed.hosts['worker-1'].exec_prefix,'sleep','600'])\n"
    "redis=RedisServer().start()\n"
    "print(bed.run_id, bed._watchdog.pid, sleeper.pid, redis.process.pid, flush=True)\n"
    "sys.stdin.readline()\n"
    "bed.stop()\n"
    "redis.stop()\n"
)


def start_driver() -> tuple[subprocess.Popen[str], str, int, int, int]:
    """A run's driver in its own process (one bed per process): it builds a bed, starts a
    process on a host and a Redis, and stops them all once told to."""
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], cwd=str(ROOT), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    run_id, *pids = driver.stdout.readline().split()
    watchdog, sleeper, redis_pid = (int(p) for p in pids)
    found = nothing_left(run_id)
    assert len(found["namespaces"]) == 2 and sleeper in found["processes"] and found["links"] and found["tables"]
    assert _state(redis_pid) != "Z"
    return driver, run_id, watchdog, sleeper, redis_pid


@needs_bed
def test_a_stopped_bed_leaves_nothing_behind() -> None:
    driver, run_id, watchdog, sleeper, redis_pid = start_driver()
    driver.stdin.write("stop\n")
    driver.stdin.flush()
    assert driver.wait(60) == 0
    assert nothing_left(run_id) == {}
    assert _state(sleeper) == "Z" and _state(watchdog) == "Z"


@needs_bed
def test_a_killed_driver_leaves_nothing_behind() -> None:
    """kill -9 of a run's driver: its watchdog reaps the bed (namespaces, links, rules, the
    processes on its hosts, the fault proxy), and its Redis dies with it."""
    driver, run_id, watchdog, sleeper, redis_pid = start_driver()
    driver.kill()
    driver.wait()
    # The watchdog reaps the bed, then exits: wait for that exit.
    eventually_sync(lambda: _state(watchdog) == "Z", "the watchdog's exit")
    assert nothing_left(run_id) == {}
    assert _state(sleeper) == "Z" and _state(redis_pid) == "Z"


def _state(pid: int) -> str:
    """A process's state letter; "Z" for a zombie or a process that is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][:1]
    except (OSError, IndexError):
        return "Z"


def test_where_the_bed_cannot_run_it_says_why_and_exits_77(tmp_path: Path) -> None:
    """As a user without root (where `setpriv` can make one), `check` refuses plainly."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        result = subprocess.run([sys.executable, "-m", "testbed.hosts", "check"], cwd=str(ROOT),
                                capture_output=True, text=True, timeout=60)
    else:
        result = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-m", "testbed.hosts", "check"],
            cwd=str(ROOT), capture_output=True, text=True, timeout=60, env={**os.environ, "HOME": str(tmp_path)},
        )
    if REASON is None and os.geteuid() != 0:
        pytest.fail("the bed runs without root?")
    assert result.returncode == UNAVAILABLE_EXIT, result.stdout + result.stderr
    assert result.stdout.strip()
