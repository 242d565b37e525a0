"""Tenants (issue 37 item 5): two tokens scoped to workspaces W1 and W2 of one deployment,
real redis-server, real API and worker processes over loopback HTTP.

Each defect the adversarial test of main 67ffe04 found is reproduced here and now refused:

* point 3: a W2 token created a session under a live W1 session's id; the worker overwrote
  the id's locator, and an API process that had not cached the id answered W1 404 for it;
* point 4: a W2 token that reused W1's create `Idempotency-Key` got W1's session and client id;
* point 5: W1's path in `/capabilities` (`workspaceCwd`) and in `workspace_mismatch`
  (`boundWorkspace`), and a foreign workspace answered unlike an unknown one (404 naming it,
  against the reference's 400).

And a single-tenant user sees no change (the last test).
"""

from __future__ import annotations

import uuid
from urllib.parse import quote

import httpx
import orjson

from acp_state import commands
from acp_state.commands import Reply
from acp_state.ids import workspace_id
from acp_state.store import RedisStore
from testbed.processes import ApiProcess
from tests.harness import Harness, SseClient

W1_TOKEN = "tenant-one-token-0123456789"
W2_TOKEN = "tenant-two-token-0123456789"
ADMIN = "tenant-admin-token-0123456789"
W2_ADMIN = "tenant-two-admin-token-0123456789"
UNKNOWN_ID = "0123456789abcdef"


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def _tenants(harness: Harness, tmp_path) -> tuple[ApiProcess, str, str]:
    """One worker and an API serving W1 (the primary) and W2, with a token scoped to each,
    an unscoped admin token and an admin token scoped to W2."""
    w1, w2 = harness.workspace, str(tmp_path / "tenant-two")
    (tmp_path / "tenant-two").mkdir()
    await harness.worker()
    api = await harness.api(*_tokens(w1, w2), workspaces=[w1, w2])
    return api, w1, w2


def _tokens(w1: str, w2: str) -> list[str]:
    return [
        "--token", f"{W1_TOKEN},workspace={w1}", "--token", f"{W2_TOKEN},workspace={w2}",
        "--token", f"{ADMIN},role=admin", "--token", f"{W2_ADMIN},role=admin,workspace={w2}",
    ]


async def _create(api: ApiProcess, token: str, cwd: str, **body: object) -> httpx.Response:
    return await api.client.post("/session", json={"cwd": cwd, "sessionScope": "thread", **body}, headers=bearer(token))


async def test_a_session_id_stays_its_workspaces(harness: Harness, tmp_path) -> None:
    """Point 3. Before: 200, the locator named W2, and a fresh API process answered W1's own
    token 404 for its live session (and routed an admin's prompts to the W2 session)."""
    api, w1, w2 = await _tenants(harness, tmp_path)
    made = await _create(api, W1_TOKEN, w1)
    assert made.status_code == 200, made.text
    sid = made.json()["sessionId"]

    for scope in ("thread", "single"):  # (a `single` create with no shared session of W2 makes one)
        taken = await _create(api, W2_TOKEN, w2, sessionId=sid, sessionScope=scope)
        assert taken.status_code == 409, taken.text
        assert taken.json()["code"] == "session_id_conflict" and taken.json()["sessionId"] == sid
        assert w1 not in taken.text and workspace_id(w1) not in taken.text  # which workspace holds it: not said

    # An API process started since (nothing cached) still finds the session for W1 and for
    # an admin, in W1.
    later = await harness.api(*_tokens(w1, w2), workspaces=[w1, w2])
    seen = await later.client.get(f"/session/{sid}/status", headers=bearer(W1_TOKEN))
    assert seen.status_code == 200, seen.text
    assert seen.json()["workspaceCwd"] == w1
    prompted = await later.client.post(
        f"/session/{sid}/prompt", json={"prompt": [{"type": "text", "text": "hi"}]}, headers=bearer(ADMIN)
    )
    assert prompted.status_code == 202, prompted.text
    assert (await later.client.get(f"/session/{sid}/status", headers=bearer(W2_TOKEN))).status_code == 404

    # Closed, it stays listed in W1 (a load may resume it): its id is still W1's.
    assert (await api.client.delete(f"/session/{sid}", headers=bearer(W1_TOKEN))).status_code == 204
    again = await _create(api, W2_TOKEN, w2, sessionId=sid)
    assert again.status_code == 409 and again.json()["code"] == "session_id_conflict", again.text
    redis = RedisStore.from_url(harness.redis_url)
    try:
        assert await redis.locate(sid) == workspace_id(w1)
    finally:
        await redis.close()


