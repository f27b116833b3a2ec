"""A Redis primary, its replica and three sentinels on free ports of 127.0.0.1, started as
processes of a producer.fleet.Fleet (logs in its workdir, stopped by pid with it), for tests and
chaos runs of a failover. Each sentinel has a config file of its own in the workdir (Sentinel
rewrites it) and declares the primary down after `down_after_ms`, so a failover promotes the
replica within a few seconds of the primary's kill or pause.

    sentinels = SentinelRedis(fleet).start()     # fleet.redis_url is the sentinel:// URL
    sentinels.kill_master()                      # SIGKILL, or pause_master() / resume()
    promoted = sentinels.wait_promoted(old)      # the new master, and when it was promoted
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

import redis

from producer.fleet import Fleet, free_port
from schemas.redis_url import SentinelUrl

MASTER_NAME = "cchatq"
HOST = "127.0.0.1"
QUORUM = 2


@dataclass
class Promotion:
    address: tuple[str, int]  # the new master's
    at: float  # time.monotonic() when a sentinel first named it


@dataclass
class SentinelRedis:
    fleet: Fleet
    down_after_ms: int = 1000
    failover_timeout_ms: int = 5000
    sentinel_count: int = 3
    # more redis-server options for both servers (e.g. ["--min-replicas-to-write", "1"])
    server_args: list[str] = field(default_factory=list)
    servers: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)  # port -> proc
    sentinel_ports: list[int] = field(default_factory=list)
    paused: set[int] = field(default_factory=set)

    @property
    def url(self) -> SentinelUrl:
        return SentinelUrl(tuple((HOST, p) for p in self.sentinel_ports), MASTER_NAME)

    def start(self, timeout_s: float = 30) -> SentinelRedis:
        """Primary, replica (in sync), then the sentinels (until each knows the replica and
        the other sentinels); the fleet's redis_url becomes the sentinel:// URL."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        deadline = time.monotonic() + timeout_s
        primary = self._server(binary, "redis-primary", [])
        replica = self._server(binary, "redis-replica", ["--replicaof", HOST, str(primary)])
        _until(deadline, "the replica in sync", lambda: _in_sync(replica))
        for n in range(self.sentinel_count):
            port = free_port()
            conf = self.fleet.workdir / f"sentinel-{n}.conf"
            conf.write_text(
                f"port {port}\nbind {HOST}\ndir {self.fleet.workdir}\n"
                f"sentinel monitor {MASTER_NAME} {HOST} {primary} {QUORUM}\n"
                f"sentinel down-after-milliseconds {MASTER_NAME} {self.down_after_ms}\n"
                f"sentinel failover-timeout {MASTER_NAME} {self.failover_timeout_ms}\n"
                f"sentinel parallel-syncs {MASTER_NAME} 1\n"
            )
            self.fleet.spawn([binary, str(conf), "--sentinel"], f"sentinel-{n}")
            self.sentinel_ports.append(port)
        _until(deadline, "the sentinels ready", self._sentinels_ready)
        self.fleet.redis_url = self.redis_url()
        return self

    def redis_url(self) -> str:
        hosts = ",".join(f"{HOST}:{p}" for p in self.sentinel_ports)
        return f"sentinel://{hosts}/{MASTER_NAME}/0"

    def _server(self, binary: str, name: str, args: list[str]) -> int:
        port = free_port()
        cmd = [binary, "--port", str(port), "--bind", HOST, "--save", "", "--appendonly", "no",
               "--dir", str(self.fleet.workdir), "--dbfilename", f"{name}.rdb",
               *self.server_args, *args]  # fmt: skip
        self.servers[port] = self.fleet.spawn(cmd, name)
        _until(time.monotonic() + 10, f"{name} answering", lambda: _answers(port))
        return port

    def _sentinels_ready(self) -> bool:
        for port in self.sentinel_ports:
            try:
                with redis.Redis(HOST, port, socket_timeout=1) as sentinel:
                    state = sentinel.sentinel_master(MASTER_NAME)
                    if int(state["num-other-sentinels"]) < self.sentinel_count - 1:
                        return False
                    if int(state["num-slaves"]) < len(self.servers) - 1:
                        return False
            except (redis.RedisError, KeyError):
                return False
        return True

    # the master ----------------------------------------------------------------------------

    def master(self) -> tuple[str, int] | None:
        """The master the sentinels name now (the first that answers), None if none does."""
        for port in self.sentinel_ports:
            with (
                contextlib.suppress(redis.RedisError),
                redis.Redis(HOST, port, socket_timeout=1) as sentinel,
            ):
                found = sentinel.sentinel_get_master_addr_by_name(MASTER_NAME)
                if found:
                    host = found[0].decode() if isinstance(found[0], bytes) else str(found[0])
                    return host, int(found[1])
        return None

    def master_port(self) -> int:
        found = self.master()
        if found is None:
            raise RuntimeError("no sentinel names a master")
        return found[1]

    def kill_master(self, sig: int = signal.SIGKILL) -> int:
        """Signal the master's process (SIGKILL: it is gone); its port."""
        port = self.master_port()
        os.kill(self.servers[port].pid, sig)
        if sig == signal.SIGKILL:
            self.servers[port].wait(timeout=10)
        return port

    def pause_master(self) -> int:
        """SIGSTOP the master: its connections stay open, it answers nothing; its port."""
        port = self.master_port()
        os.kill(self.servers[port].pid, signal.SIGSTOP)
        self.paused.add(port)
        return port

    def resume(self, port: int) -> None:
        """SIGCONT a paused server: the sentinels turn it into a replica of the new master."""
        os.kill(self.servers[port].pid, signal.SIGCONT)
        self.paused.discard(port)

    def wait_promoted(self, old_port: int, timeout_s: float = 60) -> Promotion:
        """Until a sentinel names another master than `old_port` (polled every 20 ms)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = self.master()
            if found is not None and found[1] != old_port:
                return Promotion(found, time.monotonic())
            time.sleep(0.02)
        raise RuntimeError(f"no replica promoted within {timeout_s:g} s of {old_port}'s loss")

    def wait_replica(self, port: int, timeout_s: float = 60) -> None:
        """Until the server at `port` is a replica in sync with the current master, and every
        sentinel knows it for one it may promote (they read the master's INFO every 10 s)."""
        deadline = time.monotonic() + timeout_s
        _until(deadline, f"{port} a replica in sync", lambda: _in_sync(port))
        _until(deadline, f"the sentinels to know {port}", lambda: self._known_replica(port))

    def _known_replica(self, port: int) -> bool:
        for sentinel_port in self.sentinel_ports:
            try:
                with redis.Redis(HOST, sentinel_port, socket_timeout=1) as sentinel:
                    replicas = sentinel.sentinel_slaves(MASTER_NAME)
            except redis.RedisError:
                return False
            live = [r for r in replicas if int(r["port"]) == port and not r["is_sdown"]]
            if not live or live[0].get("master-link-status") != "ok":
                return False
        return True

    def restart(self, port: int) -> None:
        """Start a killed server again on its port, as a replica of the current master (what
        an operator, or a managed service, does after a failover)."""
        binary = shutil.which("redis-server") or "redis-server"
        host, master = self.master() or (HOST, 0)
        cmd = [binary, "--port", str(port), "--bind", HOST, "--save", "", "--appendonly", "no",
               "--dir", str(self.fleet.workdir), "--dbfilename", f"redis-{port}.rdb",
               *self.server_args, "--replicaof", host, str(master)]  # fmt: skip
        self.servers[port] = self.fleet.spawn(cmd, f"redis-{port}")

    def info(self, section: str = "replication") -> dict[int, dict[str, Any]]:
        """INFO of every live, unpaused server, by port."""
        found = {}
        for port, proc in self.servers.items():
            if proc.poll() is None and port not in self.paused:
                with (
                    contextlib.suppress(redis.RedisError),
                    redis.Redis(HOST, port, socket_timeout=1) as server,
                ):
                    found[port] = server.info(section)
        return found

    def stop(self) -> None:
        """Resume what is paused (a stopped process ignores SIGTERM); the fleet stops them."""
        for port in list(self.paused):
            with contextlib.suppress(ProcessLookupError):
                self.resume(port)


def _answers(port: int) -> bool:
    try:
        with redis.Redis(HOST, port, socket_timeout=1) as server:
            return bool(server.ping())
    except redis.RedisError:
        return False


def _in_sync(port: int) -> bool:
    try:
        with redis.Redis(HOST, port, socket_timeout=1) as server:
            info = server.info("replication")
    except redis.RedisError:
        return False
    return bool(info.get("role") == "slave" and info.get("master_link_status") == "up")


def _until(deadline: float, what: str, ready: Any) -> None:
    while not ready():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)
