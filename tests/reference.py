"""The reference daemon (`qwen serve`) for differential tests, and the tools to compare answers.

* `reference_daemon(...)`: an async context manager that starts `qwen serve` on a free
  loopback port (its `qwen --acp` child on the scripted model endpoint,
  `testbed/model_endpoint.py`) and stops it, with its process group, afterwards.
* `shape(body)`: a JSON body reduced to its structure, so ids and times never count.
* `Exchange`, `compare`, `Difference`: one request's answer as clients read it, and what
  differs between the reference's and acp-state's answers to the same step.
* `load_allowed(path)`: the deliberate differences listed in `docs/compatibility.md`.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import os
import re
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Iterable

import httpx

from acp_state.worker.agent import INITIALIZE_TIMEOUT_S
from testbed.qwen import qwen_env
from testbed.redis_server import free_port

START_TIMEOUT_S = 60
STOP_TIMEOUT_S = 15
# The deadline the reference gives its `qwen --acp` child to answer `initialize` (and each
# later request): acp-state's worker gives its agent INITIALIZE_TIMEOUT_S, so both sides get
# the same. The reference's own default, 10 s, is below what the child takes to boot on a
# loaded machine: `initialize` alone took 8.2 s here at a load of 12 on 2 cores, and under
# scripts/stress 8 of 20 restore runs had the reference's create or load answer 504
# `init_timeout` ("initialize timed out after 9.9 s"). The child starts on demand inside
# the daemon (its create or load), so there is no readiness a test could await instead.
AGENT_INITIALIZE_TIMEOUT_MS = int(INITIALIZE_TIMEOUT_S * 1000)

# The response headers clients read. Content-Type and Cache-Control are compared by value;
# the others carry ids or digests, so only whether they are there counts.
HEADERS_BY_VALUE = ("Content-Type", "Cache-Control", "X-Accel-Buffering")
HEADERS_BY_PRESENCE = ("ETag", "X-Qwen-Event-Epoch", "X-Qwen-SSE-Stream-Id", "Retry-After")
COMPARED_HEADERS = HEADERS_BY_VALUE + HEADERS_BY_PRESENCE

# Object keys whose string values are enum-like: their value is part of the shape.
ENUM_KEYS = frozenset({
    "activeWorkState", "state", "code", "stopReason", "kind", "errorKind", "outcome", "optionId",
    "type", "status", "mode", "current", "permission", "archiveState",
})
# Object keys whose arrays hold enum-like strings: compared as sets of members.
ENUM_LIST_KEYS = frozenset({"features", "supported", "transports"})


# -- the reference daemon ----------------------------------------------------


@dataclass
class Reference:
    """A running `qwen serve`."""

    process: asyncio.subprocess.Process
    port: int
    workspace: str
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


async def _wait_healthy(reference: Reference, timeout: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    async with httpx.AsyncClient(base_url=reference.base_url, timeout=2) as client:
        while True:
            if reference.process.returncode is not None:
                raise RuntimeError(
                    f"qwen serve exited {reference.process.returncode}; see {reference.log_path}:\n"
                    + reference.log_path.read_text(errors="replace")[-3000:]
                )
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get("/health")).status_code == 200:
                    return
            if loop.time() >= deadline:
                raise RuntimeError(f"qwen serve did not answer /health in {timeout}s; see {reference.log_path}")
            await asyncio.sleep(0.1)


async def _stop(process: asyncio.subprocess.Process) -> None:
    """SIGTERM to the daemon's own process group (it and its `qwen --acp` children), then
    SIGKILL to that group if it lingers."""
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), STOP_TIMEOUT_S)
        except asyncio.TimeoutError:
            pass
    # Children may outlive a daemon that exited: end whatever is left in its group.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    if process.returncode is None:
        await process.wait()


@contextlib.asynccontextmanager
async def reference_daemon(
    qwen: str, workspace: str, llm_base_url: str, scratch: Path, *extra_args: str
) -> AsyncIterator[Reference]:
    """Start `qwen serve --workspace <workspace> --no-web` on a free loopback port, its agent
    given acp-state's `initialize` deadline (AGENT_INITIALIZE_TIMEOUT_MS).

    `scratch` receives the daemon's HOME (its settings select the scripted LLM at
    `llm_base_url`), its TMPDIR and its log (`serve.log`). The daemon and its children run
    in a process group of their own, which is ended afterwards.
    """
    home, tmp = scratch / "home", scratch / "tmp"
    home.mkdir(parents=True, exist_ok=True)
    tmp.mkdir(parents=True, exist_ok=True)
    env = qwen_env(home, llm_base_url)
    env["TMPDIR"] = str(tmp)
    env.pop("QWEN_SERVER_TOKEN", None)
    port = free_port()
    log_path = scratch / "serve.log"
    with open(log_path, "ab") as log:
        process = await asyncio.create_subprocess_exec(
            qwen, "serve", "--port", str(port), "--hostname", "127.0.0.1",
            "--workspace", workspace, "--no-web", "--initialize-timeout-ms", str(AGENT_INITIALIZE_TIMEOUT_MS),
            *extra_args,
            stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log,
            cwd=workspace, env=env, start_new_session=True,
        )
    reference = Reference(process, port, workspace, log_path)
    try:
        await _wait_healthy(reference, START_TIMEOUT_S)
        yield reference
    finally:
        await _stop(process)


# -- shapes ------------------------------------------------------------------


def _describe(value: Any, key: str | None) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean {str(value).lower()}"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return f"string {value!r}" if key in ENUM_KEYS else "string"
    if isinstance(value, list):
        return "array"
    return "object"


def shape(body: Any) -> dict[str, str]:
    """Reduce a JSON body to its structure: `{path: description}` for every value in it.

    Paths look like `$.pendingInteractions[0].kind`. A description is the JSON type
    (`string`, `number`, `boolean true`, `null`, `object`, `array`); strings under an
    enum-like key (`ENUM_KEYS`: `state`, `code`, `kind`, ...) carry their value, booleans
    always do. Arrays under `ENUM_LIST_KEYS` (`features`, ...) become one `$.features[name]`
    path per member, so the comparison says which members differ, not which index.
    """
    out: dict[str, str] = {}

    def walk(value: Any, path: str, key: str | None) -> None:
        out[path] = _describe(value, key)
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{path}.{k}", k)
        elif isinstance(value, list):
            if key in ENUM_LIST_KEYS and all(isinstance(v, str) for v in value):
                for v in value:
                    out[f"{path}[{v}]"] = "member"
            else:
                for i, v in enumerate(value):
                    walk(v, f"{path}[{i}]", key)

    walk(body, "$", None)
    return out


# -- exchanges and differences -----------------------------------------------


@dataclass
class Exchange:
    """One step's answer as a client reads it (`status` None: the step could not run)."""

    step: str  # the session state or situation, e.g. "idle", "waiting for permission"
    route: str  # "GET /session/:id/status"
    method: str = ""
    url: str = ""
    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    body: Any = None  # parsed JSON, the text of a non-JSON body, or None when empty/unread
    is_json: bool = False
    request: Any = None
    note: str = ""  # why the step could not run

    @property
    def key(self) -> str:
        return f"{self.route} @ {self.step}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "step": self.step, "route": self.route, "method": self.method, "url": self.url,
            "request": self.request, "status": self.status, "headers": self.headers,
            "body": self.body, "note": self.note,
        }


