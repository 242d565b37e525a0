"""Push, not poll: the live workspace feed and the attention inbox, through real worker and
API processes on a real Redis."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path
from typing import Any, Callable

import redis.asyncio as aioredis

from acp_state.ids import workspace_id
from testbed.processes import ApiProcess
from testbed.redis_server import RedisServer, free_port
from tests.harness import Harness, SseClient
from tests.helpers import create, eventually, prompt

PROCEED_ONCE = {"outcome": {"outcome": "selected", "optionId": "proceed_once"}}
LEASE_MS = 1500


def feed_path(workspace: str) -> str:
    return f"/workspaces/{workspace_id(workspace)}/sessions/live-state/events"


async def feed(api: ApiProcess, workspace: str, **kwargs: Any) -> SseClient:
    client = await SseClient(api, path=feed_path(workspace), **kwargs).start()
    assert client.status == 200
    return client


def revision_of(frame: dict[str, Any]) -> int:
    return frame["data"]["catalogVersion"]["revision"]


def id_of(version: dict[str, Any]) -> str:
    """The `id:` of a feed frame at this catalog version: all a resume needs."""
    return f"{version['revision']}-{version['generation']}"


def row_of(sid: str, after: int = -1, **fields: Any) -> Callable[[dict[str, Any]], bool]:
    """A `live_state_changed` frame (past revision `after`) that carries `sid`'s row with
    these fields."""

    def match(frame: dict[str, Any]) -> bool:
        if frame["event"] != "live_state_changed" or revision_of(frame) <= after:
            return False
        return any(r["sessionId"] == sid and all(r.get(k) == v for k, v in fields.items()) for r in frame["data"]["sessions"])

    return match


def rows_shown(frames: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The rows a client of the feed shows after these frames."""
    rows: dict[str, dict[str, Any]] = {}
    for f in frames:
        if f["event"] == "live_state_snapshot":
            rows = {r["sessionId"]: r for r in f["data"]["sessions"]}
        elif f["event"] == "live_state_changed":
            rows.update({r["sessionId"]: r for r in f["data"]["sessions"]})
            for removed in f["data"]["removed"]:
                rows.pop(removed, None)
    return rows


async def changes_until(stream: SseClient, last: Callable[[dict[str, Any]], bool]) -> list[dict[str, Any]]:
    """The frames of a resumed feed up to the one that satisfies `last`: every one a change,
    none a snapshot (a process whose feed is a moment behind sends what it missed as it
    catches up, so the state the client missed may take more than one frame)."""
    await stream.wait_for(last)
    frames = [f for f in stream.frames if f["event"] is not None]
    frames = frames[: next(n for n, f in enumerate(frames) if last(f)) + 1]
    assert all(f["event"] == "live_state_changed" for f in frames), frames
    return frames


def removal_of(sid: str) -> Callable[[dict[str, Any]], bool]:
    return lambda f: f["event"] == "live_state_changed" and sid in f["data"]["removed"]


async def test_the_feed_starts_with_the_live_state_and_pushes_each_change(harness: Harness, workspace: str) -> None:
    await harness.worker()
    api1, api2 = await harness.api(), await harness.api()
    before = (await create(api1, workspace))["sessionId"]
    stream = await feed(api2, workspace)
    snapshot = await stream.wait_for(lambda f: f["event"] == "live_state_snapshot")
    polled = (await api1.client.get(f"/workspaces/{workspace_id(workspace)}/sessions/live-state")).json()
    assert snapshot["data"] == polled and snapshot["id"] == id_of(polled["catalogVersion"])
    assert stream.response_headers["content-type"] == "text/event-stream"
    assert stream.response_headers["x-acp-catalog-generation"] == polled["catalogVersion"]["generation"]

    sid = (await create(api1, workspace))["sessionId"]  # created through the other API process
    came = await stream.wait_for(row_of(sid, hasActivePrompt=False))
    assert came["data"]["removed"] == [] and came["id"] == id_of(came["data"]["catalogVersion"])
    asked = await prompt(api1, sid, "#permission")
    waiting = await stream.wait_for(row_of(sid, isWaitingForPermission=True))
    assert revision_of(waiting) > revision_of(came)
    status = (await api1.client.get(f"/session/{sid}/status")).json()
    rid = status["pendingInteractions"][0]["requestId"]
    assert (await api1.client.post(f"/session/{sid}/permission/{rid}", json=PROCEED_ONCE)).status_code == 200
    await stream.wait_for(row_of(sid, revision_of(waiting), isWaitingForPermission=False, hasActivePrompt=False))
    assert (await api1.client.delete(f"/session/{before}")).status_code == 204
    gone = await stream.wait_for(removal_of(before))
    assert gone["data"]["sessions"] == []
    revisions = [revision_of(f) for f in stream.frames]
    assert revisions == sorted(revisions) and len(set(revisions)) == len(revisions)  # one frame per revision, in order
    # What the stream showed adds up to what a poll answers now.
    rows = rows_shown(stream.frames)
    now = (await api2.client.get(f"/workspaces/{workspace_id(workspace)}/sessions/live-state")).json()
    assert sorted(rows.values(), key=lambda r: r["sessionId"]) == now["sessions"]
    assert asked["promptId"]
    await stream.close()


