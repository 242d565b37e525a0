"""Differential test: the reference daemon (`qwen serve` 0.24.4) and acp-state, side by side.

Both run on one scripted LLM (`testbed.model_endpoint`) and the same workspace folder: the reference as
`qwen serve`, acp-state as one worker hosting `qwen --acp` and one API. One scenario runs
against each (concurrently); every step's status code, the headers clients read and the
body's shape (`tests.reference.shape`) are compared. Differences listed in the ```compat
block of `docs/compatibility.md` are allowed; the test fails listing every other one.

A second scenario restores a persisted session: told a fact, the session outlives a restart
(the reference: `qwen serve` stopped and started again on the same HOME and workspace;
acp-state: its worker stopped by SIGTERM, which with `--drain-grace-s 0` closes its sessions,
and a new worker started on the same agent state, the same HOME for `qwen --acp`), is seen
as persisted (listed, 404 elsewhere), is loaded (`POST /session/:id/load`), and a prompt
after the load reaches a model that was sent the fact.

Skipped when `qwen` (tests/node: `npm ci --prefix tests/node`) or `node` is missing.
`ACP_DIFF_DUMP=/some/file.json` also writes every exchange of both sides there (those of the
restore scenario to `/some/file.restore.json`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterator
from urllib.parse import quote

import httpx
import pytest

from acp_state.ids import workspace_id
from testbed.model_endpoint import ModelEndpoint, message_text
from testbed.processes import WorkerProcess
from testbed.qwen import qwen_env
from tests.harness import Harness
from tests.reference import (
    Exchange,
    compare,
    exchange_of,
    load_allowed,
    reference_daemon,
    report,
    undocumented,
)

pytestmark = pytest.mark.qwen

ROOT = Path(__file__).resolve().parent.parent
COMPATIBILITY = ROOT / "docs" / "compatibility.md"
CREATE_TIMEOUT_S = 90
WAIT_TIMEOUT_S = 60
SHORT_WAIT_S = 5
POLL_S = 0.1
UNKNOWN_SID = "00000000-0000-4000-8000-000000000000"
UNKNOWN_WS_ID = "0123456789abcdef"
UNREGISTERED_CWD = "/nonexistent-acp-state-diff-ws"
# `qwen serve` runs its sessions in the `auto` approval mode (a shell command goes to the
# permission classifier, which the scripted LLM cannot answer, so it asks): acp-state's
# agent runs in the same mode, so both agents ask the same permission the same way.
AGENT_MODE = "auto"
PROCEED_ONCE = {"outcome": {"outcome": "selected", "optionId": "proceed_once"}}


def text_prompt(text: str) -> dict[str, Any]:
    return {"prompt": [{"type": "text", "text": text}]}


@pytest.fixture
def workspace(tmp_path: Path) -> str:
    """The workspace as its real path: the reference canonicalizes `--workspace` with
    `realpath` and derives the workspace id from that, acp-state from the string it is given."""
    path = tmp_path / "ws"
    path.mkdir()
    return os.path.realpath(path)


@pytest.fixture
def fake_llm() -> Iterator[ModelEndpoint]:
    with ModelEndpoint() as fake:
        yield fake


@dataclass
class Target:
    """One side of the comparison: a base URL and what each step answered."""

    name: str
    client: httpx.AsyncClient
    workspace: str
    exchanges: list[Exchange] = field(default_factory=list)
    wait_timeout_s: float = WAIT_TIMEOUT_S  # cut short once a wait timed out: the run stays brief

    async def call(
        self, step: str, route: str, method: str, url: str, body: Any = None, raw: bytes | None = None,
        timeout: float | None = None, headers: dict[str, str] | None = None,
    ) -> Exchange:
        kwargs: dict[str, Any] = {"headers": dict(headers or {})}
        if raw is not None:
            kwargs["content"] = raw
            kwargs["headers"]["Content-Type"] = "application/json"
        elif body is not None:
            kwargs["json"] = body
        if timeout is not None:
            kwargs["timeout"] = timeout
        try:
            response = await self.client.request(method, url, **kwargs)
        except httpx.HTTPError as error:
            exchange = Exchange(step=step, route=route, method=method, url=url, request=body,
                                note=f"{type(error).__name__}: {error}")
        else:
            exchange = exchange_of(step, route, response, request=body)
        self.exchanges.append(exchange)
        return exchange

    async def headers_of_stream(self, step: str, route: str, url: str) -> Exchange:
        """Open an event stream, read the status and headers, close it."""
        try:
            async with self.client.stream("GET", url, timeout=10) as response:
                if response.status_code == 200:
                    exchange = exchange_of(step, route, response, read_body=False)
                else:
                    await response.aread()
                    exchange = exchange_of(step, route, response)
        except httpx.HTTPError as error:
            exchange = Exchange(step=step, route=route, method="GET", url=url, note=f"{type(error).__name__}: {error}")
        self.exchanges.append(exchange)
        return exchange

    async def wait_status(
        self, step: str, sid: str, predicate: Callable[[dict[str, Any]], bool], stable_s: float = 0.0
    ) -> dict[str, Any]:
        """Poll `GET /session/:id/status` until `predicate` holds (for `stable_s` if given).
        Recorded as a step of its own: a side that never gets there shows as a difference."""
        return await self.wait_get(step, "(wait) status", f"/session/{sid}/status", predicate, stable_s)

    async def wait_get(
        self, step: str, route: str, url: str, predicate: Callable[[dict[str, Any]], bool], stable_s: float = 0.0
    ) -> dict[str, Any]:
        """Poll `GET url` until its 200 answer satisfies `predicate` (see `wait_status`)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_timeout_s
        held_since: float | None = None
        last: Any = None
        while loop.time() < deadline:
            response = await self.client.get(url)
            last = response.json() if response.headers.get("content-type", "").startswith("application/json") else response.text
            if response.status_code == 200 and predicate(last):
                held_since = held_since if held_since is not None else loop.time()
                if loop.time() - held_since >= stable_s:
                    self.exchanges.append(Exchange(step=step, route=route, status=200))
                    return last
            else:
                held_since = None
            await asyncio.sleep(POLL_S)
        self.exchanges.append(Exchange(step=step, route=route,
                                       note=f"timed out after {self.wait_timeout_s}s; last answer {last}"))
        self.wait_timeout_s = SHORT_WAIT_S
        return last if isinstance(last, dict) else {}


