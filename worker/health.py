"""The worker's own small HTTP listener (`--metrics-port`): `GET /metrics` (Prometheus
text), `GET /health/live` and `GET /health/ready`, for an orchestrator's probes.

A worker serves no client traffic, so its readiness steers no load balancer: it tells a
rollout, a PodDisruptionBudget and an operator whether this worker takes sessions now.
Ready: registered under a lease and not draining. A drain turns it false at once (placement
already skips a draining worker) while liveness stays true: the drain is the process doing
its job, and a restart in the middle of it would kill the sessions it is moving. Liveness is
the event loop answering: nothing about Redis, so an outage restarts no worker (a worker
rides it out and rewrites what the store lost, architecture.md).

The listener starts before the worker registers, so a worker waiting for Redis at start is
live and not ready, rather than restarted for not answering.
"""

from __future__ import annotations

import asyncio
from typing import Any, Mapping, Protocol

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route


class Standing(Protocol):
    """What the listener reads of its worker (the worker itself; never imported here)."""

    draining: bool
    sessions: Mapping[str, Any]

    @property
    def registered(self) -> bool: ...

    @property
    def incarnation(self) -> str: ...

LIVE_PATH = "/health/live"
READY_PATH = "/health/ready"


def readiness(worker: Standing) -> tuple[bool, dict[str, object]]:
    """Whether `worker` takes sessions now, and the body that says why (not)."""
    if worker.draining:
        return False, {"status": "not_ready", "code": "draining", "error": "the worker is draining"}
    if not worker.registered:
        return False, {"status": "not_ready", "code": "not_registered", "error": "the worker holds no lease yet"}
    return True, {"status": "ready", "incarnation": worker.incarnation, "sessions": len(worker.sessions)}


def app(worker: Standing) -> Starlette:
    async def live(_: Request) -> JSONResponse:
        return JSONResponse({"status": "ok", "draining": worker.draining})

    async def ready(_: Request) -> JSONResponse:
        ok, body = readiness(worker)
        return JSONResponse(body, status_code=200 if ok else 503)

    async def metrics(_: Request) -> Response:
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    return Starlette(routes=[
        Route(LIVE_PATH, live, methods=["GET"]),
        Route(READY_PATH, ready, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ])


async def serve(worker: Standing, host: str, port: int) -> None:
    """Serve the listener until cancelled (the worker's shutdown cancels it)."""
    import uvicorn

    from acp_state.uvicorn_server import UvicornServer  # the worker owns SIGTERM

    config = uvicorn.Config(
        app(worker), host=host, port=port,
        log_level="warning", lifespan="off",
    )
    server = UvicornServer(config)
    try:
        await server.serve()
    except asyncio.CancelledError:
        server.stop()
        raise
