"""Redis ACL roles (issue 37 item 7): deploy/redis/users.acl on a real redis-server and a
cluster, every process under its own user through the whole flow (create, prompt, a vote, a
drain, a sweep, a resume, the reads, a close); the dashboard user reads every key and follows
the change channels but may not write or run scripts; a process whose user lacks a
permission stops at start, naming it."""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import AsyncIterator, Iterator

import pytest
import redis
import redis.asyncio as aioredis
from redis.exceptions import NoPermissionError

from acp_state.ids import workspace_id
from acp_state.store import acl, keys, scripts
from acp_state.store.acl import API, WORKER, script_commands, users_acl
from testbed.processes import ROOT, ApiProcess, WorkerProcess
from testbed.redis_server import RedisServer, free_cluster_port, free_port
from tests.harness import Harness, SseClient
from tests.helpers import create, eventually, is_type, prompt

SHIPPED = ROOT / "deploy" / "redis" / "users.acl"
USERS = ("admin", "worker", "api", "dashboard")


def test_the_shipped_file_is_the_roles_of_the_code() -> None:
    """The file an operator deploys lists exactly what each role's code and scripts run."""
    assert SHIPPED.read_text() == users_acl()
    # Every script a side of the store runs is in its role (a script added later, or one a
    # merge brought, would otherwise fail only under ACL users, at its first call).
    store = Path(acl.__file__).parent
    runs = {path.stem.removesuffix("_side"): set(re.findall(r"scripts\.([A-Z_]+)", path.read_text()))
            for path in store.glob("*_side.py")}
    assert runs["worker"] | runs["sweeper"] <= set(acl.WORKER_SCRIPTS)
    assert set().union(*(ran for side, ran in runs.items() if side != "worker")) <= set(acl.API_SCRIPTS)
    for name in ("APPLY", "HEARTBEAT", "SWEEP", "CLAIM_DEAD"):
        assert script_commands(getattr(scripts, name)) <= WORKER.commands, name
    for name in ("SEND", "VOTE", "LIST", "SWEEP"):
        assert script_commands(getattr(scripts, name)) <= API.commands, name
    assert "SPUBLISH" in WORKER.commands and "SSUBSCRIBE" not in WORKER.commands
    assert "XREAD" not in API.commands and "SSUBSCRIBE" in API.commands


def acl_file(folder: str, passwords: dict[str, str]) -> str:
    """The shipped file with its placeholders replaced by `passwords`, in `folder`."""
    text = SHIPPED.read_text()
    for user, password in passwords.items():
        text = text.replace(f">CHANGE-ME-{user}", f">{password}")
    path = Path(folder) / "users.acl"
    path.write_text(text)
    return str(path)


class AclRedis(RedisServer):
    """A redis-server that loads the shipped file, its placeholders replaced by passwords."""

    def __init__(self) -> None:
        self.passwords = {user: secrets.token_hex(16) for user in USERS}
        super().__init__(username="admin", password=self.passwords["admin"])

    def start(self, extra: list[str] | None = None) -> AclRedis:
        super().start(["--aclfile", acl_file(self.dir, self.passwords), *(extra or [])])
        return self

    def url_of(self, user: str, password: str = "") -> str:
        """`user`'s URL; without `password` the process takes it from the environment."""
        return f"redis://{user}{':' + password if password else ''}@127.0.0.1:{self.port}/0"

    def client(self, user: str) -> aioredis.Redis:
        return aioredis.Redis(port=self.port, username=user, password=self.passwords[user], decode_responses=True)

    async def node_client(self, user: str, key: str) -> aioredis.Redis:
        """A plain client of the node serving `key` (sharded pub/sub stays on that node)."""
        return self.client(user)

    def admin_clients(self) -> list[aioredis.Redis]:
        return [self.client("admin")]


