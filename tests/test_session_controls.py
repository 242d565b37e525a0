"""A live session's controls of issue 39 item 2, end to end: real Redis, a worker, two API
processes over loopback HTTP, the scripted agent.

Presence (`POST /session/:id/heartbeat`, `POST /session/:id/detach`): before, both routes
answered 404 and a viewer never left its session (one Web Shell tab read "3 client(s)")."""

from __future__ import annotations

import asyncio
import contextlib
import json

import httpx

from acp_state.ids import workspace_id
from acp_state.store import keys
from testbed.processes import ApiProcess
from tests.harness import Harness
from tests.helpers import create, eventually, status

CLIENT_TTL_MS = 1500
W1_TOKEN = "controls-one-token-0123456789"
W2_TOKEN = "controls-two-token-0123456789"


def as_client(client_id: str) -> dict[str, str]:
    return {"X-Qwen-Client-Id": client_id}


async def heartbeat(api: ApiProcess, sid: str, client_id: str | None, **headers: str) -> httpx.Response:
    return await api.client.post(f"/session/{sid}/heartbeat", json={},
                                 headers={**(as_client(client_id) if client_id else {}), **headers})


async def detach(api: ApiProcess, sid: str, client_id: str | None, **headers: str) -> httpx.Response:
    return await api.client.post(f"/session/{sid}/detach", headers={**(as_client(client_id) if client_id else {}), **headers})


async def client_count(api: ApiProcess, sid: str) -> int:
    return (await status(api, sid))["clientCount"]


async def test_viewers_are_counted_while_present_and_leave_on_detach_or_silence(harness: Harness, workspace: str) -> None:
    await harness.worker()
    ttl = ("--client-ttl-ms", str(CLIENT_TTL_MS))
    api1, api2 = await harness.api(*ttl), await harness.api(*ttl)
    features = (await api1.client.get("/capabilities")).json()["features"]
    assert "client_heartbeat" in features

    created = await api1.client.post("/session", json={"cwd": workspace, "sessionScope": "thread"},
                                     headers=as_client("tab-a"))
    assert created.status_code == 200, created.text
    sid = created.json()["sessionId"]
    for tab in ("tab-b", "tab-c"):  # two more viewers open it, through the other API process
        loaded = await api2.client.post(f"/session/{sid}/load", json={}, headers=as_client(tab))
        assert loaded.status_code == 200, loaded.text
    assert await client_count(api1, sid) == await client_count(api2, sid) == 3

    # A heartbeat answers as the reference's: the session, the client, when it was seen.
    beat = await heartbeat(api2, sid, "tab-a")
    assert beat.status_code == 200, beat.text
    assert set(beat.json()) == {"sessionId", "clientId", "lastSeenAt"}
    assert beat.json()["sessionId"] == sid and beat.json()["clientId"] == "tab-a"
    assert isinstance(beat.json()["lastSeenAt"], int)
    anonymous = await heartbeat(api1, sid, None)
    assert anonymous.status_code == 200 and set(anonymous.json()) == {"sessionId", "lastSeenAt"}

    # A detach on one API process is seen at once on the other.
    left = await detach(api2, sid, "tab-a")
    assert left.status_code == 204 and left.content == b""
    assert await client_count(api1, sid) == await client_count(api2, sid) == 2
    again = await heartbeat(api1, sid, "tab-a")  # it is no longer the session's client
    assert again.status_code == 400
    assert again.json() == {
        "error": f'Client id "tab-a" is not registered for session {sid}', "code": "invalid_client_id",
        "sessionId": sid, "clientId": "tab-a",
    }
    assert (await detach(api1, sid, "tab-a")).status_code == 204  # leaving twice changes nothing
    assert (await detach(api1, sid, None)).status_code == 204
    assert await client_count(api1, sid) == 2

    # tab-b heartbeats once and vanishes (a closed laptop); tab-c keeps heartbeating.
    assert (await heartbeat(api1, sid, "tab-b")).status_code == 200
    assert await client_count(api1, sid) == 2

    beats = [0]

    async def keep_beating() -> None:
        while True:
            assert (await heartbeat(api2, sid, "tab-c")).status_code == 200
            beats[0] += 1
            await asyncio.sleep(CLIENT_TTL_MS / 4000)  # four a TTL: the Web Shell's pace is three

    beating = asyncio.ensure_future(keep_beating())
    try:
        await eventually(lambda: _count_is(api1, sid, 1), "the silent client leaving the session on API 1")
        assert await client_count(api2, sid) == 1
        assert (await heartbeat(api1, sid, "tab-b")).status_code == 400  # gone, as after a detach
        # tab-c stays as long as it heartbeats: two TTLs more, on both API processes.
        until = beats[0] + 8
        await eventually(lambda: beating.done() or beats[0] >= until, "eight more heartbeats of tab-c")
        assert not beating.done(), beating
        assert await client_count(api1, sid) == await client_count(api2, sid) == 1
    finally:
        beating.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beating


