"""A rolling deploy under real Qwen Code: bench/rolling_deploy.py at a test's size.

3 workers running `qwen --acp` (one HOME, so one agent-state store), 2 API processes and
the scripted model endpoint (testbed/model_endpoint.py, which records what qwen sends). Each
session is told a fact in a first turn; then the 3 workers are restarted one after another
(SIGTERM, a new worker started, until it is ready and the old one has exited) while a
client keeps a prompt going on every session (the next one sent when its terminal
arrives). Every request and SSE frame is recorded in the chaos run's history format and
checked by bench/chaos/checker.py. The workers hand over eagerly (their default): a target
takes a session over first and its agent resumes the session after; each restart also
sends a burst of prompts to some of the restarted worker's sessions, whose turns must run in
the order they were acknowledged (carried, then parked, then new).

Opt-in by installation, as tests/test_qwen_agent.py: skipped when no `qwen` is found.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterator

import pytest

from testbed.model_endpoint import ModelEndpoint
from testbed.redis_server import RedisServer
from bench.rolling_deploy import Plan, deploy

pytestmark = pytest.mark.qwen

SESSIONS = 4  # more sessions than the 3 workers
# Prompts kept going at once, each sent to the next idle session as the last one ends: half
# the sessions busy at any time, so a restart finds some mid-turn and some idle (the bench
# keeps one going on every session; here the qwen turns would take all the CPU they get).
IN_FLIGHT = 2
GRACE_S = 20.0  # qwen's turns here take well under a second: none runs out of it
EVENT_TIMEOUT_S = 90.0  # a prompt may wait for a move, whose target may be starting qwen


@pytest.fixture
def fake_llm() -> Iterator[ModelEndpoint]:
    with ModelEndpoint() as fake:  # before the harness: it outlives the workers and their qwen
        yield fake


def explain(run: dict[str, Any]) -> str:
    """What a failure message shows: the figures, the checker's findings, where the logs are."""
    shown = {k: run[k] for k in ("restarts", "faults", "prompts", "sessions", "events", "check", "times")}
    return json.dumps(shown, indent=1, default=str)[:6000] + f"\nhistory: {run['history']}\nlogs: {run['logs']}"


def assert_checked(run: dict[str, Any]) -> None:
    check = run["check"]
    assert check["violations_total"] == 0, explain(run)
    assert check["checks"]["b"] > 0 and check["checks"]["d"] > 0 and check["checks"]["i"] > 0, explain(run)


def assert_every_conversation_went_on(run: dict[str, Any]) -> None:
    """Every session is live after the deploy under its id, and its recall reached a model
    that was sent its fact (the request's history holds the first turn)."""
    assert run["sessions"]["live_after"] == SESSIONS, explain(run)
    for sid, after in run["after"].items():
        assert after["live"], (sid, after)
        assert after["recall"] == "turn_complete", (sid, after)
        assert after["model_requests"] >= 1 and after["fact_in_history"], (sid, after)


def handoff_order(logs: str) -> list[bool]:
    """Per session a worker took over (its log says so): whether it said the agent's session
    was up only after that (the eager hand-off's order; the paced one's is the reverse)."""
    kept = []
    for path in Path(logs).glob("worker-*.log"):
        lines: dict[str, list[str]] = defaultdict(list)
        for line in path.read_text().splitlines():
            if line.startswith("{"):
                record = json.loads(line)
                if record.get("sessionId") and record.get("msg", "").startswith(("took the session over", "the agent's session is up")):
                    lines[record["sessionId"]].append("over" if record["msg"].startswith("took") else "up")
        kept += [said.index("over") < said.index("up") for said in lines.values() if "over" in said and "up" in said]
    return kept


