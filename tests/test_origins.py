"""Origins and hosts (issue 37 item 4): no web page of another origin drives the agents, a
page whose name was pointed at 127.0.0.1 (DNS rebinding) reads nothing, and an origin the
operator allows (`--allow-origin`) gets CORS answers. Real API and worker processes over
loopback HTTP, a real Redis."""

from __future__ import annotations

import asyncio
import sys

from acp_state.ids import workspace_id
from testbed.processes import ROOT
from tests.harness import Harness, SseClient
from tests.helpers import create, prompt

EVIL = "http://evil.example"
SHELL = "http://shell.example:8080"
ADMIN = "admin-token-0123456789"
PROMPT = {"prompt": [{"type": "text", "text": "hi"}]}


async def listed(api, workspace: str) -> list[str]:
    page = await api.client.get(f"/workspace/{workspace_id(workspace)}/sessions")
    assert page.status_code == 200, page.text
    return [row["sessionId"] for row in page.json()["sessions"]]


async def test_a_page_of_another_origin_creates_nothing_and_prompts_nothing(harness: Harness, workspace: str) -> None:
    """The drive-by of issue 37 item 2: a text/plain POST (which a browser sends without a
    preflight) from a foreign page, on a tokenless loopback API, answered 200 before."""
    await harness.worker()
    api = await harness.api()
    body = f'{{"cwd": "{workspace}", "sessionScope": "thread"}}'
    made = await api.client.post("/session", content=body, headers={"Content-Type": "text/plain", "Origin": EVIL})
    assert made.status_code == 403, made.text
    assert made.json() == {"error": "Request denied by CORS policy", "code": "origin_not_allowed"}
    chosen = await api.client.post(
        "/session", content=body[:-1] + ', "sessionId": "chosen-by-the-page"}',
        headers={"Content-Type": "text/plain", "Origin": EVIL},
    )
    assert chosen.status_code == 403
    assert await listed(api, workspace) == []

    sid = (await create(api, workspace))["sessionId"]
    sent = await api.client.post(f"/session/{sid}/prompt", json=PROMPT, headers={"Origin": EVIL})
    assert sent.status_code == 403 and sent.json()["code"] == "origin_not_allowed"
    assert (await api.client.post(f"/session/{sid}/cancel", headers={"Origin": EVIL})).status_code == 403
    assert (await api.client.delete(f"/session/{sid}", headers={"Origin": EVIL})).status_code == 403
    turn = (await api.client.get(f"/session/{sid}/turns/current")).json()
    assert turn["state"] == "idle" and "promptId" not in turn  # no turn was queued
    assert await listed(api, workspace) == [sid]  # and the session is still there

    # Reads too, as the reference's: the hot read answered below the stack, and the streams.
    for path in (f"/session/{sid}/status", f"/workspace/{workspace_id(workspace)}/sessions", "/attention"):
        assert (await api.client.get(path, headers={"Origin": EVIL})).status_code == 403, path
    stream = await SseClient(api, sid, headers={"Origin": EVIL}).start()
    assert stream.status == 403
    feed = await SseClient(api, path=f"/workspaces/{workspace_id(workspace)}/sessions/live-state/events",
                           headers={"Origin": EVIL}).start()
    assert feed.status == 403
    # A sandboxed frame or a file:// page sends `Origin: null`.
    assert (await api.client.post("/session", json={"cwd": workspace}, headers={"Origin": "null"})).status_code == 403

    # The page the API serves itself calls it from its own origin: answered.
    own = f"http://127.0.0.1:{api.port}"
    accepted = await api.client.post(f"/session/{sid}/prompt", json=PROMPT, headers={"Origin": own})
    assert accepted.status_code == 202, accepted.text


async def test_a_token_does_not_let_a_foreign_page_in(harness: Harness, workspace: str) -> None:
    """Whatever the token: a foreign page's request with a valid bearer token is refused too."""
    await harness.worker()
    api = await harness.api("--token", f"{ADMIN},role=admin")
    api.client.headers["Authorization"] = f"Bearer {ADMIN}"
    refused = await api.client.post("/session", json={"cwd": workspace}, headers={"Origin": EVIL})
    assert refused.status_code == 403 and refused.json()["code"] == "origin_not_allowed"
    assert await listed(api, workspace) == []


