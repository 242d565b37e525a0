"""deploy/grafana/acp-state.json: every series a panel queries exists, with the labels the
query groups and filters by, in the real `/metrics` of a running API and of running workers
that did what the panels show (a session, turns, a failed turn, a vote wait, a 404, a drain
that moved a session to the other worker).

Grafana itself is not run here: the panels' PromQL is checked for the names and labels it
reads, not evaluated."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from testbed.redis_server import free_port
from tests import helpers
from tests.harness import Harness, SseClient
from tests.helpers import create, prompt

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "acp-state.json"
# Labels Prometheus adds when it scrapes (not in a process's /metrics).
TARGET_LABELS = {"job", "instance", "namespace", "pod", "service", "endpoint", "le"}
# Families that have no sample until something fails: declared, with no series yet.
ONLY_ON_FAILURE = {"acp_state_background_errors"}
SUFFIXES = ("_bucket", "_count", "_sum", "_total")


def queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    found = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    found += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    return found


def series_read(expr: str) -> list[tuple[str, dict[str, str], set[str]]]:
    """(metric name, label matchers, labels grouped by) of each acp-state series in `expr`."""
    grouped = {label.strip() for group in re.findall(r"\bby \(([^)]*)\)", expr) for label in group.split(",")}
    grouped |= set(re.findall(r"label_values\([^,]+, *(\w+)\)", expr))
    read = []
    for name, selector in re.findall(r"\b(acp_state_[a-z_]+)(\{[^}]*\})?", expr):
        matchers = dict(re.findall(r'(\w+)=~?"([^"]*)"', selector))
        read.append((name, matchers, grouped))
    return read


def test_the_dashboard_is_well_formed() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    for panel in dashboard["panels"]:
        assert 0 <= panel["gridPos"]["x"] and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        for target in panel.get("targets", []):
            assert set(re.findall(r"\$(\w+)", target["expr"])) - {"__rate_interval"} <= variables
            assert series_read(target["expr"]), target["expr"]
    assert len(queries()) >= 20


async def test_every_series_the_dashboard_queries_is_in_the_metrics(harness: Harness, workspace: str) -> None:
    events = await harness.events()
    ports = [free_port(), free_port()]
    await harness.worker("--metrics-port", str(ports[0]), "--drain-grace-s", "5", "--lease-ms", "1500")
    api = await harness.api()
    sids = [(await create(api, workspace))["sessionId"] for _ in range(3)]
    stream = await SseClient(api, sids[0]).start()  # its events reach the API's fan-out
    for sid, text, event in zip(sids, ("hello", "#fail", "#permission"), ("turn_complete", "turn_error", "permission_request")):
        accepted = await prompt(api, sid, text)
        await events.wait_type(sid, event, promptId=accepted["promptId"])
    await stream.wait_for(lambda f: f["event"] == "turn_complete")
    await stream.close()
    assert (await api.client.get("/session/no-such-session/status")).status_code == 404
    texts = [await scrape(ports[0])]  # the first worker as it hosts them (a vote waits)
    await harness.worker("--metrics-port", str(ports[1]), "--lease-ms", "1500")
    drained = harness.processes[0]
    assert drained.proc is not None
    drained.proc.send_signal(15)  # a drain: the sessions move to the second worker
    for sid in (sids[0], sids[2]):  # (the scripted agent keeps no history of a session whose only turn failed)
        await events.wait_type(sid, "session_moved")
    assert await asyncio.wait_for(drained.proc.wait(), 60) == 0
    texts.append(await scrape(ports[1]))
    texts.append((await api.client.get("/metrics")).text)

    samples: dict[str, list[dict[str, str]]] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            samples.setdefault(family.name, [])
            for sample in family.samples:
                samples.setdefault(sample.name, []).append(sample.labels)
    missing = []
    for expr in queries():
        for name, matchers, grouped in series_read(expr):
            family = next((name.removesuffix(s) for s in SUFFIXES if name.endswith(s) and name.removesuffix(s) in samples), name)
            if family in ONLY_ON_FAILURE and family in samples and name not in samples:
                continue  # declared, no failure yet
            wanted = {k: v for k, v in matchers.items() if k not in TARGET_LABELS}
            labels = (grouped - TARGET_LABELS) | set(wanted)
            found = [s for s in samples.get(name, [])
                     if labels <= set(s) and all(re.fullmatch(v, s[k]) for k, v in wanted.items())]
            if not found:
                missing.append((name, wanted, sorted(labels), expr))
    assert not missing, "\n".join(map(str, missing))
    # The fan-out lag is observed where events arrive: the API that streamed the first turn.
    api_text = texts[-1]
    assert helpers.samples(api_text, "acp_state_fanout_lag_seconds_count")[()] >= 1


async def scrape(port: int) -> str:
    async with httpx.AsyncClient(timeout=10) as client:
        return (await client.get(f"http://127.0.0.1:{port}/metrics")).text
