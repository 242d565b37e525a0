"""Stream tickets (issue 37 item 6): an event stream opens without a token in its URL, with
a ticket got by an authenticated POST, which opens that one stream, once, within its life,
as its principal, on any API process. Real API and worker processes, a real Redis."""

from __future__ import annotations

import time
from urllib.parse import quote

from acp_state.api.auth import Token
from acp_state.api.stream_tickets import Tickets
from acp_state.ids import workspace_id
from tests.harness import Harness, SseClient
from tests.helpers import create, prompt

ADMIN = "admin-token-0123456789"
SCOPED = "scoped-token-0123456789"


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def ticket_for(api, path: str, token: str = ADMIN) -> str:
    answer = await api.client.post("/stream-tickets", json={"path": path}, headers=bearer(token))
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["expiresAt"] > time.time() * 1000
    return body["ticket"]


async def opened(api, path: str, ticket: str) -> SseClient:
    """The stream at `path` opened with `?ticket=` and no Authorization, as EventSource does."""
    return await SseClient(api, path=path, query=f"?ticket={quote(ticket)}", headers={"Authorization": ""}).start()


async def test_a_ticket_opens_its_stream_once_on_any_api_process(harness: Harness, workspace: str, tmp_path,
                                                                  redis_client) -> None:
    other = tmp_path / "other"
    other.mkdir()
    tokens = ("--token", f"{ADMIN},role=admin", "--token", f"{SCOPED},workspace={workspace}")
    await harness.worker()
    first = await harness.api(*tokens, workspaces=[workspace, str(other)])
    second = await harness.api(*tokens, workspaces=[workspace, str(other)])
    first.client.headers.update(bearer(ADMIN))
    ours = (await create(first, workspace))["sessionId"]
    theirs = (await create(first, str(other)))["sessionId"]
    path = f"/session/{ours}/events"

    # No ticket without a token.
    assert (await first.client.post("/stream-tickets", json={"path": path}, headers={"Authorization": ""})).status_code == 401
    # Only event streams get tickets.
    refused = await first.client.post("/stream-tickets", json={"path": f"/session/{ours}/status"})
    assert refused.status_code == 400 and refused.json()["code"] == "invalid_stream_path"

    # Issued by one process, opened on another (neither keeps anything of its own).
    ticket = await ticket_for(first, path)
    stream = await opened(second, path, ticket)
    try:
        assert stream.status == 200
        await prompt(first, ours, "hello")
        await stream.wait_for(lambda f: f["event"] == "turn_complete")
    finally:
        await stream.close()
    # Once: a second use, on either process, is refused.
    for api in (first, second):
        again = await opened(api, path, ticket)
        assert again.status == 401, api
        assert again.frames == []
    spent = await second.client.get(f"{path}?ticket={quote(ticket)}", headers={"Authorization": ""})
    assert spent.json()["code"] == "ticket_used"
    kept = [key async for key in redis_client.scan_iter(match="acp:ticket:*")]
    ttls = [await redis_client.pttl(key) for key in kept]
    assert ttls and all(0 < ttl <= 61_000 for ttl in ttls), ttls  # nothing kept for good

    # A ticket opens the stream it was issued for and no other, and only as a ticket.
    ticket = await ticket_for(first, path)
    for elsewhere in (f"/session/{theirs}/events", "/attention/events",
                      f"/workspaces/{workspace_id(workspace)}/sessions/live-state/events"):
        wrong = await opened(first, elsewhere, ticket)
        assert wrong.status == 401, elsewhere
    assert (await first.client.get(f"/session/{ours}/status?ticket={quote(ticket)}",
                                   headers={"Authorization": ""})).status_code == 401
    assert (await opened(first, path, ticket)).status == 200  # unspent by the refusals above
    tampered = ticket[:-2] + ("AA" if not ticket.endswith("AA") else "BB")
    assert (await opened(first, path, tampered)).status == 401

    # The token itself never goes in a URL: `?access_token=` opens nothing (the reference
    # takes none either).
    assert (await SseClient(first, ours, query=f"?access_token={ADMIN}", headers={"Authorization": ""}).start()).status == 401


async def test_an_expired_ticket_and_a_scoped_tokens_ticket(harness: Harness, workspace: str, tmp_path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    await harness.worker()
    api = await harness.api("--token", f"{ADMIN},role=admin", "--token", f"{SCOPED},workspace={workspace}",
                            workspaces=[workspace, str(other)])
    api.client.headers.update(bearer(ADMIN))
    ours = (await create(api, workspace))["sessionId"]
    theirs = (await create(api, str(other)))["sessionId"]

    # A ticket issued 61 s ago, by the deployment's own key (the same tokens): expired.
    tickets = Tickets([Token.parse(f"{ADMIN},role=admin"), Token.parse(f"{SCOPED},workspace={workspace}")])
    path = f"/session/{ours}/events"
    old, _ = tickets.issue(Token.parse(f"{ADMIN},role=admin").principal(), path, now_ms=int(time.time() * 1000) - 61_000)
    late = await api.client.get(f"{path}?ticket={quote(old)}", headers={"Authorization": ""})
    assert late.status_code == 401 and late.json()["code"] == "ticket_expired"
    # A key made of other tokens (another deployment, or tokens since rotated) opens nothing.
    foreign = Tickets([Token.parse("another-token-0123456789,role=admin")])
    forged, _ = foreign.issue(Token.parse("another-token-0123456789,role=admin").principal(), path)
    assert (await opened(api, path, forged)).status == 401

    # A workspace-scoped token's ticket is that token: the other workspace's streams answer
    # as they do the token itself, even with a ticket for their path: its session is not
    # found, and its workspace is answered as an unknown one (docs/api.md, Tenants).
    for path, status, code in ((f"/session/{theirs}/events", 404, "session_not_found"),
                               (f"/workspaces/{workspace_id(str(other))}/sessions/live-state/events", 400,
                                "workspace_mismatch")):
        ticket = await ticket_for(api, path, SCOPED)
        answer = await api.client.get(f"{path}?ticket={quote(ticket)}", headers={"Authorization": ""})
        assert (answer.status_code, answer.json()["code"]) == (status, code), answer.text
        assert str(other) not in answer.text and workspace_id(str(other)) not in answer.text
    own_feed = f"/workspaces/{workspace_id(workspace)}/sessions/live-state/events"
    feed = await opened(api, own_feed, await ticket_for(api, own_feed, SCOPED))
    try:
        assert feed.status == 200
        snapshot = await feed.wait_for(lambda f: f["event"] == "live_state_snapshot")
        assert [row["sessionId"] for row in snapshot["data"]["sessions"]] == [ours]
    finally:
        await feed.close()
    inbox = await opened(api, "/attention/events", await ticket_for(api, "/attention/events", SCOPED))
    try:
        await prompt(api, theirs, "#permission")
        await prompt(api, ours, "#permission")
        def items(frame: dict) -> list[dict]:
            if frame["event"] == "attention_snapshot":
                return frame["data"]["items"]
            return [frame["data"]] if frame["event"] == "attention_added" else []

        await inbox.wait_for(lambda f: any(item["sessionId"] == ours for item in items(f)))
        assert all(item["sessionId"] == ours for frame in inbox.frames for item in items(frame))
    finally:
        await inbox.close()