def first_request_id(status: dict[str, Any]) -> str:
    pending = status.get("pendingInteractions") or [{}]
    return pending[0].get("requestId", "no-pending-request")


def waiting_permission(s: dict[str, Any]) -> bool:
    return bool(s.get("isWaitingForPermission"))


def waiting_question(s: dict[str, Any]) -> bool:
    return bool(s.get("isWaitingForUserQuestion"))


def idle(s: dict[str, Any]) -> bool:
    return s.get("hasActivePrompt") is False and s.get("activeWorkState") == "idle"


async def context_views(t: Target, step: str, s: str) -> None:
    """A session's context (its agent's modes), context usage and goal."""
    for route in ("context", "context-usage", "goal"):
        await t.call(step, f"GET /session/:id/{route}", "GET", f"{s}/{route}")


async def scenario(t: Target) -> None:
    """The one scenario both sides run. Step names say the session's state."""
    ws = t.workspace
    wid = workspace_id(ws)
    enc = quote(ws, safe="")

    await t.call("daemon", "GET /capabilities", "GET", "/capabilities")
    created = await t.call("new", "POST /session", "POST", "/session", {"cwd": ws}, timeout=CREATE_TIMEOUT_S)
    sid = (created.body or {}).get("sessionId", "no-session") if created.is_json else "no-session"
    s = f"/session/{sid}"

    async def session_views(step: str, *prompt_ids: str) -> None:
        await t.call(step, "GET /session/:id/status", "GET", f"{s}/status")
        await t.call(step, "GET /workspace/:id/sessions", "GET", f"/workspace/{wid}/sessions")
        await t.call(step, "GET /workspaces/:workspace/sessions/live-state", "GET",
                     f"/workspaces/{wid}/sessions/live-state")
        await t.call(step, "GET /session/:id/turns/current", "GET", f"{s}/turns/current")
        for n, prompt_id in enumerate(prompt_ids):
            label = step if len(prompt_ids) == 1 else f"{step}, prompt {n + 1}"
            await t.call(label, "GET /session/:id/turns/:promptId", "GET", f"{s}/turns/{prompt_id}")

    # 1. A fresh idle session.
    await session_views("idle, fresh")
    await t.call("idle, fresh", "GET /session/:id/pending-prompts", "GET", f"{s}/pending-prompts")
    await t.call("idle, fresh", "GET /session/:id/supported-commands", "GET", f"{s}/supported-commands")
    await context_views(t, "idle, fresh", s)
    await t.call("idle, path form", "GET /workspace/:id/sessions", "GET", f"/workspace/{enc}/sessions")
    await t.call("idle, path form", "GET /workspaces/:workspace/sessions/live-state", "GET",
                 f"/workspaces/{enc}/sessions/live-state")
    await t.headers_of_stream("idle", "GET /session/:id/events", f"{s}/events")

    # 2. A turn waiting for a permission (shell tool).
    ran = await t.call("idle", "POST /session/:id/prompt", "POST", f"{s}/prompt", text_prompt("PERM please run"))
    pid1 = (ran.body or {}).get("promptId", "no-prompt") if ran.is_json else "no-prompt"
    status = await t.wait_status("waiting for permission", sid, waiting_permission)
    rid = first_request_id(status)
    await session_views("waiting for permission", pid1)
    await t.call("unknown promptId", "GET /session/:id/turns/:promptId", "GET", f"{s}/turns/nope")
    await t.headers_of_stream("waiting for permission", "GET /session/:id/events", f"{s}/events")
    vote = "POST /session/:id/permission/:requestId"
    await t.call("bad outcome", vote, "POST", f"{s}/permission/{rid}", {"outcome": {"outcome": "bogus"}})
    await t.call("no body fields", vote, "POST", f"{s}/permission/{rid}", {})
    await t.call("unknown requestId", vote, "POST", f"{s}/permission/{UNKNOWN_SID}", PROCEED_ONCE)
    await t.call("waiting for permission", vote, "POST", f"{s}/permission/{rid}", PROCEED_ONCE)
    await t.wait_status("turn ended", sid, idle)
    await session_views("turn ended", pid1)
    await context_views(t, "turn ended", s)
    await t.call("turn ended", "POST /session/:id/resume", "POST", f"{s}/resume", {})
    await t.call("invalid JSON", "POST /session/:id/resume", "POST", f"{s}/resume", raw=b"{not json")
    # A poller's conditional GET, with the validator the previous answer carried (if any).
    seen = await t.call("turn ended", "GET /session/:id/status", "GET", f"{s}/status")
    await t.call("turn ended, If-None-Match", "GET /session/:id/status", "GET", f"{s}/status",
                 headers={"If-None-Match": seen.headers.get("ETag", 'W/"none"')})
    await t.call("turn ended, vote again", vote, "POST", f"{s}/permission/{rid}", PROCEED_ONCE)

    # 3. A question (ask_user_question) and its answer.
    asked = await t.call("idle after a turn", "POST /session/:id/prompt", "POST", f"{s}/prompt",
                         text_prompt("QUESTION ask me"))
    pid2 = (asked.body or {}).get("promptId", "no-prompt") if asked.is_json else "no-prompt"
    status = await t.wait_status("waiting for question", sid, waiting_question)
    await session_views("waiting for question", pid2)
    await t.call("waiting for question", vote, "POST", f"{s}/permission/{first_request_id(status)}",
                 {**PROCEED_ONCE, "answers": {"0": "Blue"}})
    await t.wait_status("question answered", sid, idle)
    await session_views("question answered", pid2)

    # 4. A prompt queued behind a running one, then cancel.
    running = await t.call("idle after a question", "POST /session/:id/prompt", "POST", f"{s}/prompt",
                           text_prompt("PERM run again"))
    pid3 = (running.body or {}).get("promptId", "no-prompt") if running.is_json else "no-prompt"
    await t.wait_status("running, waiting for permission", sid, waiting_permission)
    queued = await t.call("running", "POST /session/:id/prompt", "POST", f"{s}/prompt",
                          text_prompt("hello queued"))
    pid4 = (queued.body or {}).get("promptId", "no-prompt") if queued.is_json else "no-prompt"
    await session_views("one running, one queued", pid3, pid4)
    await t.call("one running, one queued", "GET /session/:id/supported-commands", "GET", f"{s}/supported-commands")
    await t.call("one running, one queued", "GET /session/:id/pending-prompts", "GET", f"{s}/pending-prompts")
    remove = "DELETE /session/:id/pending-prompts/:promptId"
    await t.call("one running, one queued", remove, "DELETE", f"{s}/pending-prompts/{pid4}")
    await t.call("queued one removed", "GET /session/:id/pending-prompts", "GET", f"{s}/pending-prompts")
    await t.call("queued one removed", remove, "DELETE", f"{s}/pending-prompts/{pid4}")
    await t.call("queued one removed", "GET /session/:id/turns/:promptId", "GET", f"{s}/turns/{pid4}")
    await t.call("one running, one queued", "POST /session/:id/cancel", "POST", f"{s}/cancel")
    await t.wait_status("after cancel", sid, idle, stable_s=1.0)
    await session_views("after cancel", pid3, pid4)
    await t.call("after cancel", "GET /session/:id/pending-prompts", "GET", f"{s}/pending-prompts")
    await t.call("idle", "POST /session/:id/cancel", "POST", f"{s}/cancel")

    # 5. Malformed bodies.
    prompt = "POST /session/:id/prompt"
    await t.call("no prompt field", prompt, "POST", f"{s}/prompt", {})
    await t.call("empty prompt array", prompt, "POST", f"{s}/prompt", {"prompt": []})
    await t.call("invalid JSON", prompt, "POST", f"{s}/prompt", raw=b"{not json")
    await t.call("cwd of another workspace", "POST /session", "POST", "/session", {"cwd": UNREGISTERED_CWD})

    # 6. Unknown ids.
    u = f"/session/{UNKNOWN_SID}"
    unknown = "unknown session"
    await t.call(unknown, "GET /session/:id/status", "GET", f"{u}/status")
    await t.call(unknown, "GET /session/:id/turns/current", "GET", f"{u}/turns/current")
    await t.call(unknown, "GET /session/:id/turns/:promptId", "GET", f"{u}/turns/nope")
    await t.call(unknown, prompt, "POST", f"{u}/prompt", text_prompt("hello"))
    await t.call(unknown, "POST /session/:id/cancel", "POST", f"{u}/cancel")
    await t.call(unknown, "GET /session/:id/pending-prompts", "GET", f"{u}/pending-prompts")
    await t.call(unknown, "GET /session/:id/supported-commands", "GET", f"{u}/supported-commands")
    await context_views(t, unknown, u)
    await t.call(unknown, "POST /session/:id/resume", "POST", f"{u}/resume", {})
    await t.call(unknown, "DELETE /session/:id/pending-prompts/:promptId", "DELETE", f"{u}/pending-prompts/{UNKNOWN_SID}")
    await t.call(unknown, vote, "POST", f"{u}/permission/{UNKNOWN_SID}", PROCEED_ONCE)
    await t.headers_of_stream(unknown, "GET /session/:id/events", f"{u}/events")
    await t.call(unknown, "DELETE /session/:id", "DELETE", u)
    listing, live = "GET /workspace/:id/sessions", "GET /workspaces/:workspace/sessions/live-state"
    for step, ident in (
        ("unknown workspace id", UNKNOWN_WS_ID),
        ("bad workspace id", "nothex"),
        ("unregistered absolute path", quote(UNREGISTERED_CWD, safe="")),
    ):
        await t.call(step, listing, "GET", f"/workspace/{ident}/sessions")
        await t.call(step, live, "GET", f"/workspaces/{ident}/sessions/live-state")

    # 7. The session catalog (POST /sessions/catalog).
    catalog = "POST /sessions/catalog"
    await t.call("one workspace by path", catalog, "POST", "/sessions/catalog", {"workspaces": [{"workspace": ws}]})
    await t.call("one workspace by id", catalog, "POST", "/sessions/catalog", {"workspaces": [{"workspace": wid}]})
    await t.call("all workspaces", catalog, "POST", "/sessions/catalog", {"workspaces": "all"})
    await t.call("unregistered workspace", catalog, "POST", "/sessions/catalog",
                 {"workspaces": [{"workspace": UNREGISTERED_CWD}]})
    await t.call("invalid request", catalog, "POST", "/sessions/catalog", {})

    # 8. What the reference's Web Shell relies on (issue 39): the page sizes it lists with, a
    # session's source (every create of the page sends one), its brand and goals.
    for size in ("1000", "200", "0", "-3"):
        await t.call(f"size {size}", listing, "GET", f"/workspace/{enc}/sessions?size={size}&archiveState=active")
    sourced = await t.call("new, with a source", "POST /session", "POST", "/session",
                           {"cwd": ws, "sessionScope": "thread", "sourceType": "web_shell", "sourceId": "tab-1"},
                           timeout=CREATE_TIMEOUT_S)
    sourced_id = (sourced.body or {}).get("sessionId", "no-session") if sourced.is_json else "no-session"
    for step, query in (("by source type", "sourceType=web_shell"),
                        ("by source type and id", "sourceType=web_shell&sourceId=tab-1"),
                        ("by another source id", "sourceType=web_shell&sourceId=tab-2"),
                        ("by the default source", "sourceType=default&size=1000&archiveState=active")):
        await t.call(f"sourced, {step}", listing, "GET", f"/workspace/{wid}/sessions?{query}")
    for step, body in (("source type malformed", {"sourceType": "Web"}),
                       ("source id without a type", {"sourceId": "tab-1"}),
                       ("source reserved", {"sourceType": "standalone"})):
        await t.call(step, "POST /session", "POST", "/session", {"cwd": ws, "sessionScope": "thread", **body})
    await t.call("source id without a type", listing, "GET", f"/workspace/{wid}/sessions?sourceId=tab-1")
    await t.call("sourced", "DELETE /session/:id", "DELETE", f"/session/{sourced_id}")
    await t.call("daemon", "GET /brand", "GET", "/brand")
    await t.call("daemon", "GET /goals", "GET", "/goals")
    for route in ("/workspace/settings", "/workspace/extensions", "/workspace/extensions/operations"):
        await t.call("daemon", f"GET {route}", "GET", route)

    # 9. Close, then the session is gone.
    await t.call("idle", "DELETE /session/:id", "DELETE", s)
    await t.call("deleted", "GET /session/:id/status", "GET", f"{s}/status")
    await t.call("deleted", "GET /session/:id/turns/current", "GET", f"{s}/turns/current")
    await t.call("deleted", "GET /workspace/:id/sessions", "GET", f"/workspace/{wid}/sessions")
    await t.call("deleted", "GET /workspaces/:workspace/sessions/live-state", "GET",
                 f"/workspaces/{wid}/sessions/live-state")

    # 9. Presence (issue 39): heartbeat and detach, on a session of their own, last (the
    # reference closes a session once its last client left).
    heartbeat, detach = "POST /session/:id/heartbeat", "POST /session/:id/detach"
    other = await t.call("new", "POST /session", "POST", "/session", {"cwd": ws, "sessionScope": "thread"},
                         timeout=CREATE_TIMEOUT_S)
    other_body = other.body if other.is_json and isinstance(other.body, dict) else {}
    o, viewer = f"/session/{other_body.get('sessionId', 'no-session')}", other_body.get("clientId", "no-client")
    me = {"X-Qwen-Client-Id": viewer}
    await t.call("present", heartbeat, "POST", f"{o}/heartbeat", {}, headers=me)
    await t.call("no client id", heartbeat, "POST", f"{o}/heartbeat", {})
    await t.call("unregistered client", heartbeat, "POST", f"{o}/heartbeat", {},
                 headers={"X-Qwen-Client-Id": "client_unregistered"})
    await t.call("malformed client id", heartbeat, "POST", f"{o}/heartbeat", {}, headers={"X-Qwen-Client-Id": "a b"})
    await t.call("present", "GET /session/:id/status", "GET", f"{o}/status")
    mode = "POST /session/:id/approval-mode"
    await t.call("present", mode, "POST", f"{o}/approval-mode", {"mode": "plan"}, headers=me)
    await t.call("unknown mode", mode, "POST", f"{o}/approval-mode", {"mode": "sideways"})
    await t.call("bad persist flag", mode, "POST", f"{o}/approval-mode", {"mode": "plan", "persist": "yes"})
    await t.call("plan mode", "GET /session/:id/status", "GET", f"{o}/status")
    await t.call(unknown, mode, "POST", f"{u}/approval-mode", {"mode": "plan"})
    await t.call("unregistered client", detach, "POST", f"{o}/detach", headers={"X-Qwen-Client-Id": "client_unregistered"})
    await t.call("no client id", detach, "POST", f"{o}/detach")
    await t.call("present", detach, "POST", f"{o}/detach", headers=me)
    await t.call("detached", "GET /session/:id/status", "GET", f"{o}/status")
    await t.call("detached", heartbeat, "POST", f"{o}/heartbeat", {}, headers=me)
    await t.call(unknown, heartbeat, "POST", f"{u}/heartbeat", {})
    await t.call(unknown, detach, "POST", f"{u}/detach")


