"""A private local fleet that outlives the command starting it: `cchatq up` starts it in a
folder (Redis, the replay server, a worker per queue, optionally Flower, the metrics exporter
and a Redis Cluster for the sessions' state) and records what it started in the folder's
fleet.json; `cchatq down` stops exactly those processes and removes the folder. The processes
are producer/fleet.py's, each in a session of its own; a recorded process is known again by its
pid and its start time, so a pid reused by another program is never signalled.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import socket
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import requests

from producer.fleet import (
    CONFIG_VARIABLES,
    Fleet,
    free_port,
    proc_stat,
    proc_stats,
    redis_answers,
    replay_backends,
)
from producer.fleet_status import read_fleet_status
from producer.local_cluster import LocalCluster
from producer.redis_connect import redis_client
from schemas.config import read_config
from schemas.fleet_urls import STATE_VARIABLE
from schemas.redis_url import redacted

DEFAULT_DIR = ".cchatq-fleet"  # in the current directory; CCHATQ_FLEET_DIR overrides it
RECORD = "fleet.json"
REPLAY_DEFAULT_BACKEND = "replay-openai"  # `"model": "replay/<scenario>"` on the OpenAI wire
FLOWER_PORT = 5555
METRICS_PORT = 9808
UP_DEADLINE_S = 90.0  # five workers booting at once on two cores take ~15 s
STOP_GRACE_S = 10.0


class UpFailed(RuntimeError):
    """`cchatq up` could not start its fleet; the message names the log to read."""


@dataclass(frozen=True)
class Started:
    """A process `up` started: known again by its pid and its start time (in clock ticks since
    boot, /proc/PID/stat), its group is itself and its children (its own session)."""

    name: str
    pid: int
    start_ticks: int
    cmdline: list[str]
    log: str


@dataclass
class FleetRecord:
    """DIR/fleet.json: what `up` started, where it listens, and the exports it printed."""

    dir: str
    redis_url: str = ""
    redis_private: bool = False
    state_url: str = ""  # the local Redis Cluster's (`up --cluster N`): the sessions' state
    replay_url: str = ""
    config: str = ""  # the configuration file up wrote (with the replay server)
    flower_url: str = ""
    metrics_url: str = ""
    processes: list[Started] = field(default_factory=list)
    failed: str = ""  # why up gave up: its processes are stopped

    def save(self) -> None:
        path = Path(self.dir) / RECORD
        path.with_suffix(".tmp").write_text(json.dumps(asdict(self), indent=2) + "\n")
        path.with_suffix(".tmp").replace(path)

    @classmethod
    def load(cls, folder: Path) -> FleetRecord | None:
        """The folder's record; None when it has none. A record that cannot be read raises."""
        path = folder / RECORD
        if not path.exists():
            return None
        raw: dict[str, Any] = json.loads(path.read_text())
        processes = [Started(**p) for p in raw.pop("processes", [])]
        return cls(**raw, processes=processes)

    def exports(self) -> list[str]:
        """The shell lines `eval "$(cchatq up)"` runs."""
        values = {"REDIS_URL": self.redis_url}
        if self.state_url:
            values[STATE_VARIABLE] = self.state_url
        if self.config:
            values["CCHATQ_CONFIG"] = self.config
        if self.replay_url:
            values["CCHATQ_REPLAY_URL"] = self.replay_url
        if self.flower_url:
            values["CCHATQ_FLOWER_URL"] = self.flower_url
        return [f"export {name}={shlex.quote(value)}" for name, value in values.items()]


def fleet_dir(given: str | None, environ: Mapping[str, str] = os.environ) -> Path:
    return Path(given or environ.get("CCHATQ_FLEET_DIR") or DEFAULT_DIR).absolute()


# processes, known by pid and start time ----------------------------------------------------


def start_ticks(pid: int) -> int:
    fields = proc_stat(pid)
    return int(fields[19]) if fields else -1  # field 22 of the whole line: starttime


def is_running(process: Started) -> bool:
    """Whether the recorded process still runs: the same pid with the same start time (not a
    pid reused since), and not a zombie."""
    fields = proc_stat(process.pid)
    return fields is not None and fields[0] != "Z" and int(fields[19]) == process.start_ticks


def group_members(pgid: int) -> list[int]:
    """The live processes of a process group, read from /proc."""
    return [pid for pid, fields in proc_stats() if fields[0] != "Z" and int(fields[2]) == pgid]


def our_group(process: Started) -> list[int]:
    """The live processes of the group a recorded process leads: none when its pid now names
    another program. With the leader gone, its group's members are its children (the kernel
    gives no new process a pid still in use as a group id)."""
    fields = proc_stat(process.pid)
    if fields is not None and int(fields[19]) != process.start_ticks:
        return []
    return group_members(process.pid)


def stop_processes(processes: Iterable[Started], grace_s: float = STOP_GRACE_S) -> list[Started]:
    """SIGTERM the groups of those still running (each its own session, so its group is it and
    its children), SIGKILL what is left after `grace_s`. Returns the ones that were running."""
    running = [p for p in processes if our_group(p)]
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        for process in [p for p in running if our_group(p)]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, sig)
        deadline = time.monotonic() + wait_s
        while any(our_group(p) for p in running) and time.monotonic() < deadline:
            time.sleep(0.1)
    return running


# up ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class UpOptions:
    flower: bool = False
    metrics: bool = False
    latency_ms: int = 0
    cluster_masters: int = 0  # a local Redis Cluster of that many masters for the state