async def _count_is(api: ApiProcess, sid: str, count: int) -> bool:
    return await client_count(api, sid) == count


async def test_presence_routes_refuse_what_the_caller_may_not_see(harness: Harness, workspace: str, tmp_path) -> None:
    other = tmp_path / "w2"
    other.mkdir()
    await harness.worker()
    api = await harness.api("--token", f"{W1_TOKEN},workspace={workspace}", "--token", f"{W2_TOKEN},workspace={other}",
                            workspaces=[workspace, str(other)])
    w1, w2 = {"Authorization": f"Bearer {W1_TOKEN}"}, {"Authorization": f"Bearer {W2_TOKEN}"}
    created = await api.client.post("/session", json={"cwd": workspace, "sessionScope": "thread"},
                                    headers={**w1, **as_client("tab-a")})
    assert created.status_code == 200, created.text
    sid = created.json()["sessionId"]
    unknown = "00000000-0000-4000-8000-000000000000"

    for route, answer in (("heartbeat", 404), ("detach", 204)):
        # Another workspace's token is told nothing: the answer of an unknown session (a
        # heartbeat's 404; a detach's 204 as the reference's, having done nothing).
        theirs = await api.client.post(f"/session/{sid}/{route}", headers={**w2, **as_client("tab-a")})
        nobody = await api.client.post(f"/session/{unknown}/{route}", headers={**w1, **as_client("tab-a")})
        assert theirs.status_code == nobody.status_code == answer
        assert theirs.content == nobody.content.replace(unknown.encode(), sid.encode())
        bad = await api.client.post(f"/session/{sid}/{route}", headers={**w1, "X-Qwen-Client-Id": "a b"})
        assert bad.status_code == 400 and bad.json()["code"] == "invalid_client_id"
        anonymous = await api.client.post(f"/session/{sid}/{route}", headers=as_client("tab-a"))
        assert anonymous.status_code == 401
    theirs = await api.client.get(f"/session/{sid}/pending-prompts", headers=w2)
    nobody = await api.client.get(f"/session/{unknown}/pending-prompts", headers=w1)
    assert theirs.status_code == nobody.status_code == 404
    assert theirs.content == nobody.content.replace(unknown.encode(), sid.encode())
    answer = (await api.client.get(f"/session/{sid}/status", headers=w1)).json()
    assert answer["clientCount"] == 1  # none of these touched the session's client


async def test_a_detached_client_stays_gone_when_the_worker_rewrites_its_session(
    own_harness: Harness, own_client, workspace: str
) -> None:
    """The owner is told of a detach: when Redis loses everything (restarted empty) and the
    worker rewrites the sessions it hosts from its memory, the client does not come back."""
    await own_harness.worker()
    api = await own_harness.api()
    created = await api.client.post("/session", json={"cwd": workspace, "sessionScope": "thread"},
                                    headers=as_client("tab-a"))
    sid = created.json()["sessionId"]
    assert (await api.client.post(f"/session/{sid}/load", json={}, headers=as_client("tab-b"))).status_code == 200
    assert (await detach(api, sid, "tab-a")).status_code == 204
    assert await client_count(api, sid) == 1
    epoch = await own_client.hget(keys.session(workspace_id(workspace), sid), "epoch")
    await own_client.flushall()

    async def rewritten() -> bool:
        now = await own_client.hget(keys.session(workspace_id(workspace), sid), "epoch")
        return now is not None and now != epoch

    await eventually(rewritten, "the worker rewriting its session after Redis lost it")
    fresh = await own_harness.api()  # no cached copy of the session from before
    assert await client_count(fresh, sid) == 1
    assert (await heartbeat(fresh, sid, "tab-a")).status_code == 400
    assert (await heartbeat(fresh, sid, "tab-b")).status_code == 200