async def test_a_dead_workers_sessions_leave_the_feed_when_its_lease_lapses(harness: Harness, workspace: str) -> None:
    victim = await harness.worker("--lease-ms", str(LEASE_MS))
    api = await harness.api()
    sid = (await create(api, workspace))["sessionId"]
    stream = await feed(api, workspace)
    snapshot = await stream.wait_for(lambda f: f["event"] == "live_state_snapshot")
    assert [r["sessionId"] for r in snapshot["data"]["sessions"]] == [sid]
    await victim.kill9()
    killed = time.monotonic()
    gone = await stream.wait_for(removal_of(sid), timeout=LEASE_MS / 1000 + 10)
    elapsed_ms = round((time.monotonic() - killed) * 1000)
    print(f"\nworker killed: its session left the live feed {elapsed_ms} ms later (lease {LEASE_MS} ms)")
    assert gone["data"]["sessions"] == [] and revision_of(gone) >= revision_of(snapshot)
    now = (await api.client.get(f"/workspaces/{workspace_id(workspace)}/sessions/live-state")).json()
    assert now["sessions"] == []
    await stream.close()


async def test_a_client_resumes_with_what_it_missed(harness: Harness, workspace: str) -> None:
    await harness.worker()
    api1, api2 = await harness.api(), await harness.api()
    kept = (await create(api1, workspace))["sessionId"]
    closed = (await create(api1, workspace))["sessionId"]
    first = await feed(api1, workspace)
    # The other API process follows the workspace too, so it remembers what a resume needs.
    witness = await feed(api2, workspace)
    snapshot = await first.wait_for(lambda f: f["event"] == "live_state_snapshot")
    generation = first.response_headers["x-acp-catalog-generation"]
    await first.close()

    assert (await api1.client.delete(f"/session/{closed}")).status_code == 204
    busy = await prompt(api1, kept, "#permission")
    await witness.wait_for(row_of(kept, isWaitingForPermission=True))
    await witness.wait_for(removal_of(closed))

    for api in (api1, api2):  # on the process it left, and on the other one
        # The form before ids were self-sufficient: the bare revision, the generation beside it.
        resumed = await feed(api, workspace, last_event_id=revision_of(snapshot), query=f"?generation={generation}")
        missed = await changes_until(resumed, row_of(kept, isWaitingForPermission=True))
        assert [f["data"]["removed"] for f in missed if f["data"]["removed"]] == [[closed]]
        assert {r["sessionId"] for f in missed for r in f["data"]["sessions"]} == {kept}
        await resumed.close()

    # Another generation's revision cannot be resumed: a fresh snapshot instead.
    stale = await feed(api2, workspace, last_event_id=revision_of(snapshot), query="?generation=1")
    fresh = await stale.wait_for(lambda f: f["event"] is not None)
    assert fresh["event"] == "live_state_snapshot"
    assert [r["sessionId"] for r in fresh["data"]["sessions"]] == [kept]
    assert busy["promptId"]
    await stale.close()
    await witness.close()


