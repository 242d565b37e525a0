"""Loop-detection turn errors: structured rejections, the bridge's own guard, turn kinds,
and the error surviving a reload until newer turn content supersedes it."""

from __future__ import annotations

import os
import signal

from acp_state.turn_errors import LOOP_DETECTED_MESSAGE
from acp_state.worker.loop_guard import CONSECUTIVE_IDENTICAL, LoopGuard, LoopLimits
from testbed.processes import ApiProcess
from tests.harness import Harness, SseClient
from tests.helpers import create, prompt, status

LOOP_STATUS = {"message": LOOP_DETECTED_MESSAGE, "code": "LOOP_DETECTED", "errorKind": "loop_detected"}


async def send(api: ApiProcess, sid: str, text: str, headers: dict | None = None, **body: object) -> dict:
    response = await api.client.post(
        f"/session/{sid}/prompt", json={"prompt": [{"type": "text", "text": text}], **body}, headers=headers or {}
    )
    assert response.status_code == 202, response.text
    return response.json()


def of_prompt(frames: list[dict], prompt_id: str, event_type: str | None = None) -> list[dict]:
    return [
        f for f in frames
        if f["data"].get("promptId") == prompt_id and (event_type is None or f["event"] == event_type)
    ]


def terminal(prompt_id: str):
    return lambda f: f["event"] in ("turn_complete", "turn_error") and f["data"].get("promptId") == prompt_id


async def test_agent_loop_error_reaches_sse_on_another_api_once(harness: Harness, workspace: str) -> None:
    await harness.worker()
    api1, api2 = await harness.api(), await harness.api()
    sid = (await create(api1, workspace))["sessionId"]
    sse = await SseClient(api2, sid).start()
    looped = await prompt(api1, sid, "#loop")
    error = await sse.wait_for(terminal(looped["promptId"]))
    assert error["event"] == "turn_error"
    assert error["data"]["data"] == {
        "sessionId": sid,
        **LOOP_STATUS,
        "loopType": "global_tool_call_duplicate",
        "promptId": looped["promptId"],
    }
    frames = sse.events()
    assert len(of_prompt(frames, looped["promptId"], "turn_error")) == 1
    assert not of_prompt(frames, looped["promptId"], "turn_complete")
    assert not [f for f in frames if f["event"] == "prompt_cancelled"]
    updates = [f["data"]["data"]["update"] for f in of_prompt(frames, looped["promptId"], "session_update")]
    assert sum(1 for u in updates if u.get("status") == "completed") == 6, "completed tool results stay"
    assert updates[-1]["status"] == "failed", "the skipped tool call ends failed"

    stored = await status(api2, sid)
    assert stored["hasTurnError"] is True and stored["turnError"] == LOOP_STATUS
    assert stored["hasActivePrompt"] is False

    follow_up = await prompt(api2, sid, "#slow 0.5")
    await sse.wait_for(lambda f: f["event"] == "session_update" and f["data"].get("promptId") == follow_up["promptId"])
    during = await status(api1, sid)
    assert during["hasActivePrompt"] is True and during["hasTurnError"] is False, "cleared when it starts"
    done = await sse.wait_for(terminal(follow_up["promptId"]))
    assert done["event"] == "turn_complete" and done["data"]["data"]["stopReason"] == "end_turn"
    await sse.close()


async def test_bridge_guard_stops_an_agent_that_loops_forever(harness: Harness, workspace: str) -> None:
    await harness.worker("--loop-identical", "5")
    api = await harness.api()
    sid = (await create(api, workspace))["sessionId"]
    sse = await SseClient(api, sid).start()
    for _ in range(2):  # the second turn proves the guard starts fresh
        looped = await prompt(api, sid, "#loop-forever")
        error = await sse.wait_for(terminal(looped["promptId"]), timeout=30)
        assert error["event"] == "turn_error"
        assert error["data"]["data"] == {
            "sessionId": sid,
            **LOOP_STATUS,
            "loopType": "consecutive_identical_tool_calls",
            "promptId": looped["promptId"],
        }
        updates = [f["data"]["data"]["update"] for f in of_prompt(sse.events(), looped["promptId"], "session_update")]
        calls = [u["toolCallId"] for u in updates if u["sessionUpdate"] == "tool_call"]
        assert len(calls) >= 5
        finished = {u["toolCallId"] for u in updates if u.get("status") in ("completed", "failed")}
        assert set(calls) <= finished, "no tool call is left pending"
        assert (await status(api, sid))["turnError"] == LOOP_STATUS
    echo = await prompt(api, sid, "still here?")
    assert (await sse.wait_for(terminal(echo["promptId"])))["event"] == "turn_complete"
    await sse.close()