async def test_the_prompt_queue_is_the_same_on_every_api_process(harness: Harness, workspace: str) -> None:
    """`GET /session/:id/pending-prompts` (before: 404): the running prompt, then the queued
    ones in the order they were accepted, whichever API process accepted them."""
    events = await harness.events()
    await harness.worker()
    api1, api2 = await harness.api(), await harness.api()
    created = await api1.client.post("/session", json={"cwd": workspace, "sessionScope": "thread"},
                                     headers=as_client("tab-a"))
    sid = created.json()["sessionId"]
    assert (await api2.client.get(f"/session/{sid}/pending-prompts")).json() == {"pendingPrompts": []}

    async def send(api: ApiProcess, text: str, client: str) -> str:
        accepted = await api.client.post(f"/session/{sid}/prompt", json={"prompt": [{"type": "text", "text": text}]},
                                         headers=as_client(client))
        assert accepted.status_code == 202, accepted.text
        return accepted.json()["promptId"]

    running = await send(api1, "#permission please", "tab-a")
    request = await events.wait_type(sid, "permission_request", promptId=running)
    second = await send(api2, "hello second", "tab-a")
    third = await send(api1, "hello third", "tab-a")
    queues = [(await api.client.get(f"/session/{sid}/pending-prompts")).json() for api in (api1, api2)]
    assert queues[0] == queues[1]
    queue = queues[0]["pendingPrompts"]
    assert [(p["promptId"], p["state"], p["text"]) for p in queue] == [
        (running, "running", "#permission please"), (second, "queued", "hello second"), (third, "queued", "hello third"),
    ]
    assert all(p["originatorClientId"] == "tab-a" and isinstance(p["queuedAt"], int) for p in queue)
    assert set(queue[0]) == {"promptId", "text", "queuedAt", "state", "originatorClientId"}

    assert request["data"]["requestId"]

    # Taking a queued prompt out (DELETE .../pending-prompts/:promptId, before: 404): it ends
    # `cancelled` without running, on every API process's view.
    removed = await api2.client.delete(f"/session/{sid}/pending-prompts/{second}")
    assert removed.status_code == 200 and removed.json() == {"removed": True}
    said = await events.wait_type(sid, "pending_prompt_completed", promptId=second)
    assert said["data"] == {"sessionId": sid, "promptId": second, "state": "removed"}
    await events.wait_type(sid, "turn_complete", promptId=second)
    assert [p["promptId"] for p in (await api1.client.get(f"/session/{sid}/pending-prompts")).json()["pendingPrompts"]] == [
        running, third,
    ]
    turn = (await api1.client.get(f"/session/{sid}/turns/{second}")).json()
    assert turn["state"] == "cancelled" and "startedAt" not in turn
    for gone in (second, "no-such-prompt"):
        again = await api1.client.delete(f"/session/{sid}/pending-prompts/{gone}")
        assert again.status_code == 200 and again.json() == {"removed": False}

    # Taking the running one out cancels it; the next queued prompt then runs.
    assert (await api1.client.delete(f"/session/{sid}/pending-prompts/{running}")).json() == {"removed": True}
    ended = await events.wait_type(sid, "turn_complete", promptId=running)
    assert ended["data"]["stopReason"] == "cancelled"
    await events.wait_type(sid, "turn_complete", promptId=third)
    assert (await api2.client.get(f"/session/{sid}/pending-prompts")).json() == {"pendingPrompts": []}
    unknown = "00000000-0000-4000-8000-000000000000"
    for answer in (await api1.client.get(f"/session/{unknown}/pending-prompts"),
                   await api1.client.delete(f"/session/{unknown}/pending-prompts/{third}")):
        assert answer.status_code == 404 and answer.json()["code"] == "session_not_found"


COMMANDS = [{"name": "review", "description": "Review the changes", "input": {"hint": "what to review"}},
            {"name": "init", "description": "Write an AGENTS.md"}]


async def test_supported_commands_are_what_the_agent_advertised(harness: Harness, workspace: str) -> None:
    """`GET /session/:id/supported-commands` (before: 404): the agent's last
    `available_commands_update`, on every API process; `[]` from an agent that sent none."""
    events = await harness.events()
    await harness.worker(env={"ACP_SCRIPTED_EAGER_UPDATE": "after", "ACP_SCRIPTED_COMMANDS": json.dumps(COMMANDS)})
    api1, api2 = await harness.api(), await harness.api()
    assert "session_supported_commands" in (await api1.client.get("/capabilities")).json()["features"]
    sid = (await create(api1, workspace))["sessionId"]
    await events.wait_type(sid, "session_update")  # the update reached the worker after the create's answer
    for api in (api1, api2):
        answer = await api.client.get(f"/session/{sid}/supported-commands")
        assert answer.status_code == 200, answer.text
        assert answer.json() == {"v": 1, "sessionId": sid, "availableCommands": COMMANDS, "availableSkills": []}
    unknown = await api2.client.get("/session/00000000-0000-4000-8000-000000000000/supported-commands")
    assert unknown.status_code == 404 and unknown.json()["code"] == "session_not_found"


