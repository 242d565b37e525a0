"""The spans acp-state makes itself, on the OpenTelemetry API: the path of a prompt from the
API's request through a worker's inbox to its turn, its permission waits, and the ACP agent.

Imported only once tracing is on (`acp_state.tracing.setup`). The API's server spans and the
Redis client spans come from the OpenTelemetry instrumentations (`asgi` below, and
`provider`); what no instrumentation covers is a command crossing Redis, so its W3C context
travels inside the command (`commands.Prompt.trace`), as a producer puts a message's creation
context in the message (messaging semantic conventions: a PRODUCER `send` span on the API,
a CONSUMER `process` span on the worker that continues it).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping

from opentelemetry import context, propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

# The messaging semantic conventions have no well-known value for a Redis stream used as a
# queue: a custom system. Spans are named by the kind of destination (a worker's inbox), as
# which inbox is unbounded (`messaging.destination.name`, the stream).
MESSAGING_SYSTEM = "redis"
DESTINATION = "acp-state.inbox"
# ACP's `_meta` keys for W3C context are the root `traceparent` and `tracestate`; Qwen Code
# (0.24) reads its own.
QWEN_META = {"traceparent": "qwen.telemetry.traceparent", "tracestate": "qwen.telemetry.tracestate"}


class Turn:
    """A turn's span, current in the task that runs the turn until it ends."""

    __slots__ = ("span", "token")

    def __init__(self, span: trace.Span, token: object) -> None:
        self.span = span
        self.token = token


class Spans:
    """acp-state's own spans, from one tracer."""

    def __init__(self, tracer_provider: trace.TracerProvider, version: str) -> None:
        self.tracer = tracer_provider.get_tracer("acp_state", version)

    # ---- the command across Redis -------------------------------------------------------

    @contextlib.contextmanager
    def sending(self, command_type: str, sid: str, message_id: str, destination: str) -> Iterator[dict[str, str]]:
        """The PRODUCER span around handing a command to its worker; yields the carrier the
        command takes along (this span's W3C context)."""
        attributes = _messaging("send", command_type, sid, message_id, destination)
        with self.tracer.start_as_current_span(f"send {DESTINATION}", kind=SpanKind.PRODUCER, attributes=attributes):
            carrier: dict[str, str] = {}
            propagate.inject(carrier)
            yield carrier

    @contextlib.contextmanager
    def processing(self, command_type: str, carrier: Mapping[str, str], sid: str, message_id: str,
                   destination: str) -> Iterator[None]:
        """The CONSUMER span of a worker handling a command that carried a context: its child."""
        attributes = _messaging("process", command_type, sid, message_id, destination)
        with self.tracer.start_as_current_span(
            f"process {DESTINATION}", context=propagate.extract(carrier), kind=SpanKind.CONSUMER, attributes=attributes
        ):
            yield

    @staticmethod
    def parent_of(carrier: Mapping[str, str] | None) -> context.Context | None:
        """What a turn admitted now starts under: the span being made (the command's process
        span), else the context the command carried (a prompt parked, or carried in a move,
        had no process span here), else nothing (a root)."""
        if trace.get_current_span().get_span_context().is_valid:
            return context.get_current()
        return propagate.extract(carrier) if carrier else None

    # ---- the turn and its waits ---------------------------------------------------------

    def start_turn(self, parent: context.Context | None, sid: str, prompt_id: str, kind: str,
                   incarnation: str) -> Turn:
        span = self.tracer.start_span("turn", context=parent, kind=SpanKind.INTERNAL, attributes={
            "session.id": sid, "acp_state.prompt.id": prompt_id, "acp_state.turn.kind": kind,
            "acp_state.worker.incarnation": incarnation,
        })
        return Turn(span, context.attach(trace.set_span_in_context(span)))

    @staticmethod
    def agent_meta(turn: Turn) -> dict[str, str]:
        """The turn's W3C context as ACP `_meta` keys, and as Qwen Code reads it."""
        meta: dict[str, str] = {}
        propagate.inject(meta, context=trace.set_span_in_context(turn.span))
        for key, qwen_key in QWEN_META.items():
            if key in meta:
                meta[qwen_key] = meta[key]
        return meta

    @staticmethod
    def end_turn(turn: Turn, state: str, stop_reason: str | None, error_code: str | None) -> None:
        span = turn.span
        span.set_attribute("acp_state.turn.state", state)
        if stop_reason:
            span.set_attribute("acp_state.turn.stop_reason", stop_reason)
        if state == "error":
            span.set_attribute("error.type", error_code or "turn_error")
            span.set_status(Status(StatusCode.ERROR))
        span.end()
        with contextlib.suppress(ValueError):  # (ended from another context than it started in)
            context.detach(turn.token)

    def start_wait(self, turn: Turn | None, request_id: str, kind: str) -> trace.Span:
        """The turn waiting on its clients for a permission (or a question's answers)."""
        parent = trace.set_span_in_context(turn.span) if turn is not None else None
        return self.tracer.start_span("permission wait", context=parent, kind=SpanKind.INTERNAL, attributes={
            "acp_state.permission.request_id": request_id, "acp_state.permission.kind": kind,
        })

    @staticmethod
    def end_wait(span: trace.Span, outcome: str) -> None:
        span.set_attribute("acp_state.permission.outcome", outcome)
        span.end()


def _messaging(operation: str, command_type: str, sid: str, message_id: str, destination: str) -> dict[str, Any]:
    return {
        "messaging.system": MESSAGING_SYSTEM,
        "messaging.operation.type": operation,
        "messaging.operation.name": operation,
        "messaging.destination.name": destination,
        "messaging.destination.template": DESTINATION,
        "messaging.message.id": message_id,
        "messaging.message.conversation_id": sid,
        "acp_state.command": command_type,
        "session.id": sid,
    }
