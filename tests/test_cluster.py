"""The end-to-end flows again, on a 3-master Redis Cluster of real redis-server processes.

This module overrides `redis_server` with a cluster, so the flows imported below run their
workers, API processes and event watchers against it through a `redis+cluster://` URL.
Then what only a cluster has: a workspace's slot moving to another node under live clients.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from acp_state.store import RedisStore, keys
from acp_state.ids import workspace_id
from testbed.redis_server import RedisCluster, free_port
from tests.harness import Harness
from tests.helpers import create, eventually, is_type, prompt, watched_session_after_a_turn
from tests.test_delete_persisted import (  # noqa: F401  (collected here, on the cluster)
    test_a_delete_and_a_load_race_and_exactly_one_wins,
    test_a_turn_the_sweeper_ended_answers_worker_lost_after_a_resume,
)
from tests.test_events import (  # noqa: F401  (collected here, on the cluster)
    test_cached_status_is_never_older_than_a_delivered_event,
    test_client_of_a_killed_api_resumes_on_another_without_loss,
    test_gaps_the_log_cannot_fill_are_announced,
    test_sse_frames_and_replay_through_any_api,
)
from tests.test_faults import test_kill9_of_a_worker_hosting_1000_sessions  # noqa: F401
from tests.test_push import (  # noqa: F401
    test_a_kept_inbox_page_misses_no_vote_taken_elsewhere_and_no_lapsed_lease,
    test_the_inbox_lists_every_wait_oldest_first_and_pages,
)
from tests.test_lease import test_kill9_worker_leaves_live_status_within_its_lease  # noqa: F401
from tests.test_tenants import (  # noqa: F401
    test_a_session_id_stays_its_workspaces,
    test_create_keys_are_per_workspace_and_principal,
    test_the_worker_claims_the_id_and_never_overwrites_another_workspaces,
)
from tests.test_loop_detection import (  # noqa: F401
    test_agent_loop_error_reaches_sse_on_another_api_once,
    test_reload_appends_the_turn_error_until_a_newer_prompt_starts,
)
from tests.test_runtime_status import (  # noqa: F401
    test_cancel_resolves_pending_and_ends_cancelled,
    test_close_removes_live_state_but_keeps_the_catalog_row,
    test_concurrent_votes_on_two_apis_have_one_winner,
    test_single_scope_coalesces_across_api_processes,
    test_turn_error_survives_queued_prompts_and_clears_on_start,
    test_two_workers_two_apis_share_runtime_state,
    test_vote_errors_follow_the_reference,
    test_workspace_listing_pages_newest_first,
)


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisCluster]:
    cluster = RedisCluster(masters=3)
    cluster.start()
    yield cluster
    cluster.stop()


async def test_live_clients_follow_a_workspace_whose_slot_moves(
    harness: Harness, redis_server: RedisCluster, workspace: str
) -> None:
    api, sid, live = await watched_session_after_a_turn(harness, workspace, "#burst 5")
    assert (await api.client.get(f"/session/{sid}/status")).json()["activeWorkState"] == "idle"  # now cached

    ws = workspace_id(workspace)
    before, after = redis_server.move_slot_of(keys.session(ws, sid))
    assert redis_server.owner_of(keys.events(ws, sid)) == after != before
    moved_at = time.monotonic()

    # The worker's commands, its transitions and the SSE subscription all follow the slot.
    second = await prompt(api, sid, "#permission")
    asked = await live.wait_for(lambda f: f["event"] == "permission_request", timeout=30)
    print(f"\nslot moved: the next prompt's permission_request reached SSE {(time.monotonic() - moved_at) * 1000:.0f} ms later")
    assert asked["data"]["promptId"] == second["promptId"]
    status = (await api.client.get(f"/session/{sid}/status")).json()
    assert status["activeWorkState"] == "active" and status["isWaitingForPermission"] is True
    rid = asked["data"]["data"]["requestId"]
    vote = {"outcome": {"outcome": "selected", "optionId": "proceed_once"}}
    assert (await api.client.post(f"/session/{sid}/permission/{rid}", json=vote)).status_code == 200
    await live.wait_for(is_type("turn_complete", promptId=second["promptId"]), timeout=30)
    status = (await api.client.get(f"/session/{sid}/status")).json()
    assert status["activeWorkState"] == "idle" and status["isWaitingForPermission"] is False

    ids = [f["id"] for f in live.events() if f["id"] is not None]
    assert ids == list(range(ids[0], ids[-1] + 1)), "no event lost across the move"
    await live.close()


async def test_workspaces_on_every_shard(harness: Harness, redis_server: RedisCluster, tmp_path) -> None:
    """Workspaces served by every master: sessions are created and listed in each."""
    folders: list[str] = []
    per_node: dict[int, int] = {node.port: 0 for node in redis_server.nodes}
    for i in range(1000):  # two workspaces on each master
        folder = tmp_path / f"ws{i}"
        owner = redis_server.owner_of(keys.live(workspace_id(str(folder))))
        if per_node[owner] < 2:
            per_node[owner] += 1
            folder.mkdir()
            folders.append(str(folder))
        if len(folders) == 2 * len(per_node):
            break
    await harness.worker()
    api = await harness.api(workspaces=folders)
    created = await asyncio.gather(*(create(api, folder) for folder in folders))
    for folder, session in zip(folders, created, strict=True):
        listing = (await api.client.get(f"/workspace/{workspace_id(folder)}/sessions")).json()
        assert [row["sessionId"] for row in listing["sessions"]] == [session["sessionId"]]


async def test_live_clients_follow_a_failover(workspace: str) -> None:
    """A replica takes over the master of a live workspace: commands, transitions, status and
    the SSE stream carry on against the new master, with no event lost."""
    cluster = RedisCluster(masters=3, replicas=1).start()
    harness = Harness(cluster.url, workspace, free_port)
    try:
        api, sid, live = await watched_session_after_a_turn(harness, workspace)

        old, new = cluster.fail_over(keys.session(workspace_id(workspace), sid))
        assert old != new
        failed_over_at = time.monotonic()

        second = await prompt(api, sid, "#burst 3")
        await live.wait_for(is_type("turn_complete", promptId=second["promptId"]), timeout=30)
        print(f"\nfailover: the next turn completed on SSE {(time.monotonic() - failed_over_at) * 1000:.0f} ms after it")
        status = (await api.client.get(f"/session/{sid}/status")).json()
        assert status["activeWorkState"] == "idle"
        ids = [f["id"] for f in live.events() if f["id"] is not None]
        assert ids == list(range(ids[0], ids[-1] + 1)), "no event lost across the failover"
        await live.close()
    finally:
        await harness.stop_all()
        cluster.stop()


async def test_a_fresh_process_answers_its_first_burst_of_requests(redis_server: RedisCluster) -> None:
    """A process that just started gets many requests at once (every client of a restarted
    API reconnects): none may fail while its client is still learning the slot map."""
    for _ in range(10):
        store = RedisStore.from_url(redis_server.url)
        try:
            answers = await asyncio.gather(*(store.locate(f"s{i}") for i in range(32)), return_exceptions=True)
        finally:
            await store.close()
        assert answers == [None] * 32


async def test_a_cluster_node_behind_a_single_node_url_is_refused(redis_server: RedisCluster) -> None:
    """`redis://` to a cluster node would fail later, command by command, with MOVED: the
    processes refuse to start instead, and say which URL to give."""
    single = f"redis://127.0.0.1:{redis_server.nodes[0].port}"
    for command in (["worker"], ["api", "--port", "0"]):
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "acp_state.cli", *command, "--redis-url", single,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        _, stderr = await asyncio.wait_for(process.communicate(), 30)
        assert process.returncode == 1
        assert "give it as redis+cluster://" in stderr.decode()


async def test_an_unplanned_failover_of_the_registry_master_sweeps_nobody(workspace: str, tmp_path) -> None:
    """kill -9 of the master that holds the lease registry and a live workspace: while its
    replica is promoted (several leases), no worker is declared dead, and every session and
    acknowledged vote carries on against the new master."""
    lease_ms = 1500
    cluster = RedisCluster(masters=3, replicas=1).start()
    victim_port = cluster.owner_of(keys.WORKERS)
    folder = next(
        str(path) for path in (tmp_path / f"ws{i}" for i in range(2000))
        if cluster.owner_of(keys.live(workspace_id(str(path)))) == victim_port
    )
    Path(folder).mkdir()
    harness = Harness(cluster.url, folder, free_port)
    try:
        events = await harness.events()
        first = await harness.worker("--lease-ms", str(lease_ms))
        second = await harness.worker("--lease-ms", str(lease_ms))
        api = await harness.api(workspaces=[folder])
        sids = [(await create(api, folder))["sessionId"] for _ in range(4)]
        asked = await prompt(api, sids[0], "#permission")
        request = await events.wait_type(sids[0], "permission_request", promptId=asked["promptId"])

        victim = next(node for node in cluster.nodes if node.port == victim_port)
        victim.process.kill()
        victim.process.wait()
        killed_at = time.monotonic()
        survivor = next(node.port for node in cluster.nodes if node.port != victim_port)
        await eventually(
            lambda: cluster._owner_seen_by(survivor, keys.WORKERS) not in (victim_port, None), "a replica's promotion"
        )
        promoted_ms = (time.monotonic() - killed_at) * 1000

        # An acknowledged vote reaches the agent; an unconfirmed one is retried with its key.
        url = f"/session/{sids[0]}/permission/{request['data']['requestId']}"
        vote = {"outcome": {"outcome": "selected", "optionId": "proceed_once"}}

        async def vote_acknowledged() -> bool:  # a 503 while the slots move, then the 200
            answer = await api.client.post(url, json=vote, headers={"Idempotency-Key": "v1"})
            assert answer.status_code in (200, 503), answer.text
            return answer.status_code == 200

        await eventually(vote_acknowledged, "the vote acknowledged after the failover", step=0.2)
        await events.wait_type(sids[0], "turn_complete", promptId=asked["promptId"], timeout=30)
        for sid in sids:
            done = await prompt(api, sid, "hello")
            await events.wait_type(sid, "turn_complete", promptId=done["promptId"], timeout=30)
        print(f"\nunplanned failover: replica promoted {promoted_ms:.0f} ms after kill -9 (lease {lease_ms} ms); "
              f"every session went on")
        assert not [e for e in events.events if e["type"] == "session_died"]
        registered = set(await events.redis.zrange(keys.WORKERS, 0, -1))
        assert {first.incarnation, second.incarnation} <= registered
    finally:
        await harness.stop_all()
        cluster.stop()

