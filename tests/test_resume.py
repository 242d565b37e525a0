"""Conversations outlive their worker: a persisted session resumes on any worker (ACP
`session/load`), and a drain (SIGTERM, `acp-state drain`) moves every session of a worker
to another one, keeping its id, its event stream and every prompt sent meanwhile.

Real worker and API processes, each worker with the scripted agent, which keeps each
session's history on disk (the state dir the test suite shares) and reloads it: `#recall`
answers every earlier prompt of the session, so a test sees that the conversation went on.
"""

from __future__ import annotations

import asyncio
import sys

from acp_state.store import keys
from testbed.processes import ROOT, ApiProcess
from tests.harness import Harness, SseClient
from tests.helpers import SAFETY_STOP_S, create, eventually, is_type, load, prompt, recalled, status, turn_done

LEASE_MS = "1500"


async def told_a_fact(harness: Harness, api: ApiProcess, sid: str, fact: str) -> None:
    sent = await prompt(api, sid, fact)
    assert (await turn_done(await harness.events(), sid, sent["promptId"]))["type"] == "turn_complete"


# ---- resume a persisted session ------------------------------------------------------------


async def test_a_session_whose_worker_died_resumes_on_another_with_its_conversation(harness: Harness, workspace: str) -> None:
    first = await harness.worker("--lease-ms", LEASE_MS)
    api = await harness.api()
    watcher = await harness.events()
    sid = (await create(api, workspace))["sessionId"]
    told = await prompt(api, sid, "remember PELICAN")
    assert (await turn_done(watcher, sid, told["promptId"]))["type"] == "turn_complete"
    await first.kill9()
    await watcher.wait_type(sid, "session_died")
    assert (await api.client.get(f"/session/{sid}/status")).status_code == 404
    listed = (await api.client.get(f"/workspace/{workspace_id(workspace)}/sessions")).json()["sessions"]
    assert [row.get("resumable") for row in listed if row["sessionId"] == sid] == [True]
    # A prompt to a persisted session is refused as the reference refuses it: it is not live.
    refused = await api.client.post(f"/session/{sid}/prompt", json={"prompt": [{"type": "text", "text": "hi"}]})
    assert refused.status_code == 404 and refused.json()["code"] == "session_not_found"

    await harness.worker("--lease-ms", LEASE_MS)
    resumed = await load(api, sid)
    assert resumed.status_code == 200, resumed.text
    body = resumed.json()
    assert body["sessionId"] == sid and body["attached"] is False
    assert body["hasActivePrompt"] is False and body["hasRunningBackgroundTasks"] is False
    # Its turns of before answer again, as the reference's ledger does.
    current = (await api.client.get(f"/session/{sid}/turns/current")).json()
    assert (current["promptId"], current["state"]) == (told["promptId"], "completed")
    assert (await api.client.get(f"/session/{sid}/turns/{told['promptId']}")).status_code == 200
    texts = [r["data"]["update"]["content"].get("text") for r in body["compactedReplay"] if r["type"] == "session_update"]
    assert "remember PELICAN" in texts  # the transcript of the earlier worker's turns
    assert (await status(api, sid))["sessionId"] == sid
    assert "remember PELICAN" in await recalled(harness, api, sid)  # the agent loaded its history
    again = await load(api, sid)  # now live: attached, as any load of a live session
    assert again.status_code == 200 and again.json()["attached"] is True


def workspace_id(path: str) -> str:
    from acp_state.ids import workspace_id as of

    return of(path)


async def test_concurrent_loads_on_two_api_processes_resume_the_session_once(
    harness: Harness, workspace: str, redis_client
) -> None:
    first = await harness.worker("--lease-ms", LEASE_MS)
    apis = [await harness.api(), await harness.api()]
    watcher = await harness.events()
    sid = (await create(apis[0], workspace))["sessionId"]
    await told_a_fact(harness, apis[0], sid, "remember HERON")
    await first.kill9()
    await watcher.wait_type(sid, "session_died")
    second = [await harness.worker("--lease-ms", LEASE_MS), await harness.worker("--lease-ms", LEASE_MS)]

    answers = await asyncio.gather(*(load(apis[i % 2], sid) for i in range(6)))
    assert [a.status_code for a in answers] == [200] * 6, [a.text for a in answers]
    assert sorted(a.json()["attached"] for a in answers) == [False] + [True] * 5
    hosting = [await redis_client.smembers(keys.worker_sessions(w.incarnation)) for w in second]
    assert sorted(len(h) for h in hosting) == [0, 1]  # one live session, on one worker
    assert "remember HERON" in await recalled(harness, apis[1], sid)


