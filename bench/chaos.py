"""`python -m bench.chaos [scenario ...]` (or `make chaos`): the fleet under failure, each
scenario on a private fleet of its own (Redis, replay server, one worker per queue), on
127.0.0.1 only:

  kill           1,000 weather sessions (round, tool call, round) while a random worker process
                 (a worker's main process, with its pool, or one prefork pool child) is
                 SIGKILLed every 2 s; a killed worker is started again at once. First the same
                 1,000 with no kill: the baseline wall time.
  redis-restart  300 sessions submitted by `cchatq submit` (waiting); Redis (append-only file,
                 fsync every second) is SIGKILLed mid-batch and started again on its port and
                 directory, then the same with SIGTERM, then without persistence (what is lost:
                 informational).
  faults         300 sessions while the replay server answers 10% of model calls 429
                 (Retry-After 1 s) and 5% 500; it times each retry after a 429.
  producer-kill  300 sessions submitted by `cchatq submit`, SIGKILLed while it waits; the fleet
                 finishes them with no producer, and a new Client reads them.
  partition      worker hosts in network namespaces cut silently 30 s mid-batch: one host, the
                 whole fleet, the whole fleet while Redis restarts (bench/chaos_partition.py;
                 root). `partition-long`: 5-minute cuts, run only when named.

One row per run: sessions finished of those submitted, how many ended step_failed, with another
error body, with a duplicated tool message (a tool message twice for one call id, more tool
messages or executed calls than calls, or a call's tool.call.finished trace event twice), hung
(not finished by the deadline), and the wall time. Under the table: what each run saw (kills,
Redis downtime, faults), its dead letters and the commonest warnings of the fleet's logs,
whose directory is kept.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import redis
import requests

import fixtures
from bench import chaos_partition
from bench.chaos_report import (
    Row,
    crash_summary,
    dead_letters,
    finished_count,
    log_digest,
    print_table,
    remove_dumps,
    tally,
)
from fixtures.demo_batch import CITIES, WEATHER, weather_json
from producer.client import Client
from producer.fleet import Fleet
from producer.specfile import load_spec_from_objects
from producer.submitting import Submission
from schemas import keys
from schemas.spec_types import Spec

GUESTS = Path(fixtures.__file__).parent / "guests"
SCENARIOS = ("kill", "redis-restart", "faults", "producer-kill", "partition")
NAMED_ONLY = ("partition-long",)  # run only when asked for
KILL_EVERY_S = 2.0
REDIS_DOWN_S = 0.5
RETRY_AFTER_S = 1


# --- sessions --------------------------------------------------------------------------------


def weather_objects(run: str, n: int, latency_ms: int = 0) -> list[dict[str, Any]]:
    """The bench's weather session (round, tool call, round), each with a first message of its
    own (the replay server keys a conversation by it)."""
    marker = f" [[latency_ms:{latency_ms}]]" if latency_ms else ""
    tool = {**WEATHER, "module": str(GUESTS / "weather.wasm")}
    return [
        {
            "id": f"{run}/{i}",
            "model": "replay/weather",
            "messages": [
                {"role": "user", "content": f"[{run} {i}] Weather in {city_of(i)}?{marker}"}
            ],
            "tools": [tool],
        }
        for i in range(n)
    ]


def city_of(i: int) -> str:
    return CITIES[i % len(CITIES)]


def weather_specs(run: str, n: int, latency_ms: int = 0) -> list[Spec]:
    return load_spec_from_objects(weather_objects(run, n, latency_ms))


def write_spec_file(path: Path, objects: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(o) + "\n" for o in objects))
    return path


# --- fleets ---------------------------------------------------------------------------------


def start_fleet(
    workdir: Path,
    appendonly: bool = False,
    latency_ms: int = 0,
    replay_args: Sequence[str] = (),
) -> tuple[Fleet, Client]:
    workdir.mkdir(parents=True, exist_ok=True)
    fleet = Fleet(workdir=workdir)
    fleet.ensure_redis(private=True, appendonly=appendonly)
    fleet.start_replay(latency_ms, replay_args)
    fleet.start_workers()
    client = Client(fleet.redis_url)
    warm = client.enqueue(weather_specs(f"warm-{uuid.uuid4().hex[:6]}", 20))  # compile, connect
    for _ in client.wait(warm, timeout_s=120, poll_s=0.05):
        pass
    return fleet, client


def wait_in_process(client: Client, sub: Submission, deadline_s: float) -> float:
    """Wait for a batch as a producer does (nudging when it stalls); the wall time."""
    started = time.perf_counter()
    try:
        for _ in client.wait(sub, timeout_s=deadline_s, poll_s=0.05):
            pass
    except TimeoutError:
        pass
    return time.perf_counter() - started


def session_keys(client: Client, ids: Sequence[str]) -> list[str]:
    """The session keys of these spec ids' runs (a key that holds nothing for an id not
    claimed yet, or whose claim a restart lost)."""
    claims = client.claims(ids)
    return [f"unclaimed:{i}" if c is None else c.sk for i, c in zip(ids, claims, strict=True)]


def wait_records(client: Client, ids: Sequence[str], want: int, deadline: float) -> bool:
    """Poll Redis until `want` of these sessions have a record (a restarting Redis is
    retried), or until the monotonic `deadline`."""
    while time.monotonic() < deadline:
        try:
            if finished_count(client.redis, session_keys(client, ids)) >= want:
                return True
        except redis.RedisError:
            pass
        time.sleep(0.1)
    return False


def expected(objects: list[dict[str, Any]]) -> dict[str, str]:
    """Each spec id's expected answer."""
    return {o["id"]: f"Weather report: {weather_json(city_of(i))}" for i, o in enumerate(objects)}