def read_headers(response: httpx.Response) -> dict[str, str]:
    return {name: response.headers[name] for name in COMPARED_HEADERS if name in response.headers}


def exchange_of(step: str, route: str, response: httpx.Response, request: Any = None, read_body: bool = True) -> Exchange:
    body: Any = None
    is_json = False
    if read_body and response.content:
        try:
            body, is_json = response.json(), True
        except ValueError:
            body = response.text[:500]
    return Exchange(
        step=step, route=route, method=response.request.method, url=str(response.request.url.raw_path.decode()),
        status=response.status_code, headers=read_headers(response), body=body, is_json=is_json, request=request,
    )


@dataclass(frozen=True)
class Difference:
    """One difference of one step. `kind`: no_route (acp-state's router has no such route),
    status, header, missing (in acp-state), extra (in acp-state), type, value, unrun. `what`: `status`, `header:<Name>` or a body path."""

    route: str
    step: str
    kind: str
    what: str
    reference: str
    ours: str

    @property
    def summary_key(self) -> tuple[str, str, str, str, str]:
        return (self.route, self.kind, self.what, self.reference, self.ours)


def _normalize_header(name: str, value: str) -> str:
    value = re.sub(r"\s*([;,=])\s*", r"\1", value.strip())
    return value.lower() if name == "Content-Type" else value


