"""Runtime status end to end: real Redis, two workers, two API processes, the scripted agent."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import signal


from acp_state.store import keys, scripts
from acp_state.ids import workspace_id
from tests.harness import Harness
from tests.helpers import create, prompt, status

PERMISSION_OPTIONS = [
    {"optionId": "proceed_once", "label": "Allow", "kind": "allow_once"},
    {"optionId": "cancel", "label": "Reject", "kind": "reject_once"},
]
QUESTION_OPTIONS = [
    {"optionId": "proceed_once", "label": "Submit", "kind": "allow_once"},
    {"optionId": "cancel", "label": "Cancel", "kind": "reject_once"},
]
MALFORMED = '`outcome` must be `{ outcome: "cancelled" }` or `{ outcome: "selected", optionId: string }`'


def agent_text(events: list[dict], prompt_id: str) -> str:
    """What the agent said during one prompt (its agent_message_chunk texts)."""
    return "".join(
        e["data"]["update"]["content"].get("text", "")
        for e in events
        if e["type"] == "session_update"
        and e.get("promptId") == prompt_id
        and e["data"]["update"].get("sessionUpdate") == "agent_message_chunk"
    )


async def test_two_workers_two_apis_share_runtime_state(harness: Harness, redis_client, workspace: str) -> None:
    events = await harness.events()
    worker_a = await harness.worker("--max-sessions", "1")
    worker_b = await harness.worker("--max-sessions", "1")
    api1, api2 = await harness.api(), await harness.api()

    first = await create(api1, workspace)
    second = await create(api2, workspace)
    ws = workspace_id(workspace)
    owners = {
        await redis_client.hget(keys.session(ws, s["sessionId"]), "inc"): s["sessionId"] for s in (first, second)
    }
    assert set(owners) == {worker_a.incarnation, worker_b.incarnation}, "placement uses both workers' capacity"
    sid = owners[worker_a.incarnation]

    # A permission, seen identically through both API processes.
    accepted = await prompt(api1, sid, "#permission please")
    request = await events.wait_type(sid, "permission_request")
    via_1, via_2 = await status(api1, sid), await status(api2, sid)
    assert via_1 == via_2
    assert via_1["hasActivePrompt"] is True and via_1["activeWorkState"] == "active"
    assert via_1["isWaitingForPermission"] is True
    assert via_1["isWaitingForUserQuestion"] is False
    assert via_1["pendingInteractionCount"] == 1
    assert via_1["pendingInteractions"] == [
        {
            "requestId": request["data"]["requestId"],
            "kind": "permission",
            "createdAt": via_1["pendingInteractions"][0]["createdAt"],
            "action": {
                "type": "execute",
                "title": "touch perm_check.txt (create a file)",
                "content": [{"type": "content", "content": {"type": "text", "text": "touch perm_check.txt"}}],
                "locations": [],
                "input": {"command": "touch perm_check.txt", "description": "create a file"},
            },
            "options": PERMISSION_OPTIONS,
        }
    ]

    # The vote goes to the *other* API process and still reaches the agent on worker A.
    rid = request["data"]["requestId"]
    vote = await api2.client.post(
        f"/session/{sid}/permission/{rid}", json={"outcome": {"outcome": "selected", "optionId": "proceed_once"}}
    )
    assert vote.status_code == 200 and vote.json() == {}
    done = await events.wait_type(sid, "turn_complete", promptId=accepted["promptId"])
    assert done["data"]["stopReason"] == "end_turn"
    assert agent_text(events.of(sid), accepted["promptId"]) == "permission granted: proceed_once"
    after = await status(api1, sid)
    assert after["isWaitingForPermission"] is False
    assert after["pendingInteractionCount"] == 0 and after["pendingInteractions"] == []
    assert after["hasActivePrompt"] is False

    # A question: answers reach the agent and come back in its reply.
    asked = await prompt(api2, sid, "#question colours")
    question = await events.wait_type(sid, "permission_request", promptId=asked["promptId"])
    shown = await status(api1, sid)
    assert shown["isWaitingForUserQuestion"] is True and shown["isWaitingForPermission"] is False
    assert shown["pendingInteractions"] == [
        {
            "requestId": question["data"]["requestId"],
            "kind": "user_question",
            "createdAt": shown["pendingInteractions"][0]["createdAt"],
            "title": "Ask user 1 question",
            "questions": [
                {
                    "question": "Which color?",
                    "header": "Color",
                    "multiSelect": False,
                    "options": [{"label": "Red", "description": "warm"}, {"label": "Blue", "description": "cool"}],
                    "answerKey": "0",
                }
            ],
            "options": QUESTION_OPTIONS,
        }
    ]
    answer = await api1.client.post(
        f"/session/{sid}/permission/{question['data']['requestId']}",
        json={"outcome": {"outcome": "selected", "optionId": "proceed_once"}, "answers": {"0": "Blue"}},
    )
    assert answer.status_code == 200
    await events.wait_type(sid, "turn_complete", promptId=asked["promptId"])
    assert agent_text(events.of(sid), asked["promptId"]) == 'answers: {"0":"Blue"}'
    cleared = await status(api2, sid)
    assert cleared["isWaitingForUserQuestion"] is False and cleared["pendingInteractionCount"] == 0


async def test_vote_errors_follow_the_reference(harness: Harness, workspace: str) -> None:
    events = await harness.events()
    await harness.worker()
    api = await harness.api()
    sid = (await create(api, workspace))["sessionId"]
    await prompt(api, sid, "#permission")
    rid = (await events.wait_type(sid, "permission_request"))["data"]["requestId"]
    url = f"/session/{sid}/permission/{rid}"

    malformed = await api.client.post(url, json={"outcome": {"outcome": "selected"}})
    # The reference's bodies, each with a `code` added (every failure of acp-state has one).
    assert malformed.status_code == 400 and malformed.json() == {"error": MALFORMED, "code": "invalid_vote"}
    not_json = await api.client.post(url, content=b"{nope")
    assert not_json.status_code == 400

    unknown = await api.client.post(
        f"/session/{sid}/permission/no-such-request", json={"outcome": {"outcome": "cancelled"}}
    )
    assert unknown.status_code == 404
    assert unknown.json() == {
        "error": "No pending permission request for session",
        "code": "permission_request_not_found",
        "sessionId": sid,
        "requestId": "no-such-request",
    }

    sentinel = await api.client.post(url, json={"outcome": {"outcome": "selected", "optionId": "__cancelled__"}})
    assert sentinel.status_code == 400 and sentinel.json()["code"] == "invalid_option_id"
    not_offered = await api.client.post(url, json={"outcome": {"outcome": "selected", "optionId": "proceed_always"}})
    assert not_offered.status_code == 400
    assert not_offered.json() == {
        "error": "optionId is not one of the offered options",
        "code": "invalid_option_id",
        "requestId": rid,
        "optionId": "proceed_always",
    }
    bad_client = await api.client.post(
        url, json={"outcome": {"outcome": "cancelled"}}, headers={"X-Qwen-Client-Id": "bad id!"}
    )
    assert bad_client.status_code == 400 and bad_client.json()["code"] == "invalid_client_id"
    stranger = await api.client.post(
        url, json={"outcome": {"outcome": "cancelled"}}, headers={"X-Qwen-Client-Id": "not-registered"}
    )
    assert stranger.status_code == 400 and stranger.json()["code"] == "invalid_client_id"

    # The rejections above left the request pending; the first valid vote wins it.
    assert (await status(api, sid))["pendingInteractionCount"] == 1
    first = await api.client.post(url, json={"outcome": {"outcome": "selected", "optionId": "cancel"}})
    second = await api.client.post(url, json={"outcome": {"outcome": "selected", "optionId": "proceed_once"}})
    assert first.status_code == 200
    assert second.status_code == 404
    resolved = await events.wait_type(sid, "permission_resolved", requestId=rid)
    assert resolved["data"]["outcome"] == {"outcome": "selected", "optionId": "cancel"}

    legacy = await api.client.post(f"/permission/{rid}", json={"outcome": {"outcome": "cancelled"}})
    assert legacy.status_code == 404
    assert legacy.json() == {"error": "No pending permission request", "code": "permission_request_not_found", "requestId": rid}


async def test_concurrent_votes_on_two_apis_have_one_winner(harness: Harness, workspace: str) -> None:
    events = await harness.events()
    await harness.worker()
    api1, api2 = await harness.api(), await harness.api()
    sid = (await create(api1, workspace))["sessionId"]
    await prompt(api1, sid, "#permission")
    rid = (await events.wait_type(sid, "permission_request"))["data"]["requestId"]
    body = {"outcome": {"outcome": "selected", "optionId": "proceed_once"}}
    votes = await asyncio.gather(
        *[api.client.post(f"/session/{sid}/permission/{rid}", json=body) for api in (api1, api2) * 8]
    )
    assert sorted(v.status_code for v in votes) == [200] + [404] * 15, [v.text for v in votes if v.status_code == 503]
    await events.wait_type(sid, "turn_complete")
    assert [e["type"] for e in events.of(sid)].count("permission_resolved") == 1


async def test_turn_error_survives_queued_prompts_and_clears_on_start(harness: Harness, workspace: str) -> None:
    events = await harness.events()
    worker = await harness.worker("--lease-ms", "30000")
    api = await harness.api()
    sid = (await create(api, workspace))["sessionId"]

    failed = await prompt(api, sid, "#fail")
    error = await events.wait_type(sid, "turn_error", promptId=failed["promptId"])
    assert error["data"] == {
        "sessionId": sid,
        "message": "scripted failure",
        "code": "-32603",
        "promptId": failed["promptId"],
    }
    stored = await status(api, sid)
    assert stored["hasTurnError"] is True
    assert stored["turnError"] == {"message": "scripted failure", "code": "-32603"}
    assert stored["updatedAt"] > stored["createdAt"]

    # Freeze the worker: prompts are admitted and queued, none can start.
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        # The first waits on a vote, so the second is queued behind it however the worker
        # reads the two (a blocked XREAD may hand it the first one alone).
        queued = [await prompt(api, sid, "#permission"), await prompt(api, sid, "again")]
        waiting = await status(api, sid)
        assert waiting["hasTurnError"] is True and waiting["turnError"] == stored["turnError"]
    finally:
        os.kill(worker.pid, signal.SIGCONT)

    asked = await events.wait_type(sid, "permission_request", promptId=queued[0]["promptId"])
    await events.wait_type(sid, "pending_prompt_added", promptId=queued[1]["promptId"])
    started = await status(api, sid)
    assert started["hasTurnError"] is False and "turnError" not in started
    vote = {"outcome": {"outcome": "selected", "optionId": "proceed_once"}}
    voted = await api.client.post(f"/session/{sid}/permission/{asked['data']['requestId']}", json=vote)
    assert voted.status_code == 200, voted.text
    await events.wait_type(sid, "turn_complete", promptId=queued[1]["promptId"])
    after = await status(api, sid)
    assert after["hasTurnError"] is False and "turnError" not in after
    kinds = [e["type"] for e in events.of(sid) if e.get("promptId") == queued[1]["promptId"]]
    assert kinds[0] == "pending_prompt_added" and "pending_prompt_started" in kinds


async def test_queue_is_bounded_per_session(harness: Harness, workspace: str) -> None:
    events = await harness.events()
    await harness.worker()
    api = await harness.api()
    sid = (await create(api, workspace))["sessionId"]
    running = await prompt(api, sid, "#permission")
    await events.wait_type(sid, "permission_request", promptId=running["promptId"])
    for _ in range(5):
        await prompt(api, sid, "queued")
    refused = await api.client.post(f"/session/{sid}/prompt", json={"prompt": [{"type": "text", "text": "one more"}]})
    assert refused.status_code == 503
    assert refused.json()["code"] == "prompt_queue_full" and "Retry-After" in refused.headers


async def test_cancel_resolves_pending_and_ends_cancelled(harness: Harness, workspace: str) -> None:
    events = await harness.events()
    await harness.worker()
    api = await harness.api()
    sid = (await create(api, workspace))["sessionId"]
    running = await prompt(api, sid, "#permission")
    rid = (await events.wait_type(sid, "permission_request"))["data"]["requestId"]
    assert (await api.client.post(f"/session/{sid}/cancel")).status_code == 204
    resolved = await events.wait_type(sid, "permission_resolved", requestId=rid)
    assert resolved["data"]["outcome"] == {"outcome": "cancelled"}
    done = await events.wait_type(sid, "turn_complete", promptId=running["promptId"])
    assert done["data"]["stopReason"] == "cancelled"
    after = await status(api, sid)
    assert after["pendingInteractionCount"] == 0 and after["hasTurnError"] is False


async def test_close_removes_live_state_but_keeps_the_catalog_row(harness: Harness, redis_client, workspace: str) -> None:
    events = await harness.events()
    await harness.worker()
    api = await harness.api()
    sid = (await create(api, workspace))["sessionId"]
    first = await prompt(api, sid, "name me")
    await events.wait_type(sid, "turn_complete", promptId=first["promptId"])
    ws = workspace_id(workspace)

    listed = (await api.client.get(f"/workspace/{ws}/sessions")).json()["sessions"]
    assert [row["sessionId"] for row in listed] == [sid]
    assert listed[0]["displayName"] == "name me" and listed[0]["isArchived"] is False
    assert "pendingInteractions" in listed[0] and listed[0]["hasTurnError"] is False

    closed = await api.client.delete(f"/session/{sid}")
    assert closed.status_code == 204
    await events.wait_type(sid, "session_closed")
    gone = await api.client.get(f"/session/{sid}/status")
    assert gone.status_code == 404
    assert gone.json() == {"error": f'No session with id "{sid}"', "code": "session_not_found", "sessionId": sid}
    assert not await redis_client.exists(keys.session(ws, sid))

    row = (await api.client.get(f"/workspace/{ws}/sessions")).json()["sessions"][0]
    assert row == {
        "sessionId": sid,
        "workspaceCwd": workspace,
        "createdAt": listed[0]["createdAt"],
        "updatedAt": listed[0]["updatedAt"],
        "displayName": "name me",
        "clientCount": 0,
        "hasActivePrompt": False,
        "isArchived": False,
        "resumable": True,  # acp-state's own: a load resumes it (its agent can load sessions)
    }
    # A DELETE of the listed session that is not live deletes its row; then it is unknown.
    assert (await api.client.delete(f"/session/{sid}")).status_code == 204
    assert (await api.client.get(f"/workspace/{ws}/sessions")).json()["sessions"] == []
    assert (await api.client.delete(f"/session/{sid}")).status_code == 404


async def test_single_scope_coalesces_across_api_processes(harness: Harness, workspace: str) -> None:
    await harness.worker()
    api1, api2 = await harness.api(), await harness.api()
    responses = await asyncio.gather(
        *[api.client.post("/session", json={"cwd": workspace}) for api in (api1, api2, api1, api2)]
    )
    bodies = [r.json() for r in responses]
    assert all(r.status_code == 200 for r in responses), bodies
    assert len({b["sessionId"] for b in bodies}) == 1
    assert sorted(b["attached"] for b in bodies) == [False, True, True, True]
    assert len({b["clientId"] for b in bodies}) == 4
    assert (await status(api1, bodies[0]["sessionId"]))["clientCount"] == 4


async def test_bad_session_requests_get_clear_errors(harness: Harness, workspace: str, tmp_path) -> None:
    await harness.worker()
    api = await harness.api()
    mismatch = await api.client.post("/session", json={"cwd": str(tmp_path / "elsewhere")})
    assert mismatch.status_code == 400 and mismatch.json()["code"] == "workspace_mismatch"
    bad_scope = await api.client.post("/session", json={"cwd": workspace, "sessionScope": "team"})
    assert bad_scope.status_code == 400 and bad_scope.json()["code"] == "invalid_session_scope"
    bad_id = await api.client.post("/session", json={"cwd": workspace, "sessionId": "not-a-uuid"})
    assert bad_id.status_code == 400 and bad_id.json()["code"] == "invalid_session_id"
    not_object = await api.client.post("/session", json=[1, 2])
    assert not_object.status_code == 400
    supplied = "2b0c5a0e-1c6d-4d7e-9f00-0123456789ab"
    made = await create(api, workspace, sessionId=supplied)
    assert made["sessionId"] == supplied
    twice = await api.client.post("/session", json={"cwd": workspace, "sessionId": supplied, "sessionScope": "thread"})
    assert twice.status_code == 409
    empty_prompt = await api.client.post(f"/session/{supplied}/prompt", json={"prompt": []})
    assert empty_prompt.status_code == 400 and empty_prompt.json()["code"] == "invalid_prompt"
    unknown = await api.client.post("/session/nope/prompt", json={"prompt": [{"type": "text", "text": "x"}]})
    assert unknown.status_code == 404 and unknown.json()["code"] == "session_not_found"
    ws = workspace_id(workspace)
    # A page size is clamped to 1..100 as the reference does; one that is no number is refused.
    assert len((await api.client.get(f"/workspace/{ws}/sessions?size=0")).json()["sessions"]) == 1
    assert (await api.client.get(f"/workspace/{ws}/sessions?size=ten")).json()["code"] == "invalid_size"
    assert (await api.client.get(f"/workspace/{ws}/sessions?cursor=%%%")).status_code == 400
    assert (await api.client.get(f"/workspace/{ws}/sessions?archiveState=x")).json()["code"] == "invalid_archive_state"
    unknown_ws = await api.client.get("/workspace/0123456789abcdef/sessions")  # neither an id of ours nor a path
    assert unknown_ws.status_code == 400 and unknown_ws.json()["code"] == "workspace_mismatch"


async def test_workspace_listing_pages_newest_first(harness: Harness, workspace: str) -> None:
    events = await harness.events()
    await harness.worker()
    api = await harness.api()
    ids = []
    for n in range(5):
        sid = (await create(api, workspace))["sessionId"]
        done = await prompt(api, sid, f"prompt {n}")
        await events.wait_type(sid, "turn_complete", promptId=done["promptId"])
        ids.append(sid)
    ws = workspace_id(workspace)
    first = (await api.client.get(f"/workspace/{ws}/sessions?size=3")).json()
    second = (await api.client.get(f"/workspace/{ws}/sessions?size=3&cursor={first['nextCursor']}")).json()
    assert "nextCursor" not in second
    listed = [row["sessionId"] for row in first["sessions"] + second["sessions"]]
    assert listed == list(reversed(ids))


async def test_a_burst_of_concurrent_requests_is_served_not_refused(harness: Harness, workspace: str) -> None:
    """More requests in flight than a default Redis pool has connections (100): creates wait
    for their worker's reply on a connection each, and none is refused with a 503."""
    import httpx

    await harness.worker("--max-sessions", "200")
    api = await harness.api()
    burst = 150
    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{api.port}", timeout=60, limits=httpx.Limits(max_connections=None)
    ) as client:
        created = await asyncio.gather(
            *(client.post("/session", json={"cwd": workspace, "sessionScope": "thread"}) for _ in range(burst))
        )
        assert [r.status_code for r in created] == [200] * burst, {r.status_code: r.text for r in created}
        sids = [r.json()["sessionId"] for r in created]
        statuses = await asyncio.gather(*(client.get(f"/session/{sid}/status") for sid in sids))
    assert [r.status_code for r in statuses] == [200] * burst
    listed, cursor = [], ""
    while cursor is not None:
        page = (await api.client.get(f"/workspace/{workspace_id(workspace)}/sessions?size=100{cursor}")).json()
        listed += [row["sessionId"] for row in page["sessions"]]
        cursor = f"&cursor={page['nextCursor']}" if "nextCursor" in page else None
    assert sorted(listed) == sorted(sids)