def assert_handed_over_in_order(run: dict[str, Any], moves_seen: bool = True) -> None:
    """The takeover before the agent's load (each target's own log, in its order), and each
    burst's turns in the order its prompts were acknowledged. `moves_seen`: some target
    lived to resume a session it took over (a kill -9 may take every one of them)."""
    order = handoff_order(run["logs"])
    assert all(order) and (order or not moves_seen), (order, explain(run))
    prompts = run["prompts"]
    assert (prompts["bursts"] >= 1 or not moves_seen) and prompts["bursts_in_order"] == prompts["bursts"], explain(run)


async def test_a_rolling_deploy_moves_every_session_and_loses_no_prompt(
    qwen: str, fake_llm: ModelEndpoint, own_redis: RedisServer, workspace: str, tmp_path: Path
) -> None:
    plan = Plan(SESSIONS, GRACE_S, in_flight=IN_FLIGHT, event_timeout_s=EVENT_TIMEOUT_S, stop_timeout_s=90)
    run = await deploy(plan, own_redis.url, workspace, fake_llm, tmp_path / "home", tmp_path)
    (tmp_path / "run.json").write_text(json.dumps(run, indent=1, default=str))

    assert len(run["restarts"]) == 3, explain(run)
    for restart in run["restarts"]:
        # Every session of the restarted worker moved (its stream said so), and it exited 0.
        assert restart["moved"] == restart["sessions"], explain(run)
        assert restart["old_exit_code"] == 0, explain(run)
    assert run["sessions_moved"] >= SESSIONS and run["events"]["session_moved"] >= SESSIONS, explain(run)
    assert run["events"]["session_died"] == 0 and run["events"]["session_closed"] == 0, explain(run)
    assert_every_conversation_went_on(run)
    prompts = run["prompts"]
    assert prompts["acknowledged"] >= SESSIONS, explain(run)
    # Every acknowledged prompt completed, once; none was refused, none ended in an error.
    assert prompts["lost"] == 0 and prompts["refused"] == 0 and prompts["no_terminal"] == 0, explain(run)
    # Some were sent while their session was on its way (held, then carried or parked).
    assert prompts["during_a_move"] >= 1 and prompts["during_a_move_completed"] == prompts["during_a_move"], explain(run)
    assert run["sessions"]["conversations_lost"] == 0, explain(run)
    assert_handed_over_in_order(run)
    assert_checked(run)


async def test_a_kill9_mid_deploy_keeps_the_chaos_invariants(
    qwen: str, fake_llm: ModelEndpoint, own_redis: RedisServer, workspace: str, tmp_path: Path
) -> None:
    """The worker that took the second drain's first session is killed -9 as soon as the
    client sees that move: its sessions die (`session_died`, swept once its lease lapsed),
    moves under way to it go elsewhere, and the client resumes each dead session with
    `POST /session/:id/load` on another worker."""
    plan = Plan(SESSIONS, GRACE_S, in_flight=IN_FLIGHT, kill9=True, event_timeout_s=EVENT_TIMEOUT_S, stop_timeout_s=90)
    run = await deploy(plan, own_redis.url, workspace, fake_llm, tmp_path / "home", tmp_path)
    (tmp_path / "run.json").write_text(json.dumps(run, indent=1, default=str))

    # The checker's invariants first: the deaths were the killed worker's (f), every
    # acknowledged prompt has exactly one terminal (d), nothing answered live after its death
    # (c), a drained worker closed nothing another worker could take (i), ...
    assert_checked(run)
    [fault] = run["faults"]
    assert fault["sessions"], explain(run)  # it held at least the session it had just taken
    died = run["events"]["session_died"]
    assert died >= 1, explain(run)
    # Each death was resumed by a load (a new life of the session: a new epoch, same id).
    assert run["sessions"]["resumed_by_load"] == died, explain(run)
    assert all(r["status"] == 200 for r in run["sessions"]["resumes"]), explain(run)
    # The drained workers still exited 0 (the one whose target died found another).
    assert all(r["old_exit_code"] == 0 for r in run["restarts"]), explain(run)
    assert run["check"]["checks"]["f"] >= died, explain(run)
    assert_every_conversation_went_on(run)
    assert_handed_over_in_order(run, moves_seen=False)
