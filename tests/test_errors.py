"""No plain-text 500 anywhere: whatever fails, in a route or in a middleware, answers JSON
with a code; Redis out of memory is 503 `store_full`, Redis loading is 503 `store_unavailable`."""

from __future__ import annotations

import logging
from typing import AsyncIterator

import httpx
import pytest
import redis.asyncio as aioredis
from redis import exceptions as redis_errors
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from acp_state.api import auth, request_metrics
from acp_state.api.app import create_app
from acp_state.api.auth import Token
from acp_state.api.outcomes import effect
from acp_state.api.settings import Settings
from acp_state.store.connection import connect
from testbed.redis_server import RedisServer
from tests.harness import Harness

OOM = "OOM command not allowed when used memory > 'maxmemory'."
TOKEN = "errors-test-token-0123456789"

FAILURES: dict[str, Exception] = {
    "/boom": RuntimeError("a bug"),
    "/oom": redis_errors.ResponseError(OOM),
    "/oom-parsed": redis_errors.OutOfMemoryError("command not allowed when used memory > 'maxmemory'."),
    "/oom-in-pipeline": redis_errors.OutOfMemoryError(
        "Command # 1 (SET k v) of pipeline caused error: command not allowed when used memory > 'maxmemory'."
    ),
    "/wrongtype": redis_errors.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"),
    "/loading": redis_errors.BusyLoadingError("Redis is loading the dataset in memory"),
}
# A cluster failing over or a shard stalled, as redis-py reports each once its retries end.
CLUSTER_FAULTS: dict[str, Exception] = {
    "/cluster-ttl-exhausted": redis_errors.ClusterError("TTL exhausted."),
    "/cluster-down": redis_errors.ClusterDownError("The cluster is down"),
    "/master-down": redis_errors.MasterDownError("Link with MASTER is down and replica-serve-stale-data is set to 'no'."),
    "/try-again": redis_errors.TryAgainError("Multiple keys request during rehashing of slot"),
    "/slot-not-covered": redis_errors.SlotNotCoveredError("Slot 1234 is not covered by the cluster."),
    "/read-only": redis_errors.ReadOnlyError("You can't write against a read only replica."),
}
# A connection closed under a write, as redis-py lets it escape (seen in the cluster chaos run).
CLUSTER_FAULTS["/torn-uvloop"] = RuntimeError(
    "unable to perform operation on <TCPTransport closed=True reading=False 0x55>; the handler is closed"
)
CLUSTER_FAULTS["/torn-writer"] = AttributeError("'NoneType' object has no attribute 'writelines'")
FAILURES.update(CLUSTER_FAULTS)
# Inside the one store call that makes a command's effect: was the command run, or not?
EFFECT_FAULTS: dict[str, tuple[Exception, str]] = {
    "/effect/reset": (redis_errors.ConnectionError("Connection reset by peer"), "outcome_unknown"),
    "/effect/timeout": (redis_errors.TimeoutError("Timeout reading from socket"), "outcome_unknown"),
    "/effect/cluster-ttl-exhausted": (redis_errors.ClusterError("TTL exhausted."), "outcome_unknown"),
    "/effect/refused": (redis_errors.ConnectionError("Error 111 connecting to 127.0.0.1:1. Connection refused."), "store_unavailable"),
    "/effect/cluster-down": (redis_errors.ClusterDownError("The cluster is down"), "store_unavailable"),
    "/effect/read-only": (redis_errors.ReadOnlyError("You can't write against a read only replica."), "store_unavailable"),
    "/effect/torn": (AttributeError("'NoneType' object has no attribute 'writelines'"), "store_unavailable"),
    "/effect/oom": (redis_errors.OutOfMemoryError("command not allowed when used memory > 'maxmemory'."), "store_full"),
}


def _raiser(error: Exception):  # type: ignore[no-untyped-def]
    async def route(_: Request) -> Response:
        raise error

    return route


def _effect_raiser(error: Exception, resent: bool = False):  # type: ignore[no-untyped-def]
    async def route(_: Request) -> Response:
        async with effect(resent):
            raise error

    return route


@pytest.fixture
async def app(redis_server: RedisServer, workspace: str) -> AsyncIterator[Starlette]:
    """The API process's app, with routes that fail in every way, its lifespan running."""
    application = create_app(
        Settings(redis_url=redis_server.url, workspaces=[workspace], tokens=[Token.parse(f"{TOKEN},role=admin")])
    )
    application.router.routes.extend(Route(path, _raiser(error)) for path, error in FAILURES.items())
    application.router.routes.extend(Route(path, _effect_raiser(e)) for path, (e, _) in EFFECT_FAULTS.items())
    application.router.routes.extend(
        Route(f"/resent{path}", _effect_raiser(e, resent=True)) for path, (e, _) in EFFECT_FAULTS.items()
    )
    async with application.router.lifespan_context(application):
        yield application


@pytest.fixture
async def client(app: Starlette) -> AsyncIterator[httpx.AsyncClient]:
    # raise_app_exceptions=False: the server's view (Starlette re-raises a 500 for it to log).
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(
        transport=transport, base_url="http://localhost", headers={"Authorization": f"Bearer {TOKEN}"}
    ) as c:
        yield c


