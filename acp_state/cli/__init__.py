"""The composition root: the `acp-state` command, which wires the core, the API and the
worker into processes, and the HTTP servers they run on (`serving`).

The only package that imports both the API (`acp_state.api`) and the worker
(`acp_state.worker`); see docs/architecture.md for who may import what.
"""

from .commands import main

__all__ = ["main"]