async def test_an_allowed_origin_gets_cors_answers(harness: Harness, workspace: str) -> None:
    """A Web Shell served elsewhere: its preflight, its calls, its hot reads and its streams
    all carry the CORS headers a browser needs to let the page read them."""
    await harness.worker()
    api = await harness.api("--token", f"{ADMIN},role=admin", "--allow-origin", SHELL)
    preflight = await api.client.options("/session", headers={
        "Origin": SHELL, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type,idempotency-key,x-qwen-client-id",
    })
    assert preflight.status_code == 204, preflight.text
    assert preflight.headers["access-control-allow-origin"] == SHELL
    assert "Origin" in preflight.headers["vary"]
    allowed = {h.strip().lower() for h in preflight.headers["access-control-allow-headers"].split(",")}
    assert {"authorization", "content-type", "last-event-id", "idempotency-key", "x-qwen-client-id",
            "x-qwen-event-epoch", "if-none-match"} <= allowed
    assert {"POST", "DELETE", "GET"} <= {m.strip() for m in preflight.headers["access-control-allow-methods"].split(",")}

    api.client.headers["Authorization"] = f"Bearer {ADMIN}"
    made = await api.client.post("/session", json={"cwd": workspace, "sessionScope": "thread"}, headers={"Origin": SHELL})
    assert made.status_code == 200, made.text
    assert made.headers["access-control-allow-origin"] == SHELL
    sid = made.json()["sessionId"]
    read = await api.client.get(f"/session/{sid}/status", headers={"Origin": SHELL})
    again = await api.client.get(f"/session/{sid}/status", headers={"Origin": SHELL})  # from the cache, below the stack
    assert read.status_code == again.status_code == 200
    assert read.headers["access-control-allow-origin"] == again.headers["access-control-allow-origin"] == SHELL
    exposed = {h.strip().lower() for h in read.headers["access-control-expose-headers"].split(",")}
    assert {"x-qwen-event-epoch", "retry-after"} <= exposed
    stream = await SseClient(api, sid, headers={"Origin": SHELL}).start()
    try:
        assert stream.status == 200 and stream.response_headers["access-control-allow-origin"] == SHELL
        await prompt(api, sid, "hello")
        await stream.wait_for(lambda f: f["event"] == "turn_complete")
    finally:
        await stream.close()
    # An error answer carries them too, so the page can read why.
    missing = await api.client.get("/session/00000000-0000-4000-8000-000000000000/status", headers={"Origin": SHELL})
    assert missing.status_code == 404 and missing.headers["access-control-allow-origin"] == SHELL
    # Another origin is still refused, its preflight too.
    other = await api.client.options("/session", headers={"Origin": EVIL, "Access-Control-Request-Method": "POST"})
    assert other.status_code == 403 and "access-control-allow-origin" not in other.headers


async def test_a_rebound_name_on_a_loopback_bind_is_refused(harness: Harness, workspace: str) -> None:
    """DNS rebinding: a page of evil.example whose name now resolves to 127.0.0.1 is
    same-origin with itself, so it sends no Origin; its Host names evil.example."""
    await harness.worker()
    api = await harness.api()
    sid = (await create(api, workspace))["sessionId"]
    for host in (f"evil.example:{api.port}", "evil.example", f"127.0.0.1.nip.io:{api.port}"):
        for method, path in (("GET", f"/session/{sid}/status"), ("GET", "/capabilities"), ("GET", "/"),
                             ("POST", f"/session/{sid}/prompt")):
            answer = await api.client.request(method, path, headers={"Host": host}, json=PROMPT if method == "POST" else None)
            assert answer.status_code == 403, (host, path, answer.text)
            assert answer.json() == {"error": "Invalid Host header", "code": "host_not_allowed"}
        stream = await SseClient(api, sid, headers={"Host": host}).start()
        assert stream.status == 403
    turn = (await api.client.get(f"/session/{sid}/turns/current")).json()
    assert turn["state"] == "idle" and "promptId" not in turn
    # Every loopback name, any port: answered.
    for host in (f"localhost:{api.port}", f"127.0.0.1:{api.port}", "127.0.0.2:9", f"[::1]:{api.port}", "localhost"):
        assert (await api.client.get(f"/session/{sid}/status", headers={"Host": host})).status_code == 200, host


async def run_cli(*args: str) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "acp_state.cli", "api", "--redis-url", "memory://", "--port", "0", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=str(ROOT),
    )
    _, stderr = await asyncio.wait_for(process.communicate(), 30)
    return process.returncode or 0, stderr.decode()


async def test_any_origin_or_a_remote_one_needs_a_token() -> None:
    """As the reference refuses them: `*` without a token lets any page drive the agents; a
    non-loopback http(s) origin without a token lets another machine's page do it."""
    code, said = await run_cli("--allow-origin", "*")
    assert code != 0 and "refusing --allow-origin '*' without a bearer token" in said, said
    code, said = await run_cli("--allow-origin", "http://shell.example")
    assert code != 0 and "without a bearer token" in said, said
    code, said = await run_cli("--allow-origin", "http://shell.example/", "--token", ADMIN)
    assert code != 0 and "expected `*` or an origin" in said, said
