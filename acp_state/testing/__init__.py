"""The test double: a scripted ACP agent (`python -m acp_state.testing.scripted_agent`).

Not production code: the tests drive it, and `acp-state dev` and `acp-state worker` run it
when no `--agent` is given. Only the composition root (`acp_state.cli`) and the tests refer
to it; the core, the API and the worker never import it.
"""
