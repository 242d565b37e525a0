"""acp-state core: the wire model, the commands, and the store both sides share (`acp_state.store`).

Nothing here speaks HTTP or spawns processes; `api/` and `worker/` meet only through this
package and through Redis.
"""

__version__ = "0.1.0"
