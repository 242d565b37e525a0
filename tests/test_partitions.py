"""Network faults across hosts: each process on its own host of a network-namespace test bed
(testbed/hosts.py), Redis on the bed's Redis address, partitions as kernel drop rules (no RST,
no FIN), latency through the bed's fault proxy. Skipped, saying why, where namespaces or
nftables are not available (not root, no `ip netns`)."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from testbed.hosts import TestBed
from testbed.processes import ApiProcess
from tests.harness import Harness, SseClient
from tests.helpers import create, eventually, is_type, prompt
from tests.host_bed import across, bed, bed_redis  # noqa: F401 (fixtures)

LEASE_MS = 2000


async def incarnations(api: ApiProcess) -> set[str]:
    response = await api.client.get("/workers")
    assert response.status_code == 200, response.text
    return {w["incarnation"] for w in response.json()["workers"]}


@pytest.mark.parametrize("direction", ["both", "in", "out"])
async def test_a_worker_cut_off_past_its_lease_is_declared_dead_and_rejoins_as_a_new_incarnation(
    bed: TestBed, across: Harness, workspace: str, direction: str,
) -> None:
    worker = await across.worker("--lease-ms", str(LEASE_MS), host=bed.hosts["worker-1"])
    api = await across.api(host=bed.hosts["api-1"])
    sid = (await create(api, workspace))["sessionId"]
    sse = await SseClient(api, sid).start()
    await sse.wait_for(lambda f: f["event"] == "session_snapshot")
    await prompt(api, sid, "#slow 1")  # runs, and ends, while its worker is cut off

    bed.partition("worker-1", direction)
    died = await sse.wait_for(lambda f: f["event"] == "session_died", timeout=8 * LEASE_MS / 1000)
    assert died["data"]["data"]["reason"] == "worker_lost"
    assert (await api.client.get(f"/session/{sid}/status")).status_code == 404
    assert worker.incarnation not in await incarnations(api)
    bed.heal("worker-1")

    # It joins again under a new incarnation, with nothing of the old one's.
    fresh = await eventually(lambda: _new_incarnation(api, worker.incarnation), "the rejoin")
    again = (await create(api, workspace))["sessionId"]
    live = await SseClient(api, again).start()
    accepted = await prompt(api, again, "hello")
    await live.wait_for(is_type("turn_complete", promptId=accepted["promptId"]))
    assert await incarnations(api) == {fresh}
    # A declared death is final: the old incarnation's turn, which ended meanwhile, never
    # reported after the session died (its writes were refused), nor did anything else.
    replay = await SseClient(api, sid, last_event_id=0).start()
    frames = await replay.wait_for(lambda f: f["event"] == "session_died")
    assert not [f for f in replay.frames if f.get("id") and int(f["id"]) > int(frames["id"])]
    for client in (sse, live, replay):
        await client.close()


async def _new_incarnation(api: ApiProcess, old: str) -> str | None:
    live = await incarnations(api) - {old}
    return next(iter(live), None)


async def test_an_api_cut_off_from_redis_answers_503_ends_its_streams_and_recovers(
    bed: TestBed, across: Harness, workspace: str,
) -> None:
    await across.worker("--lease-ms", str(LEASE_MS), host=bed.hosts["worker-1"])
    api = await across.api(host=bed.hosts["api-1"])
    sid = (await create(api, workspace))["sessionId"]
    sse = await SseClient(api, sid).start()
    await sse.wait_for(lambda f: f["event"] == "session_snapshot")

    bed.partition("api-1")
    # Its clients still reach it; what needs Redis is refused, with a reason and a retry
    # hint, rather than left hanging (the client's own timeout is 30 s).
    answer = await api.client.get(f"/session/{sid}/status")
    assert answer.status_code == 503, answer.text
    assert answer.json()["code"] == "store_unavailable" and answer.headers["Retry-After"]
    refused = await api.client.post(f"/session/{sid}/prompt", json={"prompt": [{"type": "text", "text": "x"}]})
    assert refused.status_code == 503 and refused.json()["code"]
    # Its event streams end, so their clients reconnect (to another API process).
    await asyncio.wait_for(sse.closed.wait(), 30)

    bed.heal("api-1")
    back = await eventually(lambda: _status_ok(api, sid), "the API's recovery")
    assert back["sessionId"] == sid
    again = await SseClient(api, sid, last_event_id=0).start()
    accepted = await prompt(api, sid, "after the heal")
    await again.wait_for(is_type("turn_complete", promptId=accepted["promptId"]))
    await again.close()


async def _status_ok(api: ApiProcess, sid: str) -> dict | None:
    answer = await api.client.get(f"/session/{sid}/status")
    return answer.json() if answer.status_code == 200 else None


async def test_half_open_connections_are_noticed_by_each_process_and_cost_no_lease(
    bed: TestBed, across: Harness, workspace: str,
) -> None:
    worker = await across.worker("--lease-ms", str(LEASE_MS), host=bed.hosts["worker-1"])
    api = await across.api(host=bed.hosts["api-1"])
    sid = (await create(api, workspace))["sessionId"]
    sse = await SseClient(api, sid).start()
    first = await prompt(api, sid, "warm")
    await sse.wait_for(is_type("turn_complete", promptId=first["promptId"]))

    # Every connection the worker has open to Redis goes silent, with no RST: its inbox read
    # is found dead by keepalive (~4 s, two leases), its renewals in flight by their
    # timeout; the API, which sweeps, would declare it dead were its lease to lapse.
    assert bed.half_open("worker-1") > 0
    accepted = await prompt(api, sid, "through")
    await sse.wait_for(is_type("turn_complete", promptId=accepted["promptId"]), timeout=30)
    assert await incarnations(api) == {worker.incarnation}
    # Then the API's: it finds its own dead connections and takes the next prompt.
    assert bed.half_open("api-1") > 0
    accepted = await eventually(lambda: _accepted(api, sid), "a prompt accepted")
    await sse.wait_for(is_type("turn_complete", promptId=accepted["promptId"]), timeout=30)
    assert await incarnations(api) == {worker.incarnation}
    assert not sse.events("session_died")
    await sse.close()


async def _accepted(api: ApiProcess, sid: str) -> dict | None:
    answer = await api.client.post(f"/session/{sid}/prompt", json={"prompt": [{"type": "text", "text": "through"}]})
    return answer.json() if answer.status_code == 202 else None


async def test_latency_of_half_the_lease_kills_no_worker(bed: TestBed, across: Harness, workspace: str) -> None:
    worker = await across.worker("--lease-ms", str(LEASE_MS), host=bed.hosts["worker-1"])
    api = await across.api(host=bed.hosts["api-1"])
    sid = (await create(api, workspace))["sessionId"]
    sse = await SseClient(api, sid).start()
    await sse.wait_for(lambda f: f["event"] == "session_snapshot")

    # A quarter lease each way: every round trip of the worker takes half its lease.
    bed.proxy().set(bed.hosts["worker-1"].ip, latency_ms=LEASE_MS / 4)
    held_until = time.monotonic() + 4 * LEASE_MS / 1000
    while time.monotonic() < held_until:  # turns go on, one after another, for four leases
        accepted = await prompt(api, sid, "slowly")
        await sse.wait_for(is_type("turn_complete", promptId=accepted["promptId"]), timeout=30)
    bed.proxy().clear_all()
    assert await incarnations(api) == {worker.incarnation}
    assert not sse.events("session_died")
    await sse.close()



async def test_a_worker_that_rejoins_over_a_slow_link_joins_once(bed: TestBed, across: Harness, workspace: str) -> None:
    """A worker frozen past its lease joins again as a new incarnation; over a slow link its
    renewals overlap that join. One that was sent before the join landed answers `new` for
    the new incarnation: that is the join itself, not a store that lost its state. Taken for
    the latter (with the freeze still counted), it gave the new incarnation up too, and the
    sessions created on it vanished without a word (bench/chaos/run.py --hosts --cluster)."""
    worker = await across.worker("--lease-ms", str(LEASE_MS), host=bed.hosts["worker-1"])
    api = await across.api(host=bed.hosts["api-1"])
    await create(api, workspace)
    worker.proc.send_signal(signal.SIGSTOP)
    try:
        await eventually(lambda: _gone(api, worker.incarnation), "the frozen worker's death")
        bed.proxy().set(bed.hosts["worker-1"].ip, latency_ms=LEASE_MS / 4)
    finally:
        worker.proc.send_signal(signal.SIGCONT)
    fresh = await eventually(lambda: _new_incarnation(api, worker.incarnation), "the rejoin")
    sid = (await create(api, workspace))["sessionId"]
    sse = await SseClient(api, sid).start()
    accepted = await prompt(api, sid, "after the rejoin")
    await sse.wait_for(is_type("turn_complete", promptId=accepted["promptId"]), timeout=30)
    assert await incarnations(api) == {fresh}
    assert not sse.events("session_died")
    await sse.close()


async def _gone(api: ApiProcess, incarnation: str) -> bool:
    return incarnation not in await incarnations(api)
