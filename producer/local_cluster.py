"""A Redis Cluster on one machine, for the tests, the benchmarks and `cchatq up --cluster N`: N
masters started as redis-server processes through a Fleet (producer/fleet.py: each in a session
of its own, its log in the fleet's log folder, stopped by pid), then formed with plain commands
(CLUSTER ADDSLOTSRANGE, SET-CONFIG-EPOCH, MEET), so only redis-server needs to be installed,
not redis-cli.

    with LocalCluster(masters=3) as cluster:
        client = RedisCluster.from_url(cluster.url)

Started through a fleet (`LocalCluster(fleet=fleet).start()`), the fleet's stop() stops it as
well. A cluster has one database: its URLs all name db 0.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from producer.fleet import Fleet, free_port, redis_answers
from producer.redis_connect import redis_client

SLOTS = 16384
# a master says ok no sooner than 2 s after it started (Redis's writable delay): three form in
# ~2.2 s here; a loaded machine is slower
FORM_TIMEOUT_S = 30.0
NODE_TIMEOUT_MS = 2000  # a node unreachable that long is marked failed by the others
STOP_GRACE_S = 10.0
START_ATTEMPTS = 3  # a free port taken by another program between free_port() and the bind


class ClusterFailed(RuntimeError):
    """The cluster's processes did not start or did not form; the message names what to read."""


@dataclass(frozen=True)
class Node:
    port: int
    bus_port: int  # the cluster bus's: a free port too, since port + 10000 may not be one
    proc: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


