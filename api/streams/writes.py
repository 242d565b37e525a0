"""One chunk written by a hub to many event streams, and what the servers let a write skip.

A hub writes each change to every open stream from its own step (`EventStreamResponse.
write_now`). What can be made once per change rather than once per stream is made here,
once: the ASGI message (the servers only read it), and, for uvicorn, the chunk as its
chunked transfer encoding puts it on the wire. Two facts of the servers keep a write that
completes at once down to one call into the server:

* granian's `send` answers a write it took at once with an empty awaitable (a type granian
  does not export, known here by its name): nothing to step.
* uvicorn's (httptools) `send` is a coroutine that, while the transport takes writes and the
  client is connected, frames the chunk and calls `transport.write`: `transport_of` gives
  that transport's owner, and the hub writes the framed chunk to it itself. Whenever the
  transport is paused (flow control) or the client gone, the write goes through `send` as
  before, which waits for the transport to drain or drops the write as uvicorn does.
"""

from __future__ import annotations

from typing import Any, Callable

BODY = "http.response.body"


class Chunk:
    """A chunk of an event stream, to be written to many streams: its ASGI message, shared by
    every stream's `send` (servers read a message, never change it), and its chunked
    encoding, made the first time a stream asks for it."""

    __slots__ = ("body", "message", "_chunked")

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.message = {"type": BODY, "body": body, "more_body": True}
        self._chunked: bytes | None = None

    @property
    def chunked(self) -> bytes:
        """The chunk as HTTP/1.1 chunked transfer encoding frames it (uvicorn's own framing)."""
        if self._chunked is None:
            self._chunked = b"%x\r\n%b\r\n" % (len(self.body), self.body)
        return self._chunked


# The types of awaitable a server's `send` answers with when the write completed at once, and
# every instance of which is complete: granian's empty awaitable, once a send returned one.
AT_ONCE: set[type] = set()


def learn(sent: Any) -> None:
    """`sent`, a server's `send(...)`, completed at once when stepped: remember its type if it
    is granian's empty awaitable."""
    kind = type(sent)
    if kind.__name__ == "PyEmptyAwaitable" and kind.__module__.startswith("granian"):
        AT_ONCE.add(kind)


def _httptools_cycle() -> type | None:
    try:
        from uvicorn.protocols.http.httptools_impl import RequestResponseCycle
    except ImportError:  # uvicorn (or httptools) not installed: never this server
        return None
    return RequestResponseCycle


_HTTPTOOLS_CYCLE = _httptools_cycle()


def transport_of(send: Callable[..., Any]) -> Any | None:
    """The uvicorn (httptools) request cycle whose `send` this is, if its body goes out in
    chunked encoding (an event stream's does: it has no length); None for any other server,
    or any other framing (a HEAD, say), whose writes go through `send`."""
    cycle = getattr(send, "__self__", None)
    if _HTTPTOOLS_CYCLE is None or type(cycle) is not _HTTPTOOLS_CYCLE:
        return None
    # Another uvicorn may keep its cycle otherwise (the pin allows any >= 0.30): without each
    # attribute the direct write reads, the stream writes through `send`.
    flow, transport = getattr(cycle, "flow", None), getattr(cycle, "transport", None)
    if not (hasattr(flow, "write_paused") and hasattr(cycle, "disconnected") and callable(getattr(transport, "write", None))):
        return None
    if getattr(cycle, "chunked_encoding", None) is not True or not getattr(cycle, "response_started", False):
        return None
    return None if getattr(cycle, "response_complete", True) else cycle
