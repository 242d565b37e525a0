"""Redis for the chaos run: one throwaway redis-server, or a Redis Cluster whose node
timeout is short (so a killed master's replica is promoted within seconds), both with the
DEBUG command enabled for local connections (`DEBUG SLEEP`).

Built on testbed/redis_server.py without changing it: `ChaosRedisCluster` only overrides how
the nodes are started and adds what the fault injector needs (which nodes are masters now,
which master has a replica, kill -9 of one node, its restart as a replica).

Every port comes from binding port 0 on 127.0.0.1; the machine's shared Redis on 6379 is
never touched.
"""

from __future__ import annotations

import subprocess
import time
from typing import Any

import redis

from testbed.redis_server import RedisCluster, RedisServer, bind_args

SHARED_REDIS_PORT = 6379
DEBUG_ARGS = ["--enable-debug-command", "local"]


def _guard(port: int) -> int:
    if port == SHARED_REDIS_PORT:
        raise RuntimeError("refusing to use the machine's shared Redis port 6379")
    return port


def client(port: int, **options: Any) -> redis.Redis:
    """A plain synchronous client of one of our own nodes (never 6379)."""
    options.setdefault("socket_timeout", 5)
    options.setdefault("socket_connect_timeout", 2)
    return redis.Redis(host="127.0.0.1", port=_guard(port), decode_responses=True, **options)


class ChaosRedis:
    """One redis-server on a free port that can be killed and started again, empty, on the
    same port. `address`: also listen there (a run across hosts)."""

    def __init__(self, address: str | None = None) -> None:
        self.server = RedisServer()
        self.address = address
        _guard(self.server.port)

    @property
    def url(self) -> str:
        return f"redis://{self.address}:{self.server.port}/0" if self.address else self.server.url

    @property
    def ports(self) -> list[int]:
        return [self.server.port]

    def masters(self) -> list[int]:
        return [self.server.port]

    def alive_ports(self) -> list[int]:
        return [self.server.port] if self.server.process and self.server.process.poll() is None else []

    def start(self) -> ChaosRedis:
        self.server.start(DEBUG_ARGS + bind_args(self.address))
        return self

    def kill9(self) -> None:
        process = self.server.process
        if process is not None and process.poll() is None:
            process.kill()
            process.wait(10)

    def restart_empty(self) -> None:
        """Start again on the same port with no data (no persistence is configured)."""
        self.kill9()
        self.server.start(DEBUG_ARGS + bind_args(self.address))

    def healthy(self) -> bool:
        try:
            return bool(client(self.server.port, socket_timeout=1).ping())
        except redis.RedisError:
            return False

    def stop(self) -> None:
        self.server.stop()


class ChaosRedisCluster(RedisCluster):
    """`masters` masters with `replicas` replicas each, `cluster-node-timeout` of
    `node_timeout_ms`, and replicas that may always take over (validity factor 0)."""

    def __init__(self, masters: int = 3, replicas: int = 1, node_timeout_ms: int = 2000,
                 address: str | None = None) -> None:
        super().__init__(masters=masters, replicas=replicas)
        self.node_timeout_ms = node_timeout_ms
        self.address = address
        for node in self.nodes:
            _guard(node.port)

    def node_args(self) -> list[str]:
        return [
            "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(self.node_timeout_ms),
            "--cluster-replica-validity-factor", "0",
            *DEBUG_ARGS,
            # Across hosts the nodes announce the address the hosts reach them on.
            *bind_args(self.address),
            *(["--cluster-announce-ip", self.address] if self.address else []),
        ]

    def start(self) -> ChaosRedisCluster:
        for node in self.nodes:
            node.start(self.node_args())
        addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
        subprocess.run(
            ["redis-cli", "--cluster", "create", *addresses, "--cluster-replicas", str(self.replicas), "--cluster-yes"],
            check=True, capture_output=True, timeout=60,
        )
        self.wait_healthy(30)
        return self

    @property
    def ports(self) -> list[int]:
        return [node.port for node in self.nodes]

    def alive_ports(self) -> list[int]:
        return [n.port for n in self.nodes if n.process is not None and n.process.poll() is None]

    def url_for_alive(self) -> str:
        """A cluster URL whose seed node is up now (a replacement process must bootstrap)."""
        alive = self.alive_ports()
        return f"redis+cluster://{self.address or '127.0.0.1'}:{alive[0] if alive else self.nodes[0].port}"

    def _nodes_view(self) -> list[dict[str, Any]]:
        """CLUSTER NODES as seen by the first node that answers."""
        for port in self.alive_ports():
            try:
                text = client(port, socket_timeout=1).execute_command("CLUSTER", "NODES")
            except redis.RedisError:
                continue
            rows = []
            for line in text.strip().splitlines():
                parts = line.split()
                host_port = parts[1].split("@")[0]
                rows.append({
                    "id": parts[0], "port": int(host_port.rsplit(":", 1)[1]), "flags": parts[2].split(","),
                    "master_id": parts[3], "slots": parts[8:],
                })
            return rows
        return []

    def masters(self) -> list[int]:
        """Ports of the nodes that are masters serving slots now, sorted (a deterministic
        order for the schedule's target indexes)."""
        alive = set(self.alive_ports())
        return sorted(
            row["port"] for row in self._nodes_view()
            if "master" in row["flags"] and "fail" not in row["flags"] and row["slots"] and row["port"] in alive
        )

    def replica_of(self, master_port: int) -> int | None:
        rows = self._nodes_view()
        master = next((r for r in rows if r["port"] == master_port), None)
        if master is None:
            return None
        alive = set(self.alive_ports())
        for row in rows:
            if row["master_id"] == master["id"] and "slave" in row["flags"] and row["port"] in alive \
                    and "fail" not in row["flags"] and "fail?" not in row["flags"]:
                return row["port"]
        return None

    def node(self, port: int) -> RedisServer:
        return next(n for n in self.nodes if n.port == port)

    def kill9(self, port: int) -> None:
        process = self.node(port).process
        if process is not None and process.poll() is None:
            process.kill()
            process.wait(10)

    def restart_node(self, port: int) -> None:
        """Start a killed node again on its port with its nodes.conf (no data): it rejoins
        and, once its replica took over, becomes a replica of the new master."""
        self.node(port).start(self.node_args())

    def promoted(self, old_master: int, replica: int) -> bool:
        rows = self._nodes_view()
        row = next((r for r in rows if r["port"] == replica), None)
        return row is not None and "master" in row["flags"] and bool(row["slots"])

    def healthy(self) -> bool:
        alive = self.alive_ports()
        if not alive:
            return False
        try:
            for port in alive:
                c = client(port, socket_timeout=1)
                if "cluster_state:ok" not in c.execute_command("CLUSTER", "INFO"):
                    return False
                info = c.info("replication")
                if info["role"] == "slave" and info.get("master_link_status") != "up":
                    return False
        except redis.RedisError:
            return False
        return True

    def wait_healthy(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.healthy():
                return True
            time.sleep(0.1)
        return False