def _assert_json(response: httpx.Response, status: int, code: str) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json; charset=utf-8", response.headers
    body = response.json()
    assert body["code"] == code and isinstance(body["error"], str), body
    return body


async def test_an_exception_in_a_route_is_json_500_and_logged(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="api.errors"):
        _assert_json(await client.get("/boom"), 500, "internal_error")
    (record,) = [r for r in caplog.records if r.name == "api.errors"]
    assert record.exc_info and isinstance(record.exc_info[1], RuntimeError)  # with its traceback
    assert "GET /boom" in record.getMessage()


async def test_an_exception_in_the_auth_middleware_is_json_500(
    client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(self: object, scope: object) -> None:
        raise RuntimeError("auth broke")

    monkeypatch.setattr(auth.Authenticator, "principal", broken)
    with caplog.at_level(logging.ERROR, logger="api.errors"):
        _assert_json(await client.get("/capabilities"), 500, "internal_error")
    assert any(r.exc_info and isinstance(r.exc_info[1], RuntimeError) for r in caplog.records)


async def test_an_exception_in_the_metrics_middleware_is_json_500(
    client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*_: object) -> None:
        raise RuntimeError("metrics broke")

    # Counting happens on the way out: it fails after the route raised, before any answer.
    monkeypatch.setattr(request_metrics.REQUESTS, "inc", broken)
    _assert_json(await client.get("/boom"), 500, "internal_error")


async def test_a_redis_error_in_a_middleware_keeps_its_own_answer(
    client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Outside the handlers' middleware, the last-resort handler still answers a store error
    as a store error, not as a bug."""
    def loading(self: object, scope: object) -> None:
        raise redis_errors.BusyLoadingError("Redis is loading the dataset in memory")

    monkeypatch.setattr(auth.Authenticator, "principal", loading)
    response = await client.get("/capabilities")
    _assert_json(response, 503, "store_unavailable")
    assert response.headers["retry-after"] == "1"


@pytest.mark.parametrize("path", ["/oom", "/oom-parsed", "/oom-in-pipeline"])
async def test_redis_out_of_memory_is_503_store_full(client: httpx.AsyncClient, path: str) -> None:
    response = await client.get(path)
    body = _assert_json(response, 503, "store_full")
    assert response.headers["retry-after"] == "5" and body["retryAfterMs"] == 5000


async def test_other_redis_refusals_are_json_500(client: httpx.AsyncClient) -> None:
    _assert_json(await client.get("/wrongtype"), 500, "internal_error")


async def test_redis_loading_is_503_store_unavailable(client: httpx.AsyncClient) -> None:
    response = await client.get("/loading")
    _assert_json(response, 503, "store_unavailable")
    assert response.headers["retry-after"] == "1"


# ---- real processes, a real Redis out of memory ------------------------------------------




async def test_create_on_a_full_redis_is_json_503(own_harness: Harness, own_redis: RedisServer, workspace: str) -> None:
    await own_harness.worker()
    api = await own_harness.api()
    redis: aioredis.Redis = connect(own_redis.url)
    body = {"cwd": workspace, "sessionScope": "thread"}
    try:
        await redis.config_set("maxmemory-policy", "noeviction")
        await redis.config_set("maxmemory", 1)  # below what any Redis uses: every write is refused
        response = await api.client.post("/session", json=body)
        assert response.headers["content-type"] == "application/json; charset=utf-8", (response.status_code, response.text)
        assert response.status_code == 503, response.text
        assert response.json()["code"] == "store_full" and response.headers["retry-after"] == "5"
    finally:
        await redis.config_set("maxmemory", 0)
        await redis.aclose()
    made = await api.client.post("/session", json=body)  # nothing was left behind in the way
    assert made.status_code == 200, made.text



@pytest.mark.parametrize("path", sorted(CLUSTER_FAULTS))
async def test_a_cluster_failing_over_is_503_store_unavailable(client: httpx.AsyncClient, path: str) -> None:
    """Not a 500: the client may retry, and with its Idempotency-Key learns the outcome."""
    response = await client.get(path)
    _assert_json(response, 503, "store_unavailable")
    assert response.headers["retry-after"] == "1"


@pytest.mark.parametrize("path", sorted(EFFECT_FAULTS))
async def test_a_command_that_may_have_run_is_outcome_unknown_and_one_that_cannot_is_refused(
    client: httpx.AsyncClient, path: str
) -> None:
    response = await client.get(path)
    _assert_json(response, 503, EFFECT_FAULTS[path][1])


@pytest.mark.parametrize("path", sorted(EFFECT_FAULTS))
async def test_after_a_client_that_resends_every_store_error_is_outcome_unknown(
    client: httpx.AsyncClient, path: str
) -> None:
    """redis-py's cluster client resends after an error: an earlier attempt may have run, so
    not even a refused connection on the last one proves that nothing was done."""
    _assert_json(await client.get(f"/resent{path}"), 503, "outcome_unknown")
