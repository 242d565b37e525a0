"""A throwaway redis-server on a free loopback port, for tests and benchmarks.

No persistence, its own folder; never the machine's shared Redis on 6379.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time

import redis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, port: int | None = None, folder: str | None = None) -> None:
        self.port = port or free_port()
        self.dir = folder or tempfile.mkdtemp(prefix="acp-redis-")
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (scripts/test installs it)")
        self.process = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.dir, "--daemonize", "no", "--loglevel", "warning"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                return self
            except redis.ConnectionError:
                if self.process.poll() is not None:
                    raise RuntimeError(f"redis-server exited: {self.process.stdout.read().decode()}") from None
                if time.monotonic() > deadline:
                    raise RuntimeError("redis-server did not answer PING") from None
                time.sleep(0.01)

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)
