"""Schema-driven fuzzing of every route (schemathesis), against a real API process, a real
worker and the suite's real Redis.

The fuzzer draws requests from `GET /openapi.json` itself, valid ones and ones that break
the schema, and swaps in real ids for most of them (a live session, a pending permission
request, the workspace id, the registered cwd) so the requests reach the code behind the
404s. Every response must be below 500 and match the document (status code, content type,
body schema, headers); afterwards the API still answers, a session created before the run
reads exactly as before and still completes a prompt, and the API exits 0 on SIGTERM.
"""

from __future__ import annotations

import asyncio
import collections
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any

import hypothesis
import hypothesis.errors
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from starlette.routing import Route

from acp_state.ids import workspace_id
from api import web
from api.app import ROUTES
from tests.harness import Harness
from tests.test_runtime_status import create, prompt, status

TARGET_REQUESTS = 10_000
TIME_LIMIT_S = 150  # the whole test must stay under ~3 minutes on 2 cores
ROUND_EXAMPLES = 100  # examples per operation and generation mode in one round
REQUEST_TIMEOUT_S = (5, 20)
SSE_TIMEOUT_S = (5, 5)
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]
MODES = (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE)
# Requests the client library refuses to send (e.g. a header value with a line break):
# nothing reached the server, so nothing is counted.
UNSENDABLE = (requests.exceptions.InvalidHeader, requests.exceptions.InvalidURL, UnicodeError, ValueError)


