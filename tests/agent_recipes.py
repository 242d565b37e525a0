"""How each real ACP coding agent is installed and pointed at the scripted model endpoint
(testbed/model_endpoint.py), offline: its environment and configuration files. It is launched
by its `--agent-preset` (acp_state/agents.py), found on PATH in tests/node's `.bin`.
docs/agents.md tells the same for users.

Every recipe writes its configuration under a home of its own (HOME, XDG dirs), so an
agent reads nothing of the machine's user and leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from testbed.redis_server import free_port

NODE_BIN = Path(__file__).resolve().parent / "node" / "node_modules" / ".bin"
MODEL = "fake-model"
API_KEY = "sk-scripted"


@dataclass
class Launch:
    """The environment an agent's worker runs with (its preset's executable on PATH)."""

    env: dict[str, str]
    # What differs between workers that share this home (the resume and drain steps start
    # more): the n-th worker's additions to `env`.
    per_worker: Callable[[int], dict[str, str]] | None = None

    def worker_env(self, n: int) -> dict[str, str]:
        return {**self.env, **(self.per_worker(n) if self.per_worker else {})}


@dataclass
class Recipe:
    name: str
    package: str  # npm package@version, as pinned in tests/node/package.json
    executable: Path  # what must exist for the agent to count as installed
    prepare: Callable[[Path, str, str], Launch]  # (home, model endpoint url, workspace) -> Launch
    notes: list[str] = field(default_factory=list)

    @property
    def installed(self) -> bool:
        return os.access(self.executable, os.X_OK) or self.executable.is_file()

    @property
    def version(self) -> str:
        return self.package.rsplit("@", 1)[1]


def base_env(home: Path) -> dict[str, str]:
    """A home of its own, the pinned agents first on PATH, and every telemetry and update
    check we know of turned off (the presets set some of them too, as users get them)."""
    for sub in ("config", "cache", "data", "state", "tmp"):
        (home / sub).mkdir(parents=True, exist_ok=True)
    return {
        "PATH": f"{NODE_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / "config"),
        "XDG_CACHE_HOME": str(home / "cache"),
        "XDG_DATA_HOME": str(home / "data"),
        "XDG_STATE_HOME": str(home / "state"),
        "TMPDIR": str(home / "tmp"),
        "NO_UPDATE_NOTIFIER": "1",
        "DO_NOT_TRACK": "1",
        "DISABLE_TELEMETRY": "1",
        "OTEL_SDK_DISABLED": "true",
        "CI": "1",
    }


def _qwen(home: Path, url: str, _cwd: str) -> Launch:
    settings = {
        "security": {"auth": {"selectedType": "openai"}},
        "general": {"enableAutoUpdate": False},
        "privacy": {"usageStatisticsEnabled": False},
        "ui": {"enableFollowupSuggestions": False},
        "memory": {"enableManagedAutoMemory": False, "enableManagedAutoDream": False},
    }
    (home / ".qwen").mkdir(parents=True, exist_ok=True)
    (home / ".qwen" / "settings.json").write_text(json.dumps(settings))
    env = {**base_env(home), "OPENAI_API_KEY": API_KEY, "OPENAI_BASE_URL": f"{url}/v1", "OPENAI_MODEL": MODEL}
    return Launch(env)


def _gemini(home: Path, url: str, _cwd: str) -> Launch:
    settings = {
        # folderTrust off: the workspace counts as trusted, so "Allow for this session" works
        "security": {"auth": {"selectedType": "gemini-api-key"}, "folderTrust": {"enabled": False}},
        # sessionRetention off: its cleanup at every start deletes each session file sharing
        # an 8-character id prefix with a file that holds no conversation, which a
        # `session/load` leaves next to the session it resumes (docs/agents.md, "Resuming").
        "general": {"disableAutoUpdate": True, "disableUpdateNag": True, "sessionRetention": {"enabled": False}},
        "privacy": {"usageStatisticsEnabled": False},
        "telemetry": {"enabled": False},
        "model": {"name": "gemini-2.5-flash"},
    }
    (home / ".gemini").mkdir(parents=True, exist_ok=True)
    (home / ".gemini" / "settings.json").write_text(json.dumps(settings))
    env = {**base_env(home), "GEMINI_API_KEY": API_KEY, "GOOGLE_GEMINI_BASE_URL": url,
           "GEMINI_TELEMETRY_ENABLED": "false"}
    return Launch(env)


def _codex(home: Path, url: str, _cwd: str) -> Launch:
    codex_home = home / ".codex"
    codex_home.mkdir(parents=True, exist_ok=True)
    (codex_home / "config.toml").write_text(
        f'model = "{MODEL}"\n'
        'model_provider = "scripted"\n'
        'check_for_update_on_startup = false\n'
        '[analytics]\nenabled = false\n'
        '[model_providers.scripted]\n'
        'name = "scripted"\n'
        f'base_url = "{url}/v1"\n'
        'env_key = "SCRIPTED_API_KEY"\n'
        'wire_api = "responses"\n'
        'request_max_retries = 0\n'
        'stream_max_retries = 0\n'
    )
    env = {**base_env(home), "CODEX_HOME": str(codex_home), "SCRIPTED_API_KEY": API_KEY}
    return Launch(env)


def _claude(home: Path, url: str, _cwd: str) -> Launch:
    env = {**base_env(home), "ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": API_KEY,
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1",
           "DISABLE_ERROR_REPORTING": "1", "CLAUDE_CONFIG_DIR": str(home / ".claude")}
    if os.geteuid() == 0:
        env["IS_SANDBOX"] = "1"  # Claude Code refuses to skip permissions as root otherwise
    return Launch(env)


def _opencode(home: Path, url: str, _cwd: str) -> Launch:
    config = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            "scripted": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "scripted",
                "options": {"baseURL": f"{url}/v1", "apiKey": API_KEY},
                "models": {MODEL: {"name": MODEL}},
            }
        },
        "model": f"scripted/{MODEL}",
        "small_model": f"scripted/{MODEL}",
        "permission": {"bash": "ask", "edit": "ask"},
        "autoupdate": False,
        "share": "disabled",
    }
    env = {**base_env(home), "OPENCODE_CONFIG_CONTENT": json.dumps(config), "OPENCODE_DISABLE_MODELS_FETCH": "1",
           "OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_LSP_DOWNLOAD": "1"}
    return Launch(env)


def _copilot(home: Path, url: str, _cwd: str) -> Launch:
    env = {**base_env(home), "COPILOT_PROVIDER_BASE_URL": f"{url}/v1", "COPILOT_PROVIDER_API_KEY": API_KEY,
           "COPILOT_MODEL": MODEL}
    return Launch(env)


def _cline(home: Path, url: str, _cwd: str) -> Launch:
    env = {**base_env(home)}
    # `cline auth` writes the provider into the home's cline config; the agent reads it there.
    subprocess.run(
        [str(NODE_BIN / "cline"), "auth", "-p", "openai", "-k", API_KEY, "-m", MODEL, "-b", f"{url}/v1"],
        env={**os.environ, **env}, check=True, capture_output=True, timeout=60,
    )
    # Its ACP mode restores only Cline's own sign-ins; a key and provider in the environment
    # let it start a session on the provider `cline auth` configured.
    env.update({"CLINE_API_KEY": API_KEY, "CLINE_PROVIDER": "openai-compatible", "CLINE_MODEL": MODEL})

    def own_hub(n: int) -> dict[str, str]:
        # Each worker's Cline a hub of its own: by default all Cline processes of a host share
        # one hub (port 25463, found through a file in the home), which holds their live
        # sessions; the worker that started it ends it when it stops, and a session another
        # worker's Cline had loaded there is gone (`session not found`). See docs/agents.md.
        hub = home / ".cline" / "data" / "locks" / "hub"
        return {"CLINE_HUB_PORT": str(free_port()), "CLINE_HUB_DISCOVERY_PATH": str(hub / f"worker-{n}.json")}

    return Launch(env, own_hub)


RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe("qwen", "@qwen-code/qwen-code@0.24.4", NODE_BIN / "qwen", _qwen),
        Recipe("gemini", "@google/gemini-cli@0.61.0", NODE_BIN / "gemini", _gemini),
        Recipe("codex", "@zed-industries/codex-acp@0.16.0", NODE_BIN / "codex-acp", _codex),
        Recipe("claude", "@agentclientprotocol/claude-agent-acp@0.49.0", NODE_BIN / "claude-agent-acp", _claude),
        Recipe("opencode", "opencode-ai@1.18.33", NODE_BIN / "opencode", _opencode),
        Recipe("copilot", "@github/copilot@1.0.102", NODE_BIN / "copilot", _copilot),
        Recipe("cline", "cline@3.0.65", NODE_BIN / "cline", _cline),
    )
}
