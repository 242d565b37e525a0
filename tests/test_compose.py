"""docker-compose.yml and the Dockerfile, read as a user's `docker compose up` reads them: what
scripts/compose-smoke runs for real (minutes, not in the suite) rests on these holding.

The smoke itself (podman-compose, a drain between the two workers): docs/deploy.md."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from starlette.routing import Route

from acp_state.api.app import ROUTES
from acp_state.worker import health

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
WORKERS = [name for name, service in SERVICES.items() if service.get("command", [""])[0] == "worker"]
DRAIN_GRACE_MARGIN_S = 10


def api_paths() -> set[str]:
    return {route.path for route in ROUTES if isinstance(route, Route)}


def option(command: list[str], name: str) -> str:
    return next(a.split("=", 1)[1] for a in command if a.startswith(f"{name}="))


def test_every_service_is_health_checked_on_a_route_it_serves() -> None:
    assert WORKERS == ["worker-a", "worker-b"]
    for name, service in SERVICES.items():
        test = " ".join(service["healthcheck"]["test"])
        if name == "redis":
            assert "redis-cli ping" in test
            continue
        port, path = re.search(r"http://127\.0\.0\.1:(\d+)(/[\w/]+)", test).groups()
        if name == "api":
            assert path in api_paths() and port == option(service["command"], "--port")
        else:
            assert path == health.READY_PATH and port == option(service["command"], "--metrics-port")
            assert option(service["command"], "--metrics-host") == "0.0.0.0"


def test_the_api_binds_off_loopback_with_its_token_from_the_env_file() -> None:
    api = SERVICES["api"]
    assert option(api["command"], "--host") == "0.0.0.0"
    assert not any(a.startswith(("--token", "--channel-token")) for a in api["command"]), "no token in `ps`"
    assert api["env_file"] == "${ACP_STATE_ENV_FILE:-acp-state.env}"
    example = (ROOT / "deploy" / "compose.env.example").read_text()
    assert re.search(r"^ACP_STATE_TOKENS=\S+,role=admin$", example, re.MULTILINE)


def test_images_come_from_variables() -> None:
    assert SERVICES["redis"]["image"].startswith("${ACP_STATE_REDIS_IMAGE:-")
    for name in ("api", *WORKERS):
        assert SERVICES[name]["build"]["args"]["BASE_IMAGE"].startswith("${ACP_STATE_BASE_IMAGE:-")
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "ARG BASE_IMAGE=python:3.11-slim" in dockerfile
    assert re.search(r"^FROM \$\{BASE_IMAGE\} AS base$", dockerfile, re.MULTILINE)
    assert re.search(r"^FROM base AS qwen$", dockerfile, re.MULTILINE)


def test_the_workers_stop_grace_covers_their_drain_grace() -> None:
    for name in WORKERS:
        worker = SERVICES[name]
        grace = float(re.fullmatch(r"(\d+)s", worker["stop_grace_period"]).group(1))
        drain = float(re.search(r":-(\d+)\}", option(worker["command"], "--drain-grace-s")).group(1))
        assert grace >= drain + DRAIN_GRACE_MARGIN_S, name
        assert {"workspaces:/workspaces", "agent-state:/agent-state"} <= set(worker["volumes"])
        assert option(worker["command"], "--state-store") == "agent-state"  # both read one store


def test_the_image_pins_the_qwen_code_the_suite_tests() -> None:
    image = json.loads((ROOT / "deploy" / "container" / "qwen" / "package-lock.json").read_text())
    suite = json.loads((ROOT / "tests" / "node" / "package-lock.json").read_text())
    key = "node_modules/@qwen-code/qwen-code"
    assert image["packages"][key]["version"] == suite["packages"][key]["version"]
    assert image["packages"][key]["integrity"] == suite["packages"][key]["integrity"]
