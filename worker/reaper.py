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

The watchdog is also the worker's self-fence (docs/architecture.md, "The lease"): after each
renewal the store accepted, the worker writes ``D<deadline>``, the moment (on `fence_clock`,
the one clock both processes read) after which a sweeper may be about to declare it dead.
When that moment passes with no later deadline, the watchdog SIGSTOPs every group (and every
tagged stray) at once; a later deadline still ahead (a renewal accepted after all: the store
had stalled) SIGCONTs them. It does not share the worker's fate: a worker that is itself
stopped (SIGSTOP, a debugger, swapped out), or cut off from Redis, or whose event loop is
blocked, has its agents stopped all the same. Whether a stopped agent is then killed is the
worker's call (it learns whether it was declared dead), or the watchdog's on EOF: a worker
that dies while its agents are fenced has them SIGKILLed at once, never continued.
"""

from __future__ import annotations

import atexit
import logging
import os
import select
import signal
import subprocess
import sys
import time
from typing import Callable, Iterable

GRACE_S = 2.0
POLL_S = 0.05
# The longest the watchdog sleeps while a deadline is armed: poll() times out on the
# monotonic clock, which stands still while the machine is suspended, and the deadline is
# on `fence_clock`, which does not (see `fence_clock`).
ARMED_WAKE_S = 0.1
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


def fence_clock() -> float:
    """Seconds on the clock the worker's self-fence deadlines are written on: CLOCK_BOOTTIME
    on Linux (monotonic, system-wide, so the worker and its watchdog read the same clock,
    and it counts a suspended machine's sleep, which CLOCK_MONOTONIC does not: a lease
    lapses in Redis while the machine sleeps), else the monotonic clock."""
    boottime = getattr(time, "CLOCK_BOOTTIME", None)
    return time.clock_gettime(boottime) if boottime is not None else time.monotonic()


class Watchdog:
    """The watchdog's state: the groups it guards, the worker's self-fence deadline, and
    whether it stopped them. Fed lines by `serve`; `check` acts on the deadline."""

    def __init__(self, grace_s: float = GRACE_S) -> None:
        self.grace_s = grace_s
        self.groups: dict[int, str] = {}  # pgid -> its agent's tag ("" if none)
        self.deadline: float | None = None  # on fence_clock; None: the worker has no lease yet
        self.stopped = False  # every group was SIGSTOPped at the deadline, and not continued

    def take(self, line: bytes) -> None:
        """``+pgid[:tag]`` a group to guard, ``-pgid`` one gone, ``D<seconds>`` the deadline."""
        text = line.strip()
        if text[:1] == b"D":
            try:
                self.deadline = float(text[1:])
            except ValueError:
                pass  # not ours; never guess a deadline
            return
        number, _, tag = text[1:].partition(b":")
        if len(text) < 2 or text[:1] not in (b"+", b"-") or not number.isdigit():
            return  # not ours; never guess a group id
        pgid = int(number)
        if pgid <= 1:
            return  # killpg(0 or 1) would hit ourselves or everything
        if text[:1] == b"+":
            self.groups[pgid] = tag.decode(errors="replace") if tag.isalnum() else ""
            if self.stopped:  # started while fenced: it waits with the others
                self._signal_all(signal.SIGSTOP, {pgid: self.groups[pgid]})
        else:
            self.groups.pop(pgid, None)

    def wait_s(self) -> float | None:
        """How long to sleep before `check` is due (None: until the next line)."""
        if self.deadline is None or self.stopped:
            return None
        return min(ARMED_WAKE_S, max(0.0, self.deadline - fence_clock()))

    def check(self) -> None:
        """Stop every group once the deadline passed; continue them once a newer one is ahead."""
        if self.deadline is None:
            return
        past = fence_clock() >= self.deadline
        if past and not self.stopped:
            self.stopped = True
            self._signal_all(signal.SIGSTOP, self.groups)
            late_ms = (fence_clock() - self.deadline) * 1000
            if self.groups:
                _say(f"no renewal accepted in time; stopped agent groups {sorted(self.groups)} "
                     f"{late_ms:.1f} ms after the deadline")
        elif not past and self.stopped:
            self.stopped = False
            self._signal_all(signal.SIGCONT, self.groups)
            if self.groups:
                _say(f"a renewal was accepted in time; continued agent groups {sorted(self.groups)}")

    @staticmethod
    def _signal_all(sig: int, groups: dict[int, str]) -> None:
        _signal_groups(groups, sig)  # the groups first: one syscall each, at once
        _signal_pids(tagged(groups.values()), sig)  # then the strays, found in /proc

    def worker_gone(self) -> None:
        """EOF: the worker is gone. Fenced agents are killed at once (continued, they would
        run on past the lease); the others get SIGTERM, then SIGKILL after the grace."""
        if not self.groups:
            return
        if self.stopped:
            _say(f"the worker is gone while its agents were fenced; killing groups {sorted(self.groups)}")
            self._signal_all(signal.SIGKILL, self.groups)
            return
        _say(f"the worker is gone; stopping agent groups {sorted(self.groups)}")
        reap(set(self.groups), self.grace_s, self.groups.values())


def _say(message: str) -> None:
    """One line on stderr (the worker's log file), stamped with the wall clock in ms."""
    print(f"worker.reaper: {time.time() * 1000:.0f} {message}", file=sys.stderr, flush=True)


def serve(fd: int, grace_s: float = GRACE_S) -> int:
    """Read lines from `fd` until EOF, acting on the deadline between them; then reap."""
    watchdog = Watchdog(grace_s)
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP)
    pending = b""
    while True:
        wait_s = watchdog.wait_s()
        if poller.poll(None if wait_s is None else wait_s * 1000):
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                watchdog.take(line)
        watchdog.check()
    watchdog.worker_gone()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    grace_s = float(args[0]) if args else GRACE_S
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # only EOF may end us: see the module docstring
    return serve(sys.stdin.fileno(), grace_s)


# ---- the worker's side -------------------------------------------------------------------


class Reaper:
    """The worker's handle on its watchdog: started on first use, restarted if it died."""

    def __init__(self, grace_s: float = GRACE_S) -> None:
        self.grace_s = grace_s
        self.process: subprocess.Popen[bytes] | None = None
        self.groups: dict[int, str] = {}  # pgid -> its agent's tag ("" if none)
        self.deadline: float | None = None  # the self-fence deadline last sent (fence_clock)

    def fence_at(self, deadline: float) -> None:
        """Stop every guarded group at `deadline` (on `fence_clock`) unless a later one
        comes first; a later one that comes after it continues them."""
        self.deadline = deadline
        self._send(self._deadline_line())

    def _deadline_line(self) -> str:
        return f"D{self.deadline:.6f}\n" if self.deadline is not None else ""

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
            told = "".join(self._line(pgid, tag) for pgid, tag in self.groups.items()) + self._deadline_line()
            self.process.stdin.write(told.encode())
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