@dataclass
class LocalCluster:
    """`masters` redis-server processes in cluster mode, each holding an even share of the
    16384 slots. `fleet`: the one that spawns them (its workdir holds their nodes-PORT.conf,
    its log folder their logs, its stop() stops them); left empty, one of its own with a
    temporary workdir (or `workdir`), removed by stop()."""

    masters: int = 3
    fleet: Fleet | None = None
    workdir: Path | None = None
    form_timeout_s: float = FORM_TIMEOUT_S
    nodes: list[Node] = field(default_factory=list)
    owns_fleet: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        if self.masters < 1:
            raise ValueError(f"a cluster needs at least one master, not {self.masters}")
        if self.fleet is None:
            self.fleet = Fleet(workdir=self.workdir or Path())
            self.owns_fleet = True

    def __enter__(self) -> LocalCluster:
        if not self.nodes:
            self.start()
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is not None and self.owns_fleet:
            self._fleet.keep = True  # what failed is in the logs
        self.stop()

    @property
    def _fleet(self) -> Fleet:
        assert self.fleet is not None  # set by __post_init__
        return self.fleet

    @property
    def url(self) -> str:
        return self.nodes[0].url

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.nodes]

    @property
    def ports(self) -> list[int]:
        return [node.port for node in self.nodes]

    @property
    def pids(self) -> list[int]:
        return [node.proc.pid for node in self.nodes]

    def start(self) -> str:
        """Start the nodes and form the cluster; its URL. On failure what it started is
        stopped and ClusterFailed names the log to read."""
        try:
            self.launch()
            self.form()
        except BaseException:
            self.stop()
            raise
        return self.url

    def launch(self) -> None:
        """Start the nodes, each answering once this returns (a cluster not formed yet: a
        caller may record their pids before forming it)."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise ClusterFailed("redis-server is not installed (apt-get install redis-server)")
        while len(self.nodes) < self.masters:
            self.nodes.append(self._start_node(binary))

    def _start_node(self, binary: str) -> Node:
        fleet = self._fleet
        taken = {port for node in self.nodes for port in (node.port, node.bus_port)}
        for _ in range(START_ATTEMPTS):
            port, bus_port = _free_ports(2, taken)
            name = f"redis-cluster-{port}"
            cmd = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                   "--appendonly", "no", "--dir", str(fleet.workdir),
                   "--cluster-enabled", "yes", "--cluster-port", str(bus_port),
                   "--cluster-config-file", str(fleet.workdir / f"nodes-{port}.conf"),
                   "--cluster-node-timeout", str(NODE_TIMEOUT_MS)]  # fmt: skip
            node = Node(port, bus_port, fleet.spawn(cmd, name))
            deadline = time.monotonic() + 10
            while node.proc.poll() is None and time.monotonic() < deadline:
                if redis_answers(node.url):
                    return node
                time.sleep(0.05)
            self._stop_procs([node.proc])  # its port was taken meanwhile, or it hangs: again
        raise ClusterFailed(
            f"redis-server did not start in cluster mode (see {fleet.log_of(name)})"
        )

    def form(self) -> None:
        """Give each node its share of the slots and a config epoch of its own, introduce them
        all to the first, and wait until every node sees the whole cluster, all slots served."""
        clients = [
            redis_client(n.url, whole_cluster=False, decode_responses=True, socket_timeout=5)
            for n in self.nodes
        ]
        try:
            first = self.nodes[0]
            for i, client in enumerate(clients):
                low, high = i * SLOTS // self.masters, (i + 1) * SLOTS // self.masters - 1
                client.execute_command("CLUSTER", "ADDSLOTSRANGE", low, high)
                # distinct epochs, as redis-cli gives: no collision for the nodes to settle
                client.execute_command("CLUSTER", "SET-CONFIG-EPOCH", i + 1)
            for client in clients[1:]:
                client.execute_command("CLUSTER", "MEET", "127.0.0.1", first.port, first.bus_port)
            self._wait_formed(clients)
        finally:
            for client in clients:
                client.close()

    def _wait_formed(self, clients: list[Any]) -> None:
        deadline = time.monotonic() + self.form_timeout_s
        while True:
            waiting = [
                n.port for n, c in zip(self.nodes, clients, strict=True) if not self._sees_all(c)
            ]
            if not waiting:
                return
            for node in self.nodes:
                if node.proc.poll() is not None:
                    log = self._fleet.log_of(f"redis-cluster-{node.port}")
                    raise ClusterFailed(f"cluster node {node.port} exited (see {log})")
            if time.monotonic() > deadline:
                raise ClusterFailed(
                    f"the cluster did not form within {self.form_timeout_s:.0f} s: nodes "
                    f"{waiting} do not see all {self.masters} nodes and slots (see their "
                    f"logs in {self._fleet.logs})"
                )
            time.sleep(0.02)

    def _sees_all(self, client: Any) -> bool:
        """Whether a node says the cluster is ok, all slots assigned, and knows every node with
        none in handshake or suspected failed."""
        try:
            info = _fields(client.execute_command("CLUSTER", "INFO"))
            lines = str(client.execute_command("CLUSTER", "NODES")).strip().splitlines()
        except redis.RedisError:
            return False
        flags = [set(line.split()[2].split(",")) for line in lines if line.strip()]
        return (
            info.get("cluster_state") == "ok"
            and info.get("cluster_slots_assigned") == str(SLOTS)
            and info.get("cluster_known_nodes") == str(self.masters)
            and len(flags) == self.masters
            and not any(f & {"handshake", "fail", "fail?", "noaddr"} for f in flags)
        )

    def stop(self) -> None:
        """Stop exactly the processes this cluster started, by pid (SIGTERM, then SIGKILL
        after a grace period); a fleet of its own goes with its temporary workdir."""
        self._stop_procs([node.proc for node in self.nodes])
        self.nodes.clear()
        if self.owns_fleet:
            self._fleet.stop()

    def _stop_procs(self, procs: list[subprocess.Popen[bytes]]) -> None:
        for proc in procs:
            if proc.poll() is None:
                _signal_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in procs:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
            if proc in self._fleet.procs:  # the fleet's stop() has nothing left to do for it
                self._fleet.procs.remove(proc)


def _free_ports(count: int, taken: set[int]) -> list[int]:
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in taken and port not in ports:
            ports.append(port)
    return ports


def _fields(info: str) -> dict[str, str]:
    """CLUSTER INFO's `name:value` lines."""
    pairs = (line.split(":", 1) for line in str(info).splitlines() if ":" in line)
    return {name.strip(): value.strip() for name, value in pairs}


def _signal_group(pid: int, sig: int) -> None:
    # each node runs in a session of its own (Fleet.spawn): its group is it and its children
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