def running_fleet(folder: Path) -> FleetRecord | None:
    """The fleet recorded in `folder` if every process it started still runs. What is left of
    a fleet that is not whole (a stale record) is stopped and the folder removed."""
    record = FleetRecord.load(folder)
    if record is None:
        return None
    if record.processes and all(is_running(p) for p in record.processes):
        return record
    stop_processes(record.processes)
    shutil.rmtree(folder)
    return None


def start_fleet(folder: Path, options: UpOptions, environ: Mapping[str, str]) -> FleetRecord:
    """Start a fleet in `folder` (which must not hold one), recording each process as it
    starts, and return once every queue is served. On failure what it started is stopped, the
    record says why, and UpFailed names the log to read."""
    external = environ.get("REDIS_URL", "")
    if external and options.cluster_masters:
        # workers of others on that broker would take our steps and read their state elsewhere
        raise UpFailed("--cluster starts a broker Redis of its own: unset REDIS_URL")
    if external and not redis_answers(external):
        raise UpFailed(f"REDIS_URL={redacted(external)} does not answer")
    real_backends = any(environ.get(v) for v in CONFIG_VARIABLES)
    if real_backends:
        read_config(environ)  # a wrong configuration is named before anything starts
    folder.mkdir(parents=True, exist_ok=True)
    fleet = Fleet(workdir=folder, log_dir=folder / "logs")
    record = FleetRecord(dir=str(folder))
    try:
        _start(fleet, record, options, external, real_backends)
    except BaseException as exc:
        fleet.stop()
        record.failed = str(exc) or type(exc).__name__
        record.processes = []
        record.save()
        if isinstance(exc, UpFailed | RuntimeError):
            raise UpFailed(f"{exc}; stopped what it started") from None
        raise
    return record


def _start(
    fleet: Fleet, record: FleetRecord, options: UpOptions, external: str, real_backends: bool
) -> None:
    deadline = time.monotonic() + UP_DEADLINE_S
    folder = Path(record.dir)
    if external:
        record.redis_url = fleet.redis_url = external
    else:
        record.redis_url = fleet.ensure_redis(private=True)
        record.redis_private = True
    _record(fleet, record)
    if options.cluster_masters:  # the broker stays on the plain Redis: Celery's needs one
        remaining_s = max(deadline - time.monotonic(), 1)
        cluster = LocalCluster(options.cluster_masters, fleet=fleet, form_timeout_s=remaining_s)
        cluster.launch()
        _record(fleet, record)  # its nodes' pids, before the wait to form
        cluster.form()
        fleet.env[STATE_VARIABLE] = record.state_url = cluster.url
    if not real_backends:
        record.replay_url = fleet.start_replay(options.latency_ms)
        config = {
            "backends": replay_backends(record.replay_url),
            "default_backend": REPLAY_DEFAULT_BACKEND,
        }
        path = folder / "config.json"
        path.write_text(json.dumps(config, indent=2) + "\n")
        fleet.env["CCHATQ_CONFIG"] = record.config = str(path)
        _record(fleet, record)
    already = None
    if external:  # workers of others may serve the queues already: ours are one more each
        with redis_client(external) as client:
            already = read_fleet_status(client).consumers_by_queue
    fleet.start_workers()
    _record(fleet, record)
    checks: list[tuple[str, str]] = []  # (name, url that answers once it is up)
    if options.flower:
        port = _port(FLOWER_PORT)
        # with no basic auth its API answers on loopback only, so `cchatq status` links work
        extra = {} if os.environ.get("FLOWER_BASIC_AUTH") else {"FLOWER_UNAUTHENTICATED_API": "1"}
        cmd = [sys.executable, "-m", "producer.cli", "flower", "--port", str(port)]
        fleet.spawn(cmd, "flower", env=fleet.worker_env(extra))
        record.flower_url = f"http://127.0.0.1:{port}"
        checks.append(("flower", f"{record.flower_url}/healthcheck"))
    if options.metrics:
        port = _port(METRICS_PORT)
        cmd = [sys.executable, "-m", "producer.cli", "metrics", "--port", str(port)]
        fleet.spawn(cmd, "metrics", env=fleet.worker_env())
        record.metrics_url = f"http://127.0.0.1:{port}/metrics"
        checks.append(("metrics", record.metrics_url))
    _record(fleet, record)
    fleet.wait_served(timeout_s=max(deadline - time.monotonic(), 1), already=already)
    for name, url in checks:
        _wait_http(fleet, name, url, deadline)


def _record(fleet: Fleet, record: FleetRecord) -> None:
    """Every process the fleet started so far, in the record on disk: a `down` after an `up`
    that was killed midway still finds them."""
    known = {p.pid for p in record.processes}
    for proc in fleet.procs:
        if proc.pid not in known:
            name = fleet.names[proc.pid]
            cmdline = [str(a) for a in proc.args] if isinstance(proc.args, list) else []
            started = Started(
                name, proc.pid, start_ticks(proc.pid), cmdline, str(fleet.log_of(name))
            )
            record.processes.append(started)
    record.save()


def _port(preferred: int) -> int:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", preferred))
        except OSError:
            return free_port()
    return preferred


def _wait_http(fleet: Fleet, name: str, url: str, deadline: float) -> None:
    proc = next(p for p in fleet.procs if fleet.names[p.pid] == name)
    while True:
        try:
            if requests.get(url, timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise UpFailed(f"{name} did not answer on {url} (see {fleet.log_of(name)})")
        time.sleep(0.2)
