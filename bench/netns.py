"""Hosts in network namespaces, for partition tests and chaos runs: each a namespace joined to
the root namespace by a veth pair, with a /30 of its own from 198.18.0.0/15 (RFC 2544's
benchmarking range), whose link can be cut silently (nftables drops everything in and out,
so no FIN or RST is ever sent) and healed.

    with Network() as net:
        host = net.add_host()               # host.gateway: where it reaches the root namespace
        fleet.start_worker("llm", prefix=host.prefix(), extra_env=...)
        host.cut(); ...; host.heal()

The servers a host uses (Redis, the replay server) listen on 127.0.0.1 and on the hosts'
gateway addresses (the root side of each veth); a host's processes reach them there. Traffic
stays between the run's namespaces and the root namespace: no route goes anywhere else.

Names are unique per run (`cq<pid><random>h<n>`), so several runs may share the machine;
addresses are drawn under a lock among those no interface holds. Everything is removed on
close (a context manager; also at exit, and a later Network sweeps what a killed run left).
Needs root, `ip` and `nft`: `missing()` says why not.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import random
import shutil
import signal
import subprocess
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

RANGE = ipaddress.ip_network("198.18.0.0/15")
CUT_TABLE = "cchatq_cut"
# the runs' markers (run id -> its process id), so a later run removes what a killed one left
RUNS_DIR = Path("/run/cchatq-netns")
LOCK = RUNS_DIR / ".lock"
# a host's link dropped both ways, its loopback left alone
CUT_RULES = f"""table inet {CUT_TABLE} {{
    chain input {{
        type filter hook input priority -300; policy drop;
        iifname "lo" accept
    }}
    chain output {{
        type filter hook output priority -300; policy drop;
        oifname "lo" accept
    }}
}}
"""


def missing() -> str:
    """Why hosts cannot be made here ("" when they can): not root, or `ip` / `nft` missing."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    absent = [tool for tool in ("ip", "nft") if shutil.which(tool) is None]
    if absent:
        return f"{' and '.join(absent)} not installed (apt-get install iproute2 nftables)"
    return ""


def _run(*cmd: str, stdin: str | None = None, check: bool = True) -> str:
    done = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip() or done.returncode}")
    return done.stdout


@dataclass
class Host:
    """One namespace: `address` its own, `gateway` the root side of its link."""

    name: str
    root_if: str
    address: str
    gateway: str
    is_cut: bool = False

    def prefix(self) -> list[str]:
        """What runs a command inside the host (`[*host.prefix(), *cmd]`): `ip netns exec`
        sets the namespace and execs the command, so its pid is the command's."""
        return ["ip", "netns", "exec", self.name]

    def cut(self) -> None:
        """Drop every packet in and out of the host's link, silently."""
        if not self.is_cut:
            _run("ip", "netns", "exec", self.name, "nft", "-f", "-", stdin=CUT_RULES)
            self.is_cut = True

    def heal(self) -> None:
        if self.is_cut:
            _run("ip", "netns", "exec", self.name, "nft", "delete", "table", "inet", CUT_TABLE)
            self.is_cut = False

    def pids(self) -> list[int]:
        """The processes running in the host's namespace."""
        out = _run("ip", "netns", "pids", self.name, check=False)
        return [int(pid) for pid in out.split()]


@dataclass
class Network:
    """A run's hosts, all removed by close()."""

    hosts: list[Host] = field(default_factory=list)
    run_id: str = ""

    def __post_init__(self) -> None:
        why = missing()
        if why:
            raise RuntimeError(f"cannot make hosts: {why}")
        RUNS_DIR.mkdir(parents=True, exist_ok=True)
        sweep_stale()
        self.run_id = f"cq{os.getpid():x}{random.randrange(256):02x}"
        (RUNS_DIR / self.run_id).write_text(str(os.getpid()))
        # at exit too, when the caller never reaches close()
        self._finalizer = weakref.finalize(self, _remove_run, self.run_id, self.hosts)

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def add_host(self) -> Host:
        """A new namespace with its veth pair, its /30's two addresses, its links and `lo`
        up, and a default route through its gateway."""
        number = len(self.hosts)
        name = f"{self.run_id}h{number}"
        root_if, inner_if = f"{name}r", f"{name}n"
        with _locked():
            subnet = _free_subnet()
            gateway, address = (str(a) for a in subnet.hosts())
            host = Host(name, root_if, address, gateway)
            self.hosts.append(host)  # removed on close even if what follows fails
            _run("ip", "netns", "add", name)
            _run("ip", "link", "add", root_if, "type", "veth", "peer", "name", inner_if)
            _run("ip", "link", "set", inner_if, "netns", name)
            _run("ip", "addr", "add", f"{gateway}/30", "dev", root_if)
            _run("ip", "link", "set", root_if, "up")
        inside = ("ip", "-n", name)
        _run(*inside, "addr", "add", f"{address}/30", "dev", inner_if)
        _run(*inside, "link", "set", inner_if, "up")
        _run(*inside, "link", "set", "lo", "up")
        _run(*inside, "route", "add", "default", "via", gateway)
        return host

    @property
    def gateways(self) -> list[str]:
        """Every host's gateway address: what servers bind besides 127.0.0.1."""
        return [host.gateway for host in self.hosts]

    def close(self) -> None:
        self._finalizer()


def _remove_run(run_id: str, hosts: Sequence[Host]) -> None:
    for host in hosts:
        _remove_host(host.name, host.root_if)
    with contextlib.suppress(OSError):
        (RUNS_DIR / run_id).unlink()


def _remove_host(name: str, root_if: str) -> None:
    """SIGKILL what still runs inside (the run's own processes), then the link (both ends go
    with it) and the namespace."""
    out = _run("ip", "netns", "pids", name, check=False)
    for pid in out.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
    _run("ip", "link", "del", root_if, check=False)
    _run("ip", "netns", "del", name, check=False)


def sweep_stale() -> None:
    """Remove the namespaces and links of runs whose process is gone (killed before close)."""
    if not RUNS_DIR.is_dir():
        return
    names = _run("ip", "netns", "list", check=False).split()
    for marker in RUNS_DIR.glob("cq*"):
        try:
            pid = int(marker.read_text())
        except (OSError, ValueError):
            continue
        if Path(f"/proc/{pid}").exists():
            continue
        for name in names:
            if name.startswith(marker.name + "h"):
                _remove_host(name, f"{name}r")
        with contextlib.suppress(OSError):
            marker.unlink()


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    """Address draws of concurrent runs, one at a time."""
    with open(LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _free_subnet() -> ipaddress.IPv4Network:
    """A /30 of RANGE that no interface of the root namespace has an address in."""
    used = set()
    for line in _run("ip", "-4", "-o", "addr", "show").splitlines():
        fields = line.split()
        if "inet" in fields:
            used.add(ipaddress.ip_interface(fields[fields.index("inet") + 1]).network)
    count = RANGE.num_addresses // 4
    for _ in range(1000):
        subnet = ipaddress.ip_network(
            (int(RANGE.network_address) + 4 * random.randrange(count), 30)
        )
        if not any(subnet.overlaps(other) for other in used):
            return subnet  # type: ignore[return-value]
    raise RuntimeError(f"no free /30 in {RANGE}")
