"""`DELETE /session/:id` of a listed session that is not live deletes it, racing a load
exactly one of them wins, and a turn the sweeper ended answers its `worker_lost` end after a
resume (issue 37 item 8; docs/api.md, "Deleting a session").

Real redis-server, worker and API processes, the scripted agent with the suite's shared
state dir (its history on disk, which a load replays). A worker is killed with SIGKILL, and
its sessions become listed rows once the sweeper has declared it dead (their
`session_died`, awaited: no sleeps).
"""

from __future__ import annotations

import asyncio
import os

import orjson

from acp_state.ids import workspace_id
from acp_state.store import keys
from acp_state.testing.scripted_agent import history_path
from testbed.processes import ApiProcess
from tests.harness import Harness
from tests.helpers import create, eventually, prompt

LEASE_MS = "1500"


async def listed(api: ApiProcess, workspace: str) -> set[str]:
    response = await api.client.get(f"/workspace/{workspace_id(workspace)}/sessions", params={"size": 100})
    assert response.status_code == 200, response.text
    return {row["sessionId"] for row in response.json()["sessions"]}


async def load(api: ApiProcess, sid: str):
    return await api.client.post(f"/session/{sid}/load", json={})


async def turn_done(harness: Harness, sid: str, prompt_id: str) -> dict:
    watcher = await harness.events()
    return await watcher.wait_for(
        lambda e: e["_channel"].endswith(sid) and e["type"] in ("turn_complete", "turn_error")
        and e["data"].get("promptId") == prompt_id
    )


async def assert_deleted(apis: list[ApiProcess], workspace: str, sid: str, redis_client) -> None:
    """Gone for every API process: not listed, a load 404s, as do its transcript and
    status; nothing of it is left in Redis but what is not acp-state's to drop."""
    ws = workspace_id(workspace)
    for api in apis:
        assert sid not in await listed(api, workspace)
        again = await load(api, sid)
        assert again.status_code == 404 and again.json()["code"] == "session_not_found", again.text
        assert (await api.client.get(f"/session/{sid}/transcript")).status_code == 404
        assert (await api.client.get(f"/session/{sid}/status")).status_code == 404
    assert not await redis_client.hexists(keys.catalog(ws), sid)
    assert await redis_client.exists(
        keys.session(ws, sid), keys.load_claim(ws, sid), keys.turns(ws, sid), keys.transcript(ws, sid)
    ) == 0


async def test_a_listed_session_whose_worker_was_killed_mid_turn_is_deleted(
    harness: Harness, workspace: str, redis_client
) -> None:
    first = await harness.worker("--lease-ms", LEASE_MS)
    api = await harness.api()
    watcher = await harness.events()
    sid = (await create(api, workspace))["sessionId"]
    told = await prompt(api, sid, "remember OSPREY")
    assert (await turn_done(harness, sid, told["promptId"]))["type"] == "turn_complete"
    running = await prompt(api, sid, "#slow 30")
    await watcher.wait_type(sid, "session_update", promptId=running["promptId"])  # mid-turn
    await first.kill9()
    await watcher.wait_type(sid, "session_died")  # the sweeper declared the worker dead
    await harness.worker("--lease-ms", LEASE_MS)  # a worker that could resume it
    assert sid in await listed(api, workspace)
    row = orjson.loads(await redis_client.hget(keys.catalog(workspace_id(workspace)), sid))
    history = history_path(row["agentSessionId"])  # the agent's own history of the session
    assert os.path.exists(history)

    deleted = await api.client.delete(f"/session/{sid}")
    assert deleted.status_code == 204, deleted.text
    await assert_deleted([api], workspace, sid, redis_client)
    # The agent's own history (its --state-dir) is not acp-state's: it stays (docs/api.md).
    assert os.path.exists(history)
    again = await api.client.delete(f"/session/{sid}")
    assert again.status_code == 404 and again.json()["code"] == "session_not_found"


async def test_a_delete_and_a_load_race_and_exactly_one_wins(harness: Harness, workspace: str, redis_client) -> None:
    """Each listed session is deleted and loaded at once, through two API processes, every
    pair of requests in flight together: either the delete wins (204; the load 404
    `session_not_found`; the session is gone for good) or the load does (200; the delete 409
    `session_resumed`; the session is live and listed). A session the load won is closed
    and raced again, until every one was deleted."""
    first = await harness.worker("--lease-ms", LEASE_MS)
    apis = [await harness.api(), await harness.api()]
    watcher = await harness.events()
    sids = [(await create(apis[0], workspace))["sessionId"] for _ in range(8)]
    for n, sid in enumerate(sids):
        await prompt(apis[0], sid, f"remember BIRD-{n}")
    for sid in sids:
        await watcher.wait_type(sid, "turn_complete")
    await first.kill9()
    for sid in sids:
        await watcher.wait_type(sid, "session_died")
    await harness.worker("--lease-ms", LEASE_MS)

    async def race(n: int, sid: str) -> tuple[str, int, int]:
        delete_api, load_api = apis[n % 2], apis[(n + 1) % 2]
        if n % 4 < 2:
            deleted, loaded = await asyncio.gather(delete_api.client.delete(f"/session/{sid}"), load(load_api, sid))
        else:
            loaded, deleted = await asyncio.gather(load(load_api, sid), delete_api.client.delete(f"/session/{sid}"))
        return sid, deleted.status_code, loaded.status_code, deleted, loaded

    outcomes: dict[str, int] = {"delete": 0, "load": 0, "load, then a close": 0}
    remaining = list(sids)
    rounds = 0
    while remaining:
        rounds += 1
        assert rounds <= 10, f"the loads kept winning: {outcomes}"
        results = await asyncio.gather(*(race(n + rounds, sid) for n, sid in enumerate(remaining)))
        remaining = []
        for sid, deleted_status, loaded_status, deleted, loaded in results:
            if (deleted_status, loaded_status) == (204, 404):
                assert loaded.json()["code"] == "session_not_found", loaded.text
                outcomes["delete"] += 1
                await assert_deleted(apis, workspace, sid, redis_client)
                continue
            if (deleted_status, loaded_status) == (409, 200):
                assert deleted.json()["code"] == "session_resumed", deleted.text
                outcomes["load"] += 1
                assert (await apis[0].client.get(f"/session/{sid}/status")).status_code == 200  # live
                closed = await apis[1].client.delete(f"/session/{sid}")  # live: a DELETE closes it
                assert closed.status_code == 204, closed.text
            else:
                # The delete came after the load had ended: it closed the live session.
                assert (deleted_status, loaded_status) == (204, 200), (deleted.text, loaded.text)
                outcomes["load, then a close"] += 1
            assert sid in await listed(apis[0], workspace) and sid in await listed(apis[1], workspace)
            assert (await apis[0].client.get(f"/session/{sid}/status")).status_code == 404  # closed
            remaining.append(sid)
    assert outcomes["delete"] == len(sids), outcomes
    assert not (await listed(apis[0], workspace)) & set(sids)