async def test_a_reconnect_with_its_last_event_id_alone_gets_the_changes_it_missed(harness: Harness, workspace: str) -> None:
    """A browser's EventSource reconnects by itself with `Last-Event-ID` alone: each id of
    the feed names its generation with its revision, so that is all a resume needs. The
    form before (the bare revision, the generation beside it) is still answered; the case of
    issue 27: the id of the frame that announced a new session, on the process it came from
    and on another one, after the session changed."""
    await harness.worker()
    api1, api2 = await harness.api(), await harness.api()
    stream = await feed(api1, workspace)
    witness = await feed(api2, workspace)  # the other process follows the workspace too: it can answer
    await stream.wait_for(lambda f: f["event"] == "live_state_snapshot")
    sid = (await create(api1, workspace))["sessionId"]
    announced = await stream.wait_for(row_of(sid))
    version = announced["data"]["catalogVersion"]
    assert announced["id"] == id_of(version)
    await stream.close()
    await prompt(api1, sid, "#permission")  # what the client misses
    await witness.wait_for(row_of(sid, isWaitingForPermission=True))

    forms = {
        "the id alone": {"last_event_id": announced["id"]},
        "the id as a query": {"query": f"?lastEventId={announced['id']}"},
        "the bare revision and the generation": {
            "last_event_id": version["revision"], "query": f"?generation={version['generation']}"
        },
        # A browser's reconnect repeats the URL it first opened: the id's generation wins.
        "the id and a stale generation": {"last_event_id": announced["id"], "query": "?generation=1"},
    }
    for api in (api1, api2):
        for form, how in forms.items():
            resumed = await feed(api, workspace, **how)
            missed = await changes_until(resumed, row_of(sid, isWaitingForPermission=True))
            assert {r["sessionId"] for f in missed for r in f["data"]["sessions"]} == {sid}, form
            assert all(f["data"]["removed"] == [] and f["id"] == id_of(f["data"]["catalogVersion"]) for f in missed)
            await resumed.close()

    # A revision the feed has not reached was seen on a process that heard it first: nothing
    # is missed, and the next change comes as a change.
    ahead = await feed(api1, workspace, last_event_id=f"{version['revision'] + 1000}-{version['generation']}")
    other = (await create(api1, workspace))["sessionId"]
    came = await ahead.wait_for(lambda f: f["event"] is not None)
    assert came["event"] == "live_state_changed" and [r["sessionId"] for r in came["data"]["sessions"]] == [other]
    await ahead.close()

    # What cannot be answered from memory gets a snapshot: another generation's revision, and
    # what is not an id of the feed at all.
    for last in (f"{version['revision']}-1", f"{version['revision']}-", "x-1"):
        fresh = await feed(api1, workspace, last_event_id=last)
        first = await fresh.wait_for(lambda f: f["event"] is not None)
        assert first["event"] == "live_state_snapshot", (last, first)
        assert sorted(r["sessionId"] for r in first["data"]["sessions"]) == sorted([sid, other])
        await fresh.close()
    await witness.close()


async def test_a_reconnect_to_a_restarted_api_process_gets_the_changes_not_a_snapshot(harness: Harness, workspace: str) -> None:
    """Most changes move no row (a turn's every update, a create's answer taken), so a
    client's last frame fell behind the workspace's revision, and a reconnect to a feed that
    started since, here the API process restarted on its port, got a snapshot though the
    client missed nothing (issue 27). The feed tells its revision soon after such changes
    (`id:` with no event); resumed from it, the restarted process sends the next change."""
    events = await harness.events()
    await harness.worker()
    api = await harness.api()
    sid = (await create(api, workspace))["sessionId"]
    last_id: list[str] = []

    async def read_ids() -> None:
        async with api.client.stream("GET", feed_path(workspace), timeout=None) as response:
            async for line in response.aiter_lines():
                if line.startswith("id: "):
                    last_id.append(line[4:])

    reader = asyncio.ensure_future(read_ids())
    await eventually(lambda: last_id, "the feed's snapshot")
    turn = await prompt(api, sid, "#burst 5")  # updates that move the revision, and few rows
    await events.wait_type(sid, "turn_complete", promptId=turn["promptId"])
    polled = (await api.client.get(f"/workspaces/{workspace_id(workspace)}/sessions/live-state")).json()
    await eventually(lambda: last_id[-1] == id_of(polled["catalogVersion"]), "the feed telling its revision")

    assert await api.terminate() in (0, None)  # its streams end; the client reconnects to its successor
    await asyncio.gather(reader, return_exceptions=True)
    await api.start()
    resumed = await feed(api, workspace, last_event_id=last_id[-1])
    other = (await create(api, workspace))["sessionId"]
    first = await resumed.wait_for(lambda f: f["event"] is not None)
    assert first["event"] == "live_state_changed" and [r["sessionId"] for r in first["data"]["sessions"]] == [other], first
    await resumed.close()


