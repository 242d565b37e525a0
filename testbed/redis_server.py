"""A throwaway redis-server on a free loopback port, for tests and benchmarks.

No persistence, its own folder; never the machine's shared Redis on 6379.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis


def die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the thread that started it ends (Linux)."""
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


# Ports handed out by this process, each held by an exclusive lock on a file of its own until
# this process ends: the parallel test runners and bench processes of one machine never hand
# out the same port, and a crashed process's locks go with it.
PORT_LOCKS = Path(tempfile.gettempdir()) / "acp-state-ports"
_held_ports: dict[int, int] = {}  # port -> the fd holding its lock


def _unshared_ports() -> range:
    """Ports the kernel never picks for an outgoing connection: below its ephemeral range
    (or above it, when the range starts low). A server restarted on a port from there finds it
    free; one from the ephemeral range may meanwhile be any client's local port (CI saw an API
    slot of the cluster chaos run refused its own port after a kill -9 so)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    if low - 1024 >= 4096:
        return range(max(1024, low - 12_000), low)
    return range(high + 1, 65536)


def _reserve(port: int, host: str) -> bool:
    """Lock `port` for this process if no other process of the test bed holds it and nothing
    is bound to it now."""
    if port in _held_ports:
        return False
    fd = os.open(PORT_LOCKS / str(port), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False  # another process's
    try:
        with socket.socket() as probe:
            probe.bind((host, port))
    except OSError:
        os.close(fd)  # taken by something outside the test bed
        return False
    _held_ports[port] = fd
    return True


def free_port(host: str = "127.0.0.1", ports: range | None = None) -> int:
    """A port nothing listens on or holds now, outside the kernel's ephemeral range, reserved
    for this process (never handed out twice on this machine while it lives)."""
    ports = ports or _unshared_ports()
    PORT_LOCKS.mkdir(exist_ok=True)
    start = random.randrange(len(ports))
    for step in range(len(ports)):
        port = ports[(start + step) % len(ports)]
        if _reserve(port, host):
            return port
    raise RuntimeError(f"no free port in {ports.start}-{ports.stop - 1}")


def bind_args(address: str | None) -> list[str]:
    """Listen on loopback (the fault injector's own connections) and, for a run across
    hosts, on the address the other hosts reach (testbed/hosts.py's `redis_ip`), where the
    run's own reads (owners, the final key scan) come from too: that address is on the
    bed's private bridge, so protected mode (loopback only without a password) is off."""
    return ["--bind", "127.0.0.1", address, "--protected-mode", "no"] if address else []


class RedisServer:
    def __init__(self, port: int | None = None, folder: str | None = None,
                 username: str | None = None, password: str | None = None) -> None:
        self.port = port or free_port()
        self.dir = folder or tempfile.mkdtemp(prefix="acp-redis-")
        self.process: subprocess.Popen[bytes] | None = None
        # The credentials this object's own readiness check logs in with, when the server's
        # `extra` options (an `--aclfile`, `--requirepass`) shut the default user out.
        self.username = username
        self.password = password

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, extra: list[str] | None = None) -> RedisServer:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (scripts/test installs it)")
        self.process = subprocess.Popen(
            # It dies with the process that started it, even one killed with -9 (a crashed
            # test run or chaos run leaves no Redis behind: tests/test_hosts.py).
            preexec_fn=die_with_parent,
            args=[binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.dir, "--daemonize", "no", "--loglevel", "warning",
             # Fault tests stall the server on purpose (DEBUG SLEEP), from loopback only.
             "--enable-debug-command", "local", *(extra or [])],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        client = redis.Redis(port=self.port, username=self.username, password=self.password)
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


def free_cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too, both outside the ephemeral
    range: a node restarted on them (bench.chaos) finds both free."""
    ports = _unshared_ports()
    below_bus = range(ports.start, min(ports.stop, 65536) - 10_000)
    while True:
        port = free_port(ports=below_bus)
        if _reserve(port + 10_000, "127.0.0.1"):
            return port


class RedisCluster:
    """A throwaway Redis Cluster of `masters` redis-server processes, each with `replicas`
    replicas, all slots assigned by `redis-cli --cluster create`."""

    def __init__(self, masters: int = 3, replicas: int = 0) -> None:
        self.replicas = replicas
        self.nodes = [RedisServer(port=free_cluster_port()) for _ in range(masters * (1 + replicas))]

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def start(self) -> RedisCluster:
        for node in self.nodes:
            node.start(["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                        "--cluster-node-timeout", "5000"])
        addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
        subprocess.run(
            ["redis-cli", "--cluster", "create", *addresses, "--cluster-replicas", str(self.replicas), "--cluster-yes"],
            check=True, capture_output=True, timeout=60,
        )
        deadline = time.monotonic() + 30
        for node in self.nodes:
            client = redis.Redis(port=node.port, decode_responses=True)
            while "cluster_state:ok" not in client.execute_command("CLUSTER", "INFO") or (
                client.info("replication")["role"] == "slave"
                and client.info("replication")["master_link_status"] != "up"
            ):
                if time.monotonic() > deadline:
                    raise RuntimeError("the cluster did not reach cluster_state:ok")
                time.sleep(0.05)
        return self

    def fail_over(self, key: str) -> tuple[int, int]:
        """Promote a replica of the master serving `key` (CLUSTER FAILOVER, the graceful
        kind); returns (old master port, new master port) once every node agrees."""
        old = self.owner_of(key)
        old_id = redis.Redis(port=old, decode_responses=True).execute_command("CLUSTER", "MYID")
        replica = next(
            n.port for n in self.nodes
            if redis.Redis(port=n.port, decode_responses=True).info("replication").get("master_port") == old
        )
        redis.Redis(port=replica).execute_command("CLUSTER", "FAILOVER")
        deadline = time.monotonic() + 30
        while any(self._owner_seen_by(n.port, key) != replica for n in self.nodes):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the failover of {old} ({old_id}) did not finish")
            time.sleep(0.05)
        return old, replica

    def _owner_seen_by(self, port: int, key: str) -> int | None:
        client = redis.Redis(port=port)
        slot = int(client.execute_command("CLUSTER", "KEYSLOT", key))
        for start, end, primary, *_ in client.execute_command("CLUSTER", "SLOTS"):
            if int(start) <= slot <= int(end):
                return int(primary[1])
        return None

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def owner_of(self, key: str) -> int:
        """The port of the node that serves `key`'s slot."""
        port = self._owner_seen_by(self.nodes[0].port, key)
        if port is None:
            raise LookupError(f"the slot of {key} is not served")
        return port

    def move_slot_of(self, key: str) -> tuple[int, int]:
        """Migrate the slot of `key`, with its keys, to another node (what `redis-cli
        --cluster reshard` does, for one slot); returns (from port, to port)."""
        clients = {n.port: redis.Redis(port=n.port, decode_responses=True) for n in self.nodes}
        slot = int(clients[self.nodes[0].port].execute_command("CLUSTER", "KEYSLOT", key))
        node_ids = {port: client.execute_command("CLUSTER", "MYID") for port, client in clients.items()}
        source = self.owner_of(key)
        target = next(port for port in clients if port != source)
        clients[target].execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", node_ids[source])
        clients[source].execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", node_ids[target])
        while names := clients[source].execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100):
            clients[source].execute_command("MIGRATE", "127.0.0.1", target, "", 0, 5000, "KEYS", *names)
        for client in clients.values():
            client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", node_ids[target])
        return source, target
