"""The hot reads (`api/hot_reads.py`): a status, listing or inbox answer kept current in an API
process's cache is sent past Starlette's stack. A client must not be able to tell: the same
status, headers and body as the read that went to Redis, the same 304s, the same counts in
`/metrics`, and never an answer the stack would have refused (another workspace's token, no
token, a session whose worker lost its lease)."""

from __future__ import annotations


import httpx
from prometheus_client.parser import text_string_to_metric_families

from acp_state.ids import workspace_id
from testbed.processes import ApiProcess
from tests.harness import Harness
from tests.helpers import create, past_lease

ADMIN = "admin-token-0123456789"
SCOPED = "scoped-token-0123456789"


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def answer(response: httpx.Response) -> tuple[int, list[tuple[str, str]], bytes]:
    """What a client sees of an answer, but for the `date` the server stamps on each."""
    return response.status_code, [(k, v) for k, v in response.headers.multi_items() if k != "date"], response.content


async def requests_counted(api: ApiProcess, route: str) -> dict[str, float]:
    text = (await api.client.get("/metrics", headers=bearer(ADMIN))).text
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "acp_state_http_requests_total" and sample.labels["route"] == route:
                found[sample.labels["status"]] = sample.value
    return found


async def cache_hits(api: ApiProcess) -> float:
    text = (await api.client.get("/metrics", headers=bearer(ADMIN))).text
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "acp_state_state_cache_hits_total")


async def test_a_kept_answer_is_the_answer_read_from_redis(harness: Harness, workspace: str) -> None:
    events = await harness.events()
    await harness.worker()
    api = await harness.api("--token", f"{ADMIN},role=admin")
    client, auth = api.client, bearer(ADMIN)
    sid = (await client.post("/session", json={"cwd": workspace}, headers=auth)).json()["sessionId"]
    status_path = f"/session/{sid}/status"
    listing_path = f"/workspace/{workspace_id(workspace)}/sessions?size=5"

    for path, route in ((status_path, "status"), (listing_path, "list_sessions"), ("/attention?size=5", "attention_page")):
        hits = await cache_hits(api)
        from_redis = await client.get(path, headers=auth)  # read, then kept
        kept = await client.get(path, headers=auth)
        assert from_redis.status_code == 200 and answer(kept) == answer(from_redis), path
        if route == "status":
            assert await cache_hits(api) > hits, "the second read was the cache's"
            from_status = from_redis
        etag = kept.headers["etag"]
        unchanged = await client.get(path, headers={**auth, "If-None-Match": f'"other", {etag}'})
        assert (unchanged.status_code, unchanged.content, unchanged.headers["etag"]) == (304, b"", etag)
        assert "content-type" not in unchanged.headers and "content-length" not in unchanged.headers
        assert await requests_counted(api, route) == {"200": 2.0, "304": 1.0}, "every read is counted, kept or not"

    # A change: the kept answers go, the next reads are the new state's.
    done = await prompt_as(client, auth, sid)
    await events.wait_type(sid, "turn_complete", promptId=done["promptId"])
    status_etag = from_status.headers["etag"]
    changed = await client.get(status_path, headers={**auth, "If-None-Match": status_etag})
    assert changed.status_code == 200 and changed.headers["etag"] != status_etag
    assert changed.content != from_status.content


async def prompt_as(client: httpx.AsyncClient, auth: dict[str, str], sid: str) -> dict:
    accepted = await client.post(f"/session/{sid}/prompt", json={"prompt": [{"type": "text", "text": "hello"}]}, headers=auth)
    assert accepted.status_code == 202, accepted.text
    return accepted.json()


