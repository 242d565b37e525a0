"""The event stream over Redis: SSE on any API process, replay with Last-Event-ID, gaps said."""

from __future__ import annotations

import asyncio
import socket

import orjson
import pytest

from acp_state.store import keys
from acp_state.ids import workspace_id
from tests.harness import Harness, SseClient
from tests.helpers import AsgiRequest, app_in_process, create, eventually, is_type, prompt, samples


async def test_sse_frames_and_replay_through_any_api(harness: Harness, workspace: str) -> None:
    await harness.worker()
    api1, api2 = await harness.api(), await harness.api()
    sid = (await create(api1, workspace))["sessionId"]
    live = await SseClient(api2, sid).start()
    snapshot = await live.wait_for(lambda f: f["event"] == "session_snapshot")
    assert snapshot["id"] is None and snapshot["data"]["data"]["sessionId"] == sid

    accepted = await prompt(api1, sid, "#burst 20")
    done = await live.wait_for(is_type("turn_complete"))
    ids = [f["id"] for f in live.events()]
    assert ids == list(range(ids[0], done["id"] + 1)), "ids increase by one, none missing"
    assert done["data"] == {
        "id": done["id"],
        "v": 1,
        "type": "turn_complete",
        "promptId": accepted["promptId"],
        "data": {"sessionId": sid, "stopReason": "end_turn", "promptId": accepted["promptId"]},
        "_meta": done["data"]["_meta"],
    }
    chunks = [f for f in live.events("session_update") if f["data"]["data"]["update"]["sessionUpdate"] == "agent_message_chunk"]
    assert [c["data"]["data"]["update"]["content"]["text"] for c in chunks] == [f"chunk {i}" for i in range(1, 21)]

    # A client that saw up to id 5 gets exactly the rest, then replay_complete.
    resumed = await SseClient(api1, sid, last_event_id=5).start()
    complete = await resumed.wait_for(lambda f: f["event"] == "replay_complete")
    assert [f["id"] for f in resumed.events()] == list(range(6, done["id"] + 1))
    assert complete["data"]["data"] == {
        "lastReplayedEventId": done["id"],
        "lastEventId": done["id"],
        "replayedCount": done["id"] - 5,
    }
    # Garbage Last-Event-ID values are ignored: a fresh stream, no replay.
    for bad in ("abc", "-1", "1e3", "9" * 30):
        fresh = SseClient(api1, sid)
        fresh.last_event_id = bad  # type: ignore[assignment]
        await fresh.start()
        first = await fresh.wait_for(lambda f: f["event"] in ("session_snapshot", "replay_complete"))
        assert first["event"] == "session_snapshot"
        await fresh.close()
    await live.close()
    await resumed.close()


async def test_client_of_a_killed_api_resumes_on_another_without_loss(harness: Harness, redis_client, workspace: str) -> None:
    await harness.worker()
    doomed, survivor = await harness.api(), await harness.api()
    sid = (await create(survivor, workspace))["sessionId"]
    first = await SseClient(doomed, sid).start()
    snapshot = await first.wait_for(lambda f: f["event"] == "session_snapshot")
    start = snapshot["data"]["data"]["lastEventId"]
    running = await prompt(survivor, sid, "#slow 2")
    await first.wait_for(lambda f: f["event"] == "session_update" and "tick 3" in str(f["data"]))
    await doomed.kill9()
    await first.closed.wait()
    seen = first.last_id
    assert seen is not None

    # Events keep flowing while the client is away; it comes back on the other process.
    second = await SseClient(survivor, sid, last_event_id=seen).start()
    await second.wait_for(is_type("turn_complete", promptId=running["promptId"]), timeout=30)
    ids = [f["id"] for f in first.events()] + [f["id"] for f in second.events()]
    ws = workspace_id(workspace)
    logged = [int(entry_id.split("-")[0]) for entry_id, _ in await redis_client.xrange(keys.events(ws, sid))]
    assert ids == [i for i in logged if i > start], "every event after the snapshot, in order, exactly once"
    await second.close()