async def test_an_agent_without_load_session_is_not_resumable(harness: Harness, workspace: str) -> None:
    first = await harness.worker("--lease-ms", LEASE_MS, env={"ACP_SCRIPTED_NO_LOAD": "1"})
    api = await harness.api()
    watcher = await harness.events()
    sid = (await create(api, workspace))["sessionId"]
    await told_a_fact(harness, api, sid, "remember IBIS")
    await first.kill9()
    await watcher.wait_type(sid, "session_died")
    await harness.worker("--lease-ms", LEASE_MS)
    listed = (await api.client.get(f"/workspace/{workspace_id(workspace)}/sessions")).json()["sessions"]
    assert [row.get("resumable") for row in listed if row["sessionId"] == sid] == [False]
    refused = await load(api, sid)
    assert refused.status_code == 409 and refused.json()["code"] == "not_resumable"


async def test_a_load_goes_only_to_a_worker_that_reads_the_sessions_state_store(harness: Harness, workspace: str) -> None:
    first = await harness.worker("--lease-ms", LEASE_MS, "--state-store", "host-a")
    api = await harness.api()
    watcher = await harness.events()
    sid = (await create(api, workspace))["sessionId"]
    await told_a_fact(harness, api, sid, "remember KITE")
    await first.kill9()
    await watcher.wait_type(sid, "session_died")
    await harness.worker("--lease-ms", LEASE_MS, "--state-store", "host-b")
    refused = await load(api, sid)
    assert refused.status_code == 503, refused.text
    assert refused.json()["code"] == "no_worker_for_state_store" and refused.headers["Retry-After"]
    await harness.worker("--lease-ms", LEASE_MS, "--state-store", "host-a")
    assert (await load(api, sid)).status_code == 200
    assert "remember KITE" in await recalled(harness, api, sid)


async def test_a_load_of_an_unknown_session_is_404(harness: Harness, workspace: str) -> None:
    await harness.worker()
    api = await harness.api()
    answer = await load(api, "0b8f6f0e-8f7e-4b43-9c3c-0c3f1c4a9d11")
    assert answer.status_code == 404 and answer.json()["code"] == "session_not_found"


# ---- drains ----------------------------------------------------------------------------------


async def test_sigterm_moves_every_session_to_another_worker(harness: Harness, workspace: str) -> None:
    draining = await harness.worker("--drain-grace-s", "20")
    api = await harness.api()
    watcher = await harness.events()
    sids = [(await create(api, workspace))["sessionId"] for _ in range(3)]
    for n, sid in enumerate(sids):
        await told_a_fact(harness, api, sid, f"remember fact {n}")
    streams = [await SseClient(api, sid).start() for sid in sids]
    for stream in streams:
        await stream.wait_for(lambda f: f["event"] == "session_snapshot")
    await harness.worker()
    assert await draining.terminate() == 0
    for n, (sid, stream) in enumerate(zip(sids, streams)):
        moved = await stream.wait_for(is_type("session_moved"))
        assert moved["data"]["data"]["sessionId"] == sid
        assert not stream.events("session_died") and not stream.events("session_closed")
        assert f"remember fact {n}" in await recalled(harness, api, sid)
        # The stream goes on: the recall's turn reaches the stream opened before the move.
        await stream.wait_for(lambda f: f["event"] == "turn_complete" and f["data"]["id"] > moved["data"]["id"])
    # One log, one epoch: ids go on from before the move.
    ids = [f["data"]["id"] for f in streams[0].frames if isinstance(f.get("data"), dict) and "id" in f["data"]]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)