async def test_a_kept_answer_is_never_given_to_a_caller_the_stack_would_refuse(
    harness: Harness, workspace: str, tmp_path
) -> None:
    other = tmp_path / "other"
    other.mkdir()
    await harness.worker()
    api = await harness.api(
        "--token", f"{ADMIN},role=admin", "--token", f"{SCOPED},workspace={other}", workspaces=[workspace, str(other)]
    )
    client = api.client
    sid = (await client.post("/session", json={"cwd": workspace}, headers=bearer(ADMIN))).json()["sessionId"]
    status_path = f"/session/{sid}/status"
    listing_path = f"/workspace/{workspace_id(workspace)}/sessions"
    for path in (status_path, listing_path, "/attention"):
        for _ in range(2):  # read and kept
            assert (await client.get(path, headers=bearer(ADMIN))).status_code == 200
        anonymous = await client.get(path)
        assert (anonymous.status_code, anonymous.json()["code"]) == (401, "unauthorized")
        wrong = await client.get(path, headers=bearer("wrong-token-0123456789"))
        assert wrong.status_code == 401
    hidden = await client.get(status_path, headers=bearer(SCOPED))
    assert (hidden.status_code, hidden.json()["code"]) == (404, "session_not_found")
    unlisted = await client.get(listing_path, headers=bearer(SCOPED))
    # (A workspace the token may not see answers as an unregistered one: tests/test_tenants.py.)
    assert (unlisted.status_code, unlisted.json()["code"]) == (400, "workspace_mismatch")


async def test_a_kept_answer_goes_with_its_workers_lease(harness: Harness, redis_client, workspace: str) -> None:
    """The worker dies (kill -9) after its answers were kept: nothing is announced, yet past
    its lease deadline neither the kept status nor the kept listing row is served again."""
    victim = await harness.worker("--lease-ms", "1500")
    api = await harness.api()
    sid = (await create(api, workspace))["sessionId"]
    status_path = f"/session/{sid}/status"
    listing_path = f"/workspace/{workspace_id(workspace)}/sessions"
    for path in (status_path, listing_path, status_path, listing_path):  # read, then kept
        assert (await api.client.get(path)).status_code == 200
    assert "pendingInteractions" in (await api.client.get(listing_path)).json()["sessions"][0]

    await victim.kill9()
    await past_lease(redis_client, victim.incarnation)  # the lease is a time
    gone = await api.client.get(status_path)
    assert (gone.status_code, gone.json()["code"]) == (404, "session_not_found")
    (row,) = (await api.client.get(listing_path)).json()["sessions"]
    assert row["sessionId"] == sid and "pendingInteractions" not in row and row["hasActivePrompt"] is False


async def test_the_shortcut_answers_a_kept_read_and_leaves_every_other_to_the_app(
    harness: Harness, redis_server, workspace: str
) -> None:
    """The tests above would pass with the shortcut never taken: here it is called itself.
    A kept status and a kept listing page are sent by it (as the route sent them); a miss,
    an unknown session, a path selector and another method are left to the app, unsent."""
    from acp_state.api import hot_reads
    from acp_state.api.app import create_app
    from acp_state.api.settings import Settings

    await harness.worker()
    app = create_app(Settings(redis_url=redis_server.url, workspaces=[workspace]))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            made = await client.post("/session", json={"cwd": workspace}, timeout=60)
            sid = made.json()["sessionId"]
            status_path, listing_path = f"/session/{sid}/status", f"/workspace/{workspace_id(workspace)}/sessions"
            by_app = {path: await client.get(path) for path in (status_path, listing_path)}  # read and kept

        async def shortcut(path: str, method: str = "GET") -> tuple[bool, list[dict]]:
            sent: list[dict] = []

            async def send(message: dict) -> None:
                sent.append(message)

            scope = {"type": "http", "method": method, "path": path, "headers": [], "query_string": b""}
            return await hot_reads.answer(app.state.acp, app.authenticator, app.counts, scope, send), sent

        for path in (status_path, listing_path):
            answered, sent = await shortcut(path)
            assert answered and [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
            assert sent[0]["status"] == 200 and sent[1]["body"] == by_app[path].content
            assert dict(sent[0]["headers"])[b"etag"].decode() == by_app[path].headers["etag"]
        for path, method in ((f"/session/{sid}/status", "HEAD"), ("/session/00000000-0000-4000-8000-000000000000/status", "GET"),
                             (f"/workspace/{workspace}/sessions", "GET"), (f"/session/{sid}/transcript", "GET")):
            assert await shortcut(path, method) == (False, []), (method, path)
