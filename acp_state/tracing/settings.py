"""Whether this process traces: read from the standard OpenTelemetry variables, before any
OpenTelemetry module is imported (a process that does not trace never imports one).

On when an OTLP endpoint is named (`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, else
`OTEL_EXPORTER_OTLP_ENDPOINT`), unless `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER`
names no `otlp`. The export is OTLP over HTTP with protobuf, the protocol the specification
makes the default; a process told to speak another (`grpc`, `http/json`) says so and stays off
rather than send what its collector would not read. Everything else the exporter and the SDK
read themselves (headers, timeout, compression, certificates, `OTEL_SERVICE_NAME`,
`OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER`, `OTEL_BSP_*`, `OTEL_PROPAGATORS`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

HTTP_PROTOBUF = "http/protobuf"


@dataclass(frozen=True)
class Decision:
    """On or off, and why (said in the log when it is not what the variables seem to ask)."""

    on: bool
    why: str
    endpoint: str | None = None
    warn: bool = False  # the variables ask for traces this process will not send


def decide(environ: Mapping[str, str]) -> Decision:
    """Whether to trace, from the `OTEL_*` variables in `environ`."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return Decision(False, "OTEL_SDK_DISABLED is true")
    exporters = [e.strip().lower() for e in environ.get("OTEL_TRACES_EXPORTER", "otlp").split(",") if e.strip()]
    endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if "otlp" not in exporters:
        asked = bool(exporters) and exporters != ["none"]
        return Decision(False, f"OTEL_TRACES_EXPORTER is {','.join(exporters) or 'empty'} (only otlp is built in)",
                        warn=asked)
    if not endpoint:
        return Decision(False, "no OTLP endpoint (OTEL_EXPORTER_OTLP_ENDPOINT)")
    protocol = (environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or HTTP_PROTOBUF).strip().lower()
    if protocol != HTTP_PROTOBUF:
        return Decision(False, f"OTLP protocol {protocol!r} is not built in (only {HTTP_PROTOBUF})", endpoint, warn=True)
    return Decision(True, f"OTLP/HTTP to {endpoint}", endpoint)