async def test_the_worker_claims_the_id_and_never_overwrites_another_workspaces(harness: Harness, tmp_path) -> None:
    """Point 3, at the worker: a create that reaches a worker with an id another workspace
    holds (the API's check raced, or the id was not chosen) is refused by the worker's own
    claim, inside the locator's script, and answered `session_id_conflict`; the API turns
    that into a 409. Before: the worker set the locator unconditionally and answered ok."""
    api, w1, w2 = await _tenants(harness, tmp_path)
    sid = (await _create(api, W1_TOKEN, w1)).json()["sessionId"]
    store = RedisStore.from_url(harness.redis_url)
    try:
        (worker,) = await _live(store)
        request = f"req-{uuid.uuid4().hex[:8]}"
        await store.send_control(worker, commands.Create(
            ws=workspace_id(w2), sid=sid, cwd=w2, scope="thread", client_id="client-2", wait_ms=30_000,
            request_id=request,
        ))
        reply = await store.await_reply(request, 30)
        assert reply == Reply(ok=False, code="session_id_conflict")
        assert await store.locate(sid) == workspace_id(w1)
        assert await store.session(workspace_id(w2), sid) is None
        assert await store.catalog_row(workspace_id(w2), sid) is None
        assert (workspace_id(w2), sid) not in await store.worker_index(worker)
    finally:
        await store.close()
    assert (await api.client.get(f"/session/{sid}/status", headers=bearer(W1_TOKEN))).status_code == 200


async def _live(store: RedisStore) -> list[str]:
    view = await store.lease_view()
    return [inc for inc, deadline in view.live_until().items() if deadline > view.redis_now_ms]


async def test_create_keys_are_per_workspace_and_principal(harness: Harness, tmp_path) -> None:
    """Point 4. Before: W2's create with W1's key answered W1's session id and client id."""
    api, w1, w2 = await _tenants(harness, tmp_path)
    key = {"Idempotency-Key": "create-key-1"}
    first = await api.client.post("/session", json={"cwd": w1, "sessionScope": "thread"},
                                  headers={**bearer(W1_TOKEN), **key, "X-Qwen-Client-Id": "w1-client"})
    assert first.status_code == 200, first.text
    theirs = await api.client.post("/session", json={"cwd": w2, "sessionScope": "thread"}, headers={**bearer(W2_TOKEN), **key})
    assert theirs.status_code == 200, theirs.text
    assert theirs.json()["sessionId"] != first.json()["sessionId"]
    assert theirs.json()["clientId"] != "w1-client" and theirs.json()["workspaceCwd"] == w2
    # Another principal of the same workspace (an unscoped admin) with the key: its own create too.
    admins = await api.client.post("/session", json={"cwd": w1, "sessionScope": "thread"}, headers={**bearer(ADMIN), **key})
    assert admins.status_code == 200 and admins.json()["sessionId"] != first.json()["sessionId"], admins.text
    # Each caller's retry still answers its own first outcome.
    for token, cwd, answer in ((W1_TOKEN, w1, first), (W2_TOKEN, w2, theirs), (ADMIN, w1, admins)):
        retried = await api.client.post("/session", json={"cwd": cwd, "sessionScope": "thread"}, headers={**bearer(token), **key})
        assert retried.status_code == 200, retried.text
        assert {k: retried.json()[k] for k in ("sessionId", "clientId", "workspaceCwd")} == {
            k: answer.json()[k] for k in ("sessionId", "clientId", "workspaceCwd")
        }


