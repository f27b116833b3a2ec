"""A local fleet on one machine: a Redis, the replay LLM server and Celery workers, started as
subprocesses and stopped by pid. Used by `cchatq demo`, the tests and the benchmarks.

Workers are started as `python -m celery -A worker.tasks worker ...` processes, so the producer
never imports the worker. Every process runs in a session of its own (its process group is it
and its children), with its output in a log file, so it can outlive the process that started it
(`cchatq up`, producer/local_fleet.py).

A fleet with no `workdir` given makes a temporary one and removes it on `stop()`, unless it is
kept: `keep` set (a caller that failed and wants the logs read) or CCHATQ_KEEP_FLEET_DIR=1.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import redis

from producer.broker_queues import broker_reader
from producer.fleet_status import broker_status
from producer.redis_connect import redis_client
from schemas import task_names
from schemas.config import read_config
from schemas.fleet_config import FleetConfig
from schemas.fleet_urls import fleet_urls
from schemas.protocols import PROTOCOLS

# the variables a configuration is read from (schemas/config.py read_config)
CONFIG_VARIABLES = ("CCHATQ_BACKENDS", "CCHATQ_CONFIG")

# queue -> (pool, concurrency): I/O-bound model calls on threads, CPU-bound WASM on one process
# per core, bookkeeping on a few threads (docs/architecture.md section 2).
WORKER_PROFILES: dict[str, tuple[str, int]] = {
    "llm": ("threads", 32),
    "tools": ("prefork", os.cpu_count() or 2),
    "control": ("threads", 8),
    "programs": ("threads", 16),
    # long calls that mostly wait: wasmtime runs outside the GIL (ctypes), so threads suffice
    "background": ("threads", 16),
}


def replay_backend_name(protocol: str, stream: bool) -> str:
    return f"replay-{protocol}" + ("-stream" if stream else "")


def replay_backends(replay_url: str) -> dict[str, dict[str, object]]:
    """A backend per protocol and stream setting, on the replay server (each at its path)."""
    root = replay_url.removesuffix("/v1")
    backends: dict[str, dict[str, object]] = {
        replay_backend_name(protocol, stream): {
            "protocol": protocol,
            "base_url": root + declared.replay_path,
            "stream": stream,
        }
        for protocol, declared in PROTOCOLS.items()
        for stream in (False, True)
    }
    # and thinking on where its signatures must be replayed
    for protocol in [p.name for p in PROTOCOLS.values() if p.replay.signed_thinking]:
        for stream in (False, True):
            backend = dict(backends[replay_backend_name(protocol, stream)])
            backend["thinking_budget_tokens"] = 1024
            backends[replay_backend_name(protocol, stream) + "-thinking"] = backend
    return backends


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def proc_stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after `pid (comm)`: state, ppid, pgrp, ...; None when gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def proc_stats() -> Iterator[tuple[int, list[str]]]:
    """Every live process's pid and proc_stat fields (those gone meanwhile left out)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        pid = int(stat.parent.name)
        fields = proc_stat(pid)
        if fields is not None:
            yield pid, fields


def redis_answers(url: str) -> bool:
    try:
        client = redis_client(url, whole_cluster=False, socket_connect_timeout=0.5)
        return bool(client.ping())
    except (redis.RedisError, ValueError):  # ValueError: not a Redis URL
        return False


def worker_command(
    queue: str, pool: str | None = None, concurrency: int | None = None, name: str | None = None
) -> list[str]:
    default_pool, default_concurrency = WORKER_PROFILES.get(queue.split(",")[0], ("threads", 8))
    return [
        sys.executable, "-m", "celery", "-A", "worker.tasks", "worker",
        "-Q", queue,
        "-P", pool or default_pool,
        "-c", str(concurrency or default_concurrency),
        "-n", f"{name or queue.replace(',', '-')}@%h",
        "--without-gossip", "--without-mingle",
        "--loglevel", os.environ.get("CCHATQ_LOG_LEVEL", "WARNING"),
    ]  # fmt: skip


