"""Secrets stay out of `ps` (issue 37 item 6): tokens from `--token-file` or
`ACP_STATE_TOKENS`, the Redis URL and its password from `ACP_STATE_REDIS_URL` /
`ACP_STATE_REDIS_PASSWORD`; no process's command line holds them, and the agent children a
worker spawns do not inherit them in their environment."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import httpx
import pytest

from acp_state.cli import secrets
from testbed.processes import ROOT
from testbed.redis_server import RedisServer, die_with_parent, free_port
from tests.helpers import eventually

TOKEN = "file-token-0123456789abcdef"
ENV_TOKEN = "env-token-0123456789abcdef"
PASSWORD = "redis-pass-0123456789abcdef"


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (from /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def read_proc(pid: int, name: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/{name}").read_bytes()
    except OSError:
        return b""  # gone meanwhile


async def start(argv: list[str], env: dict[str, str], marker: str, log: Path) -> asyncio.subprocess.Process:
    """`acp-state ARGV`, exec'd (not forked from the fork server: its command line is the one
    `ps` shows), up to its ready line."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("ACP_STATE_")}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "acp_state.cli", *argv,
        env={**base, "PYTHONPATH": str(ROOT), **env}, cwd=str(ROOT),
        stdout=asyncio.subprocess.PIPE, stderr=open(log, "ab"), preexec_fn=die_with_parent,
    )
    assert process.stdout is not None
    while marker not in (line := (await asyncio.wait_for(process.stdout.readline(), 30)).decode()):
        assert line, f"{argv[0]} exited early: {log.read_text()[-2000:]}"
    process.ready_line = line  # type: ignore[attr-defined]
    return process


@pytest.fixture
def locked_redis():
    server = RedisServer(password=PASSWORD)
    server.start(["--requirepass", PASSWORD])
    yield server
    server.stop()


async def test_no_secret_in_any_command_line_nor_in_the_agents_environment(
    locked_redis: RedisServer, workspace: str, tmp_path: Path
) -> None:
    token_file = tmp_path / "tokens"
    token_file.write_text(f"# the API's tokens\n\n{TOKEN}\n  {TOKEN[::-1]},role=admin  \n")
    token_file.chmod(0o600)
    redis_env = {"ACP_STATE_REDIS_URL": locked_redis.url, "ACP_STATE_REDIS_PASSWORD": PASSWORD}
    port = free_port()
    worker = await start(["worker", "--drain-grace-s", "0"], redis_env, "acp-state worker ", tmp_path / "worker.log")
    api = await start(
        ["api", "--port", str(port), "--workspace", workspace, "--token-file", str(token_file)],
        {**redis_env, "ACP_STATE_TOKENS": ENV_TOKEN}, "acp-state api listening", tmp_path / "api.log",
    )
    try:
        assert PASSWORD not in worker.ready_line  # type: ignore[attr-defined]
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            assert (await client.get("/capabilities")).status_code == 401  # the file's tokens are in force
            for token in (TOKEN, TOKEN[::-1], ENV_TOKEN):
                assert (await client.get("/capabilities", headers={"Authorization": f"Bearer {token}"})).status_code == 200
            headers = {"Authorization": f"Bearer {TOKEN}"}
            made = await client.post("/session", json={"cwd": workspace}, headers=headers)
            assert made.status_code == 200, made.text  # the API and the worker reached Redis with the env's password
            sid = made.json()["sessionId"]
            body = {"prompt": [{"type": "text", "text": "hello"}]}
            assert (await client.post(f"/session/{sid}/prompt", json=body, headers=headers)).status_code == 202
        agents = await eventually(lambda: descendants(worker.pid), "the worker spawned its agent child")
        secrets_bytes = [s.encode() for s in (TOKEN, TOKEN[::-1], ENV_TOKEN, PASSWORD)]
        for pid in (worker.pid, api.pid, *agents, *descendants(api.pid)):
            cmdline = read_proc(pid, "cmdline")
            assert not [s for s in secrets_bytes if s in cmdline], (pid, cmdline)
        for pid in agents:  # what a worker's agents inherit: none of the secret variables
            environ = read_proc(pid, "environ")
            assert environ, pid
            assert not [s for s in secrets_bytes if s in environ], (pid, environ)
            assert not [v for v in secrets.SECRET_VARIABLES if f"{v}=".encode() in environ]
    finally:
        for process in (api, worker):
            process.terminate()
            await process.wait()