async def test_an_agent_that_advertises_nothing_has_no_commands(harness: Harness, workspace: str) -> None:
    await harness.worker()
    api = await harness.api()
    sid = (await create(api, workspace))["sessionId"]
    answer = await api.client.get(f"/session/{sid}/supported-commands")
    assert answer.json() == {"v": 1, "sessionId": sid, "availableCommands": [], "availableSkills": []}


async def test_the_approval_mode_is_the_agents_session_mode(harness: Harness, workspace: str) -> None:
    """`POST /session/:id/approval-mode` (before: 404, the Web Shell's red toast) switches the
    agent's ACP session mode; the status shows it on every API process; a mode the agent does
    not offer gets the reference's 400, naming the ones it does; `approvalMode` on create
    starts the session in that mode (before: ignored)."""
    events = await harness.events()
    await harness.worker(env={"ACP_SCRIPTED_MODES": "default,auto-edit,plan"})
    api1, api2 = await harness.api(), await harness.api()
    assert "session_approval_mode_control" in (await api1.client.get("/capabilities")).json()["features"]
    created = await api1.client.post("/session", json={"cwd": workspace, "sessionScope": "thread"},
                                     headers=as_client("tab-a"))
    sid = created.json()["sessionId"]
    assert (await status(api2, sid))["approvalMode"] == "default"

    switched = await api2.client.post(f"/session/{sid}/approval-mode", json={"mode": "plan"}, headers=as_client("tab-a"))
    assert switched.status_code == 200, switched.text
    assert switched.json() == {"sessionId": sid, "mode": "plan", "previous": "default", "persisted": False}
    changed = await events.wait_type(sid, "approval_mode_changed")
    assert changed["data"] == {"sessionId": sid, "previous": "default", "next": "plan", "persisted": False}
    assert changed["originatorClientId"] == "tab-a"
    assert (await status(api1, sid))["approvalMode"] == (await status(api2, sid))["approvalMode"] == "plan"

    not_offered = await api1.client.post(f"/session/{sid}/approval-mode", json={"mode": "yolo"})
    assert not_offered.status_code == 400
    assert not_offered.json() == {"error": "`mode` is required and must be one of the allowed values",
                                  "code": "invalid_approval_mode", "allowed": ["default", "auto-edit", "plan"]}
    unknown_name = await api1.client.post(f"/session/{sid}/approval-mode", json={"mode": "sideways"})
    assert unknown_name.status_code == 400
    assert unknown_name.json()["allowed"] == ["plan", "default", "auto-edit", "auto", "yolo"]
    for body, code in (({"mode": "plan", "persist": "yes"}, "invalid_persist_flag"),
                       ({"mode": "plan", "planMode": True}, "invalid_plan_mode")):
        refused = await api1.client.post(f"/session/{sid}/approval-mode", json=body)
        assert refused.status_code == 400 and refused.json()["code"] == code
    assert (await status(api1, sid))["approvalMode"] == "plan"  # none of those changed it
    nobody = await api1.client.post("/session/00000000-0000-4000-8000-000000000000/approval-mode", json={"mode": "plan"})
    assert nobody.status_code == 404 and nobody.json()["code"] == "session_not_found"

    started = await create(api2, workspace, approvalMode="auto-edit")
    assert (await status(api1, started["sessionId"]))["approvalMode"] == "auto-edit"
    bad = await api2.client.post("/session", json={"cwd": workspace, "approvalMode": "sideways"})
    assert bad.status_code == 400 and bad.json()["code"] == "invalid_approval_mode"


async def test_an_agent_without_modes_offers_none(harness: Harness, workspace: str) -> None:
    await harness.worker()
    api = await harness.api()
    sid = (await create(api, workspace))["sessionId"]
    assert "approvalMode" not in await status(api, sid)
    refused = await api.client.post(f"/session/{sid}/approval-mode", json={"mode": "default"})
    assert refused.status_code == 400 and refused.json()["allowed"] == []
