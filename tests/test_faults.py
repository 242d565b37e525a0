"""Faults injected with real processes: Redis restarting empty while workers hold sessions."""

from __future__ import annotations

import asyncio
import time


from tests.conftest import RedisServer, free_port
from tests.harness import Harness, SseClient
from tests.helpers import create, eventually, prompt, watched_session_after_a_turn

LEASE_MS = 1200


async def test_redis_restart_with_data_loss(own_redis: RedisServer, workspace: str) -> None:
    harness = Harness(own_redis.url, workspace, free_port)
    try:
        await harness.worker("--lease-ms", str(LEASE_MS))
        api = await harness.api()
        sid = (await create(api, workspace))["sessionId"]
        idle = (await create(api, workspace))["sessionId"]
        sse = await SseClient(api, sid).start()
        await sse.wait_for(lambda f: f["event"] == "session_snapshot")
        waiting = await prompt(api, sid, "#permission")
        request = await sse.wait_for(lambda f: f["event"] == "permission_request")
        epoch_before = waiting["eventEpoch"]

        own_redis.process.kill()  # no persistence: everything Redis held is gone
        own_redis.process.wait()
        down = await api.client.post(f"/session/{idle}/prompt", json={"prompt": [{"type": "text", "text": "x"}]})
        assert down.status_code == 503 and down.headers["Retry-After"] == "1"
        assert down.json()["code"] == "store_unavailable"
        rid = request["data"]["data"]["requestId"]
        vote = await api.client.post(
            f"/session/{sid}/permission/{rid}", json={"outcome": {"outcome": "selected", "optionId": "proceed_once"}}
        )
        assert vote.status_code == 503

        restarted = RedisServer(port=own_redis.port, folder=own_redis.dir).start()
        own_redis.process = restarted.process
        came_back = time.monotonic()
        # The workers rewrite what they hold from memory: status, pending interaction included.

        async def rewritten() -> bool:
            status = await api.client.get(f"/session/{sid}/status")
            return status.status_code == 200 and status.json()["isWaitingForPermission"]

        await eventually(rewritten, "the waiting session's status rewritten")
        rewritten_ms = round((time.monotonic() - came_back) * 1000)
        assert (await api.client.get(f"/session/{idle}/status")).status_code == 200
        print(f"\nRedis restarted empty: sessions rewritten {rewritten_ms} ms after it came back (lease {LEASE_MS} ms)")
        # The event history is gone, and the epoch says so.
        again = await prompt(api, idle, "hello")
        assert again["eventEpoch"] != epoch_before
        # The agent still waits for its vote; the rewritten request takes it, even by the
        # legacy route, whose request index was rewritten too.
        vote = await api.client.post(
            f"/permission/{rid}", json={"outcome": {"outcome": "selected", "optionId": "proceed_once"}}
        )
        assert vote.status_code == 200, vote.text
        fresh = await SseClient(api, sid, last_event_id=0).start()
        done = await fresh.wait_for(lambda f: f["event"] == "turn_complete", timeout=20)
        assert done["data"]["data"]["stopReason"] == "end_turn"
        await sse.close()
        await fresh.close()
    finally:
        await harness.stop_all()


async def test_dropped_pubsub_connection_is_re_established_and_gaps_filled(harness: Harness, redis_client, workspace: str) -> None:
    api, sid, sse = await watched_session_after_a_turn(harness, workspace, "#burst 5")

    killed = await redis_client.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
    assert killed >= 1
    second = await prompt(api, sid, "#burst 50")  # published while the API may be reconnecting
    await sse.wait_for(
        lambda f: f["event"] == "turn_complete" and f["data"].get("promptId") == second["promptId"], timeout=20
    )
    ids = [f["id"] for f in sse.events()]
    assert ids == list(range(ids[0], ids[-1] + 1)), "nothing lost, nothing twice"
    await sse.close()


async def test_kill9_of_a_worker_hosting_1000_sessions(harness: Harness, redis_client, workspace: str) -> None:
    from acp_state.store import keys
    from acp_state.clock import now_ms
    from acp_state.ids import workspace_id

    events = await harness.events()
    # A longer lease here: a worker busy starting 1,000 sessions on a loaded 2-core machine
    # must not miss its own heartbeat before the kill.
    lease_ms = 3000
    victim = await harness.worker("--lease-ms", str(lease_ms), "--max-sessions", "1000")
    api = await harness.api()
    semaphore = asyncio.Semaphore(16)

    async def one() -> str:
        async with semaphore:
            return (await create(api, workspace))["sessionId"]

    sids = await asyncio.gather(*(one() for _ in range(1000)))
    watched = [await SseClient(api, sid).start() for sid in sids[:10]]
    survivor = await harness.worker("--lease-ms", str(lease_ms))

    killed_at = now_ms()
    await victim.kill9()
    deadline = int(await redis_client.zscore(keys.WORKERS, victim.incarnation))
    await asyncio.sleep(max(0, deadline - now_ms()) / 1000 + 0.01)
    ws = workspace_id(workspace)
    for sid in sids[:50]:
        assert (await api.client.get(f"/session/{sid}/status")).status_code == 404
    page = (await api.client.get(f"/workspace/{ws}/sessions?size=100")).json()["sessions"]
    assert len(page) == 100 and all("pendingInteractions" not in row for row in page)
    hidden_at = now_ms()

    for client in watched:
        died = await client.wait_for(lambda f: f["event"] == "session_died", timeout=120)  # a safety stop
        assert died["data"]["data"]["reason"] == "worker_lost"
    # The time limit is a safety stop: a sweep of 1,000 sessions on a loaded machine is slow, not wrong.
    await events.wait_for(lambda e: sum(1 for x in events.events if x["type"] == "session_died") >= 1000, timeout=300)
    swept_at = now_ms()
    assert sorted({e["data"]["sessionId"] for e in events.events if e["type"] == "session_died"}) == sorted(sids)
    assert [k async for k in redis_client.scan_iter(match=f"*{victim.incarnation}*")] == []
    assert await redis_client.scard(keys.live(ws)) == 0
    assert not [k async for k in redis_client.scan_iter(match=f"acp:{{{ws}}}:s:*")]
    fresh = (await create(api, workspace))["sessionId"]
    assert await redis_client.hget(keys.session(ws, fresh), "inc") == survivor.incarnation
    print(
        f"\nkill -9 with 1000 sessions: lease {lease_ms} ms; hidden from readers {hidden_at - killed_at} ms "
        f"after the kill; all session_died and keys swept {swept_at - killed_at} ms after the kill"
    )
    for client in watched:
        await client.close()
