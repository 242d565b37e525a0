"""Which processes hold a TCP port: named in the one-line error of a server that cannot
listen, so an operator (or a test run restarting an API) sees who took the port rather than
only that someone did.

Read from /proc (Linux): the sockets bound to the port, in any state (a listener, or an
outgoing connection the kernel gave that port), then the processes with such a socket open.
Another user's processes are invisible without root; the answer is then shorter, never wrong.
"""

from __future__ import annotations

import os
from pathlib import Path

_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")


def _socket_inodes(port: int) -> set[str]:
    inodes: set[str] = set()
    for table in _TABLES:
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and int(fields[1].rsplit(":", 1)[1], 16) == port and fields[9] != "0":
                inodes.add(fields[9])
    return inodes


def port_holders(port: int) -> list[str]:
    """`pid N (command)` for each process holding a socket bound to `port`, pids in order."""
    wanted = {f"socket:[{inode}]" for inode in _socket_inodes(port)}
    if not wanted:
        return []
    holders = []
    for entry in sorted(Path("/proc").iterdir(), key=lambda p: int(p.name) if p.name.isdigit() else -1):
        if not entry.name.isdigit():
            continue
        try:
            fds = os.listdir(entry / "fd")
            held = any(os.readlink(entry / "fd" / fd) in wanted for fd in fds)
            if held:
                holders.append(f"pid {entry.name} ({(entry / 'comm').read_text().strip()})")
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return holders
