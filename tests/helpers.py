"""What several test modules use: create a session, prompt it, read its status, and a
session watched from its first completed turn. (Fixtures stay in conftest.py.)"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tests.harness import ApiProcess, Harness, SseClient


async def create(api: ApiProcess, workspace: str, **body: object) -> dict:
    response = await api.client.post("/session", json={"cwd": workspace, "sessionScope": "thread", **body})
    assert response.status_code == 200, response.text
    return response.json()


async def prompt(api: ApiProcess, sid: str, text: str) -> dict:
    response = await api.client.post(f"/session/{sid}/prompt", json={"prompt": [{"type": "text", "text": text}]})
    assert response.status_code == 202, response.text
    return response.json()


async def status(api: ApiProcess, sid: str) -> dict:
    response = await api.client.get(f"/session/{sid}/status")
    assert response.status_code == 200, response.text
    return response.json()


def is_type(event_type: str, **data: object):
    return lambda f: f["event"] == event_type and all(f["data"]["data"].get(k) == v for k, v in data.items())


async def watched_session_after_a_turn(harness: Harness, workspace: str, text: str = "#burst 3") -> tuple[ApiProcess, str, SseClient]:
    """A worker and an API; a session watched by an SSE client from its snapshot on, whose
    first turn (`text`) has completed on that stream."""
    await harness.worker()
    api = await harness.api()
    sid = (await create(api, workspace))["sessionId"]
    live = await SseClient(api, sid).start()
    await live.wait_for(lambda f: f["event"] == "session_snapshot")
    first = await prompt(api, sid, text)
    await live.wait_for(is_type("turn_complete", promptId=first["promptId"]))
    return api, sid, live


def samples(text: str, name: str) -> dict[tuple, float]:
    """The samples of metric `name` in a `/metrics` text, by their sorted labels."""
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                found[tuple(sorted(sample.labels.items()))] = sample.value
    return found