def spawn_producer(fleet: Fleet, spec_file: Path, out: Path, timeout_s: float) -> Any:
    """`cchatq submit FILE --out OUT` in a process of its own (stopped by the fleet)."""
    cmd = [
        sys.executable,
        "-m",
        "producer.cli",
        "submit",
        str(spec_file),
        "--out",
        str(out),
        "--timeout-s",
        str(timeout_s),
    ]
    return fleet.spawn(cmd, f"producer-{spec_file.stem}", env=fleet.worker_env())


def results_written(out: Path) -> tuple[int, Counter[str]]:
    if not out.exists():
        return 0, Counter()
    lines = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    return len(lines), Counter(str(line.get("status")) for line in lines)


# --- (a) kill -------------------------------------------------------------------------------


class Killer:
    """Every KILL_EVERY_S, SIGKILL one random worker process: a worker's main process (its
    process group: the pool too), started again at once, or a prefork pool child, which
    Celery replaces. Each kill is logged with the messages the main process held then."""

    def __init__(self, fleet: Fleet, r: Any, seed: int) -> None:
        self.fleet = fleet
        self.redis = r
        self.random = random.Random(seed)
        self.live = {name.rsplit("-", 1)[0]: proc for name, proc in fleet.workers.items()}
        self.kills: Counter[str] = Counter()
        self.timeline: list[str] = []
        self.started = time.monotonic()

    def targets(self) -> list[tuple[str, str, int]]:
        found = []
        for queue, proc in sorted(self.live.items()):
            found.append((queue, "main", proc.pid))
            found.extend((queue, "child", pid) for pid in self.fleet.pool_children(proc))
        return found

    def held(self, pid: int) -> int:
        """Messages the consumers of process `pid` took and did not acknowledge."""
        held = 0
        for raw in self.redis.smembers(keys.BROKER_CONSUMERS):
            consumer = raw.decode()
            if f".{pid}@" in consumer:  # <id>.<pid>@<host> (worker/edges/liveness.py)
                held += self.redis.hlen(keys.broker_unacked(consumer))
                held += self.redis.llen(keys.broker_taken(consumer))
        return held

    def kill_one(self) -> None:
        queue, kind, pid = self.random.choice(self.targets())
        at = time.monotonic() - self.started
        if kind == "main":
            held = self.held(pid)
            self.fleet.kill(self.live[queue])
            self.live[queue] = self.fleet.start_worker(queue)
            self.timeline.append(f"{at:.1f}s {queue} main (held {held})")
        else:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                return  # the pool replaced it meanwhile
            self.timeline.append(f"{at:.1f}s {queue} child")
        self.kills[f"{queue} {kind}"] += 1


