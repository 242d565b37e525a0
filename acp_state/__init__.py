"""acp-state core: the wire model, the Redis key schema and scripts, the store both sides share.

Nothing here speaks HTTP or spawns processes; `api/` and `worker/` meet only through this
package and through Redis.
"""

__version__ = "0.1.0"