async def start_acp_worker(harness: Harness, qwen: str, fake: ModelEndpoint, tmp_path: Path) -> WorkerProcess:
    """acp-state's worker hosting `qwen --acp` on the scripted LLM. Its agent's HOME (where
    qwen keeps its chats: the agent state a load reads) and TMPDIR are the same for every
    worker started here, so a second one is the first one's restart."""
    scratch = tmp_path / "acp-qwen-tmp"
    scratch.mkdir(exist_ok=True)
    env = qwen_env(tmp_path / "acp-home", fake.openai_url)
    env["TMPDIR"] = str(scratch)
    return await harness.worker(
        "--agent", f"{qwen} --acp", "--session-mode", AGENT_MODE,
        "--agent-stderr", str(tmp_path / "qwen-stderr.log"),
        env=env,
    )


def dump(path: Path, reference: Target, ours: Target) -> None:
    path.write_text(json.dumps(
        {"reference": [e.as_dict() for e in reference.exchanges], "acp-state": [e.as_dict() for e in ours.exchanges]},
        indent=1,
    ))


async def test_reference_and_acp_state_answer_alike(
    qwen: str, fake_llm: ModelEndpoint, harness: Harness, workspace: str, tmp_path: Path
) -> None:
    # `fake_llm` comes before `harness`, so it outlives the worker and its qwen child.
    rules = load_allowed(COMPATIBILITY)

    await start_acp_worker(harness, qwen, fake_llm, tmp_path)
    api = await harness.api()

    async with reference_daemon(qwen, workspace, fake_llm.openai_url, tmp_path / "reference") as daemon:
        async with httpx.AsyncClient(base_url=daemon.base_url, timeout=30) as client:
            reference = Target("reference", client, workspace)
            ours = Target("acp-state", api.client, workspace)
            await asyncio.gather(scenario(reference), scenario(ours))

    dump_path = Path(os.environ.get("ACP_DIFF_DUMP") or tmp_path / "exchanges.json")
    judge(rules, reference, ours, dump_path)


