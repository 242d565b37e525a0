"""Schema-driven fuzzing of every route (schemathesis), against a real API process, a real
worker and the suite's real Redis.

The cases come from the API's own `GET /openapi.json`: valid ones (positive) and ones that
break the schema (negative). Each case is sent as generated, then again with real values
swapped in (a live session, a closed one, the pending permission request, the workspace id,
the registered cwd, cursors the API issued), so requests reach the code behind the 404s.
Every response must be below 500 and match the document (status code, content type, body
schema, headers). Afterwards the API still answers, a session created before the run reads
exactly as before and still completes a prompt, and the API exits 0 on SIGTERM (the harness
checks the exit code).

Generating cases costs more CPU than serving them, so two processes fuzz side by side, one
per generation mode. `FUZZ_SEED=<n>` replays a run, `FUZZ_ROUNDS=<n>` makes it longer; a failure
prints the curl command that reproduces it.
"""

from __future__ import annotations

import asyncio
import collections
import multiprocessing
import os
import re
import random
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Iterator

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

from acp_state.api.routes import web
from acp_state.api.app import ROUTES
from acp_state.ids import workspace_id
from tests.harness import Harness
from tests.helpers import create, prompt, status

# The run is bounded by its cases, not by a clock: ROUNDS passes over every operation, each
# of up to ROUND_EXAMPLES cases drawn from the seed (about 2,300 requests a round). The time
# limit is only a safety stop for a run that hangs; it fails naming the request in flight.
# The suite runs one round; `FUZZ_ROUNDS=<n>` fuzzes longer (each round draws new cases).
ROUNDS = int(os.environ.get("FUZZ_ROUNDS", "1"))
ROUND_EXAMPLES = 30  # cases per operation in one round
SAFETY_STOP_S = 900
REQUEST_TIMEOUT_S = (5, 20)
SSE_TIMEOUT_S = (5, 5)
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]
# Values that break naive parsers, sent in place of query parameters, headers and body
# members: non-ASCII digits (`str.isdigit()` is true, `int()` fails or differs), numbers
# past `int()`'s digit limit or 64 bits, signs, spaces, NUL, key-space characters, long strings.
HOSTILE_TEXT = [
    "²", "١٢", "１２", "0" * 5000 + "1", "9" * 5000, "1" * 30, "18446744073709551616-0", "0-0", "-1", "+1",
    " 1", "1\n", "1e3", "0x10", "NaN", "", "\x00", "a\x00b", "{x}", "acp:*", "*", "../../etc/passwd", "é" * 300,
    "A" * 5000,
]
HOSTILE_JSON = [*HOSTILE_TEXT, "\ud800", 10**30, -(2**63), -1, 0, 1.5, True, None, [], {}, [[[[]]]], {"": {}}]
HOSTILE_HEADERS = ("X-Qwen-Client-Id", "Last-Event-ID")
# Requests the client library refuses to send (e.g. a header value with a line break):
# nothing reached the server, so nothing is counted.
UNSENDABLE = (requests.exceptions.InvalidHeader, requests.exceptions.InvalidURL, UnicodeError, ValueError)


class OutOfTime(Exception):
    """The fuzz run's safety stop: it names the operation whose case was under way."""