def script_sha(source: str) -> str:
    return hashlib.sha1(source.encode()).hexdigest()


@contextlib.asynccontextmanager
async def scripts_logged(redis_client):  # noqa: ANN001, ANN201
    """Every script Redis runs meanwhile, by digest (its slow log set to keep every command,
    then restored): `ran()` gives the digests, in the order they ran."""
    before = await redis_client.config_get("slowlog-*")
    await redis_client.config_set("slowlog-max-len", 100_000)
    await redis_client.config_set("slowlog-log-slower-than", 0)
    await redis_client.slowlog_reset()
    logged: list[str] = []

    async def ran() -> list[str]:
        return logged

    try:
        yield ran
    finally:
        await redis_client.config_set("slowlog-log-slower-than", before["slowlog-log-slower-than"])
        entries = await redis_client.slowlog_get(100_000)
        await redis_client.config_set("slowlog-max-len", before["slowlog-max-len"])
        for entry in reversed(entries):
            command = entry["command"]
            words = (command.decode() if isinstance(command, bytes) else command).split()
            if len(words) > 1 and words[0].upper() in ("EVALSHA", "EVALSHA_RO"):
                logged.append(words[1])


async def test_concurrent_readers_of_a_page_not_kept_read_redis_once(harness: Harness, redis_client, workspace: str) -> None:
    """A change in a workspace sends every poller of its first page to Redis at the same
    moment: they share one read of the page rather than each reading the same rows, and
    each still gets the page as it stands after the change."""
    import httpx

    events = await harness.events()
    await harness.worker()
    api = await harness.api()
    sids = [(await create(api, workspace))["sessionId"] for _ in range(4)]
    path = f"/workspace/{workspace_id(workspace)}/sessions?size=10"
    readers = 40
    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{api.port}", timeout=30, limits=httpx.Limits(max_connections=None)
    ) as client:
        async def all_read() -> list[httpx.Response]:
            return await asyncio.gather(*(client.get(path) for _ in range(readers)))

        kept = (await all_read())[0].json()  # every reader's connection open, the page kept
        done = await prompt(api, sids[0], "a change")
        await events.wait_type(sids[0], "turn_complete", promptId=done["promptId"])
        # Redis holds every command for a moment: the readers all arrive before any read of
        # the page can end, as a crowd of pollers does on a busy process.
        async with scripts_logged(redis_client) as ran:
            await redis_client.execute_command("CLIENT", "PAUSE", 500, "ALL")
            answers = await all_read()
        reads = sum(1 for sha in await ran() if sha in (script_sha(scripts.LIST), script_sha(scripts.VERSION)))
    assert [a.status_code for a in answers] == [200] * readers
    pages = {a.content for a in answers}
    assert len(pages) == 1, "every reader got the same page"
    changed = [row for row in answers[0].json()["sessions"] if row["sessionId"] == sids[0]][0]
    earlier = [row for row in kept["sessions"] if row["sessionId"] == sids[0]][0]
    assert changed != earlier, "the page after the change, not the one kept before it"
    # Forty readers each reading would run forty; a read that began before a late change's
    # invalidation may be followed by one more. (Heartbeats and sweeps run other scripts
    # meanwhile, as many as the machine's load makes the window long: not counted.)
    assert reads <= 2, f"{readers} concurrent readers of one page ran the page's scripts {reads} times"
