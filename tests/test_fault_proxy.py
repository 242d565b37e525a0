"""testbed/fault_proxy.py as the chaos run uses it: a real proxy process (`--upstream` mode)
in front of a real redis-server of this module's own, driven over its control socket.

Transparent mode (nftables redirect in a network namespace) is tested elsewhere.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from testbed.fault_proxy import FaultProxyControl, FaultProxyError
from testbed.redis_server import RedisServer, free_port

ROOT = Path(__file__).resolve().parent.parent


class ProxyProcess:
    """`python -m testbed.fault_proxy` as a subprocess, started and ready (its ready line read)."""

    def __init__(self, upstream_port: int, control: str) -> None:
        self.port = free_port()
        self.control_path = control
        self.process = subprocess.Popen(
            [sys.executable, "-m", "testbed.fault_proxy", "--listen", f"127.0.0.1:{self.port}",
             "--upstream", f"127.0.0.1:{upstream_port}", "--control", control, "--seed", "7"],
            cwd=ROOT, stdout=subprocess.PIPE, text=True,
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline()  # EOF ("") if it died first
        assert line.strip() == f"fault-proxy listening on 127.0.0.1:{self.port}", line
        self.control = FaultProxyControl(control)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)


@pytest.fixture(scope="module")
def upstream() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def proxy(upstream: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProcess]:
    p = ProxyProcess(upstream.port, str(tmp_path_factory.mktemp("fault-proxy") / "control.sock"))
    yield p
    p.stop()


@pytest.fixture(autouse=True)
def no_faults(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test starts, and leaves the shared proxy, with no fault set."""
    if "proxy" not in request.fixturenames:
        yield
        return
    p: ProxyProcess = request.getfixturevalue("proxy")
    p.control.clear_all()
    yield
    p.control.clear_all()


def client(p: ProxyProcess, **options: object) -> redis.Redis:
    # No retries: a command that times out says so at once (redis-py 8 retries 3 times).
    return redis.Redis(host="127.0.0.1", port=p.port, decode_responses=True,
                       retry=Retry(NoBackoff(), 0), **options)


def raw(p: ProxyProcess) -> socket.socket:
    """A plain socket through the proxy: one connection that a timeout does not close."""
    sock = socket.create_connection(("127.0.0.1", p.port), timeout=5)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def read_replies(sock: socket.socket, count: int) -> list[bytes]:
    """`count` RESP simple replies (one line each: +OK, :12, -ERR) from `sock`."""
    data = b""
    while data.count(b"\r\n") < count:
        more = sock.recv(65536)
        assert more, f"connection closed after {data!r}"
        data += more
    return data.split(b"\r\n")[:count]


def timed_ping(r: redis.Redis) -> float:
    start = time.perf_counter()
    assert r.ping()
    return time.perf_counter() - start


def test_ping_passes_through(proxy: ProxyProcess, upstream: RedisServer) -> None:
    r = client(proxy)
    assert r.ping()
    r.set("fp:key", "value")
    assert redis.Redis(port=upstream.port, decode_responses=True).get("fp:key") == "value"
    stats = proxy.control.stats()
    assert stats["connections_open"] >= 1 and stats["connections_total"] >= 1
    assert stats["bytes"]["client_to_upstream"] > 0 and stats["bytes"]["upstream_to_client"] > 0
    r.close()


def test_latency_delays_each_direction(proxy: ProxyProcess) -> None:
    r = client(proxy)
    r.ping()  # connected (and its handshake done) before the latency, which applies at once
    proxy.control.set(latency_ms=150)
    assert timed_ping(r) >= 0.29  # 150 ms to Redis and 150 ms back
    proxy.control.set(latency_ms=0)
    r.close()


def incr_apart(sock: socket.socket, key: str, count: int) -> list[bytes]:
    """`count` INCRs of `key`, one write each, a little apart, so the proxy reads many
    chunks, each with its own draw of jitter or loss; their replies, in arrival order."""
    for i in range(count):
        sock.sendall(f"INCR {key}\r\n".encode())
        if i % 10 == 0:
            time.sleep(0.002)  # (spacing the writes, not waiting for anything)
    return read_replies(sock, count)


def test_jitter_keeps_order(proxy: ProxyProcess) -> None:
    proxy.control.set(jitter_ms=20)
    key = f"fp:counter:{time.time_ns()}"
    sock = raw(proxy)
    assert incr_apart(sock, key, 200) == [f":{n}".encode() for n in range(1, 201)]
    sock.close()
    # And as a redis-py pipeline.
    pipe = client(proxy).pipeline(transaction=False)
    for _ in range(200):
        pipe.incr(key + ":pipeline")
    assert pipe.execute() == list(range(1, 201))