async def run_cli(*argv: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("ACP_STATE_")}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "acp_state.cli", *argv, env={**base, "PYTHONPATH": str(ROOT), **(env or {})},
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE, cwd=str(ROOT),
    )
    _, stderr = await asyncio.wait_for(process.communicate(), 30)
    return process.returncode or 0, stderr.decode()


async def test_a_token_file_others_may_read_is_refused(tmp_path: Path) -> None:
    token_file = tmp_path / "tokens"
    token_file.write_text(f"{TOKEN}\n")
    token_file.chmod(0o640)
    code, stderr = await run_cli("api", "--redis-url", "redis://127.0.0.1:1/0", "--token-file", str(token_file))
    assert code == 2
    assert stderr.strip().splitlines() == [
        f"acp-state: --token-file {token_file} is open to its group or others (mode 0640): chmod 600 it"
    ]
    code, stderr = await run_cli("api", "--redis-url", "redis://127.0.0.1:1/0", "--token-file", str(tmp_path / "none"))
    assert (code, stderr.strip()) == (2, f"acp-state: --token-file {tmp_path / 'none'}: No such file or directory")


async def test_every_redis_command_takes_its_url_from_the_environment() -> None:
    for argv in (["status", "--once"], ["drain", "w-1", "--no-wait"], ["worker"], ["api"]):
        code, stderr = await run_cli(*argv)
        assert (code, stderr.strip()) == (2, "acp-state: --redis-url (or $ACP_STATE_REDIS_URL) is required"), argv
    code, stderr = await run_cli("status", "--once", env={"ACP_STATE_REDIS_URL": "redis://:in-url@127.0.0.1:1/0",
                                                           "ACP_STATE_REDIS_PASSWORD": "in-env"})
    assert (code, stderr.strip()) == (
        2, "acp-state: both the Redis URL and ACP_STATE_REDIS_PASSWORD give a password: give one"
    )


def test_spec_lines_and_the_password_put_in() -> None:
    assert secrets.spec_lines("# c\n\n a,role=admin \nb,workspace=/x y\n") == ["a,role=admin", "b,workspace=/x y"]
    env = {"ACP_STATE_REDIS_PASSWORD": "p@ss:/w"}
    assert secrets.redis_url("redis://api@h:1/0", env) == "redis://api:p%40ss%3A%2Fw@h:1/0"
    assert secrets.redis_url("redis+cluster://h:1", env) == "redis+cluster://:p%40ss%3A%2Fw@h:1"
    assert secrets.redis_url(None, {"ACP_STATE_REDIS_URL": "redis://h:1/0"}) == "redis://h:1/0"
    assert secrets.redis_url("memory://", env) == "memory://"
    assert secrets.redacted("redis://api:secret@h:1/0") == "redis://api:***@h:1/0"
    assert secrets.redacted("redis://h:1/0") == "redis://h:1/0"


def test_a_process_holding_secrets_shields_its_memory_from_its_users_other_processes() -> None:
    """A worker's agents run as its user: non-dumpable, its /proc/<pid>/environ (which still
    holds the variables it was started with) and its memory are root's alone. So an API's,
    when it holds tokens."""
    import subprocess

    probe = (
        "import ctypes, sys; from acp_state.cli import commands; "
        "commands.asyncio.run = lambda coroutine: (coroutine.close(), "
        "print(ctypes.CDLL(None).prctl(3, 0, 0, 0, 0)))[1]; commands.main(sys.argv[1:])"
    )
    base = {k: v for k, v in os.environ.items() if not k.startswith("ACP_STATE_")}
    for command, env, expected in (
        ("worker", {"ACP_STATE_REDIS_PASSWORD": PASSWORD}, "0"),
        ("worker", {}, "1"),
        ("api", {"ACP_STATE_TOKENS": ENV_TOKEN}, "0"),
        ("api", {}, "1"),
    ):
        done = subprocess.run(
            [sys.executable, "-c", probe, command, "--redis-url", "redis://worker@127.0.0.1:1/0"],
            env={**base, "PYTHONPATH": str(ROOT), **env}, cwd=str(ROOT), capture_output=True, text=True, timeout=60,
        )
        assert done.stdout.strip() == expected, (done.stdout, done.stderr)  # PR_GET_DUMPABLE