@dataclass
class Fleet:
    """Processes started by this fleet, stopped (by pid) on exit. `workdir` holds Redis's data
    and the logs (unless `log_dir`); left empty, a temporary one that `stop()` removes."""

    redis_url: str = ""
    replay_url: str = ""
    env: dict[str, str] = field(default_factory=dict)
    workdir: Path = field(default_factory=Path)
    log_dir: Path | None = None
    keep: bool = False  # keep a temporary workdir on stop (its logs, to read after a failure)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    workers: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    redis_cmd: list[str] = field(default_factory=list)  # our redis-server's, to restart it
    redis_proc: subprocess.Popen[bytes] | None = None
    names: dict[int, str] = field(default_factory=dict)  # pid -> the name its log is under
    owns_workdir: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        if self.workdir == Path():
            self.workdir = Path(tempfile.mkdtemp(prefix="cchatq-fleet-"))
            self.owns_workdir = True

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is not None and self.owns_workdir:
            self.keep = True  # what failed is in the logs
        self.stop()

    @property
    def logs(self) -> Path:
        return self.log_dir or self.workdir

    def log_of(self, name: str) -> Path:
        return self.logs / f"{name}.log"

    # redis ---------------------------------------------------------------------------------

    def ensure_redis(
        self, url: str | None = None, private: bool = False, appendonly: bool = False,
        bind: Sequence[str] = (),
    ) -> str:  # fmt: skip
        """Use `url` (or REDIS_URL) when it answers; else (or when `private`) start a
        redis-server of our own on a free port. `appendonly`: ours keeps an append-only file
        in the workdir, fsynced every second, so `restart_redis` finds what it held. `bind`:
        addresses ours listens on besides 127.0.0.1 (test hosts' gateways, bench/netns.py)."""
        candidate = None if private else (url or os.environ.get("REDIS_URL"))
        if candidate and redis_answers(candidate):
            self.redis_url = candidate
            return candidate
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError(
                "no Redis answers and redis-server is not installed (apt-get install redis-server)"
            )
        port = free_port()
        persistence = ["--appendonly", "no"]
        if appendonly:
            persistence = ["--appendonly", "yes", "--appendfsync", "everysec"]
        # named addresses only: protected mode (loopback clients only) is for a Redis on all
        listen = ["--bind", "127.0.0.1", *bind, *(["--protected-mode", "no"] if bind else [])]
        self.redis_cmd = [binary, "--port", str(port), *listen, "--save", "",
                          *persistence, "--dir", str(self.workdir)]  # fmt: skip
        self.redis_url = f"redis://127.0.0.1:{port}/0"
        self._start_redis()
        return self.redis_url

    def _start_redis(self) -> None:
        proc = self.redis_proc = self.spawn(self.redis_cmd, "redis")
        deadline = time.monotonic() + 10
        while not redis_answers(self.redis_url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start (see {self.log_of('redis')})")
            time.sleep(0.05)

    def restart_redis(self, sig: int = signal.SIGKILL, down_s: float = 0.0) -> float:
        """Stop our redis-server with `sig`, leave it down `down_s`, start it again on the same
        port and directory (with an append-only file, it loads what was fsynced). Returns how
        long it did not answer."""
        if self.redis_proc is None:
            raise RuntimeError("this fleet started no redis-server")
        stopped = time.monotonic()
        _signal_group(self.redis_proc, sig)  # an AOF rewrite may have forked a child
        self.redis_proc.wait(timeout=30)
        self.procs.remove(self.redis_proc)
        time.sleep(down_s)
        self._start_redis()
        return time.monotonic() - stopped

    # replay server -------------------------------------------------------------------------

    def start_replay(self, latency_ms: int = 0, args: Sequence[str] = ()) -> str:
        """Start the replay server; `args` are more of its options (`--fault-429-rate 0.1`).
        It picks a free port itself and says `READY <url>` in its log."""
        cmd = [sys.executable, "-m", "fixtures.replay", "--port", "0",
               "--latency-ms", str(latency_ms), *args]  # fmt: skip
        log = self.log_of("replay")
        offset = log.stat().st_size if log.exists() else 0  # a line of an earlier one is not it
        proc = self.spawn(cmd, "replay")
        deadline = time.monotonic() + 15
        while True:
            ready = _ready_line(log, offset)
            if ready:
                self.replay_url = ready
                return ready
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"replay server did not start (see {log})")
            time.sleep(0.05)

    # workers -------------------------------------------------------------------------------

    def worker_env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """This process's environment with the fleet's Redis, module cache and configuration.
        The configuration: what `env` names (CCHATQ_BACKENDS or CCHATQ_CONFIG), else the
        replay server's backends when this fleet has one, else this process's own."""
        env = dict(os.environ)
        env.update(
            {"REDIS_URL": self.redis_url, "CCHATQ_MODULE_CACHE_DIR": str(self.workdir / "modules")}
        )
        named = {k: v for k, v in self.env.items() if k in CONFIG_VARIABLES}
        if not named and self.replay_url:
            named = {"CCHATQ_BACKENDS": json.dumps({"backends": replay_backends(self.replay_url)})}
        if named:  # one configuration, not another one this process happens to have as well
            for variable in CONFIG_VARIABLES:
                env.pop(variable, None)
        if self.replay_url:
            env["CCHATQ_REPLAY_URL"] = self.replay_url
        env.update(named)
        env.update(self.env)
        env.update(extra or {})
        return env

    def config(self) -> FleetConfig:
        """The configuration its workers read (worker_env): what a producer checks specs
        against."""
        return read_config(self.worker_env())

    def start_worker(
        self,
        queue: str,
        pool: str | None = None,
        concurrency: int | None = None,
        extra_env: dict[str, str] | None = None,
        prefix: Sequence[str] = (),
    ) -> subprocess.Popen[bytes]:
        """`prefix`: what the command runs under (`ip netns exec HOST`: a test host's)."""
        name = f"{queue.replace(',', '-')}-{len(self.workers)}"
        command = [*prefix, *worker_command(queue, pool, concurrency, name)]
        proc = self.spawn(command, name, env=self.worker_env(extra_env))
        self.workers[name] = proc
        return proc

    def start_workers(self, extra_env: dict[str, str] | None = None) -> None:
        for queue in task_names.ALL_QUEUES:
            self.start_worker(queue, extra_env=extra_env)

    def wait_served(
        self,
        queues: Sequence[str] = task_names.ALL_QUEUES,
        timeout_s: float = 60,
        already: dict[str, int] | None = None,
    ) -> None:
        """Until each of `queues` (start_workers' own) has a consumer on the fleet's broker (a
        worker registers once it has booted), so that a batch submitted next is not warned about.
        `already`: consumers per queue there were before ours started (a shared Redis), each
        queue waits for one more. A worker of ours that exits meanwhile fails it at once."""
        # its consumers are there: a Redis's beating consumers, or RabbitMQ's queues'
        client = broker_reader(fleet_urls(self.worker_env()).broker, redis_client)
        deadline = time.monotonic() + timeout_s
        before = already or {}
        try:
            while True:
                served = broker_status(client).consumers_by_queue
                missing = sorted(q for q in queues if served.get(q, 0) <= before.get(q, 0))
                if not missing:
                    return
                for name, proc in self.workers.items():
                    if proc.poll() is not None:
                        raise RuntimeError(
                            f"worker {name} exited with {proc.returncode} (see {self.log_of(name)})"
                        )
                if time.monotonic() > deadline:
                    logs = [str(self.log_of(n)) for n in self.workers if _queue_of(n) in missing]
                    where = ", ".join(logs) or str(self.logs)
                    raise RuntimeError(f"no worker took from {missing} (see {where})")
                time.sleep(0.1)
        finally:
            client.close()

    def kill(self, proc: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> None:
        """Signal a process and all its children (a prefork worker's pool processes too)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        proc.wait(timeout=30)

    def pool_children(self, proc: subprocess.Popen[bytes]) -> list[int]:
        """The pids of a worker's child processes (a prefork pool's), read from /proc."""
        return sorted(
            pid
            for pid, fields in proc_stats()
            if int(fields[1]) == proc.pid  # fields: state, ppid, pgrp, ...
        )

    # lifecycle -----------------------------------------------------------------------------

    def spawn(
        self, cmd: list[str], name: str, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        """Start `cmd` in a session of its own, its output appended to `<name>.log` and no
        stdin: nothing ties it to this process (a shell's `$(...)` waiting on our stdout)."""
        self.logs.mkdir(parents=True, exist_ok=True)
        with open(self.log_of(name), "ab") as log:  # the child keeps its own descriptor
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        self.procs.append(proc)
        self.names[proc.pid] = name
        return proc

    def stop(self) -> None:
        """Stop every process this fleet started: SIGTERM, then SIGKILL after a grace period.
        Then a temporary workdir of its own goes, unless kept."""
        for proc in reversed(self.procs):
            if proc.poll() is None:
                _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait(timeout=10)
        self.procs.clear()
        self.workers.clear()
        self.redis_proc = None
        if self.owns_workdir and not self.kept:
            shutil.rmtree(self.workdir, ignore_errors=True)

    @property
    def kept(self) -> bool:
        """Whether stop() leaves a temporary workdir in place (for its logs)."""
        return self.keep or os.environ.get("CCHATQ_KEEP_FLEET_DIR", "") not in ("", "0")


def _queue_of(worker_name: str) -> str:
    """A worker's queue from the name start_worker gave it (`llm-0`, `tools-1`)."""
    return worker_name.rsplit("-", 1)[0]


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:  # started in its own session: the group is the process and its children
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)


def _ready_line(log: Path, offset: int) -> str:
    """The url of the replay server's `READY <url>` line, written past `offset` of its log."""
    try:
        with open(log, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    found = re.search(r"^READY (\S+)$", text, flags=re.M)
    return found.group(1) if found else ""