def test_blackhole_holds_then_heals(proxy: ProxyProcess, upstream: RedisServer) -> None:
    key = f"fp:held:{time.time_ns()}"
    direct = redis.Redis(port=upstream.port, decode_responses=True)
    r = client(proxy, socket_timeout=0.4)
    r.ping()
    sock = raw(proxy)
    sock.sendall(b"PING\r\n")
    assert read_replies(sock, 1) == [b"+PONG"]

    proxy.control.set(blackhole=True)
    with pytest.raises(redis.TimeoutError):
        r.ping()
    sock.settimeout(0.4)
    sock.sendall(f"SET {key} 1\r\n".encode())
    with pytest.raises(TimeoutError):
        sock.recv(100)
    assert direct.get(key) is None  # held on the way to Redis too, not only on the way back

    proxy.control.clear()
    sock.settimeout(5)
    assert read_replies(sock, 1) == [b"+OK"]  # the same connection: the held command went on
    assert direct.get(key) == "1"
    sock.close()
    r.close()


def test_loss_delivers_everything_in_order(proxy: ProxyProcess) -> None:
    r = client(proxy)
    r.ping()
    proxy.control.set(loss=1.0)
    assert timed_ping(r) >= 0.39  # each way, a retransmission timeout of 200-400 ms
    proxy.control.set(loss=0.3)
    key = f"fp:lossy:{time.time_ns()}"
    sock = raw(proxy)
    assert incr_apart(sock, key, 100) == [f":{n}".encode() for n in range(1, 101)]
    sock.close()
    r.close()


def test_faults_are_per_source(proxy: ProxyProcess) -> None:
    r = client(proxy, socket_timeout=2)
    r.ping()
    proxy.control.set(source="10.9.8.7", blackhole=True, latency_ms=1000)
    assert r.ping()  # this client is 127.0.0.1: the other source's black hole is not its own
    stats = proxy.control.stats()
    assert stats["rules"]["10.9.8.7"]["blackhole"] is True
    assert stats["default"]["blackhole"] is False

    proxy.control.set(source="127.0.0.1", blackhole=True)
    r2 = client(proxy, socket_timeout=0.3)
    with pytest.raises((redis.TimeoutError, redis.ConnectionError)):
        r2.ping()
    proxy.control.clear(source="127.0.0.1")
    assert r.ping()
    r.close()
    r2.close()


def test_bad_control_input_answers_ok_false(proxy: ProxyProcess) -> None:
    bad = [
        b"not json",
        b"[1, 2]",
        b'{"op": "explode"}',
        b'{"no_op": 1}',
        b'{"op": "set", "loss": 2}',
        b'{"op": "set", "latency_ms": -1}',
        b'{"op": "set", "latency_ms": "slow"}',
        b'{"op": "set", "blackhole": 1}',
        b'{"op": "set", "speed": 3}',
        b'{"op": "set", "source": "not-an-ip", "latency_ms": 1}',
        b'{"op": "clear", "source": 12}',
        b"\xff\xfe",
    ]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(proxy.control_path)
        reader = sock.makefile("rb")
        for line in bad:
            sock.sendall(line + b"\n")
            reply = orjson.loads(reader.readline())
            assert reply["ok"] is False and reply["error"], (line, reply)
        sock.sendall(b'{"op": "stats"}\n')  # the same control connection still answers
        assert orjson.loads(reader.readline())["ok"] is True
    with pytest.raises(FaultProxyError, match="loss"):
        proxy.control.set(loss=1.5)
    assert proxy.control.stats()["default"]["loss"] == 0  # nothing half-applied
    assert client(proxy).ping()  # and the proxy still serves


def test_sigterm_exits_cleanly(upstream: RedisServer, tmp_path: Path) -> None:
    p = ProxyProcess(upstream.port, str(tmp_path / "control.sock"))
    try:
        sock = raw(p)
        sock.sendall(b"PING\r\n")
        assert read_replies(sock, 1) == [b"+PONG"]
        p.control.set(blackhole=True)  # a held connection must not keep it from exiting
        p.process.send_signal(signal.SIGTERM)
        assert p.process.wait(5) == 0
        assert not os.path.exists(p.control_path)
        sock.settimeout(5)
        assert sock.recv(100) == b""  # its connections were closed
        sock.close()
    finally:
        p.stop()
