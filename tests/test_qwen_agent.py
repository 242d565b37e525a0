"""The real Qwen Code agent (`qwen --acp`) behind a worker, driven offline by the scripted
model endpoint (testbed/model_endpoint.py).

Opt-in by installation: skipped when no `qwen` executable is found (see `find_qwen`).
Select or deselect it with `-m qwen` / `-m "not qwen"`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest

from testbed.model_endpoint import ModelEndpoint, message_text
from testbed.processes import ApiProcess
from testbed.qwen import qwen_env
from tests.harness import Harness

pytestmark = pytest.mark.qwen

# Qwen needs ~3-4 s to start; the first create waits for initialize + session/new + set_mode.
CREATE_TIMEOUT_S = 90
EVENT_TIMEOUT_S = 60
PROCEED_ONCE = {"outcome": {"outcome": "selected", "optionId": "proceed_once"}}


@pytest.fixture
def fake_llm() -> Iterator[ModelEndpoint]:
    with ModelEndpoint() as fake:
        yield fake


async def create(api: ApiProcess, workspace: str) -> dict[str, Any]:
    response = await api.client.post(
        "/session", json={"cwd": workspace, "sessionScope": "thread"}, timeout=CREATE_TIMEOUT_S
    )
    assert response.status_code == 200, response.text
    return response.json()


async def prompt(api: ApiProcess, sid: str, text: str) -> dict[str, Any]:
    response = await api.client.post(f"/session/{sid}/prompt", json={"prompt": [{"type": "text", "text": text}]})
    assert response.status_code == 202, response.text
    return response.json()


async def status(api: ApiProcess, sid: str) -> dict[str, Any]:
    response = await api.client.get(f"/session/{sid}/status")
    assert response.status_code == 200, response.text
    return response.json()


def tool_results(fake: ModelEndpoint) -> list[str]:
    """The text of every tool-result message the scripted model was sent."""
    return [message_text(m) for r in fake.chat_requests for m in r.get("messages") or [] if m.get("role") == "tool"]


async def test_qwen_permission_and_question_through_the_api(
    qwen: str, fake_llm: ModelEndpoint, harness: Harness, workspace: str, tmp_path: Path
) -> None:
    # `fake_llm` comes before `harness`, so it outlives the worker and its qwen child.
    scratch = tmp_path / "qwen-tmp"  # qwen leaves qwen-socks-* folders in its temp dir
    scratch.mkdir()
    env = qwen_env(tmp_path / "home", fake_llm.openai_url)
    env["TMPDIR"] = str(scratch)

    events = await harness.events()
    await harness.worker(
        "--agent", f"{qwen} --acp", "--session-mode", "default",
        "--agent-stderr", str(tmp_path / "qwen-stderr.log"),
        env=env,
    )
    api = await harness.api()
    sid = (await create(api, workspace))["sessionId"]

    # 1. A shell command needs a permission in `default` mode.
    ran = await prompt(api, sid, "PERM please run")
    request = await events.wait_type(sid, "permission_request", EVENT_TIMEOUT_S, promptId=ran["promptId"])
    shown = await status(api, sid)
    assert shown["isWaitingForPermission"] is True and shown["isWaitingForUserQuestion"] is False
    assert shown["pendingInteractionCount"] == 1
    [pending] = shown["pendingInteractions"]
    assert pending["requestId"] == request["data"]["requestId"]
    assert pending["kind"] == "permission"
    assert pending["action"]["type"] == "execute"
    assert pending["action"]["input"]["command"] == "touch perm_check.txt"
    assert "proceed_once" in [o["optionId"] for o in pending["options"]]

    vote = await api.client.post(f"/session/{sid}/permission/{pending['requestId']}", json=PROCEED_ONCE)
    assert vote.status_code == 200, vote.text
    done = await events.wait_type(sid, "turn_complete", EVENT_TIMEOUT_S, promptId=ran["promptId"])
    assert done["data"]["stopReason"] == "end_turn"
    assert (Path(workspace) / "perm_check.txt").exists()
    after = await status(api, sid)
    assert after["isWaitingForPermission"] is False and after["pendingInteractionCount"] == 0

    # 2. ask_user_question: the answers travel with the vote back to qwen and on to the LLM.
    asked = await prompt(api, sid, "QUESTION ask me")
    question = await events.wait_type(sid, "permission_request", EVENT_TIMEOUT_S, promptId=asked["promptId"])
    shown = await status(api, sid)
    assert shown["isWaitingForUserQuestion"] is True and shown["isWaitingForPermission"] is False
    [pending] = shown["pendingInteractions"]
    assert pending["requestId"] == question["data"]["requestId"]
    assert pending["kind"] == "user_question"
    assert pending["title"] == "Ask user 1 question"
    assert pending["questions"][0]["answerKey"] == "0"
    assert pending["questions"][0]["question"] == "Which color?"

    answer = await api.client.post(
        f"/session/{sid}/permission/{pending['requestId']}", json={**PROCEED_ONCE, "answers": {"0": "Blue"}}
    )
    assert answer.status_code == 200, answer.text
    done = await events.wait_type(sid, "turn_complete", EVENT_TIMEOUT_S, promptId=asked["promptId"])
    assert done["data"]["stopReason"] == "end_turn"
    assert any("Blue" in text for text in tool_results(fake_llm)), tool_results(fake_llm)
    cleared = await status(api, sid)
    assert cleared["isWaitingForUserQuestion"] is False and cleared["pendingInteractionCount"] == 0
