"""A live session's context as its agent reports it, by the reference's routes:

* `GET /session/:id/context` (feature `session_context`): `{v: 1, sessionId, workspaceCwd,
  recovery, state}`. `state` is what the agent answered of the session on its ACP
  `session/new`, `load` or `resume` (`modes`, `configOptions`; the current mode follows
  `session/set_mode`), `{}` from an agent that said nothing of it. `recovery` is always the
  reference's `{kind: "clean", canContinue: false}`: a session here is never a half-restored
  one waiting to be continued (a resume either brought it back or failed).
* `GET /session/:id/context-usage[?detail=true]` (feature `session_context_usage`): how full
  the agent's context window is, from its last ACP `usage_update` (`used` of `size` tokens),
  in the reference's shape: `usage.totalTokens`, `usage.contextWindowSize`, a `breakdown`
  whose tokens are all `unattributed` (ACP does not say what fills the window), and a
  `formattedText`. Before the agent reported any, or from an agent that never does, the
  reference's answer before a first model response: 0 tokens, `isEstimated: true` (and a
  window of 0: its size is unknown).

Both read the session's state from the owner's writes (the session hash), on any API process.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from acp_state.store import SessionView

from ..auth import principal_of
from ..responses import OrjsonResponse
from ..state import app_state

SCHEMA_VERSION = 1
BREAKDOWN = ("systemPrompt", "builtinTools", "mcpTools", "memoryFiles", "skills", "startupContext", "messages")


async def context(request: Request) -> Response:
    sid = request.path_params["id"]
    view = (await app_state(request).locator.live(sid, principal_of(request))).view
    return OrjsonResponse({
        "v": SCHEMA_VERSION, "sessionId": sid, "workspaceCwd": view.meta["workspaceCwd"],
        "recovery": {"kind": "clean", "canContinue": False}, "state": view.agent_state or {},
    })


async def context_usage(request: Request) -> Response:
    sid = request.path_params["id"]
    view = (await app_state(request).locator.live(sid, principal_of(request))).view
    reported = view.usage or {}
    used, size = int(reported.get("used") or 0), int(reported.get("size") or 0)
    usage: dict[str, Any] = {}
    model = model_name(view)
    if model is not None:
        usage["modelName"] = model
    usage.update(
        totalTokens=used,
        contextWindowSize=size,
        breakdown={**{part: 0 for part in BREAKDOWN}, "unattributed": used, "cachedTokens": 0,
                   "freeSpace": max(size - used, 0), "autocompactBuffer": 0},
        builtinTools=[], mcpTools=[], memoryFiles=[], skills=[],
        isEstimated=view.usage is None,
        showDetails=request.query_params.get("detail") == "true",
    )
    return OrjsonResponse({
        "v": SCHEMA_VERSION, "sessionId": sid, "workspaceCwd": view.meta["workspaceCwd"], "usage": usage,
        "formattedText": formatted(model, used, size, view.usage is not None),
    })


def model_name(view: SessionView) -> str | None:
    """The name of the session's current model, where the agent's `configOptions` have a
    model selector (ACP's `category: "model"`)."""
    for option in (view.agent_state or {}).get("configOptions") or []:
        if isinstance(option, dict) and option.get("category") == "model":
            current = option.get("currentValue")
            for choice in option.get("options") or []:
                if isinstance(choice, dict) and choice.get("value") == current:
                    return str(choice.get("name") or current)
            return str(current) if current is not None else None
    return None


def formatted(model: str | None, used: int, size: int, reported: bool) -> str:
    """The usage as the reference's `formattedText` (markdown) says it, in brief."""
    head = "## Context Usage\n\n"
    if not reported:
        return head + "*No usage reported by the agent yet. Send a message to see it.*"
    window = f"Context window: {size / 1000:.1f}k tokens" if size else "Context window: unknown"
    lines = [f"Model: {model}  {window}" if model else window, ""]
    share = (lambda tokens: f" ({tokens / size * 100:.1f}%)") if size else (lambda tokens: "")
    lines.append(f"  Used {used:>30} tokens{share(used)}")
    if size:
        lines.append(f"  Free {max(size - used, 0):>30} tokens{share(max(size - used, 0))}")
    return head + "\n".join(lines)