async def test_gaps_the_log_cannot_fill_are_announced(harness: Harness, workspace: str) -> None:
    watcher = await harness.events()
    await harness.worker("--event-log-max", "10")
    api = await harness.api()
    sid = (await create(api, workspace))["sessionId"]
    accepted = await prompt(api, sid, "#burst 400")
    await watcher.wait_type(sid, "turn_complete", promptId=accepted["promptId"])
    # The log kept only the newest events: a client resuming from 0 is told what it lost.
    live = await SseClient(api, sid, last_event_id=0).start()
    await live.wait_for(lambda f: f["event"] == "replay_complete")
    truncated = await live.wait_for(lambda f: f["event"] == "history_truncated")
    info = truncated["data"]["data"]
    assert info["reason"] == "trimmed" and info["requestedAfter"] == 0 and info["firstAvailableEventId"] > 1
    assert live.events()[0]["id"] == info["firstAvailableEventId"]

    status = (await api.client.get(f"/session/{sid}/status")).json()
    stale = await SseClient(api, sid, last_event_id=3, query="?eventEpoch=some-older-epoch").start()
    said = await stale.wait_for(lambda f: f["event"] == "history_truncated")
    assert said["data"]["data"]["reason"] == "epoch_changed"
    assert said["id"] == 0  # the client's resume point moves to the new epoch's start
    assert status["sessionId"] == sid
    await live.close()
    await stale.close()