@dataclass
class Fuzzer:
    """Runs schemathesis cases one by one, with real ids swapped in, and keeps the tally."""

    base_url: str
    schema: Any
    workspace: str
    sentinel: str  # read-only routes only: its state must come out of the run unchanged
    voter: str  # holds a pending permission request for the vote routes
    voter_client: str
    pool: list[str]  # sessions the mutating routes may prompt, cancel, load and close
    http: requests.Session = field(default_factory=requests.Session)
    rid: str | None = None
    sent: collections.Counter = field(default_factory=collections.Counter)
    statuses: collections.Counter = field(default_factory=collections.Counter)
    server_errors: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    unsent: int = 0
    _strategies: dict[Any, Any] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.sent.values())

    # --- the harness's own requests (not counted) ---------------------------------------

    def _get(self, path: str) -> requests.Response:
        return self.http.get(self.base_url + path, timeout=REQUEST_TIMEOUT_S)

    def pending_rid(self) -> str:
        """The voter's pending request id, asking the agent for a new one when none is left."""
        if self.rid is not None:
            return self.rid
        body = {"prompt": [{"type": "text", "text": "#permission"}]}
        deadline = time.monotonic() + 10
        asked = False
        while time.monotonic() < deadline:
            pending = self._get(f"/session/{self.voter}/status").json()["pendingInteractions"]
            if pending:
                self.rid = pending[0]["requestId"]
                return self.rid
            if not asked:
                reply = self.http.post(f"{self.base_url}/session/{self.voter}/prompt", json=body, timeout=REQUEST_TIMEOUT_S)
                assert reply.status_code == 200, reply.text
                asked = True
            time.sleep(0.01)
        raise AssertionError("the voter session never raised a permission request")

    def victim(self) -> str:
        """A session the fuzzer may close: the newest of the pool, never its first."""
        if len(self.pool) < 2:
            body = {"cwd": self.workspace, "sessionScope": "thread"}
            reply = self.http.post(f"{self.base_url}/session", json=body, timeout=REQUEST_TIMEOUT_S)
            assert reply.status_code == 200, reply.text
            self.pool.append(reply.json()["sessionId"])
        return self.pool[-1]

    # --- real ids ----------------------------------------------------------------------

    def use_real_ids(self, case: Any, pick: int) -> None:
        path = case.operation.path
        params = case.path_parameters
        if path.startswith("/session/{id}"):
            if path.endswith("/permission/{requestId}"):
                params["id"] = self.voter
            elif case.operation.method.upper() == "GET":
                params["id"] = self.sentinel if pick % 2 else (self.pool[0] if self.pool else self.sentinel)
            elif path == "/session/{id}":
                params["id"] = self.victim()
            elif self.pool:
                params["id"] = self.pool[pick % len(self.pool)]
        if "requestId" in params:
            params["requestId"] = self.pending_rid()
            if pick == 3:  # a registered client id: the vote gets past the client check
                case.headers = {**(case.headers or {}), "X-Qwen-Client-Id": self.voter_client}
        if path == "/workspace/{id}/sessions":
            params["id"] = workspace_id(self.workspace)
        if path == "/session" and isinstance(case.body, dict):
            case.body.pop("workspaceCwd", None)
            case.body["cwd"] = self.workspace

    def learn(self, case: Any, response: Any) -> None:
        """Keep the real ids current: sessions the fuzzer created or closed, votes that won."""
        path, code = case.operation.path, response.status_code
        if path == "/session" and code == 200 and not response.json()["attached"]:
            self.pool.append(response.json()["sessionId"])
        elif path == "/session/{id}" and code == 204:
            closed = case.path_parameters["id"]
            self.pool[:] = [sid for sid in self.pool if sid != closed]
        elif "requestId" in case.path_parameters and case.path_parameters["requestId"] == self.rid and code in (200, 404):
            self.rid = None  # won, or gone: ask for a new one before the next real vote

    # --- sending -----------------------------------------------------------------------

    def send(self, case: Any) -> None:
        label = case.operation.label
        try:
            if case.operation.path == "/session/{id}/events":
                response = self._open_stream(case)
            else:
                response = case.call(base_url=self.base_url, session=self.http, timeout=REQUEST_TIMEOUT_S)
        except UNSENDABLE:
            self.unsent += 1
            return
        except requests.RequestException as error:  # the server hung or dropped the connection
            self.sent[label] += 1
            self.server_errors.append(f"{label}: {type(error).__name__}: {error}\n    {case.as_curl_command(base_url=self.base_url)}")
            return
        self.sent[label] += 1
        self.statuses[response.status_code] += 1
        if case.operation.path == "/session/{id}/events":
            return
        try:
            case.validate_response(response, checks=CHECKS)
        except (Exception, BaseExceptionGroup) as failure:  # schemathesis raises a failure or a group of them
            where = self.server_errors if response.status_code >= 500 else self.mismatches
            where.append(f"{label} -> {response.status_code}: {failure}\n    {case.as_curl_command(base_url=self.base_url)}")
        if response.status_code < 300 or response.status_code == 404:
            self.learn(case, response)

    def _open_stream(self, case: Any) -> Any:
        """An SSE request: status and content type only, then hang up (the stream is endless)."""
        kwargs = case.as_transport_kwargs(base_url=self.base_url)
        with self.http.request(**kwargs, stream=True, timeout=SSE_TIMEOUT_S) as response:
            media = response.headers.get("content-type", "")
            expected = "text/event-stream" if response.status_code == 200 else ("application/json", "text/plain")
            if response.status_code >= 500:
                self.server_errors.append(f"{case.operation.label} -> {response.status_code}\n    {case.as_curl_command(base_url=self.base_url)}")
            elif response.status_code not in (200, 404) or not media.startswith(expected):
                self.mismatches.append(f"{case.operation.label} -> {response.status_code} {media}")
            elif response.status_code == 200:
                first = next(response.iter_content(chunk_size=None))
                assert first.startswith(b"retry: "), first
        return response

    # --- the run -------------------------------------------------------------------------

    def run_operation(self, operation: Any, mode: schemathesis.GenerationMode, seed: int, deadline: float) -> None:
        """Up to ROUND_EXAMPLES cases of one operation; each is sent as generated and, where
        it names a session, a request id, a workspace or a cwd, once more with real ones."""
        key = (operation.label, mode)
        if key not in self._strategies:
            self._strategies[key] = operation.as_strategy(generation_mode=mode)
        has_real_ids = "{" in operation.path or operation.path == "/session"

        @hypothesis.seed(seed)
        @hypothesis.settings(
            max_examples=ROUND_EXAMPLES,
            database=None,
            deadline=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
            verbosity=hypothesis.Verbosity.quiet,
        )
        @hypothesis.given(case=self._strategies[key], pick=st.integers(1, 3))
        def one(case: Any, pick: int) -> None:
            if time.monotonic() > deadline:
                raise OutOfTime
            self.send(case)
            if has_real_ids:
                self.use_real_ids(case, pick)
                self.send(case)

        try:
            one()
        except hypothesis.errors.Unsatisfiable:
            assert not mode.is_positive  # an operation without parameters has nothing to break

    def run(self, target: int, time_limit_s: float, seed: int) -> float:
        operations = [result.ok() for result in self.schema.get_all_operations()]
        started = time.monotonic()
        deadline = started + time_limit_s
        try:
            while self.total < target:
                for operation in operations:
                    for mode in MODES:
                        seed += 1
                        self.run_operation(operation, mode, seed, deadline)
        except OutOfTime:
            pass
        return time.monotonic() - started


