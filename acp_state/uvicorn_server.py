"""A uvicorn server that leaves the process's signals to its owner.

The API's `--server uvicorn` and the worker's metrics listener both run uvicorn on the
process's own event loop, where SIGTERM starts our clean shutdown: uvicorn must neither
install its handlers nor restore the previous ones when it stops.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import uvicorn


class UvicornServer(uvicorn.Server):
    def install_signal_handlers(self) -> None:  # uvicorn before 0.29
        pass

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # type: ignore[override]
        yield

    @property
    def port(self) -> int:
        """The bound port (the real one when asked for port 0)."""
        for listener in self.servers:
            for sock in listener.sockets:
                return sock.getsockname()[1]
        return self.config.port

    def stop(self) -> None:
        self.should_exit = True