async def test_a_reconnect_to_a_process_started_since_gets_the_changes_from_redis(harness: Harness, workspace: str) -> None:
    """A reconnect that lands on a process whose feed started after the client's last id (a
    restart, another process behind a load balancer) knows nothing of the changes before it
    started from its own memory: it asks the workspace's change log in Redis, and sends the
    sessions created, changed and removed since as changes, not a snapshot (issue 27). An id
    from before what the log keeps gets a snapshot."""
    await harness.worker()
    api_a = await harness.api()
    closing = (await create(api_a, workspace))["sessionId"]
    changing = (await create(api_a, workspace))["sessionId"]
    stream = await feed(api_a, workspace)
    snapshot = await stream.wait_for(lambda f: f["event"] == "live_state_snapshot")
    seen = rows_shown(stream.frames)
    await stream.close()
    assert sorted(seen) == sorted([closing, changing])

    # While the client is away, and no other process follows the workspace:
    created = (await create(api_a, workspace))["sessionId"]
    assert (await api_a.client.delete(f"/session/{closing}")).status_code == 204
    await prompt(api_a, changing, "#permission")
    live_state = f"/workspaces/{workspace_id(workspace)}/sessions/live-state"

    async def settled() -> bool:
        rows = {r["sessionId"]: r for r in (await api_a.client.get(live_state)).json()["sessions"]}
        return sorted(rows) == sorted([changing, created]) and rows[changing]["isWaitingForPermission"] is True

    await eventually(settled, "the workspace's changes")

    api_b = await harness.api()  # started after the id: its feed starts on the resume
    resumed = await feed(api_b, workspace, last_event_id=snapshot["id"])
    first = await resumed.wait_for(lambda f: f["event"] is not None)
    assert first["event"] == "live_state_changed", first
    missed = await changes_until(resumed, removal_of(closing))
    fresh = await feed(api_b, workspace)
    now = await fresh.wait_for(lambda f: f["event"] == "live_state_snapshot")
    await fresh.close()
    shown = rows_shown([snapshot, *missed])  # changes only (changes_until): no snapshot
    assert shown == rows_shown([now])
    assert sorted(shown) == sorted([changing, created]) and shown[changing]["isWaitingForPermission"] is True
    await resumed.close()

    # The log forgot the changes after the client's id (a workspace with more sessions changed
    # since than it keeps): that cannot be told, so a snapshot.
    redis = aioredis.Redis.from_url(harness.redis_url, decode_responses=True)
    try:
        await redis.zadd(f"acp:{{{workspace_id(workspace)}}}:chg", {"!": revision_of(now)})
    finally:
        await redis.aclose()
    api_c = await harness.api()
    for api in (api_b, api_c):
        stale = await feed(api, workspace, last_event_id=snapshot["id"])
        first = await stale.wait_for(lambda f: f["event"] is not None)
        assert first["event"] == "live_state_snapshot", first
        assert rows_shown([first]) == rows_shown([now])
        await stale.close()


async def test_a_redis_restart_starts_a_new_generation_on_the_feed(own_redis: RedisServer, workspace: str) -> None:
    harness = Harness(own_redis.url, workspace, free_port)
    try:
        await harness.worker("--lease-ms", str(LEASE_MS))
        # A session whose worker cannot yet vouch that its creator was told (the create's
        # answer could still be taken back, waitMs + 5 s) is rewritten hidden after a loss,
        # until that time passes: a short create timeout keeps it short here.
        api = await harness.api("--create-timeout-s", "1")
        sid = (await create(api, workspace))["sessionId"]
        stream = await feed(api, workspace)
        before = await stream.wait_for(lambda f: f["event"] == "live_state_snapshot")
        own_redis.process.kill()  # no persistence: the workspace's version is gone with the rest
        own_redis.process.wait()
        restarted = RedisServer(port=own_redis.port, folder=own_redis.dir).start()
        own_redis.process = restarted.process

        old = before["data"]["catalogVersion"]["generation"]
        renewed = await stream.wait_for(
            lambda f: f["event"] == "live_state_snapshot" and f["data"]["catalogVersion"]["generation"] != old, timeout=30
        )
        # The worker rewrites its session into the new generation; the feed shows it again.
        await stream.wait_for(lambda f: f["id"] is not None and revision_of(f) >= revision_of(renewed) and sid in rows_shown(stream.frames))
        polled = (await api.client.get(f"/workspaces/{workspace_id(workspace)}/sessions/live-state")).json()
        assert renewed["data"]["catalogVersion"]["generation"] == polled["catalogVersion"]["generation"]
        assert list(rows_shown(stream.frames)) == [sid] == [r["sessionId"] for r in polled["sessions"]]
        await stream.close()
    finally:
        await harness.stop_all()


