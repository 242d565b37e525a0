"""Agent children die with their worker, however the worker dies: ``python -m worker.reaper``.

Why: the worker starts every ACP agent child in a process group of its own, so that a stop
reaches a wrapper's grandchildren too (qwen). A worker that stops normally (or on SIGTERM)
stops those groups itself; a worker killed with SIGKILL, or by the OOM killer, runs no code
at all. Its children then learn of it only from EOF on stdin, and an agent that ignores EOF,
or a grandchild that never reads stdin, would run forever. PR_SET_PDEATHSIG (set on each
direct child, see `parent_death_signal`) covers the direct child on Linux, never its
grandchildren: they do not have the worker as their parent.

How: each worker process starts one watchdog (this module run as a script, stdlib only),
lazily, with a pipe from the worker as its stdin. The worker writes ``+<pgid>`` when an
agent child starts and ``-<pgid>`` when its group is gone. The kernel closes the pipe's
write end when the worker exits, by any death, so EOF on stdin means "the worker is gone":
the watchdog then sends SIGTERM to every group it still knows, SIGKILL after a grace period
to those that linger, and exits. A worker that exits cleanly has forgotten every group, and
the watchdog leaves at once.

The watchdog runs in its own session, so signals aimed at the worker's process group or
terminal (Ctrl-C, ``kill -- -<pgid>``) do not take it down first, and it ignores SIGTERM,
SIGINT and SIGHUP: its only way out is EOF, which the worker's death always brings. A group
whose members left it with setsid() themselves (a daemon, such as Cline's hub) is out of a
group signal's reach: each agent child is therefore also started with a tag of its own in
its environment (`TAG_VARIABLE`), which its descendants inherit, and every process that
still carries the tag when its group is stopped is signalled by pid (`tagged`, from /proc).
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import subprocess
import sys
import time
from typing import Callable, Iterable

GRACE_S = 2.0
POLL_S = 0.05
# Set in each agent child's environment: what finds its descendants that left its group.
TAG_VARIABLE = "ACP_STATE_AGENT_TAG"

log = logging.getLogger("worker.reaper")


# ---- the watchdog process ----------------------------------------------------------------


def _signal_groups(groups: Iterable[int], sig: int) -> set[int]:
    """Send `sig` to each group; the groups that still had members."""
    alive = set()
    for pgid in groups:
        try:
            os.killpg(pgid, sig)
            alive.add(pgid)
        except ProcessLookupError:
            pass
        except PermissionError:  # not ours (any more): never retry
            pass
    return alive


def tagged(tags: Iterable[str]) -> set[int]:
    """The live processes whose environment carries one of `tags` (Linux /proc; elsewhere
    none): an agent's descendants, even those that left its process group."""
    wanted = {f"{TAG_VARIABLE}={tag}".encode() for tag in tags if tag}
    found: set[int] = set()
    if not wanted:
        return found
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as environ:
                if wanted & set(environ.read().split(b"\0")):
                    found.add(int(entry))
        except OSError:  # gone meanwhile, or not ours
            continue
    return found


def _signal_pids(pids: Iterable[int], sig: int) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            os.kill(pid, sig)
            alive.add(pid)
        except (ProcessLookupError, PermissionError):
            pass
    return alive