def _short(body: Any, limit: int = 160) -> str:
    import json

    text = body if isinstance(body, str) else json.dumps(body, separators=(",", ":"))
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _no_route(exchange: Exchange) -> bool:
    """The router's own plain-text 404/405: no route serves this method and path."""
    return exchange.status in (404, 405) and not exchange.is_json and exchange.body in ("Not Found", "Method Not Allowed")


def compare(reference: Exchange, ours: Exchange) -> list[Difference]:
    """What differs between the two answers to one step.

    A differing status code is one difference and ends the comparison (bodies of different
    statuses do not compare). Otherwise headers (`COMPARED_HEADERS`) and body shapes are
    compared; a path missing or extra is reported once, not again for what lies under it.
    """
    assert reference.key == ours.key, (reference.key, ours.key)
    route, step = reference.route, reference.step
    diffs: list[Difference] = []

    def add(kind: str, what: str, ref: str, our: str) -> None:
        diffs.append(Difference(route, step, kind, what, ref, our))

    if reference.status is None or ours.status is None:
        if reference.status != ours.status:
            add("unrun", "step", reference.note or f"{reference.status}", ours.note or f"{ours.status}")
        return diffs
    if _no_route(ours) and not _no_route(reference):
        add("no_route", "route", f"{reference.status} {_short(reference.body)}", f"{ours.status} {ours.body!r}")
        return diffs
    if reference.status != ours.status:
        add("status", "status", f"{reference.status} {_short(reference.body)}", f"{ours.status} {_short(ours.body)}")
        return diffs

    for name in COMPARED_HEADERS:
        ref_value, our_value = reference.headers.get(name), ours.headers.get(name)
        if name in HEADERS_BY_PRESENCE:
            if (ref_value is None) != (our_value is None):
                add("header", f"header:{name}", "present" if ref_value is not None else "absent",
                    "present" if our_value is not None else "absent")
        elif ref_value is None or our_value is None:
            if ref_value != our_value:
                add("header", f"header:{name}", repr(ref_value) if ref_value else "absent",
                    repr(our_value) if our_value else "absent")
        elif _normalize_header(name, ref_value) != _normalize_header(name, our_value):
            add("header", f"header:{name}", repr(ref_value), repr(our_value))

    if reference.is_json != ours.is_json:
        add("type", "$", "JSON" if reference.is_json else f"non-JSON {_short(reference.body)!r}",
            "JSON" if ours.is_json else f"non-JSON {_short(ours.body)!r}")
        return diffs
    if not reference.is_json:
        ref_empty, our_empty = reference.body in (None, ""), ours.body in (None, "")
        if ref_empty != our_empty:
            add("type", "$", "empty" if ref_empty else _short(reference.body), "empty" if our_empty else _short(ours.body))
        return diffs

    ref_shape, our_shape = shape(reference.body), shape(ours.body)

    def under(path: str, reported: list[str]) -> bool:
        return any(path.startswith(p + ".") or path.startswith(p + "[") for p in reported)

    missing: list[str] = []
    for path, desc in ref_shape.items():
        if path not in our_shape:
            if not under(path, missing):
                missing.append(path)
                add("missing", path, desc, "absent")
        elif our_shape[path] != desc:
            ref_type, our_type = desc.split(" ")[0], our_shape[path].split(" ")[0]
            add("type" if ref_type != our_type else "value", path, desc, our_shape[path])
    extra: list[str] = []
    for path, desc in our_shape.items():
        if path not in ref_shape and not under(path, extra):
            extra.append(path)
            add("extra", path, "absent", desc)
    return diffs


