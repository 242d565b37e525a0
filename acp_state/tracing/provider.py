"""The OpenTelemetry SDK of a process that traces: its tracer provider (resource, sampler,
batching OTLP/HTTP exporter), the Redis client's instrumentation, and the API's server spans.

Imported only once tracing is on (`acp_state.tracing.setup`): these imports are the cost a
process that does not trace never pays.
"""

from __future__ import annotations

import threading
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Callable, Sequence

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware
from opentelemetry.instrumentation.redis import RedisInstrumentor
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult
from opentelemetry.trace import Link, SpanKind
from opentelemetry.util.types import Attributes

from .spans import Spans


class InsideTraces(Sampler):
    """The sampler the variables configure (`OTEL_TRACES_SAMPLER`), but for client spans that
    start a trace: a Redis call made outside any request or turn (a lease renewal, a blocking
    read of an inbox, the sweeper) would be a trace of one span, several a second per process."""

    def __init__(self, configured: Sampler) -> None:
        self.configured = configured

    def should_sample(self, parent_context: Context | None, trace_id: int, name: str,
                      kind: SpanKind | None = None, attributes: Attributes = None,
                      links: Sequence[Link] | None = None, trace_state: Any = None) -> SamplingResult:
        if kind is SpanKind.CLIENT and not trace.get_current_span(parent_context).get_span_context().is_valid:
            return SamplingResult(Decision.DROP)
        return self.configured.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)

    def get_description(self) -> str:
        return f"InsideTraces{{{self.configured.get_description()}}}"


class Provider:
    """This process's tracing: `spans` (acp-state's own), `asgi` (server spans), `shutdown`."""

    def __init__(self, service: str) -> None:
        # The variables' sampler, as a provider built without one reads it.
        configured = TracerProvider(shutdown_on_exit=False).sampler
        self.provider = TracerProvider(resource=_resource(service), sampler=InsideTraces(configured),
                                       shutdown_on_exit=False)
        # The exporter reads its endpoint, headers, timeout and compression from OTEL_EXPORTER_OTLP_*.
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        # Not made the global provider: each instrumentation is handed it, and a library that
        # traces through the global one on its own (the ACP SDK: a span per JSON-RPC message,
        # each a trace of its own) stays silent.
        RedisInstrumentor().instrument(tracer_provider=self.provider)
        self.spans = Spans(self.provider, _version())
        self._shut = False

    def asgi(self, app: Any) -> Any:
        """`app` in the ASGI instrumentation: a SERVER span per request, continuing the
        request's `traceparent`, named by its route; none for each message sent or received
        (an event stream sends one per frame for hours)."""
        return OpenTelemetryMiddleware(app, default_span_details=_route_namer(app), exclude_spans=["receive", "send"],
                                       tracer_provider=self.provider)

    def shutdown(self, timeout_s: float) -> None:
        """Send what is left, waiting at most `timeout_s` (a collector that is away must not
        hold up a process told to stop)."""
        if self._shut:
            return
        self._shut = True
        flusher = threading.Thread(target=self.provider.shutdown, name="tracing-shutdown", daemon=True)
        flusher.start()
        flusher.join(timeout_s)


def _resource(service: str) -> Resource:
    """The variables' resource (OTEL_RESOURCE_ATTRIBUTES, OTEL_SERVICE_NAME), named `service`
    where they name none."""
    configured = Resource.create()
    if str(configured.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        return configured.merge(Resource({SERVICE_NAME: service}))
    return configured


def _version() -> str:
    try:
        return version("acp-state")
    except PackageNotFoundError:
        return "0"


def _route_namer(app: Any) -> Callable[[dict[str, Any]], tuple[str, dict[str, Any]]]:
    """Span names `{method} {route}` (HTTP semantic conventions), the route from the app's
    own table; a path no route takes is named by its method alone (paths are unbounded)."""
    from starlette.routing import Match

    routes = list(getattr(app, "routes", ()))

    def details(scope: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        method = scope.get("method") or "HTTP"
        for route in routes:
            matched, _ = route.matches(scope)
            if matched is Match.FULL and isinstance(getattr(route, "path", None), str):
                return f"{method} {route.path}", {"http.route": route.path}
        return method, {}

    return details