async def test_slow_sse_client_is_dropped_without_slowing_others(harness: Harness, workspace: str) -> None:
    await harness.worker()
    api = await harness.api("--sse-send-timeout-s", "1")
    sid = (await create(api, workspace))["sessionId"]
    # A client that subscribes and then never reads (a tiny receive buffer, so the server's
    # writes to it block soon): the server must cut it off and serve the others as usual.
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", api.port))
    reader, writer = await asyncio.open_connection(sock=sock)
    writer.write(f"GET /session/{sid}/events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
    await writer.drain()
    await reader.readuntil(b"session_snapshot")
    healthy = await SseClient(api, sid).start()
    await healthy.wait_for(lambda f: f["event"] == "session_snapshot")
    for _ in range(4):
        accepted = await prompt(api, sid, "#burst 100 30000")
        await healthy.wait_for(is_type("turn_complete", promptId=accepted["promptId"]), timeout=30)
    ids = [f["id"] for f in healthy.events()]
    assert ids == list(range(ids[0], ids[-1] + 1))

    await wait_for_log(api.log_path, "dropping an SSE client that stopped reading")
    received = 0
    while chunk := await asyncio.wait_for(reader.read(1 << 16), 30):
        received += len(chunk)
    total = sum(len(orjson.dumps(f["data"])) for f in healthy.events())
    assert received < total / 2, "the server stopped writing to the stalled client"
    writer.close()
    await healthy.close()


async def test_a_client_that_leaves_frees_its_stream_at_once(harness: Harness, workspace: str) -> None:
    """A stream is ended, and its subscription dropped, as its client leaves, with no event
    to write: granian accepts writes into a closed connection without a word, so a stream
    that only learned of it by writing would stay open for good."""
    await harness.worker()
    api = await harness.api()
    sid = (await create(api, workspace))["sessionId"]

    async def open_streams() -> float:
        return samples((await api.client.get("/metrics")).text, "acp_state_sse_clients")[()]

    clients = [await SseClient(api, sid).start() for _ in range(3)]
    for client in clients:
        await client.wait_for(lambda f: f["event"] == "session_snapshot")
    assert await open_streams() == 3
    for client in clients[:2]:
        await client.close()

    async def one_open() -> bool:  # a closed stream counts out once the server sees it gone
        return await open_streams() == 1

    await eventually(one_open, "two of three streams counted out")
    accepted = await prompt(api, sid, "#burst 3")  # the one left still streams
    await clients[2].wait_for(is_type("turn_complete", promptId=accepted["promptId"]))
    await clients[2].close()


async def test_the_stream_is_served_below_the_stack_and_anything_it_would_refuse_is_left_to_the_app(
    harness: Harness, redis_server, workspace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tests above would pass with the streams served through the stack: here the app's
    opening below it is called itself. A session's stream is opened by its route in the
    table, counted under the route's name, kept alive while idle, and ends as its client
    leaves; an unknown session, another method and another route are left to the app, with
    nothing sent."""
    from prometheus_client import REGISTRY

    from acp_state.api.streams import response

    await harness.worker()
    async with app_in_process(redis_server.url, workspace) as (app, sid):
        request = AsgiRequest(b"session_snapshot", b": keepalive\n\n")
        sent, kept_alive = request.sent, request.seen[b": keepalive\n\n"]

        def served(path: str, method: str = "GET") -> asyncio.Task[bool]:
            return asyncio.ensure_future(request.served_below_the_stack(app, path, method))

        def counted() -> float:
            return REGISTRY.get_sample_value("acp_state_http_requests_total", {"route": "stream_events", "status": "200"}) or 0

        before = counted()
        monkeypatch.setattr(response, "KEEPALIVE_S", 0.1)
        stream = served(f"/session/{sid}/events")
        await asyncio.wait_for(request.seen[b"session_snapshot"].wait(), 10)
        assert sent[0]["status"] == 200 and dict(sent[0]["headers"])[b"content-type"] == b"text/event-stream"
        assert counted() == before + 1
        kept_alive.clear()
        for _ in range(2):  # an idle stream: a comment line every KEEPALIVE_S
            await asyncio.wait_for(kept_alive.wait(), 10)
            kept_alive.clear()
        request.leave()
        assert await asyncio.wait_for(stream, 10) is True
        assert app.state.acp.fanout.listeners == 0
        sent.clear()
        for path, method in ((f"/session/{sid}/events", "HEAD"), ("/session/00000000-0000-4000-8000-000000000000/events", "GET"),
                             (f"/session/{sid}/transcript", "GET")):
            assert await served(path, method) is False and sent == [], (method, path)


async def test_a_burst_of_stream_opens_shares_its_state_reads_and_never_grows_the_redis_pool_with_it(
    harness: Harness, redis_server, redis_client, workspace: str
) -> None:
    """Two hundred streams of one session opened at once (a reconnect storm) each get the
    session's snapshot, while the API reads the session's state at most
    `stream_opens.CONCURRENT` at a time: the process's Redis connections do not grow with
    the burst (they grew to one per stream opening, and the pool keeps them)."""

    from acp_state.api.streams import opens as stream_opens

    await harness.worker()
    async with app_in_process(redis_server.url, workspace) as (app, sid):
        clients_before = len(await redis_client.client_list())
        snapshots: list[dict] = []
        left = asyncio.Event()

        async def receive() -> dict:
            await left.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            if b"session_snapshot" in message.get("body", b""):
                snapshots.append(orjson.loads(message["body"].split(b"data: ", 1)[1]))

        path = f"/session/{sid}/events"
        scope = {"type": "http", "method": "GET", "path": path, "headers": [], "query_string": b""}
        streams = [asyncio.ensure_future(app(dict(scope), receive, send)) for _ in range(200)]
        await eventually(lambda: len(snapshots) == 200, "every stream sent its snapshot")
        assert {s["data"]["lastEventId"] for s in snapshots} == {snapshots[0]["data"]["lastEventId"]}
        assert len(await redis_client.client_list()) <= clients_before + stream_opens.CONCURRENT
        left.set()
        await asyncio.gather(*streams)
        await eventually(lambda: app.state.acp.fanout.listeners == 0, "every stream unsubscribed")


async def wait_for_log(path, text: str) -> None:
    """The API process says what it did in its log; wait until it said `text`."""
    await eventually(lambda: text in path.read_text(), f"{text!r} logged")


async def test_cached_status_is_never_older_than_a_delivered_event(harness: Harness, workspace: str) -> None:
    """Status is cached in each API process and invalidated through pub/sub: once this
    process delivered an event, its status route reflects that event's change."""
    await harness.worker()
    api = await harness.api()
    voter = await harness.api()
    sid = (await create(api, workspace))["sessionId"]
    sse = await SseClient(api, sid).start()
    for _ in range(10):
        accepted = await prompt(api, sid, "#permission")
        request = await sse.wait_for(
            lambda f, p=accepted["promptId"]: f["event"] == "permission_request" and f["data"].get("promptId") == p
        )
        for _ in range(3):  # read (and cache) the waiting state
            waiting = (await api.client.get(f"/session/{sid}/status")).json()
            assert waiting["isWaitingForPermission"] is True
        rid = request["data"]["data"]["requestId"]
        body = {"outcome": {"outcome": "selected", "optionId": "proceed_once"}}
        assert (await voter.client.post(f"/session/{sid}/permission/{rid}", json=body)).status_code == 200
        await sse.wait_for(is_type("permission_resolved", requestId=rid))
        after = (await api.client.get(f"/session/{sid}/status")).json()
        assert after["isWaitingForPermission"] is False and after["pendingInteractionCount"] == 0
        done = await sse.wait_for(lambda f, p=accepted["promptId"]: f["event"] == "turn_complete" and f["data"].get("promptId") == p)
        assert done
        assert (await api.client.get(f"/session/{sid}/status")).json()["hasActivePrompt"] is False
    await sse.close()


async def test_sigterm_ends_event_streams_cleanly_and_clients_resume_elsewhere(harness: Harness, workspace: str) -> None:
    """An API process told to stop ends its open event streams at once and cleanly (a
    complete response, not a connection cut after the grace period); the client resumes on
    another process with Last-Event-ID and misses nothing."""
    await harness.worker()
    leaving, staying = await harness.api(), await harness.api()
    sid = (await create(leaving, workspace))["sessionId"]
    live = await SseClient(leaving, sid).start()
    await live.wait_for(lambda f: f["event"] == "session_snapshot")
    first = await prompt(leaving, sid, "#burst 3")
    await live.wait_for(is_type("turn_complete", promptId=first["promptId"]))

    assert await leaving.terminate() == 0
    await asyncio.wait_for(live.closed.wait(), 20)
    assert live.error is None, f"the stream was cut: {live.error!r}"

    resumed = await SseClient(staying, sid, last_event_id=live.last_id).start()
    await resumed.wait_for(lambda f: f["event"] == "replay_complete")
    second = await prompt(staying, sid, "#burst 3")
    await resumed.wait_for(is_type("turn_complete", promptId=second["promptId"]))
    ids = [f["id"] for f in live.events() + resumed.events()]
    assert ids == list(range(ids[0], ids[-1] + 1)), "one run of ids across the two processes"
    await resumed.close()


async def test_a_gap_in_live_ids_is_filled_from_the_log(harness: Harness, redis_client, workspace: str) -> None:
    """Pub/sub lost an event (forced: it is written to the log and never published); the
    next live event reveals the gap, and the stream fills it from the log, in order."""
    from acp_state import events
    from acp_state.ids import new_id
    from acp_state.store import Mode, RedisStore, Transition, WorkerReport
    from acp_state.store.keys import F

    store = RedisStore(redis_client)
    ws, sid, owner = workspace_id(workspace), new_id(), f"w-gap-{new_id()}"
    await store.heartbeat(owner, WorkerReport(owner, sessions=1), 600_000)  # a live owner, with no process
    meta = {"sessionId": sid, "workspaceCwd": workspace, "createdAt": "2020-01-01T00:00:00Z"}
    await store.apply(ws, sid, owner, Transition(mode=Mode.CREATE, meta=meta, epoch="e1"))
    await store.index_session(owner, ws, sid, True)
    api = await harness.api()
    live = await SseClient(api, sid).start()
    await live.wait_for(lambda f: f["event"] == "session_snapshot")

    def update(text: str) -> str:
        return events.body("session_update", {"sessionId": sid, "update": {"sessionUpdate": "agent_message_chunk", "content": {"type": "text", "text": text}}})

    lost = await redis_client.hincrby(keys.session(ws, sid), F.SEQ, 1)
    await redis_client.xadd(keys.events(ws, sid), {"e": f'{{"id":{lost},{update("lost")}}}'}, id=f"{lost}-0")
    await store.apply(ws, sid, owner, Transition(events=[update("after")]))
    await live.wait_for(lambda f: f["id"] == lost + 1)
    assert [(f["id"], f["data"]["data"]["update"]["content"]["text"]) for f in live.events()] == [(lost, "lost"), (lost + 1, "after")]
    await live.close()
    await store.apply(ws, sid, owner, Transition(mode=Mode.DELETE))
    await store.release(owner)
