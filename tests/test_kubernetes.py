"""deploy/kubernetes: every core manifest valid against a current Kubernetes API schema
(strict: an unknown or misspelt field fails), the CRDs (KEDA's ScaledObject, the Prometheus
Operator's ServiceMonitor) checked for what their controllers read, the pieces naming each
other consistently, and the promises the manifests make checked against running processes:
the probe paths answer as the probes expect, a draining worker turns not ready and stays
live, and the termination grace covers a measured drain.

No cluster runs here: what a cluster would add (scheduling, the probes' timing, KEDA and
Prometheus themselves) is not run; docs/deploy.md says so.
"""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path
from typing import Any

import httpx
import kubernetes_validate
import pytest
import yaml

from testbed.processes import WorkerProcess
from testbed.redis_server import RedisServer, free_port
from tests.harness import Harness
from tests.helpers import create, eventually, prompt, samples

ROOT = Path(__file__).resolve().parent.parent
BASE = ROOT / "deploy" / "kubernetes"
OVERLAY = BASE / "example-overlay"
CRD_GROUPS = ("keda.sh/", "monitoring.coreos.com/")
# What the grace must leave over a measured drain: the kubelet's own steps, a slower node,
# more sessions than the measurement moved.
GRACE_MARGIN_S = 10.0


def manifests() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    docs = []
    for name in kustomization["resources"]:
        docs += [doc for doc in yaml.safe_load_all((BASE / name).read_text()) if doc]
    return docs


