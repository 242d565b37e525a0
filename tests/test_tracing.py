"""Traces (acp_state/tracing): one prompt followed from the HTTP request through Redis to the
worker's turn and on to its agent, exported by real API and worker processes over OTLP/HTTP
to a real receiver (tests/otlp_receiver.py); and nothing of it when tracing is off."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any, Iterator

import orjson
import pytest

from acp_state import commands
from acp_state.commands import Prompt
from acp_state.tracing.settings import decide
from testbed.processes import ApiProcess, WorkerProcess
from tests.harness import Harness
from tests.helpers import create, eventually
from tests.otlp_receiver import OtlpReceiver, Span

# A client's own trace: the W3C specification's example ids.
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
CLIENT_TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
CLIENT_TRACESTATE = "congo=t61rcWkgMzE"
# What a process that traces imports, and one that does not must not.
TRACING_MACHINERY = (
    "acp_state.tracing.provider", "acp_state.tracing.spans", "opentelemetry.sdk.trace", "opentelemetry.propagate",
    "opentelemetry.exporter", "opentelemetry.instrumentation",
)


def otel_variables() -> list[str]:
    return [name for name in os.environ if name.startswith("OTEL_")]


@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch) -> Iterator[OtlpReceiver]:
    """A receiver, and the processes started after it told to export to it (each process
    reads the test's environment); spans leave a process within 50 ms of their end."""
    for name in otel_variables():
        monkeypatch.delenv(name)
    with OtlpReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
        yield receiver


def agent_prompts(record: Path) -> list[dict[str, Any]]:
    """The `session/prompt` params the scripted agent received (its ACP_SCRIPTED_RECORD)."""
    if not record.exists():
        return []
    messages = [json.loads(line) for line in record.read_text().splitlines() if line]
    return [m["params"] for m in messages if m.get("method") == "session/prompt"]


def chain(receiver: OtlpReceiver, prompt_id: str) -> dict[str, Span] | None:
    """A prompt's spans from the API's request to its turn, each the parent of the next,
    once all of them have been exported (None before)."""
    turns = receiver.find(lambda s: s.name == "turn" and s.attributes.get("acp_state.prompt.id") == prompt_id)
    if not turns:
        return None
    spans = {s.span_id: s for s in receiver.find(lambda s: s.trace_id == turns[0].trace_id)}
    found = {"turn": turns[0]}
    for name in ("process", "send", "server"):
        parent = spans.get(found[list(found)[-1]].parent_id)
        if parent is None:
            return None
        found[name] = parent
    return found


async def test_a_prompt_is_one_trace_from_the_client_through_redis_to_the_agent(
    own_harness: Harness, workspace: str, receiver: OtlpReceiver, tmp_path: Path
) -> None:
    record = tmp_path / "agent-received.jsonl"
    await own_harness.worker(env={"ACP_SCRIPTED_RECORD": str(record)})
    api = await own_harness.api()
    events = await own_harness.events()
    sid = (await create(api, workspace))["sessionId"]

    response = await api.client.post(
        f"/session/{sid}/prompt", json={"prompt": [{"type": "text", "text": "traced"}]},
        headers={"traceparent": CLIENT_TRACEPARENT, "tracestate": CLIENT_TRACESTATE},
    )
    assert response.status_code == 202, response.text
    prompt_id = response.json()["promptId"]
    await events.wait_type(sid, "turn_complete", promptId=prompt_id)
    spans = await eventually(lambda: chain(receiver, prompt_id), "the prompt's spans from the API to its turn exported")

    # The client's trace goes on: API server span -> send -> worker process -> turn.
    server, send, process, turn = spans["server"], spans["send"], spans["process"], spans["turn"]
    assert {s.trace_id for s in spans.values()} == {CLIENT_TRACE}
    assert (server.service, server.kind, server.name) == ("acp-state-api", "SERVER", "POST /session/{id}/prompt")
    assert server.parent_id == CLIENT_SPAN
    assert server.attributes["http.route"] == "/session/{id}/prompt"
    assert (send.service, send.kind) == ("acp-state-api", "PRODUCER")
    assert send.attributes["messaging.operation.type"] == "send"
    assert (process.service, process.kind) == ("acp-state-worker", "CONSUMER")
    assert process.attributes["messaging.operation.type"] == "process"
    for span in (send, process):
        assert span.attributes["messaging.message.id"] == prompt_id
        assert span.attributes["messaging.message.conversation_id"] == sid
    # The worker read the prompt from the stream the API added it to.
    assert process.attributes["messaging.destination.name"] == send.attributes["messaging.destination.name"]
    assert (turn.service, turn.kind, turn.error) == ("acp-state-worker", "INTERNAL", False)
    assert turn.attributes["acp_state.turn.state"] == "completed"
    assert turn.attributes["acp_state.turn.stop_reason"] == "end_turn"
    assert turn.attributes["session.id"] == sid

    # The API's Redis calls of the request are in it (the Redis instrumentation), and no
    # Redis call outside a request or turn started a trace of its own.
    inside = {s.span_id for s in spans.values()}
    api_redis = receiver.find(lambda s: s.kind == "CLIENT" and s.trace_id == CLIENT_TRACE and s.parent_id in inside)
    assert any(s.service == "acp-state-api" for s in api_redis)
    assert not receiver.find(lambda s: s.kind == "CLIENT" and not s.parent_id)

    # The agent got the turn's context in ACP `_meta`, and in the keys Qwen Code reads.
    [params] = agent_prompts(record)
    meta = params["_meta"]
    assert meta["traceparent"] == f"00-{CLIENT_TRACE}-{turn.span_id}-01"
    assert meta["qwen.telemetry.traceparent"] == meta["traceparent"]
    assert meta["tracestate"] == meta["qwen.telemetry.tracestate"] == CLIENT_TRACESTATE


async def test_a_prompt_without_a_traceparent_starts_a_trace_that_holds_its_permission_wait(
    own_harness: Harness, workspace: str, receiver: OtlpReceiver
) -> None:
    await own_harness.worker()
    api = await own_harness.api()
    events = await own_harness.events()
    sid = (await create(api, workspace))["sessionId"]
    response = await api.client.post(f"/session/{sid}/prompt", json={"prompt": [{"type": "text", "text": "#permission"}]})
    assert response.status_code == 202, response.text
    prompt_id = response.json()["promptId"]
    asked = await events.wait_type(sid, "permission_request")
    rid = asked["data"]["requestId"]
    vote = await api.client.post(f"/session/{sid}/permission/{rid}",
                                 json={"outcome": {"outcome": "selected", "optionId": "proceed_once"}})
    assert vote.status_code == 200, vote.text
    await events.wait_type(sid, "turn_complete", promptId=prompt_id)

    spans = await eventually(lambda: chain(receiver, prompt_id), "the prompt's spans exported")
    assert spans["server"].parent_id == ""  # a new root
    assert spans["server"].trace_id != CLIENT_TRACE
    [wait] = await eventually(lambda: receiver.find(lambda s: s.name == "permission wait"), "the permission wait exported")
    assert (wait.trace_id, wait.parent_id) == (spans["turn"].trace_id, spans["turn"].span_id)
    assert wait.attributes["acp_state.permission.request_id"] == rid
    assert wait.attributes["acp_state.permission.outcome"] == "proceed_once"


async def test_off_nothing_is_exported_and_no_opentelemetry_module_is_loaded(
    own_harness: Harness, workspace: str, receiver: OtlpReceiver, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """An endpoint named, but OTEL_SDK_DISABLED: processes exec'd (not forked from the
    suite's fork server) with Python's import log, which names every module they import.
    None of the tracing machinery loads: acp-state's spans, the SDK's tracer, the exporter,
    the instrumentations. (redis-py 8 itself imports the metrics half of the SDK when it is
    installed, at its own import: docs/dependencies.md.)"""
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    monkeypatch.setenv("PYTHONPROFILEIMPORTTIME", "1")
    record = tmp_path / "agent-received.jsonl"
    redis_url = own_harness.redis_url
    worker = WorkerProcess(["worker", "--redis-url", redis_url, "--drain-grace-s", "0"], tmp_path / "worker.log",
                           env={"ACP_SCRIPTED_RECORD": str(record)}, prefix=["env"])
    port = own_harness.free_port()
    api = ApiProcess(["api", "--redis-url", redis_url, "--port", str(port), "--workspace", workspace],
                     tmp_path / "api.log", port, prefix=["env"])
    for process in (worker, api):
        await process.start()
        own_harness.processes.append(process)
    sid = (await create(api, workspace))["sessionId"]
    watcher = await own_harness.events()
    response = await api.client.post(
        f"/session/{sid}/prompt", json={"prompt": [{"type": "text", "text": "not traced"}]},
        headers={"traceparent": CLIENT_TRACEPARENT},
    )
    assert response.status_code == 202, response.text
    await watcher.wait_type(sid, "turn_complete", promptId=response.json()["promptId"])
    await own_harness.stop_all()  # a process that traced would send what it holds now, at the latest

    assert receiver.requests == 0 and not receiver.refused
    [params] = agent_prompts(record)
    assert "traceparent" not in params["_meta"]  # (the client's header is not passed on untraced)
    for log in (tmp_path / "worker.log", tmp_path / "api.log"):
        imports = [line for line in log.read_text().splitlines() if line.startswith("import time:")]
        assert any(line.endswith(" acp_state.tracing") for line in imports), f"{log}: no import log"
        loaded = [line.rpartition(" ")[2] for line in imports]
        assert not [m for m in loaded if m.startswith(TRACING_MACHINERY)], f"{log}: tracing imported when off"


# ---- the pieces -------------------------------------------------------------------------


@pytest.mark.parametrize(("variables", "on", "warn"), [
    ({}, False, False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, True, False),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, True, False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "TRUE"}, False, False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "false"}, True, False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_TRACES_EXPORTER": "none"}, False, False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_TRACES_EXPORTER": "console"}, False, True),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, False, True),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
      "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}, True, False),
])
def test_the_standard_variables_turn_tracing_on(variables: dict[str, str], on: bool, warn: bool) -> None:
    decision = decide(variables)
    assert (decision.on, decision.warn) == (on, warn), decision.why


def test_a_prompt_carries_its_trace_context_only_when_traced() -> None:
    plain = Prompt(sid="s", prompt_id="p", blocks=[], text="")
    assert b'"trace"' not in commands.encode(plain)  # the bytes of a prompt sent untraced are unchanged
    traced = Prompt(sid="s", prompt_id="p", blocks=[], text="", trace={"traceparent": CLIENT_TRACEPARENT})
    wire = orjson.loads(commands.encode(traced))
    assert wire["trace"] == {"traceparent": CLIENT_TRACEPARENT}
    assert commands.decode(commands.encode(traced)) == traced


def test_the_acp_sdk_opens_no_span_per_message_in_a_worker() -> None:
    """Its spans (one per JSON-RPC message, when opentelemetry-api is importable) would cost
    every streamed chunk a span, and when on each be a trace of its own."""
    import acp.telemetry

    import acp_state.worker.agent  # noqa: F401 (what a worker imports)

    assert isinstance(acp.telemetry.span_context("acp.notification", attributes={"method": "x"}),
                      contextlib.nullcontext)
