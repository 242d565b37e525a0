"""How the store's calls reach Redis in batches: a Lua script that runs alone or queued in a
pipeline (`Script`), one script for many calls in one pipeline (`pipelined`), and the calls
of one event-loop turn sent together (`PerLoopTurn`).

Round trips are what a store call costs; these are the three ways RedisStore shares one
among many calls.
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any, Awaitable, Callable, Generic, TypeVar

from redis.exceptions import NoScriptError

from .connection import Client

T = TypeVar("T")
R = TypeVar("R")


class Script:
    """One Lua script, run by EVALSHA and loaded on NOSCRIPT (a Redis that restarted empty).

    redis-py's own script helper cannot queue into a cluster pipeline; this one can, so the
    same call works on a single Redis and on a cluster, alone or pipelined.
    """

    def __init__(self, redis: Client, source: str, *, allow_oom: bool = False) -> None:
        self.redis = redis
        if allow_oom and not type(redis).__module__.startswith("fakeredis"):
            # Runs when Redis is out of memory (its writes are a few small fields): a full
            # Redis must not keep healthy workers from renewing. (The embedded fakeredis
            # never runs out of memory, and does not read script flags.)
            source = "#!lua flags=allow-oom\n" + source
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    async def load(self) -> None:
        await self.redis.script_load(self.source)  # on a cluster: on every primary

    def queue(self, pipe: Any, keys: list[str], args: list[Any]) -> None:
        pipe.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)

    async def __call__(self, keys: list[str], args: list[Any]) -> Any:
        command = ("EVALSHA", self.sha, len(keys), *keys, *args)
        try:
            return await self.redis.execute_command(*command)
        except NoScriptError:
            await self.load()
            return await self.redis.execute_command(*command)


async def pipelined(redis: Client, script: Script, calls: list[tuple[list[str], list[Any]]]) -> list[Any]:
    """Run one script for each (keys, args) in one pipeline, answers (or errors) in call
    order; the calls a freshly restarted Redis did not know the script for are run again,
    in their order, once it is loaded."""
    results: list[Any] = [None] * len(calls)
    todo = list(range(len(calls)))
    for attempt in range(2):
        pipe = redis.pipeline(transaction=False)
        for i in todo:
            script.queue(pipe, *calls[i])
        replies = await pipe.execute(raise_on_error=False)
        for i, reply in zip(todo, replies, strict=True):
            results[i] = reply
        todo = [i for i in todo if isinstance(results[i], NoScriptError)]
        if not todo or attempt:
            break
        await script.load()
    return results


class PerLoopTurn(Generic[T, R]):
    """The calls made in one turn of the event loop, sent together at its end by `send`
    (one pipeline, one write): a burst of creates otherwise paid a round trip each for its
    index entry and its reply, a fifth of a worker's CPU per create. `send` answers each
    call's result or exception, in order; if it fails as a whole, every call fails with it."""

    def __init__(self, send: Callable[[list[T]], Awaitable[list[R | Exception]]]) -> None:
        self._send = send
        self._pending: list[tuple[T, asyncio.Future[R]]] = []
        self._sending: set[asyncio.Task[None]] = set()  # held: the loop keeps only weak references

    async def __call__(self, call: T) -> R:
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._start)
        self._pending.append((call, future))
        return await future

    def _start(self) -> None:
        batch, self._pending = self._pending, []
        task = asyncio.ensure_future(self._run(batch))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _run(self, batch: list[tuple[T, asyncio.Future[R]]]) -> None:
        try:
            results = await self._send([call for call, _ in batch])
        except BaseException as error:  # every caller sees it (a worker's `_stored` retries)
            for _, future in batch:
                if not future.done():
                    future.set_exception(error if isinstance(error, Exception) else ConnectionError("cancelled"))
            if not isinstance(error, Exception):
                raise
            return
        for (_, future), result in zip(batch, results, strict=True):
            if not future.done():
                if isinstance(result, Exception):
                    future.set_exception(result)
                else:
                    future.set_result(result)