# -- the deliberate differences ---------------------------------------------


@dataclass
class AllowedDifference:
    """One line of the `compat` block: `route | what | kind | reason`.

    `route` is a glob over `"METHOD /route/template @ step"` (without ` @ ` it matches every
    step); `what` a glob over `status`, `header:<Name>` or a body path (`$.code`,
    `$.features*`: `[` would open an fnmatch character class); `kind` one of the difference
    kinds or `*`."""

    route: str
    what: str
    kind: str
    reason: str
    used: int = 0

    def allows(self, diff: Difference) -> bool:
        route = self.route if " @ " in self.route else self.route + " @ *"
        return (
            fnmatch.fnmatchcase(f"{diff.route} @ {diff.step}", route)
            and fnmatch.fnmatchcase(diff.what, self.what)
            and (self.kind == "*" or self.kind == diff.kind)
        )


def load_allowed(path: Path) -> list[AllowedDifference]:
    """The rules of every fenced ```compat block of `path`; `#` starts a comment line."""
    rules: list[AllowedDifference] = []
    inside = False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            inside = stripped == "```compat" if not inside else False
            continue
        if not inside or not stripped or stripped.startswith("#"):
            continue
        parts = [p.strip() for p in stripped.split(" | ")]
        if len(parts) != 4 or not all(parts):
            raise ValueError(f"{path}:{number}: expected `route | what | kind | reason`, got {line!r}")
        rules.append(AllowedDifference(*parts))
    return rules


def undocumented(diffs: Iterable[Difference], rules: list[AllowedDifference]) -> list[Difference]:
    left = []
    for diff in diffs:
        rule = next((r for r in rules if r.allows(diff)), None)
        if rule is None:
            left.append(diff)
        else:
            rule.used += 1
    return left


def report(diffs: list[Difference]) -> list[str]:
    """One readable line per distinct difference, with the steps where it showed; the routes
    acp-state lacks first, under a heading of their own."""
    grouped: dict[tuple[str, str, str, str, str], list[str]] = {}
    members: dict[tuple[str, str, str, str], list[str]] = {}  # (route, step, kind, array) -> names
    for diff in diffs:
        if "member" in (diff.reference, diff.ours):  # one line per array, not per member
            array, _, name = diff.what.rpartition("[")
            members.setdefault((diff.route, diff.step, diff.kind, array), []).append(name.rstrip("]"))
            continue
        steps = grouped.setdefault(diff.summary_key, [])
        if diff.step not in steps:
            steps.append(diff.step)
    missing_routes: list[str] = []
    lines: list[str] = []
    for (route, step, kind, array), names in members.items():
        side = "missing in acp-state" if kind == "missing" else "only in acp-state"
        lines.append(f"{route} [{step}]: {array} members {side} ({len(names)}): {', '.join(names)}")
    for (route, kind, what, ref, ours), steps in grouped.items():
        where = "; ".join(steps)
        if kind == "status":
            text = f"status: reference {ref} | acp-state {ours}"
        elif kind == "missing":
            text = f"{what} missing in acp-state (reference: {ref})"
        elif kind == "extra":
            text = f"{what} only in acp-state ({ours})"
        elif kind == "no_route":
            text = f"no such route in acp-state: reference {ref} | acp-state {ours}"
        elif kind == "unrun":
            text = f"step did not run: reference {ref} | acp-state {ours}"
        else:
            text = f"{what}: reference {ref} | acp-state {ours}"
        (missing_routes if kind == "no_route" else lines).append(f"{route} [{where}]: {text}")
    sections = []
    if missing_routes:
        sections += ["-- routes acp-state does not serve (its router answers 404 Not Found):", *missing_routes]
    if lines:
        sections += ["-- differences on routes acp-state serves:", *lines]
    return sections
