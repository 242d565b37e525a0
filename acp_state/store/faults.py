"""What a Redis error says about the command that met it.

Both sides ask the same two questions of an error: may the command be tried again (the store
could not take it now: unreachable, stalled, loading, full, failing over), and could it have
run before the error (then only a retry under the same running number or idempotency key is
safe, and an API answers that the outcome is unknown)? Anything else is a bug of ours.
"""

from __future__ import annotations

from typing import Callable

from redis import exceptions as redis_errors

# The store could not take the command now; the same command may succeed later. On a cluster,
# redis-py gives up on a slot whose redirections or connection errors outlast its retries
# with a bare ClusterError ("TTL exhausted"), and on a slot no node serves with
# SlotNotCoveredError (not even a RedisError).
TRANSIENT: tuple[type[BaseException], ...] = (
    redis_errors.ConnectionError,
    redis_errors.TimeoutError,
    redis_errors.OutOfMemoryError,
    redis_errors.ReadOnlyError,
    redis_errors.TryAgainError,
    redis_errors.ClusterError,  # ClusterDownError and MasterDownError too
    redis_errors.SlotNotCoveredError,
)

# Refused by a Redis that answered, before the command ran: out of memory (a script is
# refused before its first write), a replica's read-only refusal, a cluster that is down or
# a slot that is migrating. Loading is a ConnectionError subclass, refused before running.
_REFUSED: tuple[type[BaseException], ...] = (
    redis_errors.BusyLoadingError,
    redis_errors.OutOfMemoryError,
    redis_errors.ReadOnlyError,
    redis_errors.TryAgainError,
    redis_errors.ClusterDownError,
    redis_errors.SlotNotCoveredError,
)


def is_transient(error: BaseException) -> bool:
    return (
        isinstance(error, TRANSIENT)
        or torn_under_write(error)
        or (isinstance(error, redis_errors.ResponseError) and (
            is_out_of_memory(error) or _says(error, "READONLY")
            # A blocking command (BLMOVE: an API awaiting a worker's reply) that its master
            # released when it became a replica (a failover): the store moved, not a bug.
            or _says(error, "UNBLOCKED")
        ))
    )


def never_ran(error: BaseException) -> bool:
    """The command cannot have run: Redis refused it, or it was never sent."""
    if isinstance(error, _REFUSED) or torn_under_write(error):
        return True
    if isinstance(error, redis_errors.ResponseError):
        return is_out_of_memory(error) or _says(error, "READONLY") or _says(error, "CLUSTERDOWN")
    text = str(error)
    # No connection was made: redis-py's texts for a refused or failed connect, a full pool.
    return "connecting to" in text or "No connection available" in text or "Connection refused" in text


def is_out_of_memory(error: BaseException) -> bool:
    """Redis refused a write at maxmemory under `noeviction`: the reply "OOM command not
    allowed ...", which redis-py raises as OutOfMemoryError without the "OOM" (with
    "Command # n (...) of pipeline caused error: " in front inside a pipeline); the text
    checks catch the reply where it reaches us unparsed."""
    if isinstance(error, redis_errors.OutOfMemoryError):
        return True
    if not isinstance(error, redis_errors.ResponseError):
        return False
    message = str(error)
    return message.startswith("OOM") or "OOM command not allowed" in message


def torn_under_write(error: BaseException) -> bool:
    """A connection closed under a write, as redis-py (8.1) lets it escape unwrapped: uvloop's
    RuntimeError "unable to perform operation on <TCPTransport closed=True ...>; the handler
    is closed", or an AttributeError on the writer a concurrent disconnect dropped. Either
    way the write itself failed: nothing of it went out."""
    text = str(error)
    if isinstance(error, RuntimeError):
        return "the handler is closed" in text
    return isinstance(error, AttributeError) and "'NoneType' object has no attribute 'write" in text


def _says(error: BaseException, code: str) -> bool:
    message = str(error)
    return message.startswith(code) or f"error: {code}" in message


# Every error the store's client raises: an API answers each as a failure of the store
# (503 store_full or store_unavailable, or a 500 for a bug of ours).
STORE_ERRORS: tuple[type[BaseException], ...] = (redis_errors.RedisError, redis_errors.RedisClusterException)


# What an operator is told the store's errors mean, by the process's recurring-failure log
# (acp_state.logs): the kinds a store that is away produces, each with where it is.
_AWAY: tuple[type[BaseException], ...] = (
    redis_errors.ConnectionError, redis_errors.TimeoutError, redis_errors.ClusterError,
    redis_errors.SlotNotCoveredError,
)


def address(url: str) -> str:
    """Where a store URL points, for a log line: `host:port` (the first node of a cluster's),
    a socket's path; never its credentials."""
    scheme, _, rest = url.partition("://")
    if scheme == "unix":
        return rest.split("?", 1)[0]
    if not rest:
        return scheme
    location = rest.split("/", 1)[0].split("?", 1)[0].rpartition("@")[2]
    host, _, port = location.partition(",")[0].rpartition(":")
    return f"{host}:{port}" if host else f"{location or scheme}:6379"


def outage_namer(url: str) -> Callable[[BaseException], str | None]:
    """How the store at `url` names an error that says it could not take a command now:
    "redis unreachable at HOST:PORT" (down, cut off, stalled past a timeout, a cluster
    without a master for a slot), "redis at HOST:PORT refused a command" (full, read-only,
    loading); None for an error that is ours (a bug)."""
    where = address(url)

    def name(error: BaseException) -> str | None:
        if isinstance(error, _REFUSED) or (is_transient(error) and not isinstance(error, _AWAY)):
            return f"redis at {where} refused a command"
        if is_transient(error) or isinstance(error, TimeoutError):  # (also a wait for it that gave up)
            return f"redis unreachable at {where}"
        return None

    return name
