"""Traces: one prompt followed across processes with OpenTelemetry (docs/architecture.md, "Traces").

Off by default, and free when off: this module imports no OpenTelemetry code, and each call
below is one test of a module global until `setup` turns tracing on from the standard
`OTEL_*` variables (`settings`); only then are the SDK (`provider`) and acp-state's spans
(`spans`) imported. The API and the worker call these functions, never OpenTelemetry:

* API: the composition root's `asgi` around the app (a server span per request), and the
  store's `sending` around handing a prompt to its worker (its context goes in the command).
* worker: `processing` around handling a command that carried a context, `parent_of` when a
  prompt is admitted, `start_turn` / `agent_meta` / `end_turn` around its turn, and
  `start_wait` / `end_wait` around a permission the turn waits on.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
from typing import TYPE_CHECKING, Any, ContextManager, Mapping

from ..turns import TurnRecord
from .settings import decide

if TYPE_CHECKING:
    from .provider import Provider

log = logging.getLogger("tracing")

SHUTDOWN_WAIT_S = 3.0

# Set by `setup` when tracing is on; None: off (every call below returns at once).
_provider: Provider | None = None
_OFF: ContextManager[Any] = contextlib.nullcontext()  # reusable: it holds nothing


def setup(service: str, environ: Mapping[str, str] = os.environ) -> bool:
    """Turn tracing on for this process if the `OTEL_*` variables ask for it (`service`: its
    default `service.name`). Whether it is on."""
    global _provider
    if _provider is not None:
        return True
    decision = decide(environ)
    if not decision.on:
        (log.warning if decision.warn else log.debug)("tracing off: %s", decision.why)
        return False
    try:
        from .provider import Provider
    except ImportError as error:  # installed without its extra
        log.error("tracing off: OpenTelemetry is not installed (pip install 'acp-state[tracing]'): %s", error)
        return False
    _provider = Provider(service)
    atexit.register(shutdown)
    log.info("tracing on: %s", decision.why)
    return True


def enabled() -> bool:
    return _provider is not None


def shutdown() -> None:
    """Send the spans still buffered (at most `SHUTDOWN_WAIT_S`); the process is stopping."""
    if _provider is not None:
        _provider.shutdown(SHUTDOWN_WAIT_S)


def asgi(app: Any) -> Any:
    """The ASGI app to serve: `app` itself, or `app` in the server-span instrumentation."""
    return app if _provider is None else _provider.asgi(app)


# ---- the API: a command crossing Redis ----------------------------------------------------


def sending(command_type: str, sid: str, message_id: str, destination: str) -> ContextManager[dict[str, str] | None]:
    """Around handing a command to its worker (`destination`: the stream it is added to):
    yields the trace context the command carries (`commands.Prompt.trace`), or None when off."""
    return _OFF if _provider is None else _provider.spans.sending(command_type, sid, message_id, destination)


# ---- the worker ---------------------------------------------------------------------------


def processing(command: Any, stream: str) -> ContextManager[None]:
    """Around handling a command read from `stream`: the span continuing its sender's, when it
    carried a context."""
    carrier = getattr(command, "trace", None)
    if _provider is None or not carrier:
        return _OFF
    message_id = getattr(command, "prompt_id", None) or getattr(command, "request_id", None) or ""
    return _provider.spans.processing(command.TYPE, _strings(carrier), command.sid, message_id, stream)


def parent_of(carrier: Mapping[str, Any] | None) -> Any:
    """What the turn of a prompt admitted now will start under (None when off)."""
    return None if _provider is None else _provider.spans.parent_of(_strings(carrier) if carrier else None)


def start_turn(parent: Any, sid: str, prompt_id: str, kind: str, incarnation: str) -> Any:
    """A turn starts (in the task that runs it): its span, current in that task until
    `end_turn`; None when off."""
    return None if _provider is None else _provider.spans.start_turn(parent, sid, prompt_id, kind, incarnation)


def agent_meta(turn: Any) -> dict[str, str]:
    """The `_meta` keys that hand the turn's context to the agent (none when off)."""
    return {} if turn is None or _provider is None else _provider.spans.agent_meta(turn)


def end_turn(turn: Any, record: TurnRecord) -> None:
    """The turn is over (`record`: its record as it ended, or as it stood when its agent went away)."""
    if turn is not None and _provider is not None:
        _provider.spans.end_turn(turn, record.state.value, record.stop_reason, (record.error or {}).get("code"))


def start_wait(turn: Any, request_id: str, kind: str) -> Any:
    """The turn starts waiting on a permission request; None when off."""
    return None if _provider is None else _provider.spans.start_wait(turn, request_id, kind)


def end_wait(wait: Any, answer: asyncio.Future[Any]) -> None:
    """The wait is over: `answer` (its future) holds the vote that won it, or None (cancelled)."""
    if wait is None or _provider is None:
        return
    vote = answer.result() if answer.done() and not answer.cancelled() and answer.exception() is None else None
    outcome = "cancelled" if vote is None or not vote.selected else str(vote.option_id)
    _provider.spans.end_wait(wait, outcome)


def quiet_acp_sdk() -> None:
    """The ACP SDK opens a span per JSON-RPC message through OpenTelemetry's global tracer
    whenever opentelemetry-api can be imported (acp/telemetry.py), tracing on or off: a
    no-op span per streamed chunk when off, and when on a trace of its own per message (its
    reader task has no context to join). acp-state makes the turn's spans itself, so these
    are switched off: the SDK reads its `TRACER` per message and skips a None."""
    import acp.telemetry

    if getattr(acp.telemetry, "TRACER", None) is not None:
        acp.telemetry.TRACER = None


def _strings(carrier: Mapping[str, Any]) -> dict[str, str]:
    """The carrier's string entries (a command's fields come from JSON: anything may be there)."""
    return {k: v for k, v in carrier.items() if isinstance(k, str) and isinstance(v, str)}
