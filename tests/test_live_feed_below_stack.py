"""The live feed is opened by its route below Starlette's stack (`ApiApp.opened_stream`), as
the session stream is: what the route would refuse is still the app's answer."""

from __future__ import annotations

import asyncio

from prometheus_client import REGISTRY

from acp_state.ids import workspace_id
from tests.harness import Harness
from tests.helpers import AsgiRequest, app_in_process, eventually


async def test_the_feed_is_served_below_the_stack_and_anything_it_would_refuse_is_left_to_the_app(
    harness: Harness, redis_server, workspace: str
) -> None:
    """The app's opening below the stack called itself: a workspace's feed is sent by it (its snapshot first),
    counted under the route's name, and lets go of its listener as its client leaves; an
    unknown workspace, another method and another route are left to the app, with nothing
    sent."""
    await harness.worker()
    async with app_in_process(redis_server.url, workspace) as (app, sid):
        request = AsgiRequest(b"live_state_snapshot")
        sent = request.sent

        def served(path: str, method: str = "GET") -> asyncio.Task[bool]:
            return asyncio.ensure_future(request.served_below_the_stack(app, path, method))

        def counted() -> float:
            return REGISTRY.get_sample_value("acp_state_http_requests_total", {"route": "live_state_events", "status": "200"}) or 0

        before = counted()
        feed = f"/workspaces/{workspace_id(workspace)}/sessions/live-state/events"
        stream = served(feed)
        await asyncio.wait_for(request.seen[b"live_state_snapshot"].wait(), 10)
        assert sent[0]["status"] == 200 and dict(sent[0]["headers"])[b"content-type"] == b"text/event-stream"
        assert sid.encode() in b"".join(m.get("body", b"") for m in sent)
        assert counted() == before + 1
        assert app.acp.feeds.listeners == 1
        request.leave()
        assert await asyncio.wait_for(stream, 10) is True
        await eventually(lambda: app.acp.feeds.listeners == 0, "the feed let go of its listener")
        sent.clear()
        for path, method in ((feed, "HEAD"), ("/workspaces/no-such-workspace/sessions/live-state/events", "GET"),
                             (f"/workspaces/{workspace_id(workspace)}/sessions/live-state", "GET")):
            assert await served(path, method) is False and sent == [], (method, path)
