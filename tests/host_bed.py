"""The host test bed's fixtures (testbed/hosts.py): a bed of network namespaces for a test
module, a Redis of the test's own on the bed's Redis address, and a harness whose processes
reach it across the bed, every cut healed afterwards. Skipped, saying why, where namespaces
or nftables are not available (not root, no `ip netns`)."""

from __future__ import annotations

from typing import AsyncIterator, Iterator

import pytest

from testbed.hosts import HostsUnavailable, TestBed
from testbed.redis_server import RedisServer, bind_args, free_port
from tests.harness import Harness


@pytest.fixture(scope="module")
def bed() -> Iterator[TestBed]:
    try:
        test_bed = TestBed(["api-1", "worker-1"]).start()
    except HostsUnavailable as error:
        pytest.skip(f"no host test bed here: {error}")
    try:
        yield test_bed
    finally:
        test_bed.stop()


@pytest.fixture
def bed_redis(bed: TestBed) -> Iterator[RedisServer]:
    """A Redis of the test's own on the bed's Redis address (and loopback)."""
    server = RedisServer().start(bind_args(bed.redis_ip))
    yield server
    server.stop()


@pytest.fixture
async def across(bed: TestBed, bed_redis: RedisServer, workspace: str) -> AsyncIterator[Harness]:
    """A harness whose processes reach Redis across the bed; every cut healed afterwards."""
    harness = Harness(f"redis://{bed.redis_ip}:{bed_redis.port}/0", workspace, free_port)
    try:
        yield harness
    finally:
        for name in bed.hosts:
            bed.heal(name)
            bed.link_up(name)
        bed.proxy().clear_all()
        await harness.stop_all()