async def test_no_answer_names_a_workspace_the_token_may_not_see(harness: Harness, tmp_path) -> None:
    """Point 5, and the survey of every route: a W2 token is never told W1's path or id, and
    a foreign workspace answers exactly as an unknown one. Before: `/capabilities` said
    `workspaceCwd: W1`; `workspace_mismatch` said `boundWorkspace: W1`; a foreign workspace
    answered 404 `workspace_not_found` naming it (an unknown one: 400), and a create that
    named no cwd 404 with W1's path."""
    api, w1, w2 = await _tenants(harness, tmp_path)
    ws1 = workspace_id(w1)
    sid = (await _create(api, W1_TOKEN, w1)).json()["sessionId"]
    ask = {"prompt": [{"type": "text", "text": "#permission"}]}
    assert (await api.client.post(f"/session/{sid}/prompt", json=ask, headers=bearer(W1_TOKEN))).status_code == 202
    unknown = str(tmp_path / "not-a-workspace")
    told: list[str] = []

    async def as_w2(method: str, path: str, **kwargs: object) -> httpx.Response:
        response = await api.client.request(method, path, headers=bearer(W2_TOKEN), **kwargs)  # type: ignore[arg-type]
        told.append(f"{method} {path} -> {response.status_code} {response.text}")
        return response

    capabilities = (await as_w2("GET", "/capabilities")).json()
    assert capabilities["workspaceCwd"] == w2
    assert [(w["cwd"], w["primary"]) for w in capabilities["workspaces"]] == [(w2, True)]

    async def alike(method: str, path: str, foreign: str, other: str, **kwargs: object) -> None:
        """The same request naming the foreign workspace and an unknown one: one answer."""
        seen = await as_w2(method, path.format(quote(foreign, safe="")), **_named(kwargs, foreign))
        unseen = await as_w2(method, path.format(quote(other, safe="")), **_named(kwargs, other))
        assert seen.status_code == unseen.status_code, (seen.text, unseen.text)
        assert seen.text.replace(foreign, "X") == unseen.text.replace(other, "X"), (seen.text, unseen.text)

    for foreign, other in ((w1, unknown), (ws1, UNKNOWN_ID)):
        await alike("GET", "/workspace/{}/sessions", foreign, other)
        await alike("GET", "/workspaces/{}/sessions/live-state", foreign, other)
        await alike("POST", "/sessions/live-state", foreign, other, json={"workspaces": ["{}"]})
        await alike("POST", "/sessions/catalog", foreign, other, json={"workspaces": [{"workspace": "{}"}]})
        feed = SseClient(api, path=f"/workspaces/{quote(foreign, safe='')}/sessions/live-state/events",
                         headers=bearer(W2_TOKEN))
        await feed.start()
        assert feed.status == 400
        await feed.close()
    await alike("POST", "/session", w1, unknown, json={"cwd": "{}", "sessionScope": "thread"})
    mismatch = await as_w2("POST", "/session", json={"cwd": unknown})
    assert mismatch.status_code == 400 and mismatch.json()["code"] == "workspace_mismatch"
    assert mismatch.json()["boundWorkspace"] == w2
    # A create that names no workspace goes to the caller's own.
    made = await as_w2("POST", "/session", json={"sessionScope": "thread"})
    assert made.status_code == 200 and made.json()["workspaceCwd"] == w2, made.text
    # Its sessions: 404 as an unknown id's, whatever the route.
    for method, path in (("GET", "/session/{}/status"), ("GET", "/session/{}/turns/current"),
                         ("GET", "/session/{}/transcript"), ("POST", "/session/{}/load"), ("POST", "/session/{}/cancel"),
                         ("POST", "/session/{}/resume"), ("GET", "/session/{}/context"),
                         ("GET", "/session/{}/context-usage"), ("GET", "/session/{}/goal"),
                         ("GET", "/session/{}/pending-prompts"), ("GET", "/session/{}/supported-commands"),
                         ("POST", "/session/{}/approval-mode"), ("POST", "/session/{}/heartbeat"),
                         ("POST", "/session/{}/detach")):
        body = {"mode": "default"} if path.endswith("approval-mode") else {}
        await alike(method, path, sid, str(uuid.uuid4()), **({"json": body} if method == "POST" else {}))
    # The deployment-wide routes: every workspace's work, so not for a scoped token.
    inbox = (await as_w2("GET", "/attention")).json()
    assert inbox["items"] == []
    assert (await as_w2("GET", "/workers")).status_code == 403
    scoped_admin = await api.client.get("/metrics", headers=bearer(W2_ADMIN))
    assert scoped_admin.status_code == 403 and scoped_admin.json()["code"] == "deployment_scope_required"
    assert (await api.client.get("/metrics", headers=bearer(ADMIN))).status_code == 200
    await as_w2("GET", "/openapi.json")
    await as_w2("GET", "/health/ready")
    # Nothing W2 was told names W1 (but what W2 itself sent, echoed alike for an unknown one).
    for answer in told:
        request, _, body = answer.partition(" -> ")
        body = body.replace(f'"{w1}"', "").replace(f'"{ws1}"', "")
        assert w1 not in body and ws1 not in body, answer
    # While W1's own token sees its pending permission and its workspace.
    assert [i["sessionId"] for i in (await api.client.get("/attention", headers=bearer(W1_TOKEN))).json()["items"]] == [sid]
    assert (await api.client.get("/capabilities", headers=bearer(W1_TOKEN))).json()["workspaceCwd"] == w1