def judge(rules: list, reference: Target, ours: Target, dump_path: Path) -> None:
    """Write every exchange to `dump_path`, compare the two sides step by step and fail
    listing every difference `rules` (docs/compatibility.md) do not allow."""
    dump(dump_path, reference, ours)
    assert [e.key for e in reference.exchanges] == [e.key for e in ours.exchanges]

    diffs = [d for ref, our in zip(reference.exchanges, ours.exchanges) for d in compare(ref, our)]
    left = undocumented(diffs, rules)
    unused = [f"{r.route} | {r.what} | {r.kind}" for r in rules if not r.used]
    if unused:
        print("compat rules that matched nothing in this run:\n  " + "\n  ".join(unused))
    if left:
        lines = report(left)
        pytest.fail(
            f"{sum(not line.startswith('-- ') for line in lines)} undocumented difference(s) from the reference (qwen serve 0.24.4); "
            f"document deliberate ones in docs/compatibility.md. Every exchange: {dump_path}\n"
            + "\n".join(lines),
            pytrace=False,
        )


# -- the restore scenario: a persisted session outlives a restart and is loaded ---------------

RESTORE_WORDS = {"reference": "PELICAN", "acp-state": "HERON"}  # one scripted LLM serves both sides


def fact_of(t: Target) -> str:
    return f"remember the code word {RESTORE_WORDS[t.name]}"