def one(kind: str, name: str) -> dict[str, Any]:
    found = [d for d in manifests() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"one {kind} {name}"
    return found[0]


def container(deployment: str) -> dict[str, Any]:
    return one("Deployment", deployment)["spec"]["template"]["spec"]["containers"][0]


def option(args: list[str], name: str) -> str:
    values = [a.split("=", 1)[1] for a in args if a.startswith(f"{name}=")]
    assert len(values) == 1, f"{name} once in {args}"
    return values[0]


def test_the_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    on_disk = {p.name for p in BASE.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == on_disk


@pytest.mark.parametrize("doc", manifests(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_core_manifest_is_valid_against_the_kubernetes_schema(doc: dict[str, Any]) -> None:
    if doc["apiVersion"].startswith(CRD_GROUPS):
        pytest.skip("a CRD: kubernetes-validate has the core API's schemas only (see the CRD test below)")
    kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def test_the_strict_schema_refuses_a_misspelt_field() -> None:
    """The validation above can fail: a probe's field misspelt is refused."""
    doc = one("Deployment", "acp-state-worker")
    broken = yaml.safe_load(yaml.safe_dump(doc))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["periodSecond"] = 5
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, kubernetes_validate.latest_version(), strict=True)


def labels_match(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_selectors_ports_and_targets_name_what_exists() -> None:
    docs = manifests()
    pods = {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"] for d in docs if d["kind"] == "Deployment"}
    for doc in docs:
        if doc["kind"] == "Service":
            matched = [n for n, labels in pods.items() if labels_match(doc["spec"]["selector"], labels)]
            assert len(matched) == 1, doc["metadata"]["name"]
            ports = {p["name"] for p in container(matched[0])["ports"]}
            assert {p["targetPort"] for p in doc["spec"]["ports"]} <= ports
        if doc["kind"] in ("PodDisruptionBudget", "NetworkPolicy"):
            selector = doc["spec"].get("selector") or doc["spec"]["podSelector"]
            assert sum(labels_match(selector["matchLabels"], labels) for labels in pods.values()) == 1, doc
        if doc["kind"] == "HorizontalPodAutoscaler":
            assert doc["spec"]["scaleTargetRef"]["name"] in pods
    for name in pods:
        spec = container(name)
        ports = {p["name"] for p in spec["ports"]}
        for probe in ("readinessProbe", "livenessProbe"):
            assert spec[probe]["httpGet"]["port"] in ports, (name, probe)
    # Every port a container listens on is let in by its NetworkPolicy.
    for policy in (d for d in docs if d["kind"] == "NetworkPolicy"):
        name = next(n for n, labels in pods.items() if labels_match(policy["spec"]["podSelector"]["matchLabels"], labels))
        allowed = {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}
        assert {p["containerPort"] for p in container(name)["ports"]} <= allowed, name
        egress = {p["port"] for rule in policy["spec"]["egress"] for p in rule["ports"]}
        assert {6379, 53} <= egress, name  # Redis, DNS
    assert 443 in {p["port"] for r in one("NetworkPolicy", "acp-state-worker")["spec"]["egress"] for p in r["ports"]}


def test_the_secrets_the_manifests_read_are_the_ones_the_overlay_makes() -> None:
    overlay = yaml.safe_load((OVERLAY / "kustomization.yaml").read_text())
    made: dict[str, set[str]] = {}
    for generator in overlay["secretGenerator"]:
        made[generator["name"]] = {entry.split("=", 1)[0] for entry in generator.get("files", [])}
        if generator.get("envs"):
            made[generator["name"]].add("*")
    read: set[tuple[str, str]] = set()
    for name in ("acp-state-api", "acp-state-worker"):
        spec = container(name)
        read |= {(e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"])
                 for e in spec.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})}
        read |= {(e["secretRef"]["name"], "*") for e in spec.get("envFrom", [])}
    monitor = one("ServiceMonitor", "acp-state-api")["spec"]["endpoints"][0]["authorization"]["credentials"]
    read.add((monitor["name"], monitor["key"]))
    for secret, key in read:
        assert key in made.get(secret, set()), (secret, key)


def test_the_crds_hold_what_their_controllers_read() -> None:
    """ScaledObject and ServiceMonitor, checked by hand for the fields KEDA and the
    Prometheus Operator act on (their schemas are CRDs, not in the core API's)."""
    scaled = one("ScaledObject", "acp-state-worker")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    spec = scaled["spec"]
    one("Deployment", spec["scaleTargetRef"]["name"])  # the workers (the default kind: a Deployment)
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    assert spec["minReplicaCount"] >= 2, "a drain needs another worker to move its sessions to"
    [trigger] = spec["triggers"]
    assert trigger["type"] == "prometheus"
    assert set(trigger["metadata"]) >= {"serverAddress", "query", "threshold"}
    assert float(trigger["metadata"]["threshold"]) > 0
    assert isinstance(trigger["metadata"]["threshold"], str), "KEDA's metadata values are strings"
    # The query reads the workers' sessions gauge by the label the ServiceMonitor gives their
    # Service's targets (`service`): the gauge is one the worker exports (test below).
    query = trigger["metadata"]["query"]
    assert re.fullmatch(r'sum\(acp_state_sessions\{service="acp-state-worker"\}\)', query), query
    one("Service", "acp-state-worker")

    services = {d["metadata"]["name"]: d for d in manifests() if d["kind"] == "Service"}
    for monitor in (d for d in manifests() if d["kind"] == "ServiceMonitor"):
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        matched = [s for s in services.values()
                   if labels_match(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])]
        assert len(matched) == 1, monitor["metadata"]["name"]
        names = {p["name"] for p in matched[0]["spec"]["ports"]}
        for endpoint in monitor["spec"]["endpoints"]:
            assert endpoint["port"] in names and endpoint["path"] == "/metrics"


# ---- the promises, against running processes -----------------------------------------------


def worker_args(tmp_path: Path, metrics_port: int, drain_grace_s: str | None = None) -> list[str]:
    """The worker manifest's arguments, runnable here: its own name for the pod's, a free
    loopback port for the metrics port, a temporary folder for the agent-state volume, and
    the scripted agent for Qwen (the image's agent; the probes do not depend on it)."""
    args = container("acp-state-worker")["args"][1:]
    out = []
    for arg in args:
        name = arg.split("=", 1)[0]
        if name == "--name":
            arg = "--name=k8s-worker"
        elif name == "--metrics-host":
            arg = "--metrics-host=127.0.0.1"
        elif name == "--metrics-port":
            arg = f"--metrics-port={metrics_port}"
        elif name == "--state-dir":
            arg = f"--state-dir={tmp_path}"
        elif name == "--agent-preset":
            continue
        elif name == "--drain-grace-s" and drain_grace_s is not None:
            arg = f"--drain-grace-s={drain_grace_s}"
        out += arg.split("=", 1)  # (as separate words: the harness looks for `--drain-grace-s`)
    return out


def probe_url(deployment: str, probe: str, port: int) -> str:
    return f"http://127.0.0.1:{port}{container(deployment)[probe]['httpGet']['path']}"


async def get(url: str) -> httpx.Response:
    async with httpx.AsyncClient(timeout=5) as client:
        return await client.get(url)


async def test_the_probe_paths_answer_as_the_manifests_expect(harness: Harness, workspace: str, tmp_path: Path) -> None:
    port = free_port()
    await harness.worker(*worker_args(tmp_path, port))
    api = await harness.api()
    for deployment, listener in (("acp-state-api", api.port), ("acp-state-worker", port)):
        for probe in ("readinessProbe", "livenessProbe"):
            response = await eventually(
                lambda: _ok(probe_url(deployment, probe, listener)), f"{deployment}'s {probe} answering 200")
            assert response.status_code == 200
    # The worker's /metrics on the port the ServiceMonitor scrapes has the gauge KEDA reads.
    scraped = (await get(f"http://127.0.0.1:{port}/metrics")).text
    assert samples(scraped, "acp_state_sessions")


async def _ok(url: str) -> httpx.Response | None:
    return await _status(url, 200)


async def test_a_draining_worker_is_not_ready_stays_live_and_drains_within_the_grace(
    harness: Harness, workspace: str, tmp_path: Path
) -> None:
    """A drain whose running turns outlast the drain grace: the worker turns not ready at
    once and stays live until it exits; the drain's time beyond its grace (the turns stopped,
    every session handed to the other worker, the exit) is measured, and the manifest's
    grace must cover the manifest's drain grace plus that, plus a margin."""
    manifest_grace_s = float(option(container("acp-state-worker")["args"], "--drain-grace-s"))
    termination_grace_s = one("Deployment", "acp-state-worker")["spec"]["template"]["spec"][
        "terminationGracePeriodSeconds"]
    short_grace_s = 2.0  # the drain grace of this run: its turns run past it
    port = free_port()
    draining = await harness.worker(*worker_args(tmp_path / "a", port, str(short_grace_s)))
    api = await harness.api()
    events = await harness.events()
    sids = [(await create(api, workspace))["sessionId"] for _ in range(6)]
    for sid in sids[:3]:  # turns that run through the grace, and idle sessions beside them
        accepted = await prompt(api, sid, "#slow 60")
        await events.wait_type(sid, "session_update", promptId=accepted["promptId"])
    target_port = free_port()
    await harness.worker(*worker_args(tmp_path / "b", target_port, "0"))  # (its own stop at the end: at once)
    ready_url, live_url = probe_url("acp-state-worker", "readinessProbe", port), probe_url(
        "acp-state-worker", "livenessProbe", port)
    assert (await get(ready_url)).status_code == 200

    assert isinstance(draining, WorkerProcess) and draining.proc is not None
    started = time.monotonic()
    draining.proc.send_signal(15)
    not_ready = await eventually(lambda: _status(ready_url, 503), "readiness turning false on SIGTERM")
    assert not_ready.json()["code"] == "draining"
    live_answers = []
    while draining.proc.returncode is None:  # until it exits, liveness holds
        try:
            live_answers.append((await get(live_url)).status_code)
        except httpx.TransportError:  # the listener closes in the shutdown, after the drain
            break
        await asyncio.sleep(0.2)
    code = await asyncio.wait_for(draining.proc.wait(), 120)
    drain_s = time.monotonic() - started
    assert code == 0
    assert live_answers and set(live_answers) == {200}, live_answers

    # Every session moved to the other worker.
    for sid in sids:
        await events.wait_type(sid, "session_moved")

    async def all_on_the_target() -> bool:
        target_text = (await get(f"http://127.0.0.1:{target_port}/metrics")).text
        return sum(samples(target_text, "acp_state_sessions").values()) == len(sids)

    await eventually(all_on_the_target, f"the other worker counting all {len(sids)} sessions")

    beyond_grace_s = drain_s - short_grace_s
    needed_s = manifest_grace_s + beyond_grace_s + GRACE_MARGIN_S
    print(f"drain of {len(sids)} sessions: {drain_s:.1f} s with a {short_grace_s} s drain grace "
          f"({beyond_grace_s:.1f} s beyond it); the manifest needs {needed_s:.1f} s, gives {termination_grace_s}")
    assert termination_grace_s >= needed_s


async def _status(url: str, code: int) -> httpx.Response | None:
    try:
        response = await get(url)
    except httpx.TransportError:  # not listening yet
        return None
    return response if response.status_code == code else None



async def test_a_worker_waiting_for_redis_is_live_and_not_ready(tmp_path: Path) -> None:
    """At start, before Redis answers: live (no restart loop while Redis is away), not ready;
    ready once Redis is there and the worker holds its lease."""
    import sys

    redis = RedisServer()  # its port, not listening yet
    port = free_port()
    args = worker_args(tmp_path, port, "0")
    worker = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "acp_state.cli", "worker", "--redis-url", redis.url, *args,
        stdout=asyncio.subprocess.DEVNULL, stderr=open(tmp_path / "worker.log", "wb"), cwd=str(ROOT),
    )
    try:
        live = await eventually(lambda: _status(probe_url("acp-state-worker", "livenessProbe", port), 200),
                                "liveness answering while Redis is away")
        assert live.json()["status"] == "ok"
        not_ready = await get(probe_url("acp-state-worker", "readinessProbe", port))
        assert not_ready.status_code == 503 and not_ready.json()["code"] == "not_registered"
        redis.start()
        try:
            await eventually(lambda: _status(probe_url("acp-state-worker", "readinessProbe", port), 200),
                             "readiness once Redis answers")
        finally:
            worker.send_signal(15)
            assert await asyncio.wait_for(worker.wait(), 30) == 0
            redis.stop()
    finally:
        if worker.returncode is None:
            worker.kill()
            await worker.wait()
