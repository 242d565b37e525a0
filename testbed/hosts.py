"""A test bed of hosts on one machine: network namespaces joined by a bridge.

Each host (`api-1`, `worker-1`, ...) is a network namespace with one veth link to a bridge
in the root namespace. The root namespace is the Redis host and the test driver's: Redis
listens on the bridge's second address (`redis_ip`), the driver reaches the APIs from the
first (`driver_ip`). Every TCP connection from a host to Redis passes a transparent fault
proxy in the root namespace (an nftables `redirect`), so latency, jitter and loss can be put
on one host's links at any time, existing connections included; partitions are kernel drop
rules inside the host's namespace, so the processes' own sockets see them (no RST, no FIN:
only their timeouts and TCP keepalive notice).

    python -m testbed.hosts check     # exit 0 where the bed can run; 77 and the reason where not
    python -m testbed.hosts clean     # remove what runs that died left behind
    python -m testbed.hosts shell     # a bed of api-1 and worker-1 until Ctrl-C (for poking at it)

Nothing outlives the bed: `stop()` removes every namespace, link, rule and process it made,
and a watchdog process (its own session) does the same if the driver dies without it (kill -9
included). Every process the bed's driver starts carries `ACP_HOSTS_RUN=<run id>` in its
environment, which is how the watchdog finds them, Redis servers of the root namespace too.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RUN_ENV = "ACP_HOSTS_RUN"
PREFIX = "acph"  # of every namespace, link and nft table a bed makes: acph<pid>...
SUBNET_BASE = "10.213"  # the project's own test addresses: 10.213.<n>.0/24
UNAVAILABLE_EXIT = 77  # what `check` exits with where the bed cannot run (automake's "skipped")
ROOT = Path(__file__).resolve().parent.parent


class HostsUnavailable(RuntimeError):
    """Network namespaces (or nftables, or root) are not available here."""


def _run(*argv: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, capture_output=True, text=True, input=input, timeout=30)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {result.stderr.strip() or result.stdout.strip()}")
    return result


def unavailable_reason() -> str | None:
    """Why the bed cannot run here, or None where it can (root, `ip netns`, nftables)."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "the host test bed needs root (ip netns, nftables)"
    for tool in ("ip", "nft"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (apt-get install iproute2 nftables)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        made = _run("ip", "netns", "add", probe, check=False)
        if made.returncode != 0:
            return f"ip netns add failed: {made.stderr.strip()}"
        table = _run("ip", "netns", "exec", probe, "nft", "add", "table", "inet", "probe", check=False)
        if table.returncode != 0:
            return f"nftables does not work in a namespace: {table.stderr.strip()}"
    finally:
        _run("ip", "netns", "del", probe, check=False)
    return None


@dataclass
class Host:
    name: str
    index: int
    netns: str
    ip: str
    link: str  # the root-namespace end of its veth pair (on the bridge)
    home: Path  # its own HOME and agent-state folder

    @property
    def exec_prefix(self) -> list[str]:
        """Prepend to an argv to run it on this host (`ip netns exec` keeps the pid)."""
        return ["ip", "netns", "exec", self.netns]


@dataclass
class TestBed:
    """Hosts in namespaces on a bridge; see the module docstring. A context manager."""

    names: list[str]
    run_id: str = field(default_factory=lambda: f"{PREFIX}{os.getpid()}")
    proxy_seed: int = 0
    hosts: dict[str, Host] = field(default_factory=dict)
    subnet: str = ""
    folder: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="acp-hosts-")))
    _watchdog: subprocess.Popen[bytes] | None = None
    _proxy: subprocess.Popen[bytes] | None = None

    __test__ = False  # not a pytest class

    @property
    def bridge(self) -> str:
        return f"{self.run_id}b"

    @property
    def driver_ip(self) -> str:
        return f"{self.subnet}.1"

    @property
    def redis_ip(self) -> str:
        return f"{self.subnet}.2"

    @property
    def proxy_control(self) -> Path:
        return self.folder / "proxy.sock"

    def __enter__(self) -> TestBed:
        return self.start()

    def __exit__(self, *_: Any) -> None:
        self.stop()

    # ---- building ---------------------------------------------------------------------

    def start(self) -> TestBed:
        reason = unavailable_reason()
        if reason is not None:
            raise HostsUnavailable(reason)
        if _namespaces(self.run_id):
            raise RuntimeError(f"a bed of this process ({self.run_id}) is up already: one at a time")
        clean_dead_runs()
        self.folder.mkdir(parents=True, exist_ok=True)
        os.environ[RUN_ENV] = self.run_id  # inherited by every process started from here on
        self._watchdog = subprocess.Popen(
            [sys.executable, "-m", "testbed.hosts", "watch", str(os.getpid()), self.run_id, str(self.folder)],
            cwd=str(ROOT), start_new_session=True, stdin=subprocess.DEVNULL,
            env={k: v for k, v in os.environ.items() if k != RUN_ENV},  # it must not reap itself
        )
        try:
            self._build()
        except BaseException:
            self.stop()
            raise
        return self

    def _build(self) -> None:
        self.subnet = _free_subnet()
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.driver_ip}/24", "dev", self.bridge)
        _run("ip", "addr", "add", f"{self.redis_ip}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for index, name in enumerate(self.names):
            host = Host(name, index, f"{self.run_id}-{name}", f"{self.subnet}.{10 + index}",
                        f"{self.run_id}h{index}", self.folder / name)
            host.home.mkdir(parents=True, exist_ok=True)
            inner = f"{self.run_id}i{index}"
            _run("ip", "netns", "add", host.netns)
            _run("ip", "link", "add", host.link, "type", "veth", "peer", "name", inner)
            _run("ip", "link", "set", inner, "netns", host.netns)
            _run("ip", "link", "set", host.link, "master", self.bridge)
            _run("ip", "link", "set", host.link, "up")
            ns = host.exec_prefix
            _run(*ns, "ip", "link", "set", "lo", "up")
            _run(*ns, "ip", "link", "set", inner, "name", "eth0")
            _run(*ns, "ip", "addr", "add", f"{host.ip}/24", "dev", "eth0")
            _run(*ns, "ip", "link", "set", "eth0", "up")
            self.hosts[name] = host
        self._start_proxy()

    def _start_proxy(self) -> None:
        """The fault proxy (root namespace) and the rule that sends every host's connections
        to Redis through it; its upstream is Redis on loopback (never redirected)."""
        port = _free_port()
        self._proxy = subprocess.Popen(
            [sys.executable, "-m", "testbed.fault_proxy", "--listen", f"0.0.0.0:{port}", "--transparent",
             "--upstream-host", "127.0.0.1", "--control", str(self.proxy_control), "--seed", str(self.proxy_seed)],
            cwd=str(ROOT), stdout=subprocess.PIPE, stderr=open(self.folder / "proxy.log", "ab"),  # noqa: SIM115
        )
        assert self._proxy.stdout is not None
        line = self._proxy.stdout.readline().decode()
        if "listening" not in line:
            raise RuntimeError(f"the fault proxy did not start: {line!r}; see {self.folder / 'proxy.log'}")
        sources = ", ".join(h.ip for h in self.hosts.values())
        _run("nft", "-f", "-", input=(
            f"table ip {self.run_id} {{\n"
            f"  chain prerouting {{ type nat hook prerouting priority dstnat; policy accept;\n"
            f"    ip saddr {{ {sources} }} ip daddr {self.redis_ip} meta l4proto tcp redirect to :{port}\n"
            f"  }}\n}}\n"
        ))

    def proxy(self) -> Any:
        """The fault proxy's control client (latency, jitter, loss, black holes per host)."""
        from .fault_proxy import FaultProxyControl

        return FaultProxyControl(str(self.proxy_control))

    # ---- faults -----------------------------------------------------------------------

    def partition(self, name: str, direction: str = "both") -> None:
        """Drop the host's packets to Redis (`out`), from Redis (`in`), or both, in its own
        namespace: no RST, no FIN. The APIs' clients (from the driver's address) still reach
        it. Replaces any partition the host had."""
        if direction not in ("both", "in", "out"):
            raise ValueError(direction)
        rules = []
        if direction in ("both", "in"):
            rules.append(f"chain input {{ type filter hook input priority 0; ip saddr {self.redis_ip} drop; }}")
        if direction in ("both", "out"):
            rules.append(f"chain output {{ type filter hook output priority 0; ip daddr {self.redis_ip} drop; }}")
        self.heal(name)
        self._nft(name, "table ip partition {\n" + "\n".join(rules) + "\n}\n")

    def half_open(self, name: str) -> int:
        """Black-hole the host's connections to Redis that are open now (both ways, no RST),
        while new ones still connect: only a process that notices a dead connection by
        itself (timeouts, TCP keepalive) recovers. Returns how many connections it cut."""
        ports = self.connections_to_redis(name)
        self.heal(name)
        if not ports:
            return 0
        listed = ", ".join(str(p) for p in ports)
        self._nft(name, (
            "table ip partition {\n"
            f"chain input {{ type filter hook input priority 0; ip saddr {self.redis_ip} tcp dport {{ {listed} }} drop; }}\n"
            f"chain output {{ type filter hook output priority 0; ip daddr {self.redis_ip} tcp sport {{ {listed} }} drop; }}\n"
            "}\n"
        ))
        return len(ports)

    def connections_to_redis(self, name: str) -> list[int]:
        """The local ports of the host's established TCP connections to Redis."""
        out = _run(*self.hosts[name].exec_prefix, "ss", "-Htn", "state", "established", "dst", self.redis_ip).stdout
        ports = set()
        for line in out.splitlines():
            parts = line.split()
            if len(parts) >= 3:
                ports.add(int(parts[-2].rsplit(":", 1)[1]))
        return sorted(ports)

    def heal(self, name: str) -> None:
        """Undo `partition` and `half_open` on the host."""
        _run(*self.hosts[name].exec_prefix, "nft", "delete", "table", "ip", "partition", check=False)

    def link_down(self, name: str) -> None:
        """Pull the host's cable: its link loses carrier, nothing crosses either way (the
        API's own clients are cut too)."""
        _run("ip", "link", "set", self.hosts[name].link, "down")

    def link_up(self, name: str) -> None:
        _run("ip", "link", "set", self.hosts[name].link, "up")

    def _nft(self, name: str, ruleset: str) -> None:
        _run(*self.hosts[name].exec_prefix, "nft", "-f", "-", input=ruleset)

    # ---- tearing down -----------------------------------------------------------------

    def stop(self) -> None:
        """Remove everything the bed made (idempotent), then stop its watchdog."""
        reap(self.run_id, self.folder)
        if self._watchdog is not None and self._watchdog.poll() is None:
            self._watchdog.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._watchdog.wait(5)
        if os.environ.get(RUN_ENV) == self.run_id:
            del os.environ[RUN_ENV]


def _free_port() -> int:
    from .redis_server import free_port

    return free_port("0.0.0.0")


def _free_subnet() -> str:
    """A 10.213.<n>/24 no interface of the root namespace has yet, starting from the pid's."""
    used = _run("ip", "-o", "-4", "addr", "show").stdout
    start = os.getpid() % 250
    for step in range(250):
        candidate = f"{SUBNET_BASE}.{(start + step) % 250 + 1}"
        if f" {candidate}." not in used:
            return candidate
    raise RuntimeError("no free 10.213.x.0/24 subnet")


# ----------------------------------------------------------------------------- reaping


def _processes_of(run_id: str) -> list[int]:
    """Pids whose environment carries the run's id, and those in its namespaces."""
    pids: set[int] = set()
    marker = f"{RUN_ENV}={run_id}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if marker in (entry / "environ").read_bytes().split(b"\0"):
                pids.add(int(entry.name))
    for netns in _namespaces(run_id):
        out = _run("ip", "netns", "pids", netns, check=False).stdout
        pids.update(int(p) for p in out.split() if p.isdigit())
    pids.discard(os.getpid())
    return sorted(pids)


def _namespaces(run_id: str) -> list[str]:
    out = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.split() and line.split()[0].startswith(f"{run_id}-")]