@dataclass
class Fuzzer:
    """Sends schemathesis cases one by one, with real values swapped in, and keeps the tally."""

    base_url: str
    spec: dict[str, Any]
    schema: Any
    workspace: str
    sentinel: str  # read-only routes only: its state must come out of the run unchanged
    voter: str  # holds a pending permission request for the vote routes
    voter_client: str
    pool: list[str]  # sessions the mutating routes may prompt, cancel, load and close; pool[0] stays
    closed: list[str]  # sessions closed since their creation
    http: requests.Session = field(default_factory=requests.Session)
    rid: str | None = None
    cursors: dict[str, str] = field(default_factory=dict)
    sent: collections.Counter = field(default_factory=collections.Counter)
    statuses: collections.Counter = field(default_factory=collections.Counter)
    server_errors: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    unsent: collections.Counter = field(default_factory=collections.Counter)
    refused_by_http: int = 0  # 400s for header values HTTP forbids (see _forbidden_in_http)
    cases: int = 0
    _strategies: dict[Any, Any] = field(default_factory=dict)
    _declared: dict[str, tuple[list[str], list[str]]] | None = None

    @property
    def declared(self) -> dict[str, tuple[list[str], list[str]]]:
        """Per operation label: its query parameters and its body's top-level members."""
        if self._declared is None:
            schemas = self.spec["components"]["schemas"]
            self._declared = {}
            for path, item in self.spec["paths"].items():
                for method, operation in item.items():
                    query = [p["name"] for p in operation.get("parameters", []) if p["in"] == "query"]
                    body = operation.get("requestBody", {}).get("content", {}).get("application/json", {})
                    ref = body.get("schema", {}).get("$ref", "")
                    members = list(schemas[ref.rsplit("/", 1)[-1]]["properties"]) if ref else []
                    self._declared[f"{method.upper()} {path}"] = (query, members)
        return self._declared

    @property
    def total(self) -> int:
        return sum(self.sent.values())

    # --- the harness's own requests (not counted) ---------------------------------------

    def pending_rid(self) -> str:
        """The voter's pending request id, asking the agent for a new one when none is left."""
        if self.rid is not None:
            return self.rid
        deadline = time.monotonic() + 10
        asked = False
        while time.monotonic() < deadline:
            reply = self.http.get(f"{self.base_url}/session/{self.voter}/status", timeout=REQUEST_TIMEOUT_S)
            pending = reply.json()["pendingInteractions"]
            if pending:
                self.rid = pending[0]["requestId"]
                return self.rid
            if not asked:
                body = {"prompt": [{"type": "text", "text": "#permission"}]}
                reply = self.http.post(f"{self.base_url}/session/{self.voter}/prompt", json=body, timeout=REQUEST_TIMEOUT_S)
                assert reply.status_code == 202, reply.text
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

    # --- real values -------------------------------------------------------------------

    def variants(self, case: Any, pick: int) -> Iterator[None]:
        """Rewrite `case` in place with real values, once per variant, yielding after each:
        live and closed sessions, the pending request, the workspace, the cwd, cursors."""
        path, params = case.operation.path, case.path_parameters
        method = case.operation.method.upper()
        if path == "/session":
            if isinstance(case.body, dict):
                case.body.pop("workspaceCwd", None)
                case.body["cwd"] = self.workspace
                yield
        elif path == "/workspace/{id}/sessions":
            params["id"] = workspace_id(self.workspace)
            if pick == 3 and self.cursors.get(path):
                case.query = {**(case.query or {}), "cursor": self.cursors[path]}
            yield
        elif "requestId" in params:
            if "id" in params:
                params["id"] = self.voter  # a live session, a request it does not have
                yield
            params["requestId"] = self.pending_rid()
            if pick == 3:  # a registered client id: the vote gets past the client check
                case.headers = {**(case.headers or {}), "X-Qwen-Client-Id": self.voter_client}
            yield
        elif "id" in params:
            if method == "GET":
                params["id"] = self.sentinel if pick % 2 else self.pool[0]
                if pick == 3 and self.cursors.get(path):
                    case.query = {**(case.query or {}), "cursor": self.cursors[path]}
            elif path == "/session/{id}":
                params["id"] = self.victim()
            else:
                params["id"] = self.pool[pick % len(self.pool)]
            yield
            params["id"] = self.closed[pick % len(self.closed)]
            yield

    def hostile(self, case: Any, salt: int) -> None:
        """Replace about half of the case's query parameters, headers and body members
        (declared or not yet generated) with values from HOSTILE_TEXT / HOSTILE_JSON."""
        rng = random.Random(salt)
        query_names, body_names = self.declared[case.operation.label]
        query = dict(case.query or {})
        for name in query_names:
            if rng.random() < 0.5:
                query[name] = rng.choice(HOSTILE_TEXT)
        case.query = query
        headers = dict(case.headers or {})
        for name in HOSTILE_HEADERS:
            if rng.random() < 0.3:
                headers[name] = rng.choice(HOSTILE_TEXT)
        case.headers = headers
        if body_names and isinstance(case.body, dict):
            for name in body_names:
                if rng.random() < 0.5:
                    case.body[name] = rng.choice(HOSTILE_JSON)

    def learn(self, case: Any, response: Any) -> None:
        """Keep the real values current: sessions created or closed, votes that won, cursors."""
        path, code = case.operation.path, response.status_code
        if code == 200 and path in ("/workspace/{id}/sessions", "/session/{id}/transcript"):
            self.cursors[path] = response.json().get("nextCursor") or self.cursors.get(path)
        elif path == "/session" and code == 200 and not response.json()["attached"]:
            self.pool.append(response.json()["sessionId"])
        elif path == "/session/{id}" and code == 204:
            closed = case.path_parameters["id"]
            self.pool[:] = [sid for sid in self.pool if sid != closed]
            self.closed = [*self.closed[-20:], closed]
        elif case.path_parameters.get("requestId") == self.rid and code in (200, 404):
            self.rid = None  # won, or gone: ask for a new one before the next real vote

    # --- sending -----------------------------------------------------------------------

    def send(self, case: Any) -> None:
        label = case.operation.label
        streamed = False
        try:
            if case.operation.path.endswith("/events"):
                response, streamed = self._open_stream(case)
            else:
                response = case.call(base_url=self.base_url, session=self.http, timeout=REQUEST_TIMEOUT_S)
        except UNSENDABLE as refused:
            self.unsent[type(refused).__name__] += 1
            return
        except requests.RequestException as error:  # the server hung or dropped the connection
            self.sent[label] += 1
            self.server_errors.append(f"{label}: {type(error).__name__}: {error}\n    {self._curl(case)}")
            return
        self.sent[label] += 1
        self.statuses[label, response.status_code] += 1
        if response.status_code == 400 and _forbidden_in_http(case.headers):
            self.refused_by_http += 1  # refused before the app saw it: no route describes that
        elif not streamed:
            try:
                case.validate_response(response, checks=CHECKS)
            except (Exception, BaseExceptionGroup) as failure:  # a schemathesis failure, or a group of them
                where = self.server_errors if response.status_code >= 500 else self.mismatches
                where.append(f"{label} -> {response.status_code}: {failure}\n    {self._curl(case)}")
        if response.status_code < 300 or response.status_code == 404:
            self.learn(case, response)

    def _open_stream(self, case: Any) -> tuple[Any, bool]:
        """An SSE request. An event stream never ends: check its status, content type and
        first frame, then hang up (True). Any other answer is read whole and validated."""
        kwargs = case.as_transport_kwargs(base_url=self.base_url)
        response = self.http.request(**kwargs, stream=True, timeout=SSE_TIMEOUT_S)
        if response.status_code != 200 or not response.headers.get("content-type", "").startswith("text/event-stream"):
            response.content  # noqa: B018 - a finite body: read it for validation
            return response, False
        with response:
            first = next(response.iter_content(chunk_size=None))
            if not first.startswith(b"retry: "):
                self.mismatches.append(f"{case.operation.label}: stream opened with {first[:80]!r}\n    {self._curl(case)}")
        return response, True

    def _curl(self, case: Any) -> str:
        return case.as_curl_command(base_url=self.base_url)

    # --- the run -------------------------------------------------------------------------

    def run_operation(self, operation: Any, mode: schemathesis.GenerationMode, seed: int, deadline: float) -> None:
        """Up to ROUND_EXAMPLES cases of one operation; each is sent as generated, then once
        per variant with real values (see `variants`), then with hostile values (`hostile`)."""
        key = operation.label
        if key not in self._strategies:
            self._strategies[key] = operation.as_strategy(generation_mode=mode)
        hostile = self.declared[key] != ([], [])
        varies = hostile or "{" in operation.path  # else one request per distinct case is all there is

        @hypothesis.seed(seed)
        @hypothesis.settings(
            max_examples=ROUND_EXAMPLES,
            database=None,
            deadline=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
            verbosity=hypothesis.Verbosity.quiet,
        )
        @hypothesis.given(
            case=self._strategies[key],
            pick=st.integers(1, 3) if varies else st.just(1),
            salt=st.integers(0, 2**32) if hostile else st.just(0),
        )
        def one(case: Any, pick: int, salt: int) -> None:
            if time.monotonic() > deadline:
                raise OutOfTime(f"{key}: the run was still going after {SAFETY_STOP_S} s")
            self.cases += 1
            self.send(case)
            for _ in self.variants(case, pick):
                self.send(case)
            if hostile:
                self.hostile(case, salt)
                self.send(case)

        try:
            one()
        except hypothesis.errors.Unsatisfiable:
            assert not mode.is_positive  # an operation without parameters has nothing to break

    def run(self, mode: schemathesis.GenerationMode, rounds: int, seed: int) -> str | None:
        """`rounds` passes over every operation; None, or why the safety stop ended it."""
        operations = [result.ok() for result in self.schema.get_all_operations()]
        deadline = time.monotonic() + SAFETY_STOP_S
        try:
            for _ in range(rounds):
                for operation in operations:
                    seed += 1
                    self.run_operation(operation, mode, seed, deadline)
        except OutOfTime as stop:
            return str(stop)
        return None

    def tally(self) -> dict[str, Any]:
        names = ("sent", "statuses", "server_errors", "mismatches", "unsent", "refused_by_http", "cases")
        return {name: getattr(self, name) for name in names}