class OutOfTime(Exception):
    """The fuzz run's time limit passed."""


async def test_fuzz_every_route_without_server_errors(harness: Harness, workspace: str) -> None:
    await harness.worker("--max-sessions", "100000")
    api = await harness.api()

    document = await api.client.get("/openapi.json")
    assert document.status_code == 200
    spec = document.json()
    described = {(path, method.upper()) for path, item in spec["paths"].items() for method in item}
    served = {
        (route.path, method)
        for route in ROUTES
        if isinstance(route, Route) and route.endpoint.__module__ != web.__name__  # the Web Shell is no API
        for method in route.methods or ()
        if method != "HEAD"
    }
    assert described == served, "the OpenAPI document describes exactly the API routes the app serves"
    schema = schemathesis.openapi.from_dict(spec)

    events = await harness.events()
    sentinel = (await create(api, workspace))["sessionId"]
    finished = await prompt(api, sentinel, "hello before the fuzz")
    await events.wait_type(sentinel, "turn_complete", promptId=finished["promptId"])
    before = await status(api, sentinel)
    voter = await create(api, workspace)
    target = (await create(api, workspace))["sessionId"]

    fuzzer = Fuzzer(
        base_url=f"http://127.0.0.1:{api.port}",
        schema=schema,
        workspace=workspace,
        sentinel=sentinel,
        voter=voter["sessionId"],
        voter_client=voter["clientId"],
        pool=[target],
    )
    seed = int(os.environ.get("FUZZ_SEED") or random.randrange(2**32))
    elapsed = await asyncio.to_thread(fuzzer.run, TARGET_REQUESTS, TIME_LIMIT_S, seed)
    per_route = "\n".join(f"  {count:6d}  {label}" for label, count in sorted(fuzzer.sent.items()))
    print(f"\nfuzz (FUZZ_SEED={seed}): {fuzzer.total} requests in {elapsed:.1f}s ({fuzzer.total / elapsed:.0f}/s), "
          f"{fuzzer.unsent} unsendable skipped, statuses {dict(sorted(fuzzer.statuses.items()))}\n{per_route}")

    assert not fuzzer.server_errors, f"{len(fuzzer.server_errors)} server errors:\n" + "\n".join(fuzzer.server_errors[:20])
    assert not fuzzer.mismatches, f"{len(fuzzer.mismatches)} responses off the document:\n" + "\n".join(fuzzer.mismatches[:20])
    assert fuzzer.total >= TARGET_REQUESTS, f"only {fuzzer.total} requests in {TIME_LIMIT_S}s"
    assert set(fuzzer.sent) == {f"{method} {path}" for path, method in described}, "every route was fuzzed"

    # No crash: the process answers, and (the harness checks it) exits 0 on SIGTERM.
    assert (await api.client.get("/health")).json() == {"status": "ok"}
    # State intact: the untouched session reads exactly as before and still works.
    assert await status(api, sentinel) == before
    again = await prompt(api, sentinel, "hello after the fuzz")
    await events.wait_type(sentinel, "turn_complete", promptId=again["promptId"])
    after = await status(api, sentinel)
    assert after["hasTurnError"] is False and after["updatedAt"] > before["updatedAt"]
    transcript = (await api.client.get(f"/session/{sentinel}/transcript")).json()
    texts = [
        event["data"]["update"]["content"]["text"]
        for event in transcript["events"]
        if event["data"]["update"].get("sessionUpdate") == "agent_message_chunk"
    ]
    assert texts == ["hello before the fuzz", "hello after the fuzz"]

