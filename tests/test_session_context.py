"""A session's context and its resume, the reference's routes of issue 39, end to end: real
Redis, workers with the scripted agent, two API processes over loopback HTTP.

* `POST /session/:id/resume`: a load without the replay; the worker brings a persisted
  session back by the agent's ACP `session/resume` where it advertises it (nothing is
  replayed), else by `session/load`.
* `GET /session/:id/context` and `/context-usage`: what the agent reported of the session (its
  modes; its last ACP `usage_update`), the same on every API process.
* `GET /session/:id/goal`, `/workspace/settings`, `/workspace/extensions`: answered as a daemon
  with none of them, so the reference's Web Shell shows them empty instead of an error.
"""

from __future__ import annotations

import json
from pathlib import Path

from testbed.processes import ApiProcess
from tests.harness import Harness
from tests.helpers import create, prompt, recalled, turn_done

LEASE_MS = "1500"
CONTEXT_SIZE = 32000


def methods_sent(record: Path) -> list[str]:
    """The ACP methods the scripted agent was sent (ACP_SCRIPTED_RECORD), in order."""
    lines = record.read_text().splitlines() if record.exists() else []
    return [m["method"] for m in map(json.loads, lines) if isinstance(m.get("method"), str)]


async def resume(api: ApiProcess, sid: str, **headers: str):
    return await api.client.post(f"/session/{sid}/resume", json={}, headers=headers)


async def test_a_persisted_session_resumes_through_the_agents_session_resume(
    harness: Harness, workspace: str, tmp_path: Path
) -> None:
    record = tmp_path / "agent-messages.jsonl"
    env = {"ACP_SCRIPTED_RESUME": "1", "ACP_SCRIPTED_MODES": "default,plan", "ACP_SCRIPTED_RECORD": str(record)}
    first = await harness.worker("--lease-ms", LEASE_MS, env=env)
    api1, api2 = await harness.api(), await harness.api()
    assert {"session_resume", "unstable_session_resume"} <= set((await api1.client.get("/capabilities")).json()["features"])
    watcher = await harness.events()
    sid = (await create(api1, workspace))["sessionId"]
    told = await prompt(api1, sid, "remember PELICAN")
    assert (await turn_done(watcher, sid, told["promptId"]))["type"] == "turn_complete"

    # A live session: the caller is attached, as a load attaches it, and nothing is replayed.
    live = await resume(api2, sid, **{"X-Qwen-Client-Id": "tab-b"})
    assert live.status_code == 200, live.text
    assert live.json()["attached"] is True and live.json()["clientId"] == "tab-b" and live.json()["state"] == {}
    assert "compactedReplay" not in live.json()
    assert (await api1.client.get(f"/session/{sid}/status")).json()["clientCount"] == 2

    await first.kill9()
    await watcher.wait_type(sid, "session_died")
    record.unlink()
    await harness.worker("--lease-ms", LEASE_MS, env=env)
    resumed = await resume(api2, sid)
    assert resumed.status_code == 200, resumed.text
    body = resumed.json()
    assert body["sessionId"] == sid and body["attached"] is False and body["hasActivePrompt"] is False
    assert "compactedReplay" not in body
    # `state`: the session's modes as the agent reported them on its session/resume.
    assert body["state"]["modes"]["availableModes"] == [{"id": "default", "name": "Default"}, {"id": "plan", "name": "Plan"}]
    # The agent was asked to resume it, not to load (and replay) it, and it knows its history.
    assert "session/resume" in methods_sent(record) and "session/load" not in methods_sent(record)
    assert "remember PELICAN" in await recalled(harness, api1, sid)

    unknown = await resume(api1, "00000000-0000-4000-8000-000000000000")
    assert unknown.status_code == 404 and unknown.json()["code"] == "session_not_found"
    bad = await api1.client.post(f"/session/{sid}/resume", content=b"{nope", headers={"Content-Type": "application/json"})
    assert bad.status_code == 400 and bad.json()["code"] == "invalid_json"


