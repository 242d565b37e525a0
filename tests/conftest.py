"""Shared fixtures: a real redis-server on a free port, real worker and API processes.

Nothing here touches the machine's shared Redis on 6379.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import AsyncIterator, Iterator

import pytest
import redis.asyncio as aioredis

from acp_state.store.connection import connect

from testbed import forkserver
from testbed.qwen import find_qwen
from testbed.redis_server import RedisServer, free_port
from tests.harness import Harness

__all__ = ["RedisServer", "free_port"]

# The suite forks its workers and APIs from a pre-imported Python (testbed/forkserver.py), as
# do the benches it runs (they inherit this): a fresh interpreter's imports were a fifth of
# the suite's CPU. ACP_STATE_FORK_SERVER=0 exec's every process instead.
os.environ.setdefault(forkserver.ENABLED_BY, "1")

# The suite runs its tests in parallel (pytest-xdist, `-n` in scripts/test), longest first so
# the parallel runners end together: these modules, by their share of a run's time (seen
# with `--durations=0`), start before the rest, which keep their order. Only the order
# matters, never a figure.
LONGEST_FIRST = (
    "test_chaos", "test_agent_matrix", "test_cluster", "test_web_shell", "test_web_shell_moves",
    "test_web_shell_feeds", "test_rolling_deploy", "test_fuzz",
    "test_qwen_agent", "test_partitions", "test_fencing", "test_resume", "test_faults", "test_reference_diff",
    "test_reaper", "test_push",
)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Longest first; and the tests that share a fixture which outlives a test (a cluster, a
    test bed, a browser), defined by their module or a helper module, run on one runner, in
    one group (`--dist loadgroup`), so that it starts once."""
    rank = {name: n for n, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.module.__name__.rpartition(".")[2], len(rank)))
    for item in items:
        # The chaos runs each load both cores: one after another, never side by side.
        group = "chaos" if item.module.__name__.endswith("test_chaos") else _home_of_a_shared_fixture(item)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))


def _home_of_a_shared_fixture(item: pytest.Item) -> str | None:
    """The test module or helper defining a module- or session-scoped fixture the test uses
    (not this file, whose session fixtures every runner has its own of, nor pytest)."""
    definitions = getattr(item, "_fixtureinfo", None)
    homes = sorted(
        fixture.func.__module__
        for fixtures in (definitions.name2fixturedefs.values() if definitions else ())
        for fixture in fixtures
        if fixture.scope in ("module", "session")
        and fixture.func.__module__.startswith("tests.") and fixture.func.__module__ != __name__
    )
    return homes[0] if homes else None


@pytest.fixture(scope="session", autouse=True)
def scripted_agent_state(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The scripted agent keeps each session's history (for `session/load`) here, never
    under the real HOME; every worker the tests start shares it, as workers of one host do."""
    path = str(tmp_path_factory.mktemp("scripted-agent-state"))
    before = os.environ.get("ACP_SCRIPTED_STATE_DIR")
    os.environ["ACP_SCRIPTED_STATE_DIR"] = path
    yield path
    if before is None:
        os.environ.pop("ACP_SCRIPTED_STATE_DIR", None)
    else:
        os.environ["ACP_SCRIPTED_STATE_DIR"] = before


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A Redis of the test's own: for faults that take it down, and for exact command counts
    that other tests' leftovers (a dead worker being swept) must not touch."""
    server = RedisServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture
async def own_harness(own_redis: RedisServer, workspace: str) -> AsyncIterator[Harness]:
    """Processes on a Redis of the test's own (its faults, or a killed worker's lease, must
    not reach other tests), stopped (SIGTERM) after the test."""
    h = Harness(own_redis.url, workspace, free_port)
    try:
        yield h
    finally:
        await h.stop_all()


@pytest.fixture
async def own_client(own_redis: RedisServer) -> AsyncIterator[aioredis.Redis]:
    """A plain client of the test's own Redis, for faults and for looking at keys."""
    client = aioredis.Redis.from_url(own_redis.url, decode_responses=True)
    yield client
    await client.aclose()


@pytest.fixture
async def redis_client(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = connect(redis_server.url)
    yield client
    await client.aclose()


@pytest.fixture
def workspace(tmp_path: Path) -> str:
    path = tmp_path / "ws"
    path.mkdir()
    return str(path)


@pytest.fixture
async def harness(redis_server: RedisServer, workspace: str) -> AsyncIterator[Harness]:
    """Processes started through this harness are stopped (SIGTERM) after the test."""
    h = Harness(redis_server.url, workspace, free_port)
    try:
        yield h
    finally:
        await h.stop_all()


@pytest.fixture
def qwen() -> str:
    """The pinned `qwen` (Qwen Code 0.24.4: the agent `qwen --acp` and the reference daemon
    `qwen serve`); the tests that need it skip, saying why, where it or Node.js is missing."""
    path = find_qwen()
    if path is None:
        pytest.skip("qwen is not installed: scripts/test installs @qwen-code/qwen-code@0.24.4 into tests/node")
    if shutil.which("node") is None:
        pytest.skip("node is not on PATH: qwen needs Node.js")
    return path