def _links(run_id: str) -> list[str]:
    out = _run("ip", "-o", "link", "show", check=False).stdout
    names = [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line]
    return [n for n in names if n.startswith(run_id) and n[len(run_id):len(run_id) + 1] in ("b", "h", "i")]


def leftovers(run_id: str) -> dict[str, list[Any]]:
    """What of a run is still here: processes, namespaces, links, nft tables."""
    tables = _run("nft", "list", "tables", check=False).stdout.split()
    return {
        "processes": _processes_of(run_id),
        "namespaces": _namespaces(run_id),
        "links": _links(run_id),
        "tables": [t for t in tables if t == run_id],
    }


def reap(run_id: str, folder: Path | None = None) -> None:
    """Kill the run's processes, then remove its namespaces, links, nft table and folder."""
    for _ in range(3):  # a process may start another as it dies
        pids = _processes_of(run_id)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() and not _zombie(p) for p in pids):
            time.sleep(0.02)
    for netns in _namespaces(run_id):
        _run("ip", "netns", "del", netns, check=False)
    for link in _links(run_id):
        _run("ip", "link", "del", link, check=False)
    _run("nft", "delete", "table", "ip", run_id, check=False)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z")
    except (OSError, IndexError):
        return True


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not _zombie(pid)


def clean_dead_runs() -> list[str]:
    """Reap every bed whose driver is gone (its pid is in its run id). Returns their ids."""
    names = _run("ip", "netns", "list", check=False).stdout.split()
    names += [line.split(":")[1].strip() for line in _run("ip", "-o", "link", "show", check=False).stdout.splitlines()
              if line.count(":") >= 2]
    runs = {PREFIX + digits for name in names if name.startswith(PREFIX)
            and (digits := _leading_digits(name[len(PREFIX):]))}
    dead = [run for run in sorted(runs) if not _pid_alive(int(run[len(PREFIX):]))]
    for run in dead:
        reap(run)
    return dead


