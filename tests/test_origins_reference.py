"""Origins and hosts against the reference: the same requests to `qwen serve` 0.24.4 and to
acp-state, both with a token and `--allow-origin`, answer the same status, the same `error`
text (acp-state adds its `code`) and the same CORS headers (acp-state allows a few more
request headers it reads, and exposes a few more it sends). What differs is listed in
docs/compatibility.md, "Origins, hosts and stream tickets"."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from testbed.model_endpoint import ModelEndpoint
from tests.harness import Harness
from tests.reference import reference_daemon

TOKEN = "admin-token-0123456789"
SHELL = "http://shell.example:8080"
EVIL = "http://evil.example"
UNKNOWN_SID = "00000000-0000-4000-8000-000000000000"
CORS = ("access-control-allow-origin", "access-control-allow-methods", "access-control-max-age", "vary")


@pytest.fixture
def real_workspace(tmp_path: Path) -> str:
    path = tmp_path / "ref-ws"
    path.mkdir()
    return os.path.realpath(path)


@pytest.fixture
def fake_llm() -> Iterator[ModelEndpoint]:
    with ModelEndpoint() as fake:
        yield fake


def steps(port: int) -> list[tuple[str, str, str, dict[str, str], Any]]:
    """(name, method, path, headers, body) sent alike to both."""
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    return [
        ("foreign page's text/plain create", "POST", "/session",
         {**bearer, "Origin": EVIL, "Content-Type": "text/plain"}, '{"cwd": "/tmp"}'),
        ("foreign page's prompt", "POST", f"/session/{UNKNOWN_SID}/prompt",
         {**bearer, "Origin": EVIL, "Content-Type": "application/json"}, '{"prompt": []}'),
        ("foreign page's read", "GET", "/capabilities", {**bearer, "Origin": EVIL}, None),
        ("a null origin", "GET", "/capabilities", {**bearer, "Origin": "null"}, None),
        ("foreign preflight", "OPTIONS", "/session", {"Origin": EVIL, "Access-Control-Request-Method": "POST"}, None),
        ("allowed preflight", "OPTIONS", "/session",
         {"Origin": SHELL, "Access-Control-Request-Method": "POST",
          "Access-Control-Request-Headers": "authorization,content-type"}, None),
        ("allowed origin's read", "GET", "/capabilities", {**bearer, "Origin": SHELL}, None),
        ("allowed origin, unknown session", "GET", f"/session/{UNKNOWN_SID}/status", {**bearer, "Origin": SHELL}, None),
        ("allowed origin, no token", "GET", "/capabilities", {"Origin": SHELL}, None),
        ("own origin", "GET", "/capabilities", {**bearer, "Origin": f"http://127.0.0.1:{port}"}, None),
        ("rebound host", "GET", "/capabilities", {**bearer, "Host": f"evil.example:{port}"}, None),
        ("rebound host, no port", "GET", "/health", {"Host": "evil.example"}, None),
        ("token in the URL", "GET", f"/capabilities?access_token={TOKEN}", {}, None),
    ]


async def answers(base_url: str, port: int) -> dict[str, dict[str, Any]]:
    got: dict[str, dict[str, Any]] = {}
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
        for name, method, path, headers, body in steps(port):
            response = await client.request(method, path, headers=headers, content=body)
            try:
                error = response.json().get("error") if response.content else None
            except ValueError:
                error = response.text
            got[name] = {"status": response.status_code, "error": error,
                         **{h: response.headers.get(h) for h in CORS},
                         "allow-headers": response.headers.get("access-control-allow-headers"),
                         "expose-headers": response.headers.get("access-control-expose-headers")}
    return got


def members(text: str | None) -> set[str]:
    return {part.strip().lower() for part in (text or "").split(",") if part.strip()}


async def test_origin_and_host_answers_match_the_reference(
    harness: Harness, qwen: str, real_workspace: str, fake_llm: ModelEndpoint, tmp_path: Path
) -> None:
    api = await harness.api("--token", f"{TOKEN},role=admin", "--allow-origin", SHELL, workspaces=[real_workspace])
    ours = await answers(f"http://127.0.0.1:{api.port}", api.port)
    async with reference_daemon(qwen, real_workspace, fake_llm.openai_url, tmp_path / "reference",
                                "--token", TOKEN, "--allow-origin", SHELL) as daemon:
        theirs = await answers(daemon.base_url, daemon.port)
    (tmp_path / "answers.txt").write_text(f"reference: {theirs}\nacp-state: {ours}\n")
    for name in theirs:
        mine, ref = ours[name], theirs[name]
        assert mine["status"] == ref["status"], (name, ref, mine)
        if ref["status"] == 403:  # the refusals' words (a 401's differ, as before: docs/compatibility.md)
            assert mine["error"] == ref["error"], (name, ref, mine)
        for header in CORS:
            if header == "vary":
                assert ("origin" in members(mine[header])) == ("origin" in members(ref[header])), (name, ref, mine)
            else:
                assert mine[header] == ref[header], (name, header, ref, mine)
        assert members(ref["allow-headers"]) <= members(mine["allow-headers"]), (name, ref, mine)
        assert members(ref["expose-headers"]) <= members(mine["expose-headers"]), (name, ref, mine)


async def test_any_origin_without_a_token_is_refused_by_both(qwen: str, real_workspace: str, tmp_path: Path) -> None:
    """The reference refuses to start with `--allow-origin '*'` and no token; so does acp-state
    (tests/test_origins.py)."""
    process = await asyncio.create_subprocess_exec(
        qwen, "serve", "--port", "0", "--hostname", "127.0.0.1", "--workspace", real_workspace, "--no-web",
        "--allow-origin", "*", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "HOME": str(tmp_path)}, start_new_session=True,
    )
    out, _ = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode != 0
    assert b"--allow-origin '*'" in out and b"no bearer token" in out, out[-2000:]