def scenario_kill(root: Path, n: int, deadline_s: float, seed: int) -> list[Row]:
    fleet, client = start_fleet(root / "kill")
    with fleet:
        base_objects = weather_objects(f"base-{uuid.uuid4().hex[:6]}", n)
        sub = client.enqueue(load_spec_from_objects(base_objects))
        base_wall = wait_in_process(client, sub, deadline_s)
        base = tally(client.redis, "kill: baseline, no kill", sub.order, expected(base_objects))
        base.wall_s = base_wall
        base.goal = "-"

        objects = weather_objects(f"kill-{uuid.uuid4().hex[:6]}", n)
        specs = load_spec_from_objects(objects)
        waiter_client = Client(fleet.redis_url)
        walls: list[float] = []
        sub = waiter_client.enqueue(specs)
        killer = Killer(fleet, client.redis, seed)
        waiter = threading.Thread(
            target=lambda: walls.append(wait_in_process(waiter_client, sub, deadline_s)),
            daemon=True,
        )
        waiter.start()
        deadline = time.monotonic() + deadline_s + 5
        while waiter.is_alive() and time.monotonic() < deadline:
            waiter.join(timeout=KILL_EVERY_S)
            if waiter.is_alive():
                killer.kill_one()
        waiter.join(timeout=30)
        row = tally(client.redis, "kill: SIGKILL every 2 s", sub.order, expected(objects))
        row.wall_s = walls[0] if walls else deadline_s
        ratio = row.wall_s / base_wall
        row.notes.insert(
            0, f"kills: {sum(killer.kills.values())} ({dict(sorted(killer.kills.items()))})"
        )
        row.notes.insert(
            1, f"baseline {base_wall:.1f} s; with kills {row.wall_s:.1f} s = {ratio:.2f}x"
        )
        row.notes.insert(2, "kills, from submit: " + "; ".join(killer.timeline))
        problems = _problems(row) + ([f"wall {ratio:.2f}x baseline > 2x"] if ratio > 2 else [])
        row.goal = _verdict(problems)
        row.notes.extend(dead_letters(client.redis))
        row.notes.extend(["log digest:", *log_digest(fleet.workdir), *remove_dumps(fleet.workdir)])
        waiter_client.close()
        client.close()
    return [base, row]


def _problems(row: Row) -> list[str]:
    problems = []
    if row.finished < row.expected:
        problems.append(f"{row.expected - row.finished} not finished")
    if row.step_failed:
        problems.append(f"{row.step_failed} step_failed")
    if row.duplicates:
        problems.append(f"{row.duplicates} duplicates")
    if row.hung:
        problems.append(f"{row.hung} hung")
    return problems


def _verdict(problems: list[str]) -> str:
    return "met" if not problems else "NOT MET: " + ", ".join(problems)


# --- (b) redis-restart ----------------------------------------------------------------------

REDIS_VARIANTS: tuple[tuple[str, int, bool], ...] = (
    ("SIGKILL, append-only file", signal.SIGKILL, True),
    ("SIGTERM, append-only file", signal.SIGTERM, True),
    ("SIGKILL, no persistence", signal.SIGKILL, False),
)


