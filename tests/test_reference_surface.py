"""The reference's runtime-state surface beyond status and listing, across API processes:
workspace `:id` by id or path, live state with its catalog version (ETag/304, batch),
turn status, the batch catalog, capabilities, and the event stream's headers."""

from __future__ import annotations

import os
import urllib.parse
from pathlib import Path

from acp_state.ids import workspace_id
from testbed.processes import ApiProcess
from tests.harness import Harness
from tests.helpers import create, prompt

PROCEED_ONCE = {"outcome": {"outcome": "selected", "optionId": "proceed_once"}}


def encoded(path: str) -> str:
    return urllib.parse.quote(path, safe="")


async def live_state(api: ApiProcess, workspace: str, **headers: str) -> tuple[int, dict, dict]:
    response = await api.client.get(f"/workspaces/{workspace_id(workspace)}/sessions/live-state", headers=headers)
    return response.status_code, dict(response.headers), response.json() if response.content else {}


async def test_workspace_routes_take_an_id_or_an_absolute_path(harness: Harness, workspace: str, tmp_path: Path) -> None:
    await harness.worker()
    api = await harness.api()
    sid = (await create(api, workspace))["sessionId"]
    link = tmp_path / "link-to-ws"
    os.symlink(workspace, link)

    by_id = (await api.client.get(f"/workspace/{workspace_id(workspace)}/sessions")).json()
    for form in (encoded(workspace), encoded(str(link)), encoded(workspace + "/")):  # the SDK's path form
        answer = await api.client.get(f"/workspace/{form}/sessions")
        assert answer.status_code == 200, (form, answer.text)
        assert answer.json() == by_id and [s["sessionId"] for s in by_id["sessions"]] == [sid]
    assert (await api.client.get(f"/workspaces/{encoded(workspace)}/sessions/live-state")).status_code == 200

    relative = await api.client.get("/workspace/ws/sessions")
    assert relative.status_code == 400
    assert relative.json() == {"error": "`:id` must decode to a workspace id or absolute path", "code": "workspace_mismatch"}
    elsewhere = str(tmp_path / "elsewhere")
    foreign = await api.client.get(f"/workspace/{encoded(elsewhere)}/sessions")
    assert foreign.status_code == 400
    assert foreign.json() == {
        "error": f'Workspace mismatch: daemon is bound to "{workspace}"', "code": "workspace_mismatch",
        "boundWorkspace": workspace, "requestedWorkspace": elsewhere,
    }
    foreign_live = await api.client.get(f"/workspaces/{encoded(elsewhere)}/sessions/live-state")
    assert foreign_live.status_code == 400 and foreign_live.json()["workspaceCount"] == 1
    # A create names its cwd by any path to the workspace; the session carries the registered one.
    made = await api.client.post("/session", json={"cwd": str(link), "sessionScope": "thread"})
    assert made.status_code == 200 and made.json()["workspaceCwd"] == workspace


async def test_live_state_revision_moves_with_each_change_alike_on_every_api(harness: Harness, workspace: str) -> None:
    events = await harness.events()
    await harness.worker()
    api1, api2 = await harness.api(), await harness.api()
    code, headers, empty = await live_state(api1, workspace)
    assert code == 200 and empty["sessions"] == [] and headers["cache-control"] == "no-store"
    generation = empty["catalogVersion"]["generation"]

    sid = (await create(api1, workspace))["sessionId"]
    _, _, one = await live_state(api1, workspace)
    assert one["catalogVersion"]["generation"] == generation
    assert one["catalogVersion"]["revision"] > empty["catalogVersion"]["revision"]
    [row] = one["sessions"]
    assert row == {
        "sessionId": sid, "clientCount": 1, "hasActivePrompt": False, "activeWorkState": "idle",
        "isWaitingForPermission": False, "isWaitingForUserQuestion": False,
    }

    asked = await prompt(api2, sid, "#permission")
    request = await events.wait_type(sid, "permission_request", promptId=asked["promptId"])
    _, _, waiting = await live_state(api2, workspace)
    _, _, seen_by_other = await live_state(api1, workspace)
    assert waiting == seen_by_other  # one revision for one state, on every API process
    assert waiting["catalogVersion"]["revision"] > one["catalogVersion"]["revision"]
    assert waiting["sessions"][0]["isWaitingForPermission"] is True
    assert waiting["sessions"][0]["activeWorkState"] == "active"

    rid = request["data"]["requestId"]
    assert (await api1.client.post(f"/session/{sid}/permission/{rid}", json=PROCEED_ONCE)).status_code == 200
    await events.wait_type(sid, "turn_complete", promptId=asked["promptId"])
    _, _, done = await live_state(api2, workspace)
    assert done["catalogVersion"]["revision"] > waiting["catalogVersion"]["revision"]
    assert done["sessions"][0]["hasActivePrompt"] is False and "updatedAt" in done["sessions"][0]


