"""The operator's view: /metrics (parsed with the official Prometheus parser), the status
table, and JSON logs that carry worker, session and prompt ids."""

from __future__ import annotations

import asyncio
import sys

import httpx
import orjson

from acp_state.summary import SESSION_STATES, state_of
from testbed.processes import ROOT
from tests.conftest import free_port
from tests.harness import Harness
from tests.helpers import create, eventually, prompt, samples, status


async def test_metrics_match_the_status_routes(harness: Harness, workspace: str) -> None:
    events = await harness.events()
    metrics_port = free_port()
    await harness.worker("--metrics-port", str(metrics_port), "--lease-ms", "900")
    api = await harness.api()
    scenarios = {"#permission": "permission_request", "#question": "permission_request", "#fail": "turn_error",
                 "hello": "turn_complete", "#slow 30": "session_update"}
    sids = []
    for text, event in scenarios.items():
        sid = (await create(api, workspace))["sessionId"]
        accepted = await prompt(api, sid, text)
        await events.wait_type(sid, event, promptId=accepted["promptId"])
        sids.append(sid)

    expected = dict.fromkeys(SESSION_STATES, 0)
    for sid in sids:
        expected[state_of(await status(api, sid))] += 1
    assert all(count == 1 for count in expected.values()), expected

    async with httpx.AsyncClient() as client:
        scraped = (await client.get(f"http://127.0.0.1:{metrics_port}/metrics")).text
    by_state = {dict(labels)["state"]: value for labels, value in samples(scraped, "acp_state_sessions").items()}
    assert by_state == expected
    pending = {dict(k)["kind"]: v for k, v in samples(scraped, "acp_state_pending_interactions").items()}
    assert pending == {"permission": 1.0, "user_question": 1.0}
    errors = samples(scraped, "acp_state_turn_errors_total")
    assert errors[(("error_kind", "none"),)] == 1.0
    assert sum(samples(scraped, "acp_state_lease_renewals_total").values()) >= 1

    api_text = (await api.client.get("/metrics")).text
    requests = samples(api_text, "acp_state_http_requests_total")
    assert requests[(("route", "create_session"), ("status", "200"))] == len(sids)
    assert samples(api_text, "acp_state_live_workers") == {(): 1.0}

    # The deployment view comes from the lease reports: equal after the next heartbeat.
    async def deployment_as_expected() -> bool:
        api_text = (await api.client.get("/metrics")).text
        deployment = {dict(k)["state"]: v for k, v in samples(api_text, "acp_state_deployment_sessions").items()}
        return deployment == expected

    await eventually(deployment_as_expected, f"the deployment's sessions by state reported as {expected}")


async def test_status_table_and_json_logs(harness: Harness, workspace: str) -> None:
    events = await harness.events()
    worker = await harness.worker("--lease-ms", "900")
    api = await harness.api()
    sid = (await create(api, workspace))["sessionId"]
    accepted = await prompt(api, sid, "#fail")
    await events.wait_type(sid, "turn_error", promptId=accepted["promptId"])

    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "acp_state.cli", "status", "--redis-url", harness.redis_url, "--once",
        stdout=asyncio.subprocess.PIPE, cwd=str(ROOT),
    )
    table = (await process.stdout.read()).decode()  # type: ignore[union-attr]
    assert await process.wait() == 0
    assert worker.incarnation in table and "live workers: " in table and "sessions by state" in table

    await worker.terminate()
    lines = [orjson.loads(line) for line in worker.log_path.read_text().splitlines() if line.startswith("{")]
    assert lines, "the worker logs JSON lines"
    assert all(line["workerId"] == worker.incarnation for line in lines)
    assert {"worker registered (lease 900 ms)", "worker stopped"} <= {line["msg"] for line in lines}


async def test_a_cancellation_dropped_by_wait_for_does_not_keep_a_task_running() -> None:
    """Python 3.11's `asyncio.wait_for` drops a cancellation that arrives just as its inner
    result does, and redis-py writes every command through one: a worker's refresh loop,
    cancelled once at that moment on SIGTERM, slept on and held the shutdown past its limit
    (exit 70 in a test run). Stopping cancels again until the task has ended."""
    from acp_state.tasks import cancel_until_done

    loop = asyncio.get_running_loop()
    rounds = 0

    async def write() -> None:  # a socket write that completes at once; the stop comes meanwhile
        if rounds == 3:
            loop.call_soon(refresh.cancel)

    async def refresh_loop() -> None:
        nonlocal rounds
        while True:
            rounds += 1
            await asyncio.wait_for(write(), 5)
            await asyncio.sleep(0.001)

    refresh = asyncio.ensure_future(refresh_loop())
    while rounds < 6:
        await asyncio.sleep(0.001)
    if sys.version_info < (3, 12):
        assert not refresh.done(), "the one cancellation was dropped: the loop goes on"
    await asyncio.wait_for(cancel_until_done([refresh]), 5)
    assert refresh.cancelled()


async def test_a_shutdown_step_that_never_ends_is_traced_and_left_behind(caplog) -> None:
    """A worker's SIGTERM must end it even when one of its tasks does not end when cancelled
    (seen twice in a day of tests: a worker that ignored SIGTERM for 20 s and logged nothing).
    The step gives up at its limit, logs where the stuck task waits, and is noted, so the
    process exits at once instead of waiting on the task in the event loop's own cleanup."""
    from acp_state.worker.worker import within_limit

    release = asyncio.Event()

    async def deaf_to_cancel() -> None:
        while not release.is_set():
            try:
                await release.wait()
            except asyncio.CancelledError:
                continue  # swallows it, as a library that retries on every error would

    stuck = asyncio.ensure_future(deaf_to_cancel())
    await asyncio.sleep(0)
    stuck.cancel()
    overran: list[str] = []
    with caplog.at_level("ERROR"):
        await asyncio.wait_for(within_limit("background tasks", 0.2, asyncio.gather(stuck), overran), 5)
    assert overran == ["background tasks"]
    assert "background tasks took longer than" in caplog.text and "deaf_to_cancel" in caplog.text
    release.set()
    await stuck