async def test_bridge_guard_caps_tool_calls_per_turn(harness: Harness, workspace: str) -> None:
    await harness.worker("--loop-identical", "0", "--loop-max-tool-calls", "8")
    api = await harness.api()
    sid = (await create(api, workspace))["sessionId"]
    sse = await SseClient(api, sid).start()
    looped = await prompt(api, sid, "#loop-forever")
    error = await sse.wait_for(terminal(looped["promptId"]), timeout=30)
    assert error["data"]["data"]["loopType"] == "turn_tool_call_cap"
    await sse.close()


async def test_cancel_wins_when_it_races_the_loop_stop(harness: Harness, workspace: str) -> None:
    worker = await harness.worker("--loop-identical", "2", "--lease-ms", "30000")
    api = await harness.api()
    sid = (await create(api, workspace))["sessionId"]
    sse = await SseClient(api, sid).start()
    os.kill(worker.pid, signal.SIGSTOP)  # both commands wait in the inbox, then land together
    try:
        looped = await prompt(api, sid, "#loop-forever")
        assert (await api.client.post(f"/session/{sid}/cancel")).status_code == 204
    finally:
        os.kill(worker.pid, signal.SIGCONT)
    done = await sse.wait_for(terminal(looped["promptId"]), timeout=30)
    assert done["event"] == "turn_complete" and done["data"]["data"]["stopReason"] == "cancelled"
    assert not of_prompt(sse.events(), looped["promptId"], "turn_error")
    assert (await status(api, sid))["hasTurnError"] is False
    await sse.close()


async def test_non_interactive_turns_end_end_turn(harness: Harness, workspace: str) -> None:
    await harness.worker()
    api = await harness.api("--token", "user-secret-0123456789", "--channel-token", "channel-secret-0123456789")
    api.client.headers["Authorization"] = "Bearer user-secret-0123456789"
    sid = (await create(api, workspace))["sessionId"]
    sse = await SseClient(api, sid).start()
    channel_meta = {"_meta": {"qwen.channel.prompt": True}}
    cases = [
        ({"turnKind": "cron"}, None, "turn_complete"),
        ({"turnKind": "notification"}, None, "turn_complete"),
        ({"turnKind": "goal"}, None, "turn_complete"),
        (channel_meta, {"Authorization": "Bearer channel-secret-0123456789"}, "turn_complete"),
        # The same marker from a user token is stripped: an interactive prompt, rejected.
        (channel_meta, None, "turn_error"),
        # Delivery meta schedules delivery but never opts a turn out.
        ({"_meta": {"qwen.daemon.channelDelivery": {"kind": "channel"}}}, None, "turn_error"),
    ]
    for body, headers, expected in cases:
        sent = await send(api, sid, "#loop", headers, **body)
        ended = await sse.wait_for(terminal(sent["promptId"]))
        assert ended["event"] == expected, (body, headers)
        if expected == "turn_complete":
            assert ended["data"]["data"]["stopReason"] == "end_turn"
    bad = await api.client.post(f"/session/{sid}/prompt", json={"prompt": [{"type": "text", "text": "x"}], "turnKind": "batch"})
    assert bad.status_code == 400 and bad.json()["code"] == "invalid_turn_kind"
    await sse.close()


