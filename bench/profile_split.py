"""`python -m bench.profile_split FILE...`: where a py-spy profile's samples went, by whose code.

Reads py-spy's raw folded stacks (`py-spy record -f raw`, with `--native` for the frames
below Python: `bench.push --profile` records so) and gives each sample to the innermost frame
whose code is known: acp-state's own Python (`api/`, `acp_state/`, `worker/`), the server
(granian's Rust module, uvicorn's or httptools' Python), the event loop (uvloop's C, libuv,
asyncio), or other code (libraries: redis, Starlette, orjson...). Frames of the interpreter
and of libc (a `write`, a `syscall`) are nobody's: the sample goes to the frame that called
them. The event loop's share also says how much of it is its wait in `epoll` (py-spy counts a
thread waiting there in C as busy) and how much its transports' writes to sockets (uvloop's
`UVStream` write: on uvicorn, the transport the server writes to), and each share is split by thread: the loop's (the
Python main thread: its stacks start at `_run_module_as_main`) and the others (granian's Rust
runtime, which writes to the sockets).

    python -m bench.profile_split bench/results/push_fanout_10000_profile.txt
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

FRAME = re.compile(r"^(?P<name>.*?) \((?P<where>[^()]*)\)$")
OWN = ("api/", "acp_state/", "worker/")
SERVER = ("granian", "uvicorn/", "httptools")
LOOP = ("uvloop", "loop.c", "core.c", "linux.c", "stream.c", "poll.c", "timer.c", "async.c", "handles/",
        "asyncio/", "_asynciomodule.c", "selectors.py")


def owner(frame: str) -> str | None:
    """Whose code `frame` is, or None: the interpreter's, libc's, or unknown (see the caller)."""
    match = FRAME.match(frame)
    where = match["where"] if match else frame
    if where.startswith(OWN):
        return "acp-state"
    if any(mark in where for mark in SERVER):
        return "server"
    if any(mark in where for mark in LOOP):
        return "event loop"
    if where.endswith(".py") or re.search(r"\.py:\d+$", where) or "site-packages" in where:
        return "other"
    if ".so" in where and "libc.so" not in where and "libpython" not in where:
        return "other"  # another extension (orjson, hiredis...)
    return None


def split(path: Path) -> tuple[Counter[str], Counter[str], int, int, int]:
    """Samples per owner (in all, and in the loop's thread), the samples in all, those of the
    loop waiting in epoll, and those of its transports writing to a socket."""
    counts: Counter[str] = Counter()
    in_loop: Counter[str] = Counter()
    total = waiting = writing = 0
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        samples = int(n)
        total += samples
        frames = stack.split(";")
        who = next((o for o in map(owner, reversed(frames)) if o is not None), "other")
        counts[who] += samples
        if "_run_module_as_main" in stack:
            in_loop[who] += samples
        if who == "event loop" and "epoll" in frames[-1]:
            waiting += samples
        if who == "event loop" and "UVStream" in stack and "write" in stack:
            writing += samples
    return counts, in_loop, total, waiting, writing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("profiles", nargs="+", type=Path)
    for path in parser.parse_args().profiles:
        counts, in_loop, total, waiting, writing = split(path)
        loop_total = sum(in_loop.values())
        print(f"{path}: {total} samples, {loop_total} of them in the loop's thread")
        print(f"  {'':<11} {'all':>6} {'':>6}   {'loop thread':>11}   {'other threads':>13}")
        for who in ("acp-state", "server", "event loop", "other"):
            note = f"  (waiting in epoll: {waiting}; a transport's socket write: {writing})" if who == "event loop" else ""
            print(f"  {who:<11} {counts[who]:>6} {100 * counts[who] / max(total, 1):5.1f}%   {in_loop[who]:>5} "
                  f"{100 * in_loop[who] / max(loop_total, 1):5.1f}%   {counts[who] - in_loop[who]:>13}{note}")


if __name__ == "__main__":
    main()
