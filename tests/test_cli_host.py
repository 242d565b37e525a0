"""`--host` and `--metrics-host`: names that resolve to loopback serve (granian binds IP
addresses only), bad ones are one line on stderr and exit code 2, never a traceback."""

from __future__ import annotations

import asyncio
import sys

import httpx
import pytest

from testbed.processes import ROOT
from testbed.redis_server import RedisServer, free_port
from tests.harness import Harness


async def run_cli(*argv: str) -> tuple[int, str]:
    """Run `acp-state ARGV` to its end; (exit code, stderr)."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "acp_state.cli", *argv,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE, cwd=str(ROOT),
    )
    _, stderr = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode is not None
    return process.returncode, stderr.decode()


@pytest.mark.parametrize("server", ["granian", "uvicorn"])
async def test_api_serves_on_localhost_without_a_token(harness: Harness, server: str) -> None:
    api = await harness.api("--host", "localhost", "--server", server)
    assert api.banner.startswith(f"acp-state api listening on http://127.0.0.1:{api.port} ")
    response = await api.client.get("/capabilities")  # tokenless: localhost is loopback
    assert response.status_code == 200, response.text
    assert await api.terminate() == 0


@pytest.mark.parametrize("server", ["granian", "uvicorn"])
@pytest.mark.parametrize(
    ("host", "reason"),
    [
        ("no-such-host.invalid", "does not resolve to an address"),
        ("192.0.2.1", "cannot listen on 192.0.2.1 port 0"),  # TEST-NET-1: no interface has it
    ],
)
async def test_api_refuses_a_bad_host_in_one_line(
    redis_server: RedisServer, server: str, host: str, reason: str
) -> None:
    code, stderr = await run_cli(
        "api", "--redis-url", redis_server.url, "--host", host, "--port", "0", "--server", server,
        "--token", "a-token-of-enough-length",  # so that only the address can be refused
    )
    assert code == 2, stderr
    assert stderr.count("\n") == 1 and stderr.startswith("acp-state: --host: ") and reason in stderr, stderr


async def test_api_refuses_a_taken_port_in_one_line(redis_server: RedisServer) -> None:
    code, stderr = await run_cli(
        "api", "--redis-url", redis_server.url, "--host", "localhost", "--port", str(redis_server.port)
    )
    assert code == 2, stderr
    port = redis_server.port
    # It names who holds the port: the test's own redis-server.
    assert stderr == (f"acp-state: --host: cannot listen on localhost (127.0.0.1) port {port}: Address already in use"
                      f" (held by pid {redis_server.process.pid} (redis-server))\n")


async def test_worker_metrics_on_localhost(harness: Harness) -> None:
    port = free_port()
    await harness.worker("--metrics-host", "localhost", "--metrics-port", str(port))
    async with httpx.AsyncClient(timeout=10) as client:
        # The ready line comes before the metrics listener binds: retry a refused connection.
        for _ in range(500):
            try:
                response = await client.get(f"http://127.0.0.1:{port}/metrics")
                break
            except httpx.ConnectError:
                await asyncio.sleep(0.01)
        else:
            raise AssertionError("the worker's metrics listener did not start")
    assert response.status_code == 200 and "acp_state_sessions" in response.text


async def test_worker_refuses_a_bad_metrics_host_in_one_line(redis_server: RedisServer) -> None:
    code, stderr = await run_cli(
        "worker", "--redis-url", redis_server.url, "--metrics-host", "no-such-host.invalid", "--metrics-port", "0"
    )
    assert code == 2, stderr
    assert stderr.count("\n") == 1 and stderr.startswith("acp-state: --metrics-host: "), stderr