async def test_a_prompt_sent_during_a_drain_runs_after_the_move_and_a_turn_past_the_grace_ends(
    harness: Harness, workspace: str
) -> None:
    draining = await harness.worker("--drain-grace-s", "1.5")
    api = await harness.api()
    watcher = await harness.events()
    sid = (await create(api, workspace))["sessionId"]
    await told_a_fact(harness, api, sid, "remember OSPREY")
    # `flush`: cancelled, the agent says one more word of the turn, after the drain has
    # already ended it with its error.
    long = await prompt(api, sid, "#slow 30 flush")
    await watcher.wait_for(lambda e: e["data"].get("sessionId") == sid and e["type"] == "session_update"
                           and e.get("promptId") == long["promptId"] and "tick" in str(e["data"]))
    await harness.worker()
    stopping = asyncio.ensure_future(draining.terminate())
    during = await prompt(api, sid, "#recall")  # sent as the worker drains: held, then carried or parked
    assert await stopping == 0
    ended = await turn_done(watcher, sid, long["promptId"])
    assert ended["type"] == "turn_error" and ended["data"]["code"] == "worker_draining"
    done = await turn_done(watcher, sid, during["promptId"])
    assert done["type"] == "turn_complete", done["data"]
    # The agent's last word on the stopped turn (before its cancelled answer, which the
    # move awaits) is not relayed: it would follow the error that explains the turn.
    after_error = watcher.of(sid)[watcher.of(sid).index(ended) + 1:]
    assert "stopped at tick" not in str(after_error), after_error
    assert "remember OSPREY" in str([e for e in watcher.of(sid) if e.get("promptId") == during["promptId"]])
    log = watcher.of(sid)
    kinds = [e["type"] for e in log]
    assert "session_moved" in kinds and "session_died" not in kinds and "session_closed" not in kinds
    assert kinds.index("session_moved") < next(i for i, e in enumerate(log) if e.get("promptId") == during["promptId"]
                                               and e["type"] == "turn_complete")
    terminals = [e for e in log if e["type"] in ("turn_complete", "turn_error")]
    assert sorted(e["data"]["promptId"] for e in terminals) == sorted({e["data"]["promptId"] for e in terminals})


async def test_acp_state_drain_moves_the_sessions_of_a_worker_named_from_anywhere(harness: Harness, workspace: str) -> None:
    draining = await harness.worker("--drain-grace-s", "20")
    api = await harness.api()
    watcher = await harness.events()
    sid = (await create(api, workspace))["sessionId"]
    await told_a_fact(harness, api, sid, "remember GANNET")
    await harness.worker()
    command = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "acp_state.cli", "drain", draining.incarnation, "--redis-url", harness.redis_url,
        cwd=str(ROOT), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(command.communicate(), 60)
    assert command.returncode == 0, out.decode()
    assert f"{draining.incarnation} is gone" in out.decode()
    await watcher.wait_type(sid, "session_moved")
    assert await asyncio.wait_for(draining.proc.wait(), 20) == 0
    assert "remember GANNET" in await recalled(harness, api, sid)


async def test_a_drain_with_no_other_worker_stops_as_before_after_its_grace(harness: Harness, workspace: str) -> None:
    alone = await harness.worker("--drain-grace-s", "1")
    api = await harness.api()
    watcher = await harness.events()
    sid = (await create(api, workspace))["sessionId"]
    assert await alone.terminate() == 0
    closed = await watcher.wait_type(sid, "session_closed")
    assert closed["data"]["reason"] == "worker_shutdown"