def _named(kwargs: dict[str, object], selector: str) -> dict[str, object]:
    """`kwargs` with the string "{}" in its JSON body replaced by `selector`."""
    if "json" not in kwargs:
        return kwargs
    text = orjson.dumps(kwargs["json"]).decode().replace('"{}"', orjson.dumps(selector).decode())
    return {**kwargs, "json": orjson.loads(text)}


async def test_a_single_tenant_sees_no_change(harness: Harness, tmp_path) -> None:
    """Without tokens (the loopback default) and with one workspace's token: a chosen,
    free session id is created; a live one answers `session_exists` as before; a retry with
    the same Idempotency-Key answers the first create; a workspace mismatch still names the
    one workspace (the reference's answer)."""
    w1 = harness.workspace
    await harness.worker()
    open_api = await harness.api()
    scoped_api = await harness.api("--token", f"{W1_TOKEN},workspace={w1}")
    for api, headers in ((open_api, {}), (scoped_api, bearer(W1_TOKEN))):
        chosen = str(uuid.uuid4())
        body = {"cwd": w1, "sessionScope": "thread", "sessionId": chosen}
        key = {"Idempotency-Key": f"key-{uuid.uuid4().hex[:8]}"}
        made = await api.client.post("/session", json=body, headers={**headers, **key})
        assert made.status_code == 200 and made.json()["sessionId"] == chosen, made.text
        retried = await api.client.post("/session", json=body, headers={**headers, **key})
        assert retried.status_code == 200 and retried.json() == made.json(), retried.text
        live = await api.client.post("/session", json=body, headers=headers)
        assert live.status_code == 409 and live.json()["code"] == "session_exists", live.text
        assert (await api.client.get(f"/session/{chosen}/status", headers=headers)).status_code == 200
        # Closed (still listed), the same workspace may create it again under its id.
        assert (await api.client.delete(f"/session/{chosen}", headers=headers)).status_code == 204
        again = await api.client.post("/session", json=body, headers=headers)
        assert again.status_code == 200 and again.json()["sessionId"] == chosen, again.text
        capabilities = (await api.client.get("/capabilities", headers=headers)).json()
        assert capabilities["workspaceCwd"] == w1
    elsewhere = str(tmp_path / "elsewhere")
    refused = await open_api.client.post("/session", json={"cwd": elsewhere})
    assert refused.status_code == 400
    assert refused.json()["boundWorkspace"] == w1 and refused.json()["requestedWorkspace"] == elsewhere