def reap(groups: set[int], grace_s: float = GRACE_S, tags: Iterable[str] = ()) -> None:
    """SIGTERM every group and every process carrying one of `tags`, then SIGKILL what is
    left of them after `grace_s`."""
    tags = list(tags)
    alive = _signal_groups(groups, signal.SIGTERM)
    strays = _signal_pids(tagged(tags), signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while (alive or strays) and time.monotonic() < deadline:
        time.sleep(POLL_S)  # a process group's end is not an event we can wait on
        alive = _signal_groups(alive, 0)  # (a zombie still counts: its parent reaps it soon)
        strays = tagged(tags)
    _signal_groups(alive, signal.SIGKILL)
    _signal_pids(tagged(tags), signal.SIGKILL)


def serve(lines: Iterable[bytes], grace_s: float = GRACE_S) -> int:
    """Track ``+pgid[:tag]`` / ``-pgid`` lines until EOF, then reap what is still tracked."""
    groups: dict[int, str] = {}
    for line in lines:
        text = line.strip()
        number, _, tag = text[1:].partition(b":")
        if len(text) < 2 or text[:1] not in (b"+", b"-") or not number.isdigit():
            continue  # not ours; never guess a group id
        pgid = int(number)
        if pgid <= 1:
            continue  # killpg(0 or 1) would hit ourselves or everything
        if text[:1] == b"+":
            groups[pgid] = tag.decode(errors="replace") if tag.isalnum() else ""
        else:
            groups.pop(pgid, None)
    if groups:
        print(f"worker.reaper: the worker is gone; stopping agent groups {sorted(groups)}", file=sys.stderr, flush=True)
        reap(set(groups), grace_s, groups.values())
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    grace_s = float(args[0]) if args else GRACE_S
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # only EOF may end us: see the module docstring
    return serve(iter(sys.stdin.buffer.readline, b""), grace_s)


# ---- the worker's side -------------------------------------------------------------------


class Reaper:
    """The worker's handle on its watchdog: started on first use, restarted if it died."""

    def __init__(self, grace_s: float = GRACE_S) -> None:
        self.grace_s = grace_s
        self.process: subprocess.Popen[bytes] | None = None
        self.groups: dict[int, str] = {}  # pgid -> its agent's tag ("" if none)

    def watch(self, pgid: int, tag: str = "") -> None:
        """Kill group `pgid`, and every process tagged `tag`, if this process dies before it
        calls `forget(pgid)`."""
        self.groups[pgid] = tag
        self._send(self._line(pgid, tag))

    @staticmethod
    def _line(pgid: int, tag: str) -> str:
        return f"+{pgid}:{tag}\n" if tag else f"+{pgid}\n"

    def forget(self, pgid: int) -> None:
        if pgid in self.groups:
            del self.groups[pgid]
            self._send(f"-{pgid}\n")

    def _send(self, line: str) -> None:
        if self.process is None or self.process.poll() is not None:
            if self.groups:
                self._start()  # first use, or it died (killed by hand): it learns every group
            else:
                self._discard()
            return
        assert self.process.stdin is not None
        try:
            # A few bytes on a pipe the watchdog drains at once: this never blocks in practice.
            self.process.stdin.write(line.encode())
            self.process.stdin.flush()
        except OSError:  # it died since poll()
            self._start()

    def _start(self) -> None:
        self._discard()
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-I", os.path.abspath(__file__), str(self.grace_s)],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                # Out of the worker's process group and terminal: see the module docstring.
                start_new_session=True,
                close_fds=True,
            )
            assert self.process.stdin is not None
            self.process.stdin.write("".join(self._line(pgid, tag) for pgid, tag in self.groups.items()).encode())
            self.process.stdin.flush()
        except OSError:
            log.warning("could not start the agent reaper; agents may outlive a killed worker", exc_info=True)
            self._discard()

    def _discard(self) -> None:
        process, self.process = self.process, None
        if process is not None and process.stdin is not None:
            try:
                process.stdin.close()
            except OSError:
                pass

    def close(self) -> None:
        """Let the watchdog go (EOF): it reaps whatever was not forgotten, then exits."""
        self._discard()


_reaper: Reaper | None = None


def reaper() -> Reaper:
    """This process's watchdog handle; the watchdog itself starts with the first `watch()`."""
    global _reaper
    if _reaper is None:
        _reaper = Reaper()
        atexit.register(_reaper.close)  # what the kernel would do anyway, only sooner
    return _reaper


def parent_death_signal() -> Callable[[], None] | None:
    """A `preexec_fn` that has the kernel SIGKILL the child when the thread that spawned it
    dies (Linux PR_SET_PDEATHSIG), or None where that does not exist."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()
    pr_set_pdeathsig = 1

    def arm() -> None:  # runs in the child between fork and exec: no allocation-heavy work
        prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the worker died before the signal was armed
            os._exit(1)

    return arm


if __name__ == "__main__":
    sys.exit(main())