def question_of(t: Target) -> str:
    return f"what was the code word? (asked of {t.name} after the restore)"


def turn_ended(body: dict[str, Any]) -> bool:
    return body.get("state") == "completed"


async def restore_scenario(t: Target, restart: Callable[[], Awaitable[None]]) -> None:
    """Both sides: a session told a fact, a restart, the persisted session's views, its load,
    and a prompt after the load. Step names say the session's state."""
    ws = t.workspace
    wid = workspace_id(ws)
    prompt, load = "POST /session/:id/prompt", "POST /session/:id/load"
    created = await t.call("new", "POST /session", "POST", "/session", {"cwd": ws}, timeout=CREATE_TIMEOUT_S)
    sid = (created.body or {}).get("sessionId", "no-session") if created.is_json else "no-session"
    s = f"/session/{sid}"

    told = await t.call("idle, fresh", prompt, "POST", f"{s}/prompt", text_prompt(fact_of(t)))
    told_pid = (told.body or {}).get("promptId", "no-prompt") if told.is_json else "no-prompt"
    await t.wait_get("told a fact", "(wait) GET /session/:id/turns/:promptId", f"{s}/turns/{told_pid}", turn_ended)
    await t.wait_status("told a fact", sid, idle)
    # A second session, brought back after the restart by POST /session/:id/resume.
    other = await t.call("new", "POST /session", "POST", "/session", {"cwd": ws, "sessionScope": "thread"},
                         timeout=CREATE_TIMEOUT_S)
    o = f"/session/{(other.body or {}).get('sessionId', 'no-session') if other.is_json else 'no-session'}"
    hello = await t.call("idle, fresh", prompt, "POST", f"{o}/prompt", text_prompt(f"hello from {t.name}"))
    hello_pid = (hello.body or {}).get("promptId", "no-prompt") if hello.is_json else "no-prompt"
    await t.wait_get("told a fact", "(wait) GET /session/:id/turns/:promptId", f"{o}/turns/{hello_pid}", turn_ended)

    await restart()


    # Persisted, not live: listed, and 404 wherever a live session is needed (no auto-restore).
    views = (
        ("GET /workspace/:id/sessions", f"/workspace/{wid}/sessions"),
        ("GET /workspaces/:workspace/sessions/live-state", f"/workspaces/{wid}/sessions/live-state"),
        ("GET /session/:id/status", f"{s}/status"),
        ("GET /session/:id/turns/current", f"{s}/turns/current"),
    )
    for route, url in views:
        await t.call("persisted", route, "GET", url)
    await t.headers_of_stream("persisted", "GET /session/:id/events", f"{s}/events")
    await t.call("persisted", prompt, "POST", f"{s}/prompt", text_prompt("hello persisted"))
    await t.call("persisted, after a refused prompt", "GET /session/:id/status", "GET", f"{s}/status")

    # The load resumes it (ACP session/load under the same id), then it is live again.
    await t.call("persisted", load, "POST", f"{s}/load", {}, timeout=CREATE_TIMEOUT_S)
    # The second session is resumed (POST /session/:id/resume: no replay).
    await t.call("persisted", "GET /session/:id/context", "GET", f"{o}/context")
    await t.call("persisted", "POST /session/:id/resume", "POST", f"{o}/resume", {}, timeout=CREATE_TIMEOUT_S)
    await t.call("restored", "GET /session/:id/status", "GET", f"{o}/status")
    await t.call("restored", "GET /session/:id/context", "GET", f"{o}/context")
    for route, url in views:
        await t.call("restored", route, "GET", url)
    await t.call("restored, the turn before the restart", "GET /session/:id/turns/:promptId", "GET",
                 f"{s}/turns/{told_pid}")
    await t.headers_of_stream("restored", "GET /session/:id/events", f"{s}/events")

    asked = await t.call("restored", prompt, "POST", f"{s}/prompt", text_prompt(question_of(t)))
    pid = (asked.body or {}).get("promptId", "no-prompt") if asked.is_json else "no-prompt"
    await t.wait_get("restored, asked", "(wait) GET /session/:id/turns/:promptId", f"{s}/turns/{pid}", turn_ended)
    await t.call("restored, turn ended", "GET /session/:id/turns/:promptId", "GET", f"{s}/turns/{pid}")
    await t.call("restored, turn ended", "GET /session/:id/status", "GET", f"{s}/status")


