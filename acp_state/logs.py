"""Logging set-up: JSON lines for operators (with session / worker / prompt ids), or text."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, Callable

import orjson

# Ids a log call may pass with `extra=`; each appears as a top-level JSON field.
CONTEXT_FIELDS = ("workerId", "sessionId", "promptId", "requestId", "workspaceId")


class JsonFormatter(logging.Formatter):
    converter = time.gmtime  # timestamps in UTC, as the `Z` says

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for name in CONTEXT_FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                line[name] = value
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(line).decode()


class ContextFilter(logging.Filter):
    """Stamps fixed ids (e.g. the worker's incarnation) on every record of the process."""

    def __init__(self, **fields: str) -> None:
        super().__init__()
        self.fields = fields

    def filter(self, record: logging.LogRecord) -> bool:
        for name, value in self.fields.items():
            if getattr(record, name, None) is None:
                setattr(record, name, value)
        return True


def configure(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def stamp(**fields: str) -> None:
    """Add ids to every record this process logs from now on."""
    for handler in logging.getLogger().handlers:
        handler.addFilter(ContextFilter(**fields))


# ---- recurring failures ---------------------------------------------------------------------
#
# A store that is away fails every loop of a process several times a second (a worker's
# heartbeat, command loop, TTL refresh and sweeper; an API's fan-out repair, presence and
# sweeper): with a traceback each, a 2-minute outage once wrote 222 tracebacks, 1.48 MB.
# Each kind of failure is said once instead, with its traceback, then counted: a line with
# the count at a backoff (5 s, 10 s, ... at most a minute apart), and one line when it ends.
# A kind is what an operator acts on: for an error that says the store could not take a
# command now, the store's name for it and the error's class ("redis unreachable at
# 127.0.0.1:6390 (ConnectionError)"), whichever loop met it; for any other error (a bug),
# the task that failed and the error's class.

FIRST_REPEAT_S = 5.0
MAX_REPEAT_S = 60.0


def _unnamed(error: BaseException) -> str | None:
    return None


class RecurringFailures:
    """Failures said once per kind and then counted (see above). One per process: every
    loop that meets the same outage adds to one line."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        # The store's name for an error that means it could not take a command now (set by
        # the process's composition root: the core knows no store); None for other errors.
        self.outage_name: Callable[[BaseException], str | None] = _unnamed
        self._kinds: dict[str, _Kind] = {}
        self._failing: dict[str, set[str]] = {}  # task -> the kinds it fails with now

    def describe(self, error: BaseException) -> str:
        """One line for an error, as the failures' lines name it (for a caller's own line)."""
        outage = self.outage_name(error)
        return f"{outage} ({type(error).__name__})" if outage else f"{type(error).__name__}: {error}"

    def failed(self, logger: logging.Logger, task: str, error: BaseException, level: int = logging.ERROR) -> None:
        """`task` failed with `error`: said if it is the first of its kind for a while, else counted."""
        outage = self.outage_name(error)
        name = f"{outage or task + ' failed'} ({type(error).__name__})"
        kind = self._kinds.get(name)
        now = self.clock()
        if kind is None:
            kind = self._kinds[name] = _Kind(name, logger, level, outage=outage is not None)
        self._failing.setdefault(task, set()).add(name)
        kind.failing.add(task)
        kind.failures += 1
        if not kind.announced and now >= kind.quiet_until:
            kind.announce(now, task, error)
        elif now - kind.said_at >= kind.interval:
            kind.repeat(now)

    def succeeded(self, task: str) -> None:
        """A round of `task` went through: the kinds only it was failing with are over."""
        names = self._failing.pop(task, None)
        if not names:
            return
        now = self.clock()
        for name in names:
            kind = self._kinds[name]
            kind.failing.discard(task)
            if not kind.failing:
                kind.recover(now)


class _Kind:
    """One kind of failure: when it was last said, and what happened since."""

    def __init__(self, name: str, logger: logging.Logger, level: int, outage: bool) -> None:
        self.name = name
        self.logger = logger
        self.level = level
        self.outage = outage  # the store's (whichever task met it), else one task's own
        self.failing: set[str] = set()  # the tasks failing with it now
        self.announced = False  # said, and not said to be over yet
        self.started_at = 0.0
        self.said_at = float("-inf")
        self.failures = 0  # since the last line
        self.repeated = False  # more than once since it was announced
        self.interval = FIRST_REPEAT_S
        # A kind that ends and comes back within its interval is not announced again (a
        # store that flaps): its failures are counted into the next line instead.
        self.quiet_until = float("-inf")

    def announce(self, now: float, task: str, error: BaseException) -> None:
        if now - self.said_at > MAX_REPEAT_S:  # a new outage, not the last one flapping
            self.interval = FIRST_REPEAT_S
        self.announced = True
        self.repeated = False
        self.started_at = self.said_at = now
        self.failures = 0
        self.logger.log(self.level, "%s; repeats are counted, not logged each",
                        f"{self.name}: {task} failed" if self.outage else self.name,
                        exc_info=(type(error), error, error.__traceback__))

    def repeat(self, now: float) -> None:
        tasks = ", ".join(sorted(self.failing))
        self.logger.log(self.level, "%s \u2014 %d more in the last %.0f s (%s)", self.name, self.failures,
                        now - self.said_at, tasks)
        self.said_at = now
        self.failures = 0
        self.repeated = True
        self.interval = min(2 * self.interval, MAX_REPEAT_S)

    def recover(self, now: float) -> None:
        if not self.announced:
            return
        if self.outage or self.repeated or self.failures:  # (a bug met once needs no second line)
            more = f", {self.failures} more since the last line" if self.failures else ""
            self.logger.info("over: %s, after %.0f s%s", self.name, now - self.started_at, more)
        self.announced = False
        self.failures = 0
        self.quiet_until = now + self.interval
        self.said_at = now


FAILURES = RecurringFailures()


def failed(logger: logging.Logger, task: str, error: BaseException, level: int = logging.ERROR) -> None:
    """Report a failure of a recurring task (said once per kind, then counted; see above)."""
    FAILURES.failed(logger, task, error, level)


def succeeded(task: str) -> None:
    """Report that a round of a task that may have failed before went through."""
    FAILURES.succeeded(task)


def describe(error: BaseException) -> str:
    return FAILURES.describe(error)


def name_outages(outage_name: Callable[[BaseException], str | None]) -> None:
    """How this process's store names an error that means it could not take a command now
    (`acp_state.store.outage_namer`): such errors are one kind, whichever task met them."""
    FAILURES.outage_name = outage_name