async def test_an_agent_without_session_resume_is_loaded_instead(harness: Harness, workspace: str, tmp_path: Path) -> None:
    record = tmp_path / "agent-messages.jsonl"
    first = await harness.worker("--lease-ms", LEASE_MS)
    api = await harness.api()
    watcher = await harness.events()
    sid = (await create(api, workspace))["sessionId"]
    told = await prompt(api, sid, "remember HERON")
    assert (await turn_done(watcher, sid, told["promptId"]))["type"] == "turn_complete"
    await first.kill9()
    await watcher.wait_type(sid, "session_died")
    await harness.worker("--lease-ms", LEASE_MS, env={"ACP_SCRIPTED_RECORD": str(record)})
    resumed = await resume(api, sid)
    assert resumed.status_code == 200 and resumed.json()["attached"] is False, resumed.text
    assert "session/load" in methods_sent(record) and "session/resume" not in methods_sent(record)
    assert "remember HERON" in await recalled(harness, api, sid)


async def test_context_and_its_usage_are_what_the_agent_reported(harness: Harness, workspace: str) -> None:
    await harness.worker(env={"ACP_SCRIPTED_MODES": "default,plan", "ACP_SCRIPTED_CONTEXT_SIZE": str(CONTEXT_SIZE)})
    api1, api2 = await harness.api(), await harness.api()
    assert {"session_context", "session_context_usage"} <= set((await api1.client.get("/capabilities")).json()["features"])
    watcher = await harness.events()
    sid = (await create(api1, workspace))["sessionId"]

    context = (await api2.client.get(f"/session/{sid}/context")).json()
    assert context["sessionId"] == sid and context["workspaceCwd"] == workspace
    assert context["recovery"] == {"kind": "clean", "canContinue": False}
    assert context["state"]["modes"]["currentModeId"] == "default"
    # Before the agent reported any usage: the reference's answer before a first model reply.
    fresh = (await api2.client.get(f"/session/{sid}/context-usage")).json()
    assert fresh["usage"]["totalTokens"] == 0 and fresh["usage"]["isEstimated"] is True

    for n in (1, 2):
        sent = await prompt(api1, sid, f"hello {n}")
        assert (await turn_done(watcher, sid, sent["promptId"]))["type"] == "turn_complete"
    for api in (api1, api2):  # the same on every API process
        usage = (await api.client.get(f"/session/{sid}/context-usage")).json()["usage"]
        assert (usage["totalTokens"], usage["contextWindowSize"], usage["isEstimated"]) == (2000, CONTEXT_SIZE, False)
        assert usage["breakdown"]["freeSpace"] == CONTEXT_SIZE - 2000
    detailed = (await api1.client.get(f"/session/{sid}/context-usage?detail=true")).json()
    assert detailed["usage"]["showDetails"] is True and "2000" in detailed["formattedText"]

    # The mode switched by the approval-mode route is the context's current mode too.
    switched = await api1.client.post(f"/session/{sid}/approval-mode", json={"mode": "plan"})
    assert switched.status_code == 200, switched.text
    assert (await api2.client.get(f"/session/{sid}/context")).json()["state"]["modes"]["currentModeId"] == "plan"

    goal = await api2.client.get(f"/session/{sid}/goal")
    assert goal.json() == {"snapshot": {"v": 2, "goal": None, "activity": "idle"}}
    for route in ("context", "context-usage", "goal"):
        missing = await api1.client.get(f"/session/00000000-0000-4000-8000-000000000000/{route}")
        assert missing.status_code == 404 and missing.json()["code"] == "session_not_found", route


async def test_an_agent_that_reports_nothing_has_an_empty_context(harness: Harness, workspace: str) -> None:
    await harness.worker()
    api = await harness.api()
    sid = (await create(api, workspace))["sessionId"]
    assert (await api.client.get(f"/session/{sid}/context")).json()["state"] == {}
    usage = (await api.client.get(f"/session/{sid}/context-usage")).json()["usage"]
    assert (usage["totalTokens"], usage["contextWindowSize"], usage["isEstimated"]) == (0, 0, True)
    assert "modelName" not in usage


async def test_settings_and_extensions_are_none(harness: Harness, workspace: str) -> None:
    api = await harness.api()
    assert (await api.client.get("/workspace/settings")).json() == {"v": 1, "settings": []}
    extensions = (await api.client.get("/workspace/extensions")).json()
    assert extensions == {"v": 1, "workspaceCwd": workspace, "initialized": True, "extensions": []}
    assert (await api.client.get("/workspace/extensions/operations")).json() == {"v": 1, "operations": []}
    features = (await api.client.get("/capabilities")).json()["features"]
    assert "workspace_settings" not in features and "workspace_extensions" not in features