def replay_time(entry: dict[str, Any]) -> int | None:
    """A replayed entry's time (epoch ms) where the reference's Web Shell looks for it (its
    `serverTimestamp` reader, web-shell/assets/index-*.js): the entry's, its `_meta`'s, its
    data's or its update's `_meta.serverTimestamp`, then a `timestamp` of the update's
    `_meta`, the update, the data's `_meta` or the data (a number or an ISO string)."""
    data = entry.get("data") if isinstance(entry.get("data"), dict) else {}
    update = data.get("update") if isinstance(data.get("update"), dict) else {}
    metas = [m if isinstance(m, dict) else {} for m in (entry.get("_meta"), data.get("_meta"), update.get("_meta"))]
    for found in (entry.get("serverTimestamp"), *(m.get("serverTimestamp") for m in metas)):
        if isinstance(found, (int, float)):
            return int(found)
    for found in (metas[2].get("timestamp"), update.get("timestamp"), metas[1].get("timestamp"), data.get("timestamp")):
        if isinstance(found, (int, float)):
            return int(found)
        if isinstance(found, str) and found:
            return 0  # an ISO time: there
    return None


def steps_of(t: Target) -> list[str]:
    """What each step answered (status, or why it could not run, and the start of its body):
    the trace a failure prints."""
    return [
        f"  {e.step} | {e.method} {e.url} -> {e.status if e.status is not None else e.note} {str(e.body)[:300]}"
        for e in t.exchanges
    ]