class AclCluster:
    """A 3-master Redis Cluster whose every node loads the shipped file (set up by the admin)."""

    def __init__(self) -> None:
        self.passwords = {user: secrets.token_hex(16) for user in USERS}
        self.nodes = [RedisServer(port=free_cluster_port(), username="admin", password=self.passwords["admin"])
                      for _ in range(3)]

    def start(self) -> AclCluster:
        for node in self.nodes:
            node.start(["--aclfile", acl_file(node.dir, self.passwords), "--cluster-enabled", "yes",
                        "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "5000"])
        subprocess.run(
            ["redis-cli", "--user", "admin", "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
             "--cluster-replicas", "0", "--cluster-yes"],
            env={**os.environ, "REDISCLI_AUTH": self.passwords["admin"]}, check=True, capture_output=True, timeout=60,
        )
        deadline = time.monotonic() + 30
        for node in self.nodes:
            client = redis.Redis(port=node.port, username="admin", password=self.passwords["admin"], decode_responses=True)
            while "cluster_state:ok" not in client.execute_command("CLUSTER", "INFO"):
                assert time.monotonic() < deadline, "the cluster did not reach cluster_state:ok"
                time.sleep(0.05)
            client.close()
        return self

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def url_of(self, user: str, password: str = "") -> str:
        return f"redis+cluster://{user}{':' + password if password else ''}@127.0.0.1:{self.nodes[0].port}"

    def client(self, user: str) -> aioredis.RedisCluster:
        return aioredis.RedisCluster(host="127.0.0.1", port=self.nodes[0].port, username=user,
                                     password=self.passwords[user], decode_responses=True)

    async def node_client(self, user: str, key: str) -> aioredis.Redis:
        cluster = self.client("admin")
        try:
            await cluster.initialize()
            port = cluster.get_node_from_key(key).port
        finally:
            await cluster.aclose()
        return aioredis.Redis(port=port, username=user, password=self.passwords[user], decode_responses=True)

    def admin_clients(self) -> list[aioredis.Redis]:
        return [aioredis.Redis(port=n.port, username="admin", password=self.passwords["admin"], decode_responses=True)
                for n in self.nodes]


Deployment = AclRedis | AclCluster


@pytest.fixture
def acl_redis() -> Iterator[AclRedis]:
    server = AclRedis().start()
    yield server
    server.stop()


@pytest.fixture(params=["redis", "cluster"])
def deployment(request: pytest.FixtureRequest) -> Iterator[Deployment]:
    server = AclRedis().start() if request.param == "redis" else AclCluster().start()
    yield server
    server.stop()


@pytest.fixture
async def admin_harness(deployment: Deployment, workspace: str) -> AsyncIterator[Harness]:
    """A harness whose own watcher reads as the admin; the processes get their own users."""
    h = Harness(deployment.url_of("admin", deployment.passwords["admin"]), workspace, free_port)
    try:
        yield h
    finally:
        await h.stop_all()


async def start_worker(h: Harness, server: Deployment, *args: str, user: str = "worker") -> WorkerProcess:
    process = WorkerProcess(["worker", "--redis-url", server.url_of(user), "--lease-ms", "3000", *args],
                            h.logs / f"worker-{len(h.processes)}.log",
                            env={"ACP_STATE_REDIS_PASSWORD": server.passwords[user]})
    await process.start()
    h.processes.append(process)
    return process


async def start_api(h: Harness, server: Deployment) -> ApiProcess:
    port = free_port()
    process = ApiProcess(["api", "--redis-url", server.url_of("api"), "--port", str(port), "--workspace", h.workspace],
                         h.logs / f"api-{len(h.processes)}.log", port)
    process.env = {"ACP_STATE_REDIS_PASSWORD": server.passwords["api"]}
    await process.start()
    h.processes.append(process)
    return process


async def run_cli(server: Deployment, user: str, *argv: str) -> tuple[int, str]:
    """`acp-state ARGV` as `user`, to its end: (exit code, stdout and stderr)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACP_STATE_")}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "acp_state.cli", *argv, "--redis-url", server.url_of(user), cwd=str(ROOT),
        env={**env, "PYTHONPATH": str(ROOT), "ACP_STATE_REDIS_PASSWORD": server.passwords[user]},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, out.decode()


async def read_as(client: aioredis.Redis, key: str, key_type: str) -> object:
    reads = {
        "string": lambda: client.get(key), "hash": lambda: client.hgetall(key), "set": lambda: client.smembers(key),
        "zset": lambda: client.zrange(key, 0, -1, withscores=True), "list": lambda: client.lrange(key, 0, -1),
        "stream": lambda: client.xrange(key),
    }
    return await reads[key_type]()


async def dashboard_reads_everything_and_writes_nothing(server: Deployment, ws: str, sid: str) -> None:
    admin, dashboard = server.client("admin"), server.client("dashboard")
    try:
        # Every key of the deployment, of every type the key schema has, reads the same.
        found = [key async for key in admin.scan_iter(match="acp:*")]
        kinds = {}
        for key in found:
            key_type = await admin.type(key)
            assert await dashboard.type(key) == key_type
            if key_type in ("hash", "set", "zset", "list", "stream", "string"):
                kinds.setdefault(key_type, []).append(key)
                # The workers keep writing (a lease renewal moves the registry's deadlines between
                # two reads): the dashboard must read what the admin read just before it, in one
                # of a few tries. A read the ACL refused would raise, not differ.
                for _ in range(5):
                    before = await read_as(admin, key, key_type)
                    if await read_as(dashboard, key, key_type) == before or key_type == "stream":
                        break
                else:
                    pytest.fail(f"the dashboard never read {key} as the admin did")
        assert {"hash", "set", "zset", "stream", "string"} <= kinds.keys(), kinds.keys()
        # What docs/internals.md ("Scripts") tells a dashboard to read: the session hash, its owner's
        # lease in the registry, against Redis's TIME.
        session = await dashboard.hgetall(keys.session(ws, sid))
        deadline = await dashboard.zscore(keys.WORKERS, session["inc"])
        seconds, micros = await dashboard.time()
        assert deadline > seconds * 1000 + micros // 1000
        for key in (keys.live(ws), keys.catalog(ws), keys.catalog_order(ws), keys.catalog_version(ws),
                    keys.change_log(ws), keys.attention(ws), keys.REPORTS, keys.LEASES, keys.AGENTS):
            assert await dashboard.exists(key), key
        # No write, no script, on any acp key.
        refused = [
            dashboard.hset(keys.session(ws, sid), "inc", "forged"),
            dashboard.delete(keys.live(ws)),
            dashboard.zadd(keys.WORKERS, {"forged": 1}),
            dashboard.xadd(keys.events(ws, sid), {"e": "{}"}),
            dashboard.execute_command("SPUBLISH", keys.invalidations(ws), "forged"),
            dashboard.eval("return 1", 0),
            dashboard.execute_command("EVALSHA", scripts_sha("APPLY"), 1, keys.session(ws, sid)),
            dashboard.script_load("return 1"),
            dashboard.execute_command("FUNCTION", "LIST"),
            dashboard.flushall(),
        ]
        for call in refused:
            with pytest.raises(NoPermissionError):
                await call
        assert await dashboard.hget(keys.session(ws, sid), "inc") == session["inc"]
    finally:
        await admin.aclose()
        await dashboard.aclose()


def scripts_sha(name: str) -> str:
    import hashlib

    return hashlib.sha1(getattr(scripts, name).encode()).hexdigest()


async def test_every_process_under_its_own_user_through_the_whole_flow(
    admin_harness: Harness, deployment: Deployment, workspace: str
) -> None:
    h, acl_redis = admin_harness, deployment
    ws = workspace_id(workspace)
    first = await start_worker(h, acl_redis, "--drain-grace-s", "20")
    api = await start_api(h, acl_redis)
    sid = (await create(api, workspace))["sessionId"]
    stream = await SseClient(api, sid).start()
    await stream.wait_for(lambda f: f["event"] == "session_snapshot")

    # The dashboard follows the workspace's change channel and the session's events.
    dashboard = await acl_redis.node_client("dashboard", keys.invalidations(ws))
    following = dashboard.pubsub()
    await following.ssubscribe(keys.invalidations(ws), keys.events(ws, sid))
    heard: set[str] = set()

    async def listen() -> None:
        async for message in following.listen():
            if message["type"] == "smessage":
                heard.add(message["channel"])

    listening = asyncio.ensure_future(listen())
    try:
        # A prompt that asks for a permission, and the vote.
        asking = await prompt(api, sid, "#permission")
        asked = await stream.wait_for(lambda f: f["event"] == "permission_request")
        await dashboard_reads_everything_and_writes_nothing(acl_redis, ws, sid)
        vote = {"outcome": {"outcome": "selected", "optionId": "proceed_once"}}
        rid = asked["data"]["data"]["requestId"]
        assert (await api.client.post(f"/session/{sid}/permission/{rid}", json=vote)).status_code == 200
        await stream.wait_for(is_type("turn_complete", promptId=asking["promptId"]))
        await eventually(lambda: heard >= {keys.invalidations(ws), keys.events(ws, sid)},
                         "the dashboard heard the change channel and the event channel")
    finally:
        listening.cancel()
        await following.aclose()
        await dashboard.aclose()

    # `acp-state status` runs as the dashboard; a worker as the dashboard stops at start.
    code, out = await run_cli(acl_redis, "dashboard", "status", "--once")
    assert code == 0 and first.incarnation in out, out
    code, out = await run_cli(acl_redis, "dashboard", "worker")
    assert code == 1 and "Traceback" not in out, out
    assert out.strip().splitlines()[-1].startswith(
        f"acp-state: {acl_redis.url_of('dashboard', '***')}: the Redis user 'dashboard' may not run what acp-state "
        "worker needs: DEL, EVALSHA, "
    ), out

    # A drain: SIGTERM to the session's worker with another alive; the session moves.
    second = await start_worker(h, acl_redis)
    assert await first.terminate() == 0
    await stream.wait_for(is_type("session_moved"))
    after = await prompt(api, sid, "after the move")
    await stream.wait_for(is_type("turn_complete", promptId=after["promptId"]))

    # A sweep: kill -9 of its new worker; the API (its sweeper, as the api user) ends it.
    await second.kill9()
    await stream.wait_for(lambda f: f["event"] == "session_died", timeout=60)
    await eventually(lambda: _gone(api, sid), "the API answering 404 for the dead worker's session")
    await stream.close()

    # A resume on a new worker; the API's other routes; a keyed prompt, a cancel, a close.
    await start_worker(h, acl_redis)
    resumed = await api.client.post(f"/session/{sid}/load", json={})
    assert resumed.status_code == 200 and resumed.json()["attached"] is False, resumed.text
    slow = {"prompt": [{"type": "text", "text": "#slow 30"}]}
    keyed = [await api.client.post(f"/session/{sid}/prompt", json=slow, headers={"Idempotency-Key": "acl-1"})
             for _ in range(2)]
    assert [r.status_code for r in keyed] == [202, 202] and keyed[0].json() == keyed[1].json()
    assert (await api.client.post(f"/session/{sid}/cancel")).status_code == 204
    for path in (f"/workspace/{ws}/sessions", f"/workspaces/{ws}/sessions/live-state", "/attention", "/workers",
                 f"/session/{sid}/transcript", f"/session/{sid}/turns/current", "/capabilities", "/health/ready"):
        assert (await api.client.get(path)).status_code == 200, path
    assert (await api.client.post("/sessions/catalog", json={"workspaces": "all"})).status_code == 200
    assert (await api.client.post("/sessions/live-state", json={"workspaces": [ws]})).status_code == 200
    assert (await api.client.delete(f"/session/{sid}")).status_code == 204
    # Nothing was refused along the way.
    for admin in acl_redis.admin_clients():
        try:
            denials = await admin.acl_log()
            assert not [d for d in denials if d.get("username") != "dashboard"], denials
        finally:
            await admin.aclose()
    for process in h.processes:
        assert "NOPERM" not in process.log_path.read_text() and "Traceback" not in process.log_path.read_text()


async def _gone(api: ApiProcess, sid: str) -> bool:
    return (await api.client.get(f"/session/{sid}/status")).status_code == 404


@pytest.mark.parametrize(
    ("user", "command", "missing"),
    [
        ("dashboard", "worker", "may not run what acp-state worker needs: DEL, EVALSHA, "),
        ("api", "worker", "may not run what acp-state worker needs: XREAD, XTRIM, LPUSH "),
        ("worker", "api", "may not run what acp-state api needs: XREVRANGE, ZREVRANGE, HSETNX, SSUBSCRIBE "),
        ("dashboard", "api", "may not run what acp-state api needs: DEL, EVALSHA, "),
    ],
)
async def test_a_process_whose_user_lacks_a_permission_stops_at_start_naming_it(
    acl_redis: AclRedis, user: str, command: str, missing: str
) -> None:
    argv = [command] + (["--port", str(free_port())] if command == "api" else [])
    code, out = await run_cli(acl_redis, user, *argv)
    lines = out.strip().splitlines()
    assert code == 1 and "Traceback" not in out, out
    assert lines[-1].startswith(f"acp-state: redis://{user}:***@127.0.0.1:{acl_redis.port}/0: the Redis user {user!r} ")
    assert missing in lines[-1] and "see deploy/redis/users.acl" in lines[-1], lines[-1]


async def test_a_wrong_password_stops_at_start_in_one_line(acl_redis: AclRedis) -> None:
    acl_redis.passwords["worker"] = "not-the-password"
    code, out = await run_cli(acl_redis, "worker", "worker")
    assert code == 1 and "Traceback" not in out, out
    assert out.strip().splitlines()[-1] == (
        f"acp-state: redis://worker:***@127.0.0.1:{acl_redis.port}/0: Redis refused the login: "
        "invalid username-password pair or user is disabled."
    )


async def test_a_full_redis_is_not_taken_for_a_missing_permission() -> None:
    """Writes queued on a Redis out of memory answer OOM, not NOPERM: the probe names nothing
    (the process then meets the full Redis as it would without a probe)."""
    from acp_state.store import MissingPermission, check_permissions

    server = AclRedis().start(["--maxmemory", "1"])
    try:
        for user in ("worker", "api"):
            await check_permissions(server.url_of(user, server.passwords[user]), user)
        with pytest.raises(MissingPermission, match="may not run what acp-state worker needs: DEL, EVALSHA, "):
            await check_permissions(server.url_of("dashboard", server.passwords["dashboard"]), "worker")
    finally:
        server.stop()
