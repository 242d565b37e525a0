"""A move takes the session over first and brings its agent up after (the eager hand-off,
worker/bring_up.py): the session is live on the target, its stream going on, while the
target's agent still resumes it; what needs the agent waits for that, in order; a resume
that fails is said on the stream and leaves the session resumable.

Real worker and API processes with the scripted agent, whose `session/load` is slowed by
ACP_SCRIPTED_LOAD_DELAY_S (its history read) so that commands arrive during the bring-up.
"""

from __future__ import annotations

import json
from pathlib import Path

from acp_state.ids import workspace_id
from tests.harness import Harness
from tests.helpers import create, load, prompt, recalled, turn_done

# The target's agent takes this long to load a session: long against a drain's own steps.
SLOW_LOAD = {"ACP_SCRIPTED_LOAD_DELAY_S": "6"}
LEASE_MS = "1500"


async def test_a_moved_session_is_live_before_its_agent_loads_and_commands_wait_in_order(
    harness: Harness, workspace: str
) -> None:
    draining = await harness.worker("--drain-grace-s", "20")
    api = await harness.api()
    watcher = await harness.events()
    sid = (await create(api, workspace))["sessionId"]
    told = await prompt(api, sid, "remember KESTREL")
    assert (await turn_done(watcher, sid, told["promptId"]))["type"] == "turn_complete"
    await harness.worker(env=SLOW_LOAD)

    draining.proc.send_signal(15)
    moved = await watcher.wait_type(sid, "session_moved")
    # Sent once the session is the target's: they wait for its agent, then run in order.
    first = await prompt(api, sid, "#recall")
    second = await prompt(api, sid, "echo after the move")
    # The old owner let go and exited while the target's agent still loads the session: the
    # move took no load's time, and neither prompt could run yet.
    assert await draining.proc.wait() == 0
    kinds = {e["type"] for e in watcher.of(sid) if e.get("promptId") in (first["promptId"], second["promptId"])}
    assert not kinds & {"turn_complete", "turn_error", "pending_prompt_started"}, kinds

    done = [await turn_done(watcher, sid, sent["promptId"]) for sent in (first, second)]
    assert [e["type"] for e in done] == ["turn_complete", "turn_complete"], done
    assert moved["id"] < done[0]["id"] < done[1]["id"]
    # The first ran on the loaded session: the agent recalled the turn before the move.
    answer = [e for e in watcher.of(sid) if e.get("promptId") == first["promptId"] and e["type"] == "session_update"]
    assert "remember KESTREL" in str(answer)
    kinds = [e["type"] for e in watcher.of(sid)]
    assert "session_died" not in kinds and "session_closed" not in kinds


async def test_a_failed_bring_up_is_said_on_the_stream_and_a_later_load_resumes_the_session(
    harness: Harness, workspace: str, tmp_path: Path
) -> None:
    draining = await harness.worker("--drain-grace-s", "20", "--lease-ms", LEASE_MS)
    api = await harness.api()
    watcher = await harness.events()
    sid = (await create(api, workspace))["sessionId"]
    told = await prompt(api, sid, "remember MERLIN")
    assert (await turn_done(watcher, sid, told["promptId"]))["type"] == "turn_complete"
    # A target whose agent cannot find the session's history (its files are elsewhere, though
    # the worker names the same agent-state store): its resume fails.
    empty = tmp_path / "elsewhere"
    empty.mkdir()
    failing = await harness.worker("--lease-ms", LEASE_MS, env={**SLOW_LOAD, "ACP_SCRIPTED_STATE_DIR": str(empty)})

    draining.proc.send_signal(15)
    await watcher.wait_type(sid, "session_moved")
    waiting = await prompt(api, sid, "#recall")  # waits for the bring-up, which fails
    assert await draining.proc.wait() == 0
    ended = await turn_done(watcher, sid, waiting["promptId"])
    assert ended["type"] == "turn_error" and ended["data"]["code"] == "resume_failed", ended
    died = await watcher.wait_type(sid, "session_died")
    assert died["data"]["reason"] == "resume_failed"
    assert ended["id"] < died["id"]

    # Never lost: its row says it resumes, and a load on a worker that reads its history does.
    assert await failing.terminate() == 0
    listed = (await api.client.get(f"/workspace/{workspace_id(workspace)}/sessions")).json()["sessions"]
    assert [row.get("resumable") for row in listed if row["sessionId"] == sid] == [True]
    await harness.worker("--lease-ms", LEASE_MS)
    resumed = await load(api, sid)
    assert resumed.status_code == 200, resumed.text
    assert "remember MERLIN" in await recalled(harness, api, sid)


async def test_the_target_resumes_the_agents_session_only_after_the_old_owner_let_go(
    harness: Harness, workspace: str, tmp_path: Path
) -> None:
    """Both workers' agents record what they are sent in one file, in the order they got it:
    the old owner's agent closed the session (`session/close`, answered before the old owner
    says it let go) before the target's agent is asked to resume it."""
    record = tmp_path / "both-agents.jsonl"
    closing = {"ACP_SCRIPTED_RECORD": str(record), "ACP_SCRIPTED_CLOSE": "1"}
    draining = await harness.worker("--drain-grace-s", "20", env=closing)
    api = await harness.api()
    watcher = await harness.events()
    sid = (await create(api, workspace))["sessionId"]
    told = await prompt(api, sid, "remember SHRIKE")
    assert (await turn_done(watcher, sid, told["promptId"]))["type"] == "turn_complete"
    await harness.worker(env={"ACP_SCRIPTED_RECORD": str(record), "ACP_SCRIPTED_RESUME": "1"})

    draining.proc.send_signal(15)
    await watcher.wait_type(sid, "session_moved")
    assert "remember SHRIKE" in await recalled(harness, api, sid)
    assert await draining.proc.wait() == 0
    sent = [(m.get("method"), (m.get("params") or {}).get("sessionId")) for m in map(json.loads, record.read_text().splitlines())]
    [agent_sid] = {s for method, s in sent if method == "session/resume"}
    resumed = sent.index(("session/resume", agent_sid))
    assert ("session/close", agent_sid) in sent[:resumed], sent