# ---- the attention inbox ----------------------------------------------------------------


async def inbox(api: ApiProcess, **params: Any) -> dict[str, Any]:
    answer = await api.client.get("/attention", params=params)
    assert answer.status_code == 200, answer.text
    return answer.json()


async def wait_inbox(api: ApiProcess, done: Callable[[list[dict]], bool]) -> list[dict]:
    """The inbox once `done` holds (each read is a real request; the index changes in the
    same step as the transition, so this waits only for the worker to run it)."""
    for _ in range(400):
        items = (await inbox(api))["items"]
        if done(items):
            return items
        await asyncio.sleep(0.05)
    raise AssertionError(f"the inbox never got there: {items}")


async def test_the_inbox_lists_every_wait_oldest_first_and_pages(harness: Harness, workspace: str, tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    await harness.worker()
    api = await harness.api(workspaces=[workspace, str(other)])
    asking = (await create(api, workspace))["sessionId"]
    questioning = (await create(api, str(other)))["sessionId"]
    failing = (await create(api, workspace))["sessionId"]
    await create(api, workspace)  # an idle session waits for nobody
    await prompt(api, asking, "#permission")
    await wait_inbox(api, lambda items: len(items) == 1)
    await prompt(api, questioning, "#question")
    await wait_inbox(api, lambda items: len(items) == 2)
    await prompt(api, failing, "#error rate_limited")
    items = await wait_inbox(api, lambda items: len(items) == 3)

    assert [(i["sessionId"], i["kind"]) for i in items] == [
        (asking, "permission"), (questioning, "user_question"), (failing, "turn_error")
    ]
    assert [i["since"] for i in items] == sorted(i["since"] for i in items)
    permission, question, error = items
    status = (await api.client.get(f"/session/{asking}/status")).json()
    assert permission["requestId"] == status["pendingInteractions"][0]["requestId"]
    assert permission["workspaceId"] == workspace_id(workspace) and permission["workspaceCwd"] == workspace
    assert question["workspaceCwd"] == str(other) and question["title"]
    assert "requestId" not in error and error["title"]

    pages, cursor = [], None
    while True:
        page = await inbox(api, size=1, **({"cursor": cursor} if cursor else {}))
        pages += page["items"]
        cursor = page["nextCursor"]
        if cursor is None:
            break
    assert pages == items
    bad = await api.client.get("/attention", params={"cursor": "not-a-cursor"})
    assert bad.status_code == 400 and bad.json()["code"] == "invalid_cursor"
    assert (await api.client.get("/attention", params={"size": "0"})).json()["code"] == "invalid_size"


async def test_the_inbox_stream_follows_votes_and_a_token_sees_its_workspaces(harness: Harness, workspace: str, tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    scoped = "scoped-token-0123456789"
    await harness.worker()
    api = await harness.api(
        "--token", "admin-token-0123456789,role=admin", "--token", f"{scoped},workspace={workspace}",
        workspaces=[workspace, str(other)],
    )
    admin = {"Authorization": "Bearer admin-token-0123456789"}
    mine = {"Authorization": f"Bearer {scoped}"}
    api.client.headers.update(admin)
    everything = await SseClient(api, path="/attention/events").start()
    limited = await SseClient(api, path="/attention/events", headers=mine).start()
    assert (await everything.wait_for(lambda f: f["event"] == "attention_snapshot"))["data"] == {"items": []}
    await limited.wait_for(lambda f: f["event"] == "attention_snapshot")

    theirs = (await create(api, str(other)))["sessionId"]
    ours = (await create(api, workspace))["sessionId"]
    await prompt(api, theirs, "#permission")
    await prompt(api, ours, "#permission")
    added = await everything.wait_for(lambda f: f["event"] == "attention_added" and f["data"]["sessionId"] == ours)
    await everything.wait_for(lambda f: f["event"] == "attention_added" and f["data"]["sessionId"] == theirs)
    rid = added["data"]["requestId"]
    await limited.wait_for(lambda f: f["event"] == "attention_added" and f["data"]["sessionId"] == ours)
    for _ in range(2):  # read and kept: never the answer of a token that sees more
        assert len((await api.client.get("/attention")).json()["items"]) == 2
    scoped_page = (await api.client.get("/attention", headers=mine)).json()["items"]
    assert [i["sessionId"] for i in scoped_page] == [ours]

    assert (await api.client.post(f"/session/{ours}/permission/{rid}", json=PROCEED_ONCE)).status_code == 200
    removed = await limited.wait_for(lambda f: f["event"] == "attention_removed")
    assert removed["data"] == {"sessionId": ours, "workspaceId": workspace_id(workspace), "kind": "permission", "requestId": rid}
    await everything.wait_for(lambda f: f["event"] == "attention_removed" and f["data"]["sessionId"] == ours)
    assert [i["sessionId"] for i in (await inbox(api))["items"]] == [theirs]
    # The scoped stream never heard of the other workspace.
    assert all(f["data"].get("sessionId") != theirs for f in limited.frames if f["event"] != "attention_snapshot")
    await everything.close()
    await limited.close()


async def page_hits(api: ApiProcess) -> float:
    """Inbox pages the process answered from what it kept (its `/metrics`)."""
    text = (await api.client.get("/metrics")).text
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith("acp_state_attention_page_hits_total "))


async def served_from_memory(api: ApiProcess) -> None:
    """Wait until a read of the inbox is answered from what the process kept (the changes of
    a turn may still arrive after its wait shows, and each drops what was kept)."""

    async def kept() -> bool:
        hits = await page_hits(api)
        await inbox(api)
        return await page_hits(api) > hits

    await eventually(kept, "an inbox page served from the process's memory")


async def test_a_kept_inbox_page_misses_no_vote_taken_elsewhere_and_no_lapsed_lease(harness: Harness, workspace: str) -> None:
    """An API process keeps an inbox page until a change is announced: a vote another API
    process took is gone from its very next answer, a new wait is there, and a worker that
    dies leaves the page with its lease."""
    victim = await harness.worker("--lease-ms", str(LEASE_MS))
    reader, voter = await harness.api(), await harness.api()
    asking = (await create(reader, workspace))["sessionId"]
    later = (await create(reader, workspace))["sessionId"]
    await prompt(reader, asking, "#permission")
    items = await wait_inbox(reader, lambda items: len(items) == 1)
    await served_from_memory(reader)  # once the turn's last changes are in
    assert (await inbox(reader))["items"] == items
    await prompt(voter, later, "#question")
    await wait_inbox(reader, lambda items: len(items) == 2)
    await served_from_memory(reader)
    rid = items[0]["requestId"]
    assert (await voter.client.post(f"/session/{asking}/permission/{rid}", json=PROCEED_ONCE)).status_code == 200
    assert [i["sessionId"] for i in (await inbox(reader))["items"]] == [later]  # at once, no waiting
    assert [i["sessionId"] for i in (await inbox(reader))["items"]] == [later]
    await victim.kill9()
    await wait_inbox(reader, lambda items: items == [])


async def test_the_inbox_stream_resumes_from_its_last_event_id_alone(harness: Harness, workspace: str) -> None:
    """Each frame of the inbox stream carries an id that names its hub: a reconnect with
    `Last-Event-ID` alone, on the process it left, gets the additions and removals it
    missed, not a snapshot (issue 27); an id of another process's hub gets a snapshot."""
    await harness.worker()
    api1, api2 = await harness.api(), await harness.api()
    answered, asking = (await create(api1, workspace))["sessionId"], (await create(api1, workspace))["sessionId"]
    await prompt(api1, answered, "#permission")
    await wait_inbox(api1, lambda items: len(items) == 1)
    stream = await SseClient(api1, path="/attention/events").start()
    witness = await SseClient(api1, path="/attention/events").start()  # keeps the hub: a reconnect finds it
    snapshot = await stream.wait_for(lambda f: f["event"] == "attention_snapshot")
    assert [i["sessionId"] for i in snapshot["data"]["items"]] == [answered]
    assert re.fullmatch(r"\d+-[0-9a-f]+", snapshot["id"]), snapshot
    await stream.close()

    rid = snapshot["data"]["items"][0]["requestId"]
    assert (await api1.client.post(f"/session/{answered}/permission/{rid}", json=PROCEED_ONCE)).status_code == 200
    await prompt(api1, asking, "#question")
    await witness.wait_for(lambda f: f["event"] == "attention_removed" and f["data"]["sessionId"] == answered)
    await witness.wait_for(lambda f: f["event"] == "attention_added" and f["data"]["sessionId"] == asking)

    resumed = await SseClient(api1, path="/attention/events", last_event_id=snapshot["id"]).start()
    await resumed.wait_for(lambda f: f["event"] == "attention_added")
    await resumed.wait_for(lambda f: f["event"] == "attention_removed")
    missed = [(f["event"], f["data"]["sessionId"]) for f in resumed.frames]
    assert sorted(missed) == [("attention_added", asking), ("attention_removed", answered)], missed
    ids = [int(f["id"].split("-")[0]) for f in resumed.frames]
    assert ids == sorted(ids) and all(f["id"].endswith(snapshot["id"].split("-")[1]) for f in resumed.frames)
    await resumed.close()

    elsewhere = await SseClient(api2, path="/attention/events", last_event_id=snapshot["id"]).start()
    fresh = await elsewhere.wait_for(lambda f: f["event"] is not None)
    assert fresh["event"] == "attention_snapshot" and [i["sessionId"] for i in fresh["data"]["items"]] == [asking]
    await elsewhere.close()
    await witness.close()


async def test_a_dead_workers_waits_leave_the_inbox_with_its_lease(harness: Harness, workspace: str) -> None:
    victim = await harness.worker("--lease-ms", str(LEASE_MS))
    api = await harness.api()
    sid = (await create(api, workspace))["sessionId"]
    await prompt(api, sid, "#question")
    await wait_inbox(api, lambda items: len(items) == 1)
    stream = await SseClient(api, path="/attention/events").start()
    snapshot = await stream.wait_for(lambda f: f["event"] == "attention_snapshot")
    assert [i["kind"] for i in snapshot["data"]["items"]] == ["user_question"]
    await victim.kill9()
    gone = await stream.wait_for(lambda f: f["event"] == "attention_removed", timeout=LEASE_MS / 1000 + 10)
    assert gone["data"]["sessionId"] == sid and gone["data"]["kind"] == "user_question"
    assert (await inbox(api))["items"] == []
    await stream.close()


async def test_workers_lists_the_live_workers_with_their_load(harness: Harness, workspace: str) -> None:
    first = await harness.worker("--max-sessions", "4")
    await harness.worker()
    api = await harness.api("--token", "admin-token-0123456789,role=admin", "--token", f"scoped-token-0123456789,workspace={workspace}")
    admin = {"Authorization": "Bearer admin-token-0123456789"}
    for _ in range(2):
        made = await api.client.post("/session", json={"cwd": workspace, "sessionScope": "thread"}, headers=admin)
        assert made.status_code == 200
    # Each worker reports its load with its next heartbeat.
    listed = await workers_once(api, admin, lambda listed: sum(w["sessions"] for w in listed) == 2)
    assert len(listed) == 2
    mine = next(w for w in listed if w["incarnation"] == first.incarnation)
    assert mine["maxSessions"] == 4 and mine["load"] == mine["sessions"] / 4
    assert 0 <= mine["leaseAgeMs"] <= mine["leaseMs"] and mine["expiresInMs"] > 0
    scoped = await api.client.get("/workers", headers={"Authorization": "Bearer scoped-token-0123456789"})
    assert scoped.status_code == 403 and scoped.json()["code"] == "deployment_scope_required"
    await first.kill9()  # it leaves the list once its lease lapses
    await workers_once(api, admin, lambda listed: all(w["incarnation"] != first.incarnation for w in listed))


async def workers_once(api: ApiProcess, headers: dict[str, str], done: Callable[[list[dict]], bool]) -> list[dict]:
    for _ in range(600):
        listed = (await api.client.get("/workers", headers=headers)).json()["workers"]
        if done(listed):
            return listed
        await asyncio.sleep(0.05)
    raise AssertionError(f"the workers never got there: {listed}")
