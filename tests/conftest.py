"""Shared fixtures: a real redis-server on a free port, real worker and API processes.

Nothing here touches the machine's shared Redis on 6379.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
from pathlib import Path
from typing import AsyncIterator, Iterator

import pytest
import redis.asyncio as aioredis

from tests.harness import Harness

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A throwaway redis-server: no persistence, its own port and folder."""

    def __init__(self) -> None:
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="acp-redis-")
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not installed (.ci/run installs it)")
        self.process = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.dir, "--daemonize", "no", "--loglevel", "warning"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        import redis

        client = redis.Redis(port=self.port)
        for _ in range(500):
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if self.process.poll() is not None:
                    pytest.fail(f"redis-server exited: {self.process.stdout.read().decode()}")
                import time

                time.sleep(0.01)
        pytest.fail("redis-server did not answer PING")

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture
async def redis_client(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
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
