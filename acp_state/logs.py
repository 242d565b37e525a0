"""Logging set-up: JSON lines for operators (with session / worker / prompt ids), or text."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

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
