"""Qwen Code (`qwen`, the reference's agent) on the scripted model endpoint
(model_endpoint.py), offline: where its pinned executable is, and the home and environment
that point it at the endpoint."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from .model_endpoint import MODEL

# scripts/test installs the pinned reference (tests/node/package.json) here.
QWEN_LOCAL = Path(__file__).resolve().parent.parent / "tests" / "node" / "node_modules" / ".bin" / "qwen"
QWEN_FALLBACK = "/opt/qwen/node_modules/.bin/qwen"


def qwen_env(home_dir: str | os.PathLike[str], base_url: str,
             background_llm_calls: bool = False) -> dict[str, str]:
    """Write ``<home>/.qwen/settings.json`` (auth type ``openai``) and return the env for ``qwen --acp``
    (``base_url``: the endpoint's `openai_url`).

    Only ``security.auth.selectedType`` is required. Unless ``background_llm_calls`` is set,
    the follow-up suggestion and managed auto-memory side calls that Qwen makes after each
    turn are switched off, so every LLM request belongs to a prompt turn.
    """
    settings_dir = Path(home_dir) / ".qwen"
    settings_dir.mkdir(parents=True, exist_ok=True)
    settings: dict[str, Any] = {
        "security": {"auth": {"selectedType": "openai"}},
        "general": {"enableAutoUpdate": False},
        "privacy": {"usageStatisticsEnabled": False},
    }
    if not background_llm_calls:
        settings["ui"] = {"enableFollowupSuggestions": False}
        settings["memory"] = {"enableManagedAutoMemory": False, "enableManagedAutoDream": False}
    (settings_dir / "settings.json").write_text(json.dumps(settings, indent=2))
    env = dict(os.environ)
    env.update({
        "HOME": str(home_dir),
        "OPENAI_API_KEY": "sk-fake",
        "OPENAI_BASE_URL": base_url,
        "OPENAI_MODEL": MODEL,
        # As the reference runs its ACP children (and the worker's `qwen` preset): one node
        # process per agent, not a second one qwen would start for more heap.
        "QWEN_CODE_NO_RELAUNCH": "true",
    })
    return env


def find_qwen() -> str | None:
    """Return the path of the ``qwen`` executable (the project's pinned install, then PATH,
    then the /opt install) or None."""
    if os.access(QWEN_LOCAL, os.X_OK):
        return str(QWEN_LOCAL)
    found = shutil.which("qwen")
    if found:
        return found
    return QWEN_FALLBACK if os.access(QWEN_FALLBACK, os.X_OK) else None