async def test_a_poller_with_the_etag_gets_304_until_something_changes(harness: Harness, workspace: str) -> None:
    events = await harness.events()
    await harness.worker()
    api = await harness.api()
    sid = (await create(api, workspace))["sessionId"]
    _, headers, body = await live_state(api, workspace)
    etag = headers["etag"]
    code, again, nothing = await live_state(api, workspace, **{"If-None-Match": etag})
    assert (code, again["etag"], nothing) == (304, etag, {})

    done = await prompt(api, sid, "hello")
    await events.wait_type(sid, "turn_complete", promptId=done["promptId"])
    code, changed, newer = await live_state(api, workspace, **{"If-None-Match": etag})
    assert code == 200 and changed["etag"] != etag
    assert newer["catalogVersion"]["revision"] > body["catalogVersion"]["revision"]


async def test_a_listing_poller_with_the_etag_gets_304_until_the_listing_changes(harness: Harness, workspace: str) -> None:
    """The listing's ETag is the page's own, named once when the page is kept: a read from
    the cache names the same one, and a change names another."""
    events = await harness.events()
    await harness.worker()
    api = await harness.api()
    sid = (await create(api, workspace))["sessionId"]
    path = f"/workspace/{workspace_id(workspace)}/sessions"
    first = await api.client.get(path)
    etag = first.headers["etag"]
    assert etag.startswith('W/"') and (await api.client.get(path)).headers["etag"] == etag
    unchanged = await api.client.get(path, headers={"If-None-Match": etag})
    assert (unchanged.status_code, unchanged.content) == (304, b"")

    done = await prompt(api, sid, "hello")
    await events.wait_type(sid, "turn_complete", promptId=done["promptId"])
    changed = await api.client.get(path, headers={"If-None-Match": etag})
    assert changed.status_code == 200 and changed.headers["etag"] != etag
    assert changed.json()["sessions"][0]["sessionId"] == sid


async def test_live_state_of_several_workspaces_in_one_request(harness: Harness, tmp_path: Path) -> None:
    first, second = tmp_path / "one", tmp_path / "two"
    first.mkdir()
    second.mkdir()
    await harness.worker()
    api = await harness.api(workspaces=[str(first), str(second)])
    sid = (await create(api, str(second)))["sessionId"]
    answer = await api.client.post(
        "/sessions/live-state", json={"workspaces": [str(second), workspace_id(str(first)), "/nowhere"]}
    )
    assert answer.status_code == 200
    two, one, missing = answer.json()["workspaces"]
    assert (two["workspace"], two["workspaceId"], two["cwd"]) == (str(second), workspace_id(str(second)), str(second))
    assert [s["sessionId"] for s in two["sessions"]] == [sid] and one["sessions"] == []
    assert set(one["catalogVersion"]) == {"generation", "revision"}
    assert missing == {"workspace": "/nowhere", "error": {
        "code": "workspace_not_found", "message": "Workspace is not registered with this daemon.", "status": 404}}
    too_many = await api.client.post("/sessions/live-state", json={"workspaces": [str(first)] * 21})
    assert too_many.status_code == 400 and too_many.json()["code"] == "too_many_workspaces"
    malformed = await api.client.post("/sessions/live-state", json={"workspaces": "all"})
    assert malformed.status_code == 400 and malformed.json()["code"] == "invalid_live_state_request"


