"""Named agents: a worker offers agents by name, `/capabilities` lists them, and a create
that names one is placed on a live worker offering it (the built-in scripted agent under
several names, so this always runs and is fast)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from acp_state.agents import DEFAULT_AGENT, PRESETS, offered_agents, parse_agent_option, session_modes, with_presets
from acp_state.ids import workspace_id
from acp_state.placement import accepts, child_key, ranked, runs_child
from acp_state.store import WorkerReport, keys
from tests.harness import Harness

SCRIPTED = f"{sys.executable} -m acp_state.testing.scripted_agent"


def test_agent_options_name_agents_and_a_bare_command_is_the_default() -> None:
    assert parse_agent_option("codex=codex-acp -c x=1").name == "codex"
    assert parse_agent_option("codex=codex-acp -c x=1").command == "codex-acp -c x=1"
    assert parse_agent_option("qwen --acp").name == DEFAULT_AGENT
    assert offered_agents([], "fallback") == {DEFAULT_AGENT: "fallback"}
    assert list(offered_agents(["a=x", "y", "b=z"], "f")) == ["a", DEFAULT_AGENT, "b"]
    with pytest.raises(ValueError):
        offered_agents(["a=x", "a=y"], "f")
    with pytest.raises(ValueError):
        parse_agent_option("a=")


def test_placement_takes_fitting_workers_least_loaded_first_counting_what_was_sent() -> None:
    """One rule for a create, a load and a drain's move: a worker that drains, lacks the
    agent or reads another agent-state store is never asked; the others least loaded first
    (sessions sent since a report count); a report stored by a worker older than agent
    names or capacities reads as offering the default agent, with a capacity of 1."""
    old = WorkerReport.unpack("w-old", b'{"incarnation": "w-old", "sessions": 0}')
    assert (old.agent_names, old.max_sessions, old.draining) == ([], 0, False)
    assert accepts(old, DEFAULT_AGENT) and not accepts(old, "qwen")
    busy = WorkerReport("w-busy", sessions=3, max_sessions=4, agent_names=["default", "qwen"], state_store="s1")
    idle = WorkerReport("w-idle", sessions=1, max_sessions=4, agent_names=["default", "qwen"], state_store="s1")
    draining = WorkerReport("w-draining", max_sessions=4, agent_names=["qwen"], state_store="s1", draining=True)
    elsewhere = WorkerReport("w-elsewhere", max_sessions=4, agent_names=["qwen"], state_store="s2")
    fitting = [r for r in (busy, idle, draining, elsewhere, old) if accepts(r, "qwen", "s1")]
    assert [r.incarnation for r in ranked(fitting)] == ["w-idle", "w-busy"]
    assert [r.incarnation for r in ranked(fitting, {"w-idle": 3})] == ["w-busy", "w-idle"]
    with pytest.raises(ValueError):
        WorkerReport.unpack("w-bad", b'{"sessions": "many"}')


def test_placement_prefers_a_worker_running_the_sessions_agent_child_while_it_is_not_much_fuller() -> None:
    """A worker whose child for the session's agent and workspace runs (its report's
    `children`, which round-trips through the stored JSON) is asked before one that would
    start it cold, while its load is within a few sessions per thousand of the other's; a
    much fuller one, or a full one, is not."""
    warm = WorkerReport("w-warm", sessions=10, max_sessions=1000, children=[child_key("qwen", "/ws/a")])
    assert WorkerReport.unpack("w-warm", warm.pack()).children == warm.children
    cold = WorkerReport("w-cold", sessions=0, max_sessions=1000)
    assert runs_child(warm, "qwen", "/ws/a") and not runs_child(warm, "qwen", "/ws/b")
    assert not runs_child(warm, "gemini", "/ws/a") and not runs_child(cold, "qwen", "/ws/a")

    def order(reports: list[WorkerReport], cwd: str, sent: dict[str, int] | None = None) -> list[str]:
        return [r.incarnation for r in ranked(reports, sent, lambda r: runs_child(r, "qwen", cwd))]

    assert order([cold, warm], "/ws/a") == ["w-warm", "w-cold"]
    assert order([cold, warm], "/ws/b") == ["w-cold", "w-warm"]  # (its child runs for another workspace)
    assert order([cold, warm], "/ws/a", {"w-warm": 30}) == ["w-cold", "w-warm"]  # 40 more of 1,000: too full
    full = WorkerReport("w-full", sessions=4, max_sessions=4, children=[child_key("qwen", "/ws/a")])
    assert order([full, WorkerReport("w-some", sessions=3, max_sessions=4)], "/ws/a") == ["w-some", "w-full"]


def test_session_modes_name_an_agent_or_apply_to_every_other() -> None:
    agents = {"qwen": "q", "codex": "c", "default": "d"}
    assert session_modes([], agents) == {}
    assert session_modes(["default"], agents) == {"qwen": "default", "codex": "default", "default": "default"}
    assert session_modes(["codex=read-only", "default"], agents) == {"qwen": "default", "codex": "read-only", "default": "default"}
    assert session_modes(["qwen=default"], agents) == {"qwen": "default"}
    url = "https://agentclientprotocol.com/protocol/session-modes#agent"  # Copilot's mode ids
    assert session_modes([url], {"copilot": "c"}) == {"copilot": url}
    with pytest.raises(ValueError):
        session_modes(["qwn=default"], agents)


def test_a_preset_stands_for_an_agent_line_and_its_session_mode() -> None:
    agents, modes = with_presets(["x=y"], ["codex", "qwen"], [])
    assert agents == ["x=y", f"codex={PRESETS['codex'].command}", f"qwen={PRESETS['qwen'].command}"]
    assert modes == ["qwen=default"]  # Qwen's own `auto` mode would approve commands unasked
    assert with_presets([], ["qwen"], ["qwen=yolo"])[1] == ["qwen=yolo"]  # a given mode wins
    with pytest.raises(ValueError):
        with_presets([], ["nobody"], [])


async def test_each_agent_gets_its_own_session_mode(own_harness: Harness, workspace: str, tmp_path: Path) -> None:
    records = {name: tmp_path / f"{name}.jsonl" for name in ("alpha", "beta")}
    args = [a for name, record in records.items()
            for a in ("--agent", f"{name}=env ACP_SCRIPTED_RECORD={record} {SCRIPTED}")]
    await own_harness.worker(*args, "--session-mode", "alpha=plan", "--session-mode", "default")
    api = await own_harness.api()
    for name in records:
        assert (await create(api, workspace, agent=name)).status_code == 200
    modes = {name: [json.loads(line)["params"]["modeId"] for line in record.read_text().splitlines()
                    if json.loads(line).get("method") == "session/set_mode"] for name, record in records.items()}
    assert modes == {"alpha": ["plan"], "beta": ["default"]}


async def create(api, workspace: str, **body: object):  # type: ignore[no-untyped-def]
    return await api.client.post("/session", json={"cwd": workspace, "sessionScope": "thread", **body})


async def test_a_create_naming_an_agent_runs_on_a_worker_offering_it(own_harness: Harness, workspace: str) -> None:
    events = await own_harness.events()
    alpha = await own_harness.worker("--name", "alpha", "--agent", f"alpha={SCRIPTED}")
    beta = await own_harness.worker("--name", "beta", "--agent", f"beta={SCRIPTED}", "--agent", SCRIPTED)
    api = await own_harness.api()

    capabilities = (await api.client.get("/capabilities")).json()
    assert "named_agents" in capabilities["features"]
    offered = {a["name"]: a for a in capabilities["agents"]}
    assert offered == {
        "alpha": {"name": "alpha", "workers": 1, "defaultOn": 1},  # alpha's only agent is its default
        "beta": {"name": "beta", "workers": 1, "defaultOn": 0},
        DEFAULT_AGENT: {"name": DEFAULT_AGENT, "workers": 1, "defaultOn": 1},
    }

    for name, worker in (("alpha", alpha), ("beta", beta), (DEFAULT_AGENT, beta)):
        for _ in range(3):  # placement is shuffled: each time, only the offering worker may get it
            made = await create(api, workspace, agent=name)
            assert made.status_code == 200, made.text
            sid = made.json()["sessionId"]
            status = (await api.client.get(f"/session/{sid}/status")).json()
            assert status["sessionId"] == sid
            owner = await own_harness.watcher.redis.hget(keys.session(workspace_id(workspace), sid), keys.F.OWNER)
            assert owner == worker.incarnation
    # The agent runs: a prompt is echoed by the scripted agent behind that name.
    sid = (await create(api, workspace, agent="alpha")).json()["sessionId"]
    ran = (await api.client.post(f"/session/{sid}/prompt", json={"prompt": [{"type": "text", "text": "hi alpha"}]})).json()
    await events.wait_type(sid, "turn_complete", promptId=ran["promptId"])


async def test_an_unknown_agent_is_400_and_a_known_one_with_no_live_worker_is_503(
    own_harness: Harness, workspace: str
) -> None:
    await own_harness.worker("--agent", SCRIPTED)
    gone = await own_harness.worker("--name", "gone", "--agent", f"gone={SCRIPTED}")
    api = await own_harness.api()

    for bad in ("nobody", "bad name", 7, ""):
        refused = await create(api, workspace, agent=bad)
        assert refused.status_code == 400, refused.text
        assert refused.json()["code"] == "unknown_agent"

    assert (await create(api, workspace, agent="gone")).status_code == 200
    assert await gone.terminate() == 0  # it leaves; its agent's name stays known
    refused = await create(api, workspace, agent="gone")
    assert refused.status_code == 503, refused.text
    assert refused.json()["code"] == "no_worker_for_agent"
    assert refused.headers["retry-after"] == "2"
    listed = {a["name"]: a["workers"] for a in (await api.client.get("/capabilities")).json()["agents"]}
    assert listed == {DEFAULT_AGENT: 1, "gone": 0}
    # A create that names no agent still gets the default of a live worker.
    assert (await create(api, workspace)).status_code == 200


async def test_creates_that_arrive_while_the_child_starts_wait_for_that_child(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first creates of a workspace arrive while its agent child starts (spawning,
    then `initialize`): each must get that one child, once it is initialized. Seen in the
    scale run: every create that came during the spawn started a child of its own."""
    from acp_state.store import RedisStore
    from acp_state.store.connection import connect
    from acp_state.worker import worker as worker_module

    class SlowChild:
        made: list[SlowChild] = []

        def __init__(self, *args: object, **kwargs: object) -> None:
            self.process: object | None = None
            self.initialized = False
            SlowChild.made.append(self)

        @property
        def alive(self) -> bool:
            return self.process is not None

        async def start(self) -> None:
            await asyncio.sleep(0.02)  # the spawn
            self.process = object()
            await asyncio.sleep(0.03)  # initialize
            self.initialized = True

        async def stop(self) -> None:
            pass

    monkeypatch.setattr(worker_module, "AgentProcess", SlowChild)
    bridge = worker_module.Worker(RedisStore(connect("memory://")), worker_module.WorkerConfig(agents={DEFAULT_AGENT: "x"}))
    first = await asyncio.gather(*(bridge.agent_for(DEFAULT_AGENT, "/w", f"s{n}") for n in range(10)))
    later = await bridge.agent_for(DEFAULT_AGENT, "/w", "s10")
    assert len(SlowChild.made) == 1
    assert all(agent is later and agent.initialized for agent in first)