async def test_a_draining_worker_gets_no_creates_and_says_so(harness: Harness, workspace: str, redis_client) -> None:
    draining = await harness.worker("--drain-grace-s", "60", "--name", "leaving")
    api = await harness.api()
    watcher = await harness.events()
    sid = (await create(api, workspace))["sessionId"]
    await prompt(api, sid, "#permission")  # its turn holds the drain until the vote below
    request = await watcher.wait_type(sid, "permission_request")
    stay = await harness.worker("--name", "staying")
    draining.proc.send_signal(15)

    async def says_draining() -> bool:  # the report says so at once (the drain renews first)
        workers = (await api.client.get("/workers")).json()["workers"]  # read, not pushed: poll it
        return any(w["incarnation"] == draining.incarnation and w.get("draining") for w in workers)

    await eventually(says_draining, "the worker's report saying it drains")
    table = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "acp_state.cli", "status", "--redis-url", harness.redis_url, "--once",
        stdout=asyncio.subprocess.PIPE, cwd=str(ROOT),
    )
    rows = (await table.communicate())[0].decode().splitlines()
    assert [row.split()[-1] for row in rows if row.startswith(draining.incarnation)] == ["draining"]
    assert [row.split()[-1] for row in rows if row.startswith(stay.incarnation)] == ["serving"]
    created = [(await create(api, workspace))["sessionId"] for _ in range(3)]
    hosted = await redis_client.smembers(keys.worker_sessions(stay.incarnation))
    assert {member.split("/")[1] for member in hosted} >= set(created)
    # The vote ends the turn; the drain moves the session and the worker leaves.
    vote = await api.client.post(
        f"/session/{sid}/permission/{request['data']['requestId']}",
        json={"outcome": {"outcome": "selected", "optionId": "proceed_once"}},
    )
    assert vote.status_code == 200, vote.text
    assert await asyncio.wait_for(draining.proc.wait(), SAFETY_STOP_S) == 0


async def test_a_permission_pending_when_the_grace_runs_out_is_cancelled_and_leaves_the_inbox(
    harness: Harness, workspace: str
) -> None:
    draining = await harness.worker("--drain-grace-s", "1")
    api = await harness.api()
    watcher = await harness.events()
    sid = (await create(api, workspace))["sessionId"]
    asking = await prompt(api, sid, "#permission")
    await watcher.wait_type(sid, "permission_request")
    inbox = (await api.client.get("/attention")).json()["items"]
    assert [item["kind"] for item in inbox if item["sessionId"] == sid] == ["permission"]
    await harness.worker()
    assert await draining.terminate() == 0
    ended = await turn_done(watcher, sid, asking["promptId"])
    assert ended["type"] == "turn_error" and ended["data"]["code"] == "worker_draining"
    resolved = await watcher.wait_type(sid, "permission_resolved")
    assert resolved["data"]["outcome"] == {"outcome": "cancelled"}
    await watcher.wait_type(sid, "session_moved")
    assert not [item for item in (await api.client.get("/attention")).json()["items"] if item["sessionId"] == sid]
    after = await status(api, sid)  # live on the other worker, nothing pending, nothing running
    assert after["pendingInteractionCount"] == 0 and after["hasActivePrompt"] is False
    # The drain's stop is not the agent's failure: it is said on the stream, not kept as the
    # session's turn error (which would put the session back in the inbox).
    assert after["hasTurnError"] is False


async def test_commands_sent_while_a_session_moves_are_parked_and_run_on_its_new_owner(
    harness: Harness, workspace: str
) -> None:
    """The paced hand-off (`--handoff paced`): the target's agent takes 3 s to load before
    it takes the session over, so the session is marked moving for that long, and the
    prompts sent meanwhile wait in its parked stream, then run on the new owner, in order.
    (The eager hand-off: tests/test_eager_handoff.py.)"""
    draining = await harness.worker("--drain-grace-s", "20")
    api = await harness.api()
    watcher = await harness.events()
    sid = (await create(api, workspace))["sessionId"]
    await told_a_fact(harness, api, sid, "remember PUFFIN")
    await harness.worker("--handoff", "paced", env={"ACP_SCRIPTED_LOAD_DELAY_S": "3"})
    draining.proc.send_signal(15)

    async def moving() -> dict:
        while True:
            view = await status(api, sid)
            if view.get("moving"):
                return view
            await asyncio.sleep(0.02)  # a status is read, not pushed: poll it

    assert (await asyncio.wait_for(moving(), 10))["moving"] is True
    parked = [await prompt(api, sid, "#recall"), await prompt(api, sid, "echo after the move")]
    assert await asyncio.wait_for(draining.proc.wait(), 30) == 0
    for sent in parked:
        assert (await turn_done(watcher, sid, sent["promptId"]))["type"] == "turn_complete"
    log = watcher.of(sid)
    at = {e["type"] + (e.get("promptId") or ""): e["id"] for e in log}
    first, second = (p["promptId"] for p in parked)
    assert at["session_moved"] < at["turn_complete" + first] < at["turn_complete" + second]
    assert "remember PUFFIN" in str([e for e in log if e.get("promptId") == first])
    assert "moving" not in await status(api, sid)