def reference_log_tail(tmp_path: Path, lines: int = 40) -> str:
    log = tmp_path / "reference" / "serve.log"
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.exists() else "(no log)"


def model_history_of(fake: ModelEndpoint, t: Target) -> list[str] | None:
    """The texts of the messages the scripted LLM was sent before `t`'s question after the
    restore (None: it was never asked)."""
    for request in fake.chat_requests:
        texts = [message_text(m) for m in request.get("messages") or []]
        asked = [n for n, text in enumerate(texts) if question_of(t) in text]
        if asked:
            return texts[: asked[-1]]
    return None


async def test_a_restored_session_answers_like_the_reference(
    qwen: str, fake_llm: ModelEndpoint, harness: Harness, workspace: str, tmp_path: Path
) -> None:
    rules = load_allowed(COMPATIBILITY)
    reference = Target("reference", None, workspace)  # type: ignore[arg-type]  # set by start()
    ours_worker = await start_acp_worker(harness, qwen, fake_llm, tmp_path)
    api = await harness.api()
    ours = Target("acp-state", api.client, workspace)

    async with contextlib.AsyncExitStack() as lives:
        async def start_reference() -> None:
            # The same scratch (HOME, TMPDIR, log) every time: the restart keeps qwen's chats.
            life = contextlib.AsyncExitStack()
            daemon = await life.enter_async_context(
                reference_daemon(qwen, workspace, fake_llm.openai_url, tmp_path / "reference"))
            reference.client = await life.enter_async_context(
                httpx.AsyncClient(base_url=daemon.base_url, timeout=30))
            lives.push_async_callback(life.aclose)

        async def restart_reference() -> None:
            await lives.aclose()  # SIGTERM to the daemon's group, as a stop does
            await start_reference()

        async def restart_ours() -> None:
            nonlocal ours_worker
            # SIGTERM with --drain-grace-s 0 (the harness's default): its sessions close, as
            # the reference's do when it stops; a worker on the same agent state comes up.
            assert await ours_worker.terminate() == 0
            ours_worker = await start_acp_worker(harness, qwen, fake_llm, tmp_path)

        await start_reference()
        await asyncio.gather(restore_scenario(reference, restart_reference), restore_scenario(ours, restart_ours))

    # Both agents were sent the conversation from before the restart with the question after it.
    for target in (reference, ours):
        history = model_history_of(fake_llm, target)
        assert history is not None, (
            f"{target.name}: the question after the restore never reached the model; its steps:\n"
            + "\n".join(steps_of(target)) + f"\nthe reference's log ends:\n{reference_log_tail(tmp_path)}")
        assert any(fact_of(target) in text for text in history), (
            f"{target.name}: the model was not sent the fact told before the restart: {history}")

    # Every entry the load replays carries its time, where the reference's Web Shell reads one
    # (a reloaded transcript keeps its times; issue 39). The entries' shapes differ otherwise
    # (docs/compatibility.md).
    for target in (reference, ours):
        loads = [e for e in target.exchanges if e.route == "POST /session/:id/load" and e.status == 200]
        replay = loads[0].body["compactedReplay"] if loads else []
        assert replay and all(replay_time(entry) is not None for entry in replay), (target.name, replay)

    asked = os.environ.get("ACP_DIFF_DUMP")
    dump_path = Path(asked).with_suffix(".restore.json") if asked else tmp_path / "restore-exchanges.json"
    judge(rules, reference, ours, dump_path)