def scenario_redis(root: Path, n: int, deadline_s: float, seed: int) -> list[Row]:
    rows = []
    for number, (variant, sig, aof) in enumerate(REDIS_VARIANTS):
        workdir = root / f"redis-restart-{number}"
        fleet, client = start_fleet(workdir, appendonly=aof, latency_ms=100)
        with fleet:
            objects = weather_objects(f"redis{number}-{uuid.uuid4().hex[:6]}", n)
            ids = [o["id"] for o in objects]
            spec_file = write_spec_file(workdir / "sessions.jsonl", objects)
            out = workdir / "results.jsonl"
            timeout_s = deadline_s if aof else min(deadline_s, 60.0)
            started = time.monotonic()
            deadline = started + timeout_s
            producer = spawn_producer(fleet, spec_file, out, timeout_s)
            mid = wait_records(client, ids, n // 3, deadline)
            before = finished_count(client.redis, session_keys(client, ids))
            down_s = fleet.restart_redis(sig, REDIS_DOWN_S)
            try:
                code: int | None = producer.wait(timeout=timeout_s + 30)
            except subprocess.TimeoutExpired:
                code = None
            producer_s = time.monotonic() - started
            reader = Client(fleet.redis_url)  # the fleet may finish what the producer did not see
            wait_records(reader, ids, n, deadline)
            fleet_s = time.monotonic() - started
            sks = session_keys(reader, ids)
            row = tally(reader.redis, f"redis-restart: {variant}", sks, expected(objects))
            row.wall_s = max(fleet_s, producer_s)
            written, statuses = results_written(out)
            row.notes.insert(
                0,
                f"restarted {'mid-batch' if mid else 'late'} with {before}/{n} finished; down "
                f"{down_s:.2f} s; producer exit {code} after {producer_s:.1f} s, results written "
                f"{written}/{n} {dict(statuses)}; the fleet finished {row.finished}/{n} by the "
                f"deadline ({timeout_s:.0f} s)",
            )
            if not aof and written > row.finished:
                # records of sessions the producer had read were lost with Redis's data: they
                # are not hung (their results are in the producer's file)
                row.notes.insert(
                    1,
                    f"{n - row.finished} records lost with Redis's data; the producer's file "
                    f"holds {written}/{n} results (it submitted the lost unfinished ones again)",
                )
                row.hung = n - written
            problems = _problems(row)
            if written < n:
                problems.append(f"{n - written} results not written")
            if code != 0:
                problems.append(f"producer exit {code}")
            row.goal = _verdict(problems) if aof else "- (informational)"
            if code != 0:
                log = workdir / f"producer-{spec_file.stem}.log"
                row.notes.extend(["producer's error:", *crash_summary(log)])
            row.notes.extend(dead_letters(reader.redis))
            row.notes.extend(
                ["log digest:", *log_digest(fleet.workdir), *remove_dumps(fleet.workdir)]
            )
            reader.close()
            client.close()
        rows.append(row)
    return rows


# --- (c) faults -----------------------------------------------------------------------------


def scenario_faults(root: Path, n: int, deadline_s: float, seed: int) -> list[Row]:
    args = [
        "--fault-429-rate",
        "0.1",
        "--fault-500-rate",
        "0.05",
        "--retry-after-s",
        str(RETRY_AFTER_S),
        "--fault-seed",
        str(seed),
    ]
    fleet, client = start_fleet(root / "faults", replay_args=args)
    with fleet:
        root_url = fleet.replay_url.removesuffix("/v1")
        requests.post(f"{root_url}/reset", timeout=5).raise_for_status()  # not the warm-up's
        objects = weather_objects(f"faults-{uuid.uuid4().hex[:6]}", n)
        sub = client.enqueue(load_spec_from_objects(objects))
        wall = wait_in_process(client, sub, deadline_s)
        row = tally(
            client.redis, "faults: 10% 429 (Retry-After 1 s), 5% 500", sub.order, expected(objects)
        )
        row.wall_s = wall
        faults = requests.get(f"{root_url}/faults", timeout=5).json()
        stats = requests.get(f"{root_url}/stats", timeout=5).json()
        gap = faults["min_gap_after_429_s"]
        row.notes.insert(
            0,
            (
                f"model requests {stats['requests']}, faults injected {faults['injected']}; "
                f"retries after a 429: {faults['retries_after_429']}, early (< Retry-After): "
                f"{faults['early_retries']}, smallest gap {_seconds(gap)}, "
                f"429s never retried {faults['unretried_429']}"
            ),
        )
        problems = _problems(row)
        if faults["early_retries"]:
            problems.append(f"{faults['early_retries']} retries before Retry-After")
        row.goal = _verdict(problems)
        row.notes.extend(dead_letters(client.redis))
        row.notes.extend(["log digest:", *log_digest(fleet.workdir), *remove_dumps(fleet.workdir)])
        client.close()
    return [row]


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s"


# --- (d) producer-kill ----------------------------------------------------------------------


def scenario_producer_kill(root: Path, n: int, deadline_s: float, seed: int) -> list[Row]:
    workdir = root / "producer-kill"
    fleet, client = start_fleet(workdir, latency_ms=100)
    with fleet:
        objects = weather_objects(f"pkill-{uuid.uuid4().hex[:6]}", n)
        ids = [o["id"] for o in objects]
        spec_file = write_spec_file(workdir / "sessions.jsonl", objects)
        started = time.monotonic()
        producer = spawn_producer(fleet, spec_file, workdir / "results.jsonl", deadline_s)
        mid = wait_records(client, ids, max(n // 10, 1), started + deadline_s)
        before = finished_count(client.redis, session_keys(client, ids))
        fleet.kill(producer)
        killed_at = time.monotonic()
        reader = Client(fleet.redis_url)  # reads results, never waits: no producer nudges
        wait_records(reader, ids, n, started + deadline_s)
        wall = time.monotonic() - started
        sks = session_keys(reader, ids)
        row = tally(reader.redis, "producer-kill: cchatq submit SIGKILLed", sks, expected(objects))
        row.wall_s = wall
        row.notes.insert(
            0,
            (
                f"producer killed {'mid-wait' if mid else 'late'} with {before}/{n} "
                f"finished; the rest took {time.monotonic() - killed_at:.1f} s "
                "with no producer"
            ),
        )
        row.goal = _verdict(_problems(row))
        row.notes.extend(dead_letters(reader.redis))
        row.notes.extend(["log digest:", *log_digest(fleet.workdir), *remove_dumps(fleet.workdir)])
        reader.close()
        client.close()
    return [row]


# --- the table ------------------------------------------------------------------------------

RUNS: dict[str, Callable[[Path, int, float, int], list[Row]]] = {
    "kill": scenario_kill,
    "redis-restart": scenario_redis,
    "faults": scenario_faults,
    "producer-kill": scenario_producer_kill,
    "partition": chaos_partition.scenario_partition,
    "partition-long": chaos_partition.scenario_partition_long,
}
DEFAULT_SESSIONS = {"kill": 1000, "redis-restart": 300, "faults": 300, "producer-kill": 300,
                    "partition": 300, "partition-long": 300}  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.chaos",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "scenarios", nargs="*", metavar="scenario", help=f"of {', '.join(SCENARIOS)} (default: all)"
    )
    parser.add_argument(
        "--sessions", type=int, help="sessions per run (default: 1000 for kill, 300 for the others)"
    )
    parser.add_argument(
        "--deadline-s",
        type=float,
        default=300.0,
        help="a session not finished this long after its batch's submit is hung",
    )
    parser.add_argument("--seed", type=int, default=1, help="seeds the kills and the faults")
    args = parser.parse_args(argv)
    chosen = list(dict.fromkeys(args.scenarios or SCENARIOS))
    unknown = sorted(set(chosen) - set(SCENARIOS + NAMED_ONLY))
    if unknown:
        parser.error(
            f"unknown scenarios {unknown}: choose from {', '.join(SCENARIOS + NAMED_ONLY)}"
        )
    root = Path(tempfile.mkdtemp(prefix="cchatq-chaos-"))
    print(f"fleet logs under {root}", flush=True)
    rows: list[Row] = []
    for name in chosen:
        n = args.sessions or DEFAULT_SESSIONS[name]
        started = time.monotonic()
        new = RUNS[name](root, n, args.deadline_s, args.seed)
        rows.extend(new)
        print(f"\n== {name} ({time.monotonic() - started:.0f} s)", flush=True)
        print_table(new)
    print("\n== all runs")
    print_table(rows, notes=False)
    met = all(r.goal in ("met", "-") or r.goal.startswith("- ") for r in rows)
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