def _leading_digits(text: str) -> str:
    return text[: len(text) - len(text.lstrip("0123456789"))]


def _watch(parent: int, run_id: str, folder: str) -> int:
    """The watchdog: wait for the driver to die, then reap its bed. SIGTERM (the bed's own
    `stop`, which reaped already) ends it quietly."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while _pid_alive(parent):
        time.sleep(0.2)
    reap(run_id, Path(folder))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    command = args[0] if args else "check"
    if command == "check":
        reason = unavailable_reason()
        print(reason or "the host test bed can run here")
        return UNAVAILABLE_EXIT if reason else 0
    if command == "clean":
        print("reaped: " + (", ".join(clean_dead_runs()) or "nothing"))
        return 0
    if command == "watch":
        return _watch(int(args[1]), args[2], args[3])
    if command == "shell":
        try:
            with TestBed(["api-1", "worker-1"]) as bed:
                for host in bed.hosts.values():
                    print(f"{host.name}: {host.ip} ({' '.join(host.exec_prefix)})")
                print(f"redis address {bed.redis_ip}, proxy control {bed.proxy_control}; Ctrl-C ends it")
                signal.sigwait({signal.SIGINT, signal.SIGTERM})
        except HostsUnavailable as error:
            print(error, file=sys.stderr)
            return UNAVAILABLE_EXIT
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