async def test_a_turn_the_sweeper_ended_answers_worker_lost_after_a_resume(harness: Harness, workspace: str) -> None:
    first = await harness.worker("--lease-ms", LEASE_MS)
    api = await harness.api()
    watcher = await harness.events()
    sid = (await create(api, workspace))["sessionId"]
    told = await prompt(api, sid, "remember PLOVER")
    assert (await turn_done(harness, sid, told["promptId"]))["type"] == "turn_complete"
    running = await prompt(api, sid, "#slow 30")
    await watcher.wait_type(sid, "session_update", promptId=running["promptId"])  # mid-turn
    queued = await prompt(api, sid, "after")
    await first.kill9()
    lost = [(await turn_done(harness, sid, p["promptId"]))["data"]["code"] for p in (running, queued)]
    assert lost == ["worker_lost", "worker_lost"]
    await watcher.wait_type(sid, "session_died")

    await harness.worker("--lease-ms", LEASE_MS)
    resumed = await load(api, sid)
    assert resumed.status_code == 200 and resumed.json()["attached"] is False, resumed.text
    for sent, started in ((running, True), (queued, False)):
        turn = await api.client.get(f"/session/{sid}/turns/{sent['promptId']}")
        assert turn.status_code == 200, turn.text
        body = turn.json()
        assert (body["state"], body["error"]["code"]) == ("error", "worker_lost"), body
        assert body["endedAt"] >= body["queuedAt"] and ("startedAt" in body) is started
    done = (await api.client.get(f"/session/{sid}/turns/{told['promptId']}")).json()
    assert done["state"] == "completed"
    current = (await api.client.get(f"/session/{sid}/turns/current")).json()
    assert (current["promptId"], current["state"]) == (queued["promptId"], "error")
    # The session goes on: a new turn runs and is answered as any.
    after = await prompt(api, sid, "again")
    assert (await turn_done(harness, sid, after["promptId"]))["type"] == "turn_complete"
    assert (await api.client.get(f"/session/{sid}/turns/{after['promptId']}")).json()["state"] == "completed"


async def test_a_load_whose_claim_lapsed_does_not_revive_a_session_deleted_meanwhile(
    harness: Harness, workspace: str, redis_client
) -> None:
    """The load claims the session, so a delete meanwhile answers 409; once the claim has
    lapsed (its TTL, here the test deletes it) while the worker still loads the session, a
    delete wins, and the worker's publish of the resumed session is refused: the load
    answers 404 and the session stays deleted."""
    first = await harness.worker("--lease-ms", LEASE_MS)
    api = await harness.api()
    watcher = await harness.events()
    sid = (await create(api, workspace))["sessionId"]
    told = await prompt(api, sid, "remember AVOCET")
    assert (await turn_done(harness, sid, told["promptId"]))["type"] == "turn_complete"
    await first.kill9()
    await watcher.wait_type(sid, "session_died")
    slow = await harness.worker("--lease-ms", LEASE_MS, env={"ACP_SCRIPTED_LOAD_DELAY_S": "8"})
    ws = workspace_id(workspace)
    claim = keys.load_claim(ws, sid)

    loading = asyncio.ensure_future(load(api, sid))
    await eventually(lambda: redis_client.exists(claim), "the load's claim")
    lost = await api.client.delete(f"/session/{sid}")
    assert lost.status_code == 409 and lost.json()["code"] == "session_resumed", lost.text
    await redis_client.delete(claim)  # the claim lapses while the agent still loads
    won = await api.client.delete(f"/session/{sid}")
    assert won.status_code == 204, won.text
    loaded = await loading
    assert loaded.status_code == 404 and loaded.json()["code"] == "session_not_found", loaded.text
    await assert_deleted([api], workspace, sid, redis_client)
    await eventually(lambda: _not(redis_client.smembers(keys.worker_sessions(slow.incarnation))), "the worker dropping it")


async def _not(value) -> bool:
    return not await value