async def test_a_command_that_finds_the_session_moved_since_it_was_located_goes_to_the_new_owner() -> None:
    """The race the cache cannot close: a route located the session under its old owner, and
    the move's takeover landed before its SEND. The SEND is refused (not that owner's any
    more): the locator reads the new owner and sends there, rather than answer 404 for a
    session that is live. (A unit test on the embedded store: the window is microseconds.)"""
    import secrets

    from acp_state import commands as wire
    from acp_state.api.reads.cache import CachedSession
    from acp_state.api.locator import SessionLocator
    from acp_state.api.outcomes import gone
    from acp_state.ids import new_id
    from acp_state.store import AdmissionStatus, CatalogRow, Mode, RedisStore, Transition, WorkerRegistry, WorkerReport

    store = RedisStore.from_url(f"memory://moves-{secrets.token_hex(4)}")
    ws, sid, old, new = secrets.token_hex(8), new_id(), "w-old", "w-new"
    for inc in (old, new):
        await store.heartbeat(inc, WorkerReport(inc), 60_000)
    meta = {"sessionId": sid, "workspaceCwd": "/w", "createdAt": "2020-01-01T00:00:00Z"}
    await store.apply(ws, sid, old, Transition(mode=Mode.CREATE, meta=meta, epoch="e", catalog=CatalogRow(meta["createdAt"], meta["createdAt"], 1)))
    located = CachedSession(ws, old, await store.session(ws, sid))  # type: ignore[arg-type]
    assert await store.mark_moving(ws, sid, old, new)
    await store.apply(ws, sid, new, Transition(mode=Mode.TAKEOVER, takeover_from=old, op=1))
    registry = WorkerRegistry(store)
    locator = SessionLocator(store, registry, cache=None)  # type: ignore[arg-type]
    tried: list[str] = []
    command = wire.Prompt(sid=sid, prompt_id="p1", blocks=[], text="after the move")

    async def send(owner: str):
        tried.append(owner)
        return await store.send(ws, owner, command, admit_limit=6)

    admission = await locator.to_owner(sid, located, send, gone)
    assert admission.status is AdmissionStatus.OK and tried == [old, new]
    read = await store.read_commands({store.inbox_feed(ws, new): "0"}, block_ms=10)
    assert [c for _, _, c in read] == [command]
    # A session that is gone stays gone: no owner to follow.
    await store.apply(ws, sid, new, Transition(mode=Mode.DELETE, op=2))
    tried.clear()
    assert (await locator.to_owner(sid, located, send, gone)).status is AdmissionStatus.GONE and tried == [old]
    await store.close()


async def test_a_session_never_prompted_moves_and_resumes_as_a_new_agent_session(harness: Harness, workspace: str) -> None:
    """Its agent has nothing of it to load (the scripted agent, like many, writes a history at
    its first turn): a drain moves it all the same, and so does a load after a kill -9."""
    draining = await harness.worker("--drain-grace-s", "20", "--lease-ms", LEASE_MS)
    api = await harness.api()
    watcher = await harness.events()
    sid = (await create(api, workspace))["sessionId"]
    await harness.worker("--lease-ms", LEASE_MS)
    assert await draining.terminate() == 0
    await watcher.wait_type(sid, "session_moved")
    assert "recall:" in await recalled(harness, api, sid)  # the new owner's agent runs it

    other = (await create(api, workspace))["sessionId"]
    hosts = [w for w in harness.processes if getattr(w, "incarnation", None) and w.proc.returncode is None]
    await hosts[-1].kill9()
    await watcher.wait_type(other, "session_died")
    await harness.worker("--lease-ms", LEASE_MS)
    assert (await load(api, other)).status_code == 200
    assert "recall:" in await recalled(harness, api, other)