def _forbidden_in_http(headers: dict[str, Any] | None) -> bool:
    """A header value HTTP itself forbids (RFC 9110 5.5: NUL, CR, LF, other controls but
    HTAB), or a `Content-Length` that is not a decimal number (8.6: the body cannot be
    framed). The HTTP server may refuse the request before the app sees it, with a 400 of
    its own (granian's has no body), which the app's OpenAPI document cannot describe."""
    return any(
        any((ord(c) < 0x20 and c != "\t") or ord(c) == 0x7F for c in str(value))
        or (name.lower() == "content-length" and not str(value).strip().isdigit())
        for name, value in (headers or {}).items()
    )


def fuzz_shard(options: dict[str, Any]) -> dict[str, Any]:
    """One fuzzing process: one generation mode over every operation (run in a subprocess)."""
    mode = schemathesis.GenerationMode(options.pop("mode"))
    rounds, seed = options.pop("rounds"), options.pop("seed")
    fuzzer = Fuzzer(schema=schemathesis.openapi.from_dict(options["spec"]), **options)
    started = time.monotonic()
    stopped = fuzzer.run(mode, rounds, seed)
    return {**fuzzer.tally(), "mode": mode.value, "elapsed": time.monotonic() - started, "stopped": stopped}


async def test_fuzz_every_route_without_server_errors(harness: Harness, workspace: str) -> None:
    await harness.worker("--max-sessions", "100000")
    api = await harness.api()

    document = await api.client.get("/openapi.json")
    assert document.status_code == 200
    spec = document.json()
    described = {f"{method.upper()} {path}" for path, item in spec["paths"].items() for method in item}
    served = {
        f"{method} {re.sub(r':[a-z]+}', '}', route.path)}"  # `{id:path}` is `{id}` in OpenAPI
        for route in ROUTES
        if isinstance(route, Route) and route.endpoint.__module__ != web.__name__  # the Web Shell is no API
        for method in route.methods or ()
        if method != "HEAD"
    }
    assert described == served, "the OpenAPI document describes exactly the API routes the app serves"

    events = await harness.events()
    sentinel = (await create(api, workspace))["sessionId"]
    finished = await prompt(api, sentinel, "hello before the fuzz")
    await events.wait_type(sentinel, "turn_complete", promptId=finished["promptId"])
    before = await status(api, sentinel)
    closed = (await create(api, workspace))["sessionId"]
    assert (await api.client.delete(f"/session/{closed}")).status_code == 204

    seed = int(os.environ.get("FUZZ_SEED") or random.randrange(2**32))
    shards = []
    for index, mode in enumerate(schemathesis.GenerationMode):
        voter = await create(api, workspace)
        shards.append(
            {
                "mode": mode.value,
                "spec": spec,
                "rounds": ROUNDS,
                "seed": seed + 100_000 * index,
                "base_url": f"http://127.0.0.1:{api.port}",
                "workspace": workspace,
                "sentinel": sentinel,
                "voter": voter["sessionId"],
                "voter_client": voter["clientId"],
                "pool": [(await create(api, workspace))["sessionId"]],
                "closed": [closed],
            }
        )
    loop = asyncio.get_running_loop()
    with ProcessPoolExecutor(len(shards), mp_context=multiprocessing.get_context("spawn")) as processes:
        results = await asyncio.gather(*(loop.run_in_executor(processes, fuzz_shard, shard) for shard in shards))

    sent = sum((r["sent"] for r in results), collections.Counter())
    total, cases = sum(sent.values()), sum(r["cases"] for r in results)
    statuses = sum((r["statuses"] for r in results), collections.Counter())
    server_errors = [e for r in results for e in r["server_errors"]]
    mismatches = [m for r in results for m in r["mismatches"]]
    elapsed = max(r["elapsed"] for r in results)
    print(
        f"\nfuzz (FUZZ_SEED={seed}): {total} requests from {cases} generated cases in {elapsed:.1f}s "
        f"({total / elapsed:.0f}/s; " + ", ".join(f"{r['mode']} {sum(r['sent'].values())} in {r['elapsed']:.0f}s" for r in results)
        + f"), not sendable (skipped): {dict(sum((r['unsent'] for r in results), collections.Counter()))}"
        + f", refused by the HTTP server (forbidden header bytes): {sum(r['refused_by_http'] for r in results)}\n"
        + "\n".join(
            f"  {count:6d}  {label:45s} "
            + " ".join(f"{code}:{n}" for (name, code), n in sorted(statuses.items()) if name == label)
            for label, count in sorted(sent.items())
        )
    )
    assert not server_errors, f"{len(server_errors)} server errors:\n" + "\n".join(server_errors[:20])
    assert not mismatches, f"{len(mismatches)} responses off the document:\n" + "\n".join(mismatches[:20])
    stops = [r["stopped"] for r in results if r["stopped"]]
    assert not stops, "the safety stop ended the fuzz run: " + "; ".join(stops)
    assert set(sent) == described, "every route was fuzzed"

    # No crash: nothing failed inside the API process (not even after a response started),
    # it still answers, and (the harness checks it) it exits 0 on SIGTERM.
    log = api.log_path.read_text(errors="replace")
    assert "Traceback" not in log, log[log.index("Traceback") - 300 :][:3000]
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
