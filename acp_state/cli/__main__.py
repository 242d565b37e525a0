"""`python -m acp_state.cli`: the `acp-state` command."""

from .commands import main

main()
