"""The agent matrix: every real ACP coding agent of tests/agent_recipes.py, one row each,
through two API processes and a worker (two more, on the same agent home, for the resume and
the drain), against the scripted model endpoint, offline.

Each row: create (naming the agent); a prompt whose text reaches the transcript and the
event stream; a permission request in `pendingInteractions` with the agent's own options; a
vote that reaches the agent, after which the tool has run (the file exists); a cancel
mid-turn (a slow reply); a scripted loop that the bridge's loop guard stops with
`LOOP_DETECTED`, unless the agent stops itself (which one is recorded); a kill -9 of the
worker that leaves none of the agent's processes behind; a resume of a session told a code
word before the kill, on a new worker with the same agent home (`POST /session/:id/load`),
after which the model's request must carry the code word; a drain (SIGTERM) of that worker
that moves the session to a third, where the model still sees it.

An agent that does not advertise `loadSession` (409 `not_resumable`), or refuses the load
(503 `resume_failed`), is a result of its row, not a failure; one that advertises it and
loses the conversation fails.

A row skips only when its agent is not installed (`npm install --prefix tests/node`).
Select rows with `-k`, e.g. `-k "qwen or opencode"`. With ACP_MATRIX_RESULTS set, each row
writes what it saw there as JSON (scripts/agent-matrix prints the table).
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.agent_recipes import RECIPES, Recipe
from acp_state.ids import workspace_id
from testbed.model_endpoint import HELLO, LOOP_FILE, WRITE_FILE, WRITE_TOOLS, ModelEndpoint, Turn
from testbed.processes import ApiProcess, WorkerProcess
from tests.harness import EventWatcher, Harness, SseClient

pytestmark = pytest.mark.agents

CREATE_TIMEOUT_S = 90  # a cold agent start (node, bun) on a busy CI machine
TURN_TIMEOUT_S = 60
LOOP_TIMEOUT_S = 90
GONE_TIMEOUT_S = 15
MORE_SESSIONS = 4  # created at once right after the first: none may turn into a ghost  # the reaper's grace is 2 s; daemons get SIGTERM, then SIGKILL
# The worker's own defaults, so the row shows what a user gets: an agent whose loop detection
# trips earlier (Qwen Code's, at 6) stops the loop itself.
LOOP_IDENTICAL = 10
LOOP_MAX_TOOL_CALLS = 150
LOOP_EXTRA_CALLS = 10  # calls an agent may start before the bridge's cancel reaches it
ROW_MARK = "ACP_MATRIX_ROW"  # in the worker's environment, inherited by all its agent's processes
# The first worker's lease: once it is killed, its sessions are swept (`session_died`) within
# about this long, and only then can one be loaded elsewhere. Short, so the row does not wait
# the default 10 s; safe, because no other worker lives while it runs, and the APIs' sweepers
# would need it frozen for 3 s to declare it dead. The later workers keep the default.
FIRST_LEASE_MS = "3000"
SWEPT_TIMEOUT_S = 30
DRAIN_GRACE_S = "20"  # the resuming worker drains on SIGTERM (the harness's default is 0)
MOVE_TIMEOUT_S = 90  # a drain's target starts its agent cold, then loads the session
RECALL = "which code word did I ask you to remember?"  # says no code word itself
HISTORY_SCAN_LIMIT = 64 << 20  # files under the agent's home larger than this are not read


@pytest.fixture
def model() -> Iterator[ModelEndpoint]:
    with ModelEndpoint() as endpoint:
        yield endpoint


def recipe_or_skip(name: str) -> Recipe:
    recipe = RECIPES[name]
    if not recipe.installed:
        pytest.skip(f"{recipe.package} is not installed: npm install --prefix tests/node (see docs/agents.md)")
    return recipe


def processes_marked(mark: str) -> list[int]:
    """Live processes whose environment carries `ROW_MARK=mark` (zombies carry none)."""
    wanted = f"{ROW_MARK}={mark}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as environ:
                if wanted in environ.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            continue
    return found


async def prompt(api: ApiProcess, sid: str, text: str) -> str:
    response = await api.client.post(f"/session/{sid}/prompt", json={"prompt": [{"type": "text", "text": text}]})
    assert response.status_code == 202, response.text
    return response.json()["promptId"]


async def turn_end(events: EventWatcher, sid: str, prompt_id: str, timeout: float = TURN_TIMEOUT_S) -> dict[str, Any]:
    return await events.wait_for(
        lambda e: e["type"] in ("turn_complete", "turn_error") and e.get("promptId") == prompt_id
        and e["_channel"].endswith(sid),
        timeout,
    )


def chunk_text(event: dict[str, Any]) -> str:
    update = (event.get("data") or {}).get("update") or {}
    if update.get("sessionUpdate") != "agent_message_chunk":
        return ""
    content = update.get("content") or {}
    return content.get("text", "") if isinstance(content, dict) else ""


class Row:
    """What one agent did, step by step, with the time each step took."""

    def __init__(self, recipe: Recipe) -> None:
        self.record: dict[str, Any] = {"agent": recipe.name, "package": recipe.package, "steps": {}, "notes": []}
        self._started = time.monotonic()
        self.kept_created = 0.0  # when the session the resume step loads was created (epoch s)

    def step(self, name: str, ok: bool, since: float, **detail: Any) -> None:
        self.record["steps"][name] = {"ok": ok, "seconds": round(time.monotonic() - since, 2), **detail}

    def write(self) -> None:
        folder = os.environ.get("ACP_MATRIX_RESULTS")
        if folder:
            self.record["seconds"] = round(time.monotonic() - self._started, 1)
            Path(folder).mkdir(parents=True, exist_ok=True)
            (Path(folder) / f"{self.record['agent']}.json").write_text(json.dumps(self.record, indent=2))


@pytest.mark.parametrize("name", list(RECIPES))
async def test_agent_row(
    name: str, model: ModelEndpoint, own_harness: Harness, workspace: str, tmp_path: Path
) -> None:
    # `model` comes before `own_harness`: it outlives the worker and its agent.
    recipe = recipe_or_skip(name)
    row = Row(recipe)
    try:
        await _row(recipe, row, model, own_harness, workspace, tmp_path)
    finally:
        row.write()


async def _row(
    recipe: Recipe, row: Row, model: ModelEndpoint, harness: Harness, workspace: str, tmp_path: Path
) -> None:
    (Path(workspace) / LOOP_FILE).write_text("the loop reads this\n")
    model.script.cwd = workspace
    launch = recipe.prepare(tmp_path / "home", model.url, workspace)
    mark = uuid.uuid4().hex
    args = [
        "--agent-preset", recipe.name,  # as users launch it (its executable on the recipe's PATH)
        "--agent-stderr", str(tmp_path / f"{recipe.name}-stderr.log"),
        "--loop-identical", str(LOOP_IDENTICAL), "--loop-max-tool-calls", str(LOOP_MAX_TOOL_CALLS),
    ]
    events = await harness.events()
    worker = await harness.worker(*args, "--lease-ms", FIRST_LEASE_MS, env={**launch.worker_env(0), ROW_MARK: mark})
    first, second = await harness.api(), await harness.api()

    # 1. Create, naming the agent; one API creates, the other streams and reads.
    since = time.monotonic()
    created = await first.client.post(
        "/session", json={"cwd": workspace, "sessionScope": "thread", "agent": recipe.name}, timeout=CREATE_TIMEOUT_S
    )
    assert created.status_code == 200, created.text
    sid = created.json()["sessionId"]
    row.step("create", True, since)
    stream = await SseClient(second, sid).start()

    # 2. A prompt: the agent's text in the event stream and the transcript.
    since = time.monotonic()
    said = await prompt(first, sid, "say hello")
    end = await turn_end(events, sid, said)
    assert end["type"] == "turn_complete", end
    # (an SSE frame's data is the event's envelope)
    await stream.wait_for(lambda f: HELLO in chunk_text(f["data"] or {}) and f["data"].get("promptId") == said,
                          TURN_TIMEOUT_S)
    transcript = (await second.client.get(f"/session/{sid}/transcript")).json()
    assert any(HELLO in chunk_text(e) for e in transcript["events"]), transcript
    row.step("prompt", True, since)

    # 3. A shell command: the agent's own permission request, pending; a vote runs the tool.
    since = time.monotonic()
    ran = await prompt(second, sid, "PERM create the file")
    request = await events.wait_type(sid, "permission_request", TURN_TIMEOUT_S, promptId=ran)
    status = (await first.client.get(f"/session/{sid}/status")).json()
    [pending] = status["pendingInteractions"]
    assert pending["requestId"] == request["data"]["requestId"]
    assert status["isWaitingForPermission"] is True
    offered = request["data"].get("options") or pending["options"]
    kinds = {o.get("kind") for o in offered}
    assert "allow_once" in kinds, offered
    assert [o["optionId"] for o in pending["options"]] == [o["optionId"] for o in offered]
    allow = next(o for o in pending["options"] if o.get("kind") == "allow_once")
    row.step("permission", True, since, options=[o["optionId"] for o in pending["options"]])
    since = time.monotonic()
    vote = await first.client.post(
        f"/session/{sid}/permission/{pending['requestId']}",
        json={"outcome": {"outcome": "selected", "optionId": allow["optionId"]}},
    )
    assert vote.status_code == 200, vote.text
    end = await turn_end(events, sid, ran)
    assert end["type"] == "turn_complete", end
    assert (Path(workspace) / "perm_check.txt").exists(), "the tool did not run after the vote"
    row.step("vote", True, since)

    # 4. A new file written by the agent's own write tool, if it has one (gemini reads the
    # file through the client first when the client offers fs; acp-state offers none).
    since = time.monotonic()
    wrote = await prompt(second, sid, "WRITE a new file")
    voted_write = await _allow_until_end(events, first, sid, wrote)
    end = await turn_end(events, sid, wrote)
    has_write_tool = any(t.name in WRITE_TOOLS for turn in model.turns[-2:] for t in turn.tools)
    written = (Path(workspace) / WRITE_FILE).exists()
    row.step("write", written or not has_write_tool, since, tool=has_write_tool, votes=voted_write, ended=end["type"])
    assert end["type"] == "turn_complete", end
    assert written or not has_write_tool, "the agent's write tool did not write the file"

    # 5. A cancel mid-turn: the slow reply is streaming when the cancel arrives.
    since = time.monotonic()
    slow = await prompt(first, sid, "SLOW take your time")
    await events.wait_for(lambda e: e.get("promptId") == slow and "slow" in chunk_text(e), TURN_TIMEOUT_S)
    cancelled = await second.client.post(f"/session/{sid}/cancel")
    assert cancelled.status_code == 204, cancelled.text
    end = await turn_end(events, sid, slow)
    stop = end["data"].get("stopReason") if end["type"] == "turn_complete" else end["data"].get("code")
    row.step("cancel", stop == "cancelled", since, ended=end["type"], stopReason=stop)
    assert stop == "cancelled", end

    # 6. A loop: the same tool call for ever. The bridge's guard stops it, unless the agent
    # does first. Permission requests on the way are allowed, so only a guard can stop it.
    since = time.monotonic()
    looped = await prompt(second, sid, "LOOP read the file again")
    voted: set[str] = set()

    async def approve_loop_requests() -> None:
        while True:
            asked = await events.wait_for(
                lambda e: e["type"] == "permission_request" and e.get("promptId") == looped
                and e["data"]["requestId"] not in voted, LOOP_TIMEOUT_S,
            )
            rid = asked["data"]["requestId"]
            voted.add(rid)
            option = next(o for o in asked["data"]["options"] if o.get("kind") == "allow_once")
            await first.client.post(f"/session/{sid}/permission/{rid}",
                                    json={"outcome": {"outcome": "selected", "optionId": option["optionId"]}})

    approver = asyncio.ensure_future(approve_loop_requests())
    try:
        end = await turn_end(events, sid, looped, LOOP_TIMEOUT_S)
    finally:
        approver.cancel()
    code = (end["data"].get("code") or end["data"].get("error", {}).get("code")) if end["type"] == "turn_error" else None
    loop_calls = sum(1 for e in events.of(sid) if e.get("promptId") == looped
                     and ((e.get("data") or {}).get("update") or {}).get("sessionUpdate") == "tool_call")
    # The bridge's stop names the guard that tripped (`loopType`); an agent's own does not.
    loop_type = end["data"].get("loopType")
    stopper = "bridge" if code == "LOOP_DETECTED" and loop_type else "agent"
    # Either way the turn ended with no cancel from the test, after a bounded number of calls
    # (an agent may start a few more before the bridge's cancel reaches it). The bridge catches
    # the loop as one of identical calls, whatever the agent puts in them. An agent that stops
    # itself ends the turn as it sees fit: Gemini with `end_turn`, Cline with `cancelled`
    # (its own abort), which the bridge passes on as the agent's stop reason.
    ok = loop_calls <= LOOP_IDENTICAL + LOOP_EXTRA_CALLS
    if stopper == "bridge":
        ok = ok and loop_type == "consecutive_identical_tool_calls"
    row.step("loop", ok, since, stoppedBy=stopper, ended=end["type"], code=code, loopType=loop_type,
             stopReason=end["data"].get("stopReason"), toolCalls=loop_calls, votes=len(voted))
    assert ok, (loop_calls, end)

    # 7. More sessions at once: each is live and answers (an agent that sends an update right
    # after, or even before, its `session/new` answer must not turn a session into a ghost).
    since = time.monotonic()
    body = {"cwd": workspace, "sessionScope": "thread", "agent": recipe.name}
    made = await asyncio.gather(*(api.client.post("/session", json=body, timeout=CREATE_TIMEOUT_S)
                                  for api in [first, second] * (MORE_SESSIONS // 2)))
    assert all(m.status_code == 200 for m in made), [m.text for m in made]
    sids = [m.json()["sessionId"] for m in made]
    prompts = [await prompt(first, other, "say hello") for other in sids]
    ends = await asyncio.gather(*(turn_end(events, other, p) for other, p in zip(sids, prompts)))
    ghosts = [e for e in events.events if e["type"] in ("session_died", "session_closed")
              and any(e["_channel"].endswith(other) for other in sids)]
    # The ghost's path began with a refused write: a session update that reached the store
    # before the session (the fence says "not ours"); the worker now holds updates until then.
    refused = worker.log_path.read_text().count("the store refused a write")
    ok = not ghosts and not refused and all(e["type"] == "turn_complete" for e in ends)
    row.step("sessions", ok, since, ghosts=len(ghosts), refusedWrites=refused)
    assert ok, (ghosts, refused, ends)

    # 8. A session told a code word, for the resume below: its turn has ended (the agent has
    # its history wherever it keeps it) when the worker is killed.
    since = time.monotonic()
    fact = f"PELICAN-{recipe.name}"
    made_kept = await first.client.post("/session", json=body, timeout=CREATE_TIMEOUT_S)
    assert made_kept.status_code == 200, made_kept.text
    kept = made_kept.json()["sessionId"]
    row.kept_created = time.time()
    told = await prompt(first, kept, f"remember the code word {fact}")
    end = await turn_end(events, kept, told)
    assert end["type"] == "turn_complete", end
    assert any(fact in t.user_text for t in model.turns), "the code word never reached the model"
    row.step("remember", True, since)

    # 9. kill -9 of the worker: none of the agent's processes is left, daemons included.
    since = time.monotonic()
    assert processes_marked(mark), "the agent's processes should carry the row's mark"
    await worker.kill9()
    deadline = time.monotonic() + GONE_TIMEOUT_S
    while (left := processes_marked(mark)) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)  # a process's exit elsewhere is not an event we can await
    row.step("kill9", not left, since, left=[_describe(pid) for pid in left])
    assert not left, [_describe(pid) for pid in left]
    await stream.close()

    # 10-11. Resume on a new worker with the same agent home, then drain it to a third.
    resumer = await harness.worker(*args, "--drain-grace-s", DRAIN_GRACE_S, env=launch.worker_env(1))
    try:
        await _resume_and_drain(recipe, row, model, harness, events, (first, second), workspace, args,
                                launch.worker_env(2), resumer, kept, fact, tmp_path / "home")
    except BaseException:
        if resumer.proc is not None and resumer.proc.returncode is None:
            # It may host the session with nowhere to drain it: its SIGTERM at teardown
            # would wait out the grace.
            await resumer.kill9()
        raise


async def _resume_and_drain(
    recipe: Recipe, row: Row, model: ModelEndpoint, harness: Harness, events: EventWatcher,
    apis: tuple[ApiProcess, ApiProcess], workspace: str, args: list[str], env: dict[str, str],
    resumer: WorkerProcess, kept: str, fact: str, home: Path,
) -> None:
    first, second = apis
    # 10. Resume: the dead worker's session is swept, listed as persisted with `resumable`
    # (the agent's `loadSession`, from its initialize answer), and loaded on the new worker.
    since = time.monotonic()
    await events.wait_type(kept, "session_died", SWEPT_TIMEOUT_S)
    listed = (await first.client.get(f"/workspace/{workspace_id(workspace)}/sessions")).json()["sessions"]
    [resumable] = [r.get("resumable") for r in listed if r["sessionId"] == kept]
    loading = time.time()
    loaded = await second.client.post(f"/session/{kept}/load", json={}, timeout=CREATE_TIMEOUT_S)
    answer = loaded.json()
    # When, in UTC: Gemini CLI refuses a load in the minute its session started (see docs/agents.md).
    outcome = {"loadSession": resumable, "status": loaded.status_code, "code": answer.get("code"),
               "created": _utc(row.kept_created), "loaded": _utc(loading)}
    if loaded.status_code != 200:
        reason = answer.get("error") or answer.get("message") or ""
        # Not a failure: the agent cannot resume. Which way, the row records.
        refused = loaded.status_code == 503 and answer.get("code") == "resume_failed"
        ok = resumable is False and loaded.status_code == 409 and answer.get("code") == "not_resumable" or refused
        row.step("resume", ok, since, **outcome, reason=reason, history=_files_with(home, fact))
        row.step("drain", True, time.monotonic(), skipped="not resumed")
        assert ok, (resumable, loaded.status_code, answer)
        return
    assert answer["attached"] is False, answer
    carried, seen = await _asks(model, events, first, kept, "(after the resume)", fact)
    row.step("resume", carried, since, **outcome, carried=carried, turns=seen)
    assert resumable is True, "a session loaded although its row says it cannot be"
    assert carried, f"{recipe.name} loaded the session but the model's request lacks {fact!r}: {seen}"

    # 11. Drain: SIGTERM moves the session to a third worker (same agent, same home), where
    # it answers, and the model still sees the code word.
    since = time.monotonic()
    await harness.worker(*args, env=env)
    before = len(events.of(kept))
    earlier = {id(e) for e in events.of(kept)}  # (the first worker's death among them)
    stopping = asyncio.ensure_future(resumer.terminate(timeout=MOVE_TIMEOUT_S))
    try:
        # (a drain that finds no worker to load the session closes it when its grace ends)
        moved = await events.wait_for(lambda e: e["_channel"].endswith(kept) and id(e) not in earlier and e["type"] in (
            "session_moved", "session_closed", "session_died"), MOVE_TIMEOUT_S)
    finally:
        exit_code = await stopping
    if moved["type"] != "session_moved":
        row.step("drain", False, since, ended=moved["type"], reason=moved["data"].get("reason"), exit=exit_code)
        raise AssertionError(f"the drain did not move the session: {moved}")
    carried, seen = await _asks(model, events, second, kept, "(after the drain)", fact)
    ended = [e["type"] for e in events.of(kept)[before:] if e["type"] in ("session_died", "session_closed")]
    ok = carried and exit_code == 0 and not ended
    row.step("drain", ok, since, carried=carried, turns=seen, exit=exit_code, ended=ended)
    assert ok, (carried, exit_code, ended, seen)

    # A control: a new session asked the same has no code word to carry (the history came
    # from the load, not from something the agent keeps across sessions).
    fresh = await first.client.post("/session", json={"cwd": workspace, "sessionScope": "thread",
                                                      "agent": recipe.name}, timeout=CREATE_TIMEOUT_S)
    assert fresh.status_code == 200, fresh.text
    _, seen = await _asks(model, events, first, fresh.json()["sessionId"], "(a new session)", fact)
    leaked = any(t["carries"] for t in seen)
    row.record["steps"]["resume"].update(control=not leaked, controlTurns=seen, history=_files_with(home, fact))
    assert not leaked, f"a new session's request carries {fact!r}: the check proves nothing for {recipe.name}"


async def _asks(
    model: ModelEndpoint, events: EventWatcher, api: ApiProcess, sid: str, tag: str, fact: str
) -> tuple[bool | None, list[dict[str, Any]]]:
    """Ask the session which code word it was told; whether the model's request for that
    prompt carries `fact`, and what each request of the prompt held. The agent's own
    conversation request offers its tools; a side call (a title, a classifier) may not, and
    need not carry the history."""
    before = len(model.turns)
    asked = await prompt(api, sid, f"{RECALL} {tag}")
    end = await turn_end(events, sid, asked)
    if end["type"] == "turn_error" and end["data"].get("code") == "resume_failed":
        # A drain's target took the session over, then its agent could not resume it.
        return None, [{"resumeFailed": end["data"].get("message")}]
    assert end["type"] == "turn_complete", end
    mine: list[Turn] = [t for t in model.turns[before:] if tag in t.user_text]
    main = [t for t in mine if t.tools] or mine
    carried = bool(main) and all(fact in json.dumps(t.raw) for t in main)
    seen = [{"api": t.api, "tools": len(t.tools), "carries": fact in json.dumps(t.raw)} for t in mine]
    return carried, seen


def _utc(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).strftime("%H:%M:%S")


def _files_with(home: Path, fact: str) -> list[str]:
    """Files under the agent's home that hold `fact`: where it keeps the conversation."""
    wanted = fact.encode()
    found = []
    for folder, _, names in os.walk(home):
        for name in names:
            path = Path(folder) / name
            try:
                if path.is_file() and path.stat().st_size <= HISTORY_SCAN_LIMIT and wanted in path.read_bytes():
                    found.append(str(path.relative_to(home)))
            except OSError:
                continue
    return sorted(found)


async def _allow_until_end(events: EventWatcher, api: ApiProcess, sid: str, prompt_id: str) -> int:
    """Allow (once) every permission request of a turn until it ends; how many there were."""
    voted: set[str] = set()
    while True:
        event = await events.wait_for(
            lambda e: e.get("promptId") == prompt_id and e["_channel"].endswith(sid) and (
                e["type"] in ("turn_complete", "turn_error")
                or e["type"] == "permission_request" and e["data"]["requestId"] not in voted),
            TURN_TIMEOUT_S,
        )
        if event["type"] != "permission_request":
            return len(voted)
        rid = event["data"]["requestId"]
        voted.add(rid)
        option = next(o for o in event["data"]["options"] if o.get("kind") == "allow_once")
        await api.client.post(f"/session/{sid}/permission/{rid}",
                              json={"outcome": {"outcome": "selected", "optionId": option["optionId"]}})


def _describe(pid: int) -> str:
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return str(pid)
    return f"{pid}: {command[:200]}"