async def test_turn_status_follows_a_prompt_from_queued_to_its_end_on_any_api(harness: Harness, workspace: str) -> None:
    events = await harness.events()
    await harness.worker()
    api1, api2 = await harness.api(), await harness.api()
    sid = (await create(api1, workspace))["sessionId"]
    assert (await api2.client.get(f"/session/{sid}/turns/current")).json() == {"sessionId": sid, "state": "idle"}

    running = await prompt(api1, sid, "#permission")
    queued = await prompt(api1, sid, "second in line")
    request = await events.wait_type(sid, "permission_request", promptId=running["promptId"])
    current = (await api2.client.get(f"/session/{sid}/turns/current")).json()
    assert current["state"] == "running" and current["promptId"] == running["promptId"]
    assert current["promptText"] == "#permission" and current["startedAt"] >= current["queuedAt"]
    waiting = (await api2.client.get(f"/session/{sid}/turns/{queued['promptId']}")).json()
    assert waiting["state"] == "queued" and "startedAt" not in waiting and waiting["promptText"] == "second in line"

    rid = request["data"]["requestId"]
    assert (await api2.client.post(f"/session/{sid}/permission/{rid}", json=PROCEED_ONCE)).status_code == 200
    await events.wait_type(sid, "turn_complete", promptId=queued["promptId"])
    first = (await api1.client.get(f"/session/{sid}/turns/{running['promptId']}")).json()
    assert first["state"] == "completed" and first["stopReason"] == "end_turn"
    assert first["resultText"] == "permission granted: proceed_once"
    assert first["queuedAt"] <= first["startedAt"] <= first["endedAt"]
    last = (await api1.client.get(f"/session/{sid}/turns/current")).json()
    assert last["promptId"] == queued["promptId"] and last["resultText"] == "second in line"

    failed = await prompt(api1, sid, "#fail")
    await events.wait_type(sid, "turn_error", promptId=failed["promptId"])
    error = (await api2.client.get(f"/session/{sid}/turns/{failed['promptId']}")).json()
    assert error["state"] == "error" and error["error"]["message"] and "stopReason" not in error

    unknown = await api1.client.get(f"/session/{sid}/turns/nope")
    assert unknown.status_code == 404
    assert unknown.json() == {
        "error": f"Prompt nope not found in session {sid}", "code": "prompt_not_found", "sessionId": sid, "promptId": "nope",
    }
    assert (await api1.client.get("/session/nope/turns/current")).json()["code"] == "session_not_found"


async def test_batch_catalog_pages_each_selected_workspace(harness: Harness, workspace: str) -> None:
    await harness.worker()
    api = await harness.api()
    sids = [(await create(api, workspace))["sessionId"] for _ in range(3)]
    answer = await api.client.post(
        "/sessions/catalog", json={"workspaces": [{"workspace": workspace}, {"workspace": "/nowhere"}], "options": {"size": 2}}
    )
    assert answer.status_code == 200
    page, missing = answer.json()["workspaces"]
    assert (page["workspace"], page["workspaceId"], page["cwd"]) == (workspace, workspace_id(workspace), workspace)
    listed = [s["sessionId"] for s in page["sessions"]]
    assert len(listed) == 2 and set(listed) < set(sids)
    following = await api.client.post(
        "/sessions/catalog", json={"workspaces": [{"workspace": workspace, "cursor": page["nextCursor"]}]}
    )
    [rest] = following.json()["workspaces"]
    assert set(listed + [s["sessionId"] for s in rest["sessions"]]) == set(sids)
    assert missing["error"]["code"] == "workspace_not_found"
    everything = (await api.client.post("/sessions/catalog", json={"workspaces": "all"})).json()["workspaces"]
    assert [m["workspaceId"] for m in everything] == [workspace_id(workspace)]
    for bad in ({"workspaces": []}, {"workspaces": "all", "extra": 1}, {"workspaces": "all", "options": {"size": 0}}):
        refused = await api.client.post("/sessions/catalog", json=bad)
        assert refused.status_code == 400 and refused.json()["code"] == "invalid_session_catalog_request", bad


async def test_capabilities_and_event_stream_headers_as_the_reference(harness: Harness, workspace: str) -> None:
    await harness.worker()
    api = await harness.api()
    capabilities = (await api.client.get("/capabilities")).json()
    assert capabilities["protocolVersions"] == {"current": "v1", "supported": ["v1"]}
    assert capabilities["sessionLiveStatePollIntervalMs"] == 5000 and capabilities["workspaceCwd"] == workspace
    assert capabilities["workspaces"] == [
        {"id": workspace_id(workspace), "cwd": workspace, "primary": True, "trusted": True, "workflowsEnabled": False}
    ]
    for feature in ("session_status", "session_turn_status", "session_catalog_batch", "workspace_session_live_state",
                    "session_events", "client_identity", "permission_vote", "session_permission_vote"):
        assert feature in capabilities["features"]

    sid = (await create(api, workspace))["sessionId"]
    epoch = (await prompt(api, sid, "hi"))["eventEpoch"]
    async with api.client.stream("GET", f"/session/{sid}/events") as stream:
        headers = stream.headers
        assert headers["content-type"].startswith("text/event-stream")
        assert headers["cache-control"] == "no-cache, no-transform"
        assert headers["x-qwen-event-epoch"] == epoch and len(headers["x-qwen-sse-stream-id"]) == 36
    async with api.client.stream("GET", f"/session/{sid}/events") as again:
        assert again.headers["x-qwen-sse-stream-id"] != headers["x-qwen-sse-stream-id"]