async def test_rejection_still_drains_queued_automatic_work(harness: Harness, workspace: str) -> None:
    worker = await harness.worker("--lease-ms", "30000")
    api = await harness.api()
    sid = (await create(api, workspace))["sessionId"]
    sse = await SseClient(api, sid).start()
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        looped = await send(api, sid, "#loop")
        cron = await send(api, sid, "cron job ran", turnKind="cron")
        note = await send(api, sid, "a background task finished", turnKind="notification")
    finally:
        os.kill(worker.pid, signal.SIGCONT)
    assert (await sse.wait_for(terminal(looped["promptId"])))["event"] == "turn_error"
    for queued in (cron, note):
        ended = await sse.wait_for(terminal(queued["promptId"]))
        assert ended["event"] == "turn_complete" and ended["data"]["data"]["stopReason"] == "end_turn"
    # Automatic turns do not clear the stored error, but they are newer turn content.
    assert (await status(api, sid))["turnError"] == LOOP_STATUS
    reloaded = (await api.client.post(f"/session/{sid}/load", json={"historyPageSize": 50})).json()
    assert [e["type"] for e in reloaded["compactedReplay"]].count("turn_error") == 0
    await sse.close()


async def test_reload_appends_the_turn_error_until_a_newer_prompt_starts(harness: Harness, workspace: str) -> None:
    await harness.worker()
    api = await harness.api()
    sid = (await create(api, workspace))["sessionId"]
    sse = await SseClient(api, sid).start()
    looped = await prompt(api, sid, "#loop")
    error = await sse.wait_for(terminal(looped["promptId"]))

    reloaded = await api.client.post(f"/session/{sid}/load", json={"historyPageSize": 4})
    assert reloaded.status_code == 200
    body = reloaded.json()
    assert body["attached"] is True and body["historyHasMore"] is True
    assert body["liveJournal"] == [] and body["lastEventId"] == error["id"]
    replay = body["compactedReplay"]
    assert [e["type"] for e in replay] == ["session_update"] * 4 + ["turn_error"]
    assert replay[-1] == error["data"], "the stored turn_error event, last"
    page = (await api.client.get(f"/session/{sid}/transcript?limit=4")).json()
    assert [e["data"] for e in page["events"]] == [e["data"] for e in replay[:4]]
    assert page["hasMore"] is True and page["nextCursor"]
    older = (await api.client.get(f"/session/{sid}/transcript?limit=500&cursor={page['nextCursor']}")).json()
    assert older["hasMore"] is False
    assert older["events"][0]["data"]["update"] == {"sessionUpdate": "user_message_chunk", "content": {"type": "text", "text": "#loop"}}

    newer = await prompt(api, sid, "and now?")
    await sse.wait_for(terminal(newer["promptId"]))
    replay = (await api.client.post(f"/session/{sid}/load", json={"historyPageSize": 4})).json()["compactedReplay"]
    assert "turn_error" not in [e["type"] for e in replay]
    assert replay[-1]["data"]["update"]["content"]["text"] == "and now?"
    assert (await api.client.get(f"/session/{sid}/transcript?limit=0")).status_code == 400
    assert (await api.client.get(f"/session/{sid}/transcript?cursor=abc")).status_code == 400
    await sse.close()


def test_calls_that_differ_only_in_their_own_ids_are_identical() -> None:
    """Codex's rawInput names the call (call, turn and process ids, a start time): the same
    command again is still the same call, so the identical-call limit catches its loops."""
    guard = LoopGuard(LoopLimits(identical=3, max_tool_calls=0))
    tripped = None
    for n in range(3):
        raw = {"call_id": f"call_{n}", "turn_id": "t", "process_id": str(100 + n), "started_at_ms": 1000 + n,
               "command": ["/bin/bash", "-lc", "cat loop_target.txt"], "cwd": "/w"}
        tripped = guard.observe({"sessionUpdate": "tool_call", "toolCallId": f"call_{n}", "kind": "execute",
                                 "title": "cat loop_target.txt", "status": "in_progress", "rawInput": raw})
    assert tripped == CONSECUTIVE_IDENTICAL
    other = LoopGuard(LoopLimits(identical=2, max_tool_calls=0))
    for command in ("ls", "pwd"):  # what the call does still tells calls apart
        assert other.observe({"sessionUpdate": "tool_call", "toolCallId": command, "kind": "execute",
                              "title": command, "rawInput": {"call_id": command, "command": command}}) is None
