"""Auth: tokenless only on loopback, roles, and workspace scopes that hide, not forbid."""

from __future__ import annotations

import asyncio
import sys

from acp_state.ids import workspace_id
from testbed.processes import ROOT
from tests.harness import Harness, SseClient

USER = "user-token-0123456789"
ADMIN = "admin-token-0123456789"
CHANNEL = "channel-token-0123456789"


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def test_non_loopback_bind_without_a_token_is_refused(redis_server, workspace: str) -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "acp_state.cli", "api", "--redis-url", redis_server.url,
        "--host", "0.0.0.0", "--port", "0", "--workspace", workspace,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=str(ROOT),
    )
    _, stderr = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode != 0
    assert b"refusing to serve 0.0.0.0 without a bearer token" in stderr


async def test_tokens_roles_and_workspace_scopes(harness: Harness, workspace: str, tmp_path) -> None:
    other = str(tmp_path / "other")
    (tmp_path / "other").mkdir()
    scoped = f"scoped-token-0123456789,workspace={workspace}"
    await harness.worker()
    api = await harness.api(
        "--token", USER, "--token", f"{ADMIN},role=admin", "--token", scoped, "--channel-token", CHANNEL,
        workspaces=[workspace, other],
    )
    client = api.client
    assert (await client.get("/health")).status_code == 200
    refused = await client.get("/capabilities")
    assert refused.status_code == 401 and refused.json()["code"] == "unauthorized"
    assert (await client.get("/capabilities", headers=bearer("wrong-token-0123456789"))).status_code == 401

    async def create(cwd: str, token: str) -> str:
        made = await client.post("/session", json={"cwd": cwd, "sessionScope": "thread"}, headers=bearer(token))
        assert made.status_code == 200, made.text
        return made.json()["sessionId"]

    theirs = await create(other, USER)
    mine = await create(workspace, "scoped-token-0123456789")
    scoped_headers = bearer("scoped-token-0123456789")

    # The scoped token sees its workspace and nothing of the other one: 404, as if absent.
    listed = (await client.get("/capabilities", headers=scoped_headers)).json()["workspaces"]
    assert [w["cwd"] for w in listed] == [workspace]
    assert (await client.get(f"/session/{mine}/status", headers=scoped_headers)).status_code == 200
    hidden = await client.get(f"/session/{theirs}/status", headers=scoped_headers)
    absent = await client.get("/session/00000000-0000-4000-8000-000000000000/status", headers=scoped_headers)
    assert hidden.status_code == absent.status_code == 404
    assert hidden.json()["code"] == absent.json()["code"] == "session_not_found"
    prompt = {"prompt": [{"type": "text", "text": "hi"}]}
    assert (await client.post(f"/session/{theirs}/prompt", json=prompt, headers=scoped_headers)).status_code == 404
    assert (await client.post(f"/session/{theirs}/cancel", headers=scoped_headers)).status_code == 404
    vote = {"outcome": {"outcome": "cancelled"}}
    assert (await client.post(f"/session/{theirs}/permission/x", json=vote, headers=scoped_headers)).status_code == 404
    assert (await client.get(f"/session/{theirs}/transcript", headers=scoped_headers)).status_code == 404
    # A workspace it may not see answers as one that is not registered (the reference's 400),
    # naming only the token's own (tests/test_tenants.py holds every route to it).
    foreign = await client.get(f"/workspace/{workspace_id(other)}/sessions", headers=scoped_headers)
    unknown = await client.get("/workspace/0123456789abcdef/sessions", headers=scoped_headers)
    assert foreign.status_code == unknown.status_code == 400
    assert foreign.json() == unknown.json() and foreign.json()["code"] == "workspace_mismatch"
    assert (await client.get(f"/workspace/{workspace_id(workspace)}/sessions", headers=scoped_headers)).status_code == 200
    made = await client.post("/session", json={"cwd": other}, headers=scoped_headers)
    assert made.status_code == 400 and made.json()["code"] == "workspace_mismatch"
    assert made.json()["boundWorkspace"] == workspace and other not in made.json().get("error", "")
    sse = SseClient(api, theirs)
    api.client.headers.update(scoped_headers)
    await sse.start()
    assert sse.status == 404
    api.client.headers.pop("Authorization")

    # The Web Shell's files are open (the page asks for a token). A token never goes in a
    # URL: EventSource, which cannot send headers, opens a stream with a ticket instead
    # (tests/test_stream_tickets.py), and `?access_token=` opens nothing, as in the reference.
    assert (await client.get("/")).status_code == 200
    assert (await client.get("/static/js/api.js")).status_code == 200
    via_query = SseClient(api, mine, query="?access_token=scoped-token-0123456789")
    await via_query.start()
    assert via_query.status == 401
    await via_query.close()
    leaked = await client.get(f"/session/{mine}/status?access_token=scoped-token-0123456789")
    assert leaked.status_code == 401

    # Metrics are for admins.
    assert (await client.get("/metrics", headers=bearer(USER))).status_code == 403
    assert (await client.get("/metrics", headers=bearer(ADMIN))).status_code == 200


async def test_only_a_channel_token_makes_a_channel_prompt(harness: Harness, workspace: str) -> None:
    events = await harness.events()
    await harness.worker()
    api = await harness.api("--token", USER, "--channel-token", CHANNEL)
    sid = (await api.client.post("/session", json={"cwd": workspace}, headers=bearer(USER))).json()["sessionId"]
    body = {"prompt": [{"type": "text", "text": "#loop"}], "_meta": {"qwen.channel.prompt": True}}
    for token, expected in ((USER, "turn_error"), (CHANNEL, "turn_complete")):
        accepted = (await api.client.post(f"/session/{sid}/prompt", json=body, headers=bearer(token))).json()
        ended = await events.wait_for(
            lambda e, p=accepted["promptId"]: e["type"] in ("turn_error", "turn_complete") and e.get("promptId") == p
        )
        assert ended["type"] == expected, token
