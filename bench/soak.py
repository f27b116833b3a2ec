"""`python -m bench.soak` (or `make soak`): the fleet under a steady mixed load for an hour, with
a worker process SIGKILLed every minute, on a private fleet on 127.0.0.1 (Redis with its
append-only file, the replay server, one worker per queue).

Every `--batch-every-s` it submits a batch of weather sessions (round, tool call, round), on
the JSON and the streamed replay backends in turn; nobody waits on them. Every
`--sample-every-s` it samples the workers' resident memory (each worker's process tree), their
open file descriptors and Redis's used memory. Session keys live `--ttl-s` (a steady fleet
drops what it finished), so once the first batches expire every figure should be flat: the
slopes per hour are fitted over the samples after the first `--ttl-s`. Every batch is checked
once it has had time to end: each session has exactly one ending, nothing hung, no tool call
answered twice (bench/chaos_report.tally).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import redis

from bench.chaos_fleet import expected, weather_objects
from bench.chaos_kill import Killer
from bench.chaos_report import Row, print_table, remove_dumps, tally
from producer.client import Client
from producer.fleet import Fleet, proc_stats, replay_backend_name
from producer.specfile import load_spec_from_objects
from producer.submitting import Submission

PAGE_KB = os.sysconf("SC_PAGE_SIZE") // 1024
BACKENDS = (replay_backend_name("openai", False), replay_backend_name("anthropic", True))


@dataclass
class Sample:
    at_s: float
    worker_rss_kb: int
    worker_fds: int
    redis_used_bytes: int


@dataclass
class Soak:
    fleet: Fleet
    client: Client
    batch_size: int
    batches: list[tuple[float, Submission, dict[str, str]]] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    def submit(self, number: int) -> None:
        run = f"soak{number}-{uuid.uuid4().hex[:6]}"
        objects = weather_objects(run, self.batch_size)
        for o in objects:  # the JSON and the streamed backend in turn
            o["provider"] = BACKENDS[number % len(BACKENDS)]
        sub = self.client.enqueue(load_spec_from_objects(objects))
        self.batches.append((time.monotonic(), sub, expected(objects)))

    def sample(self) -> None:
        roots = {proc.pid for proc in self.fleet.workers.values()}
        tree = {pid for pid, fields in proc_stats() if int(fields[1]) in roots} | roots
        rss = fds = 0
        for pid in tree:
            try:
                with open(f"/proc/{pid}/statm") as statm:
                    rss += int(statm.read().split()[1]) * PAGE_KB
                fds += len(os.listdir(f"/proc/{pid}/fd"))
            except (FileNotFoundError, ProcessLookupError):
                continue  # killed between the listing and the read
        used = int(self.client.redis.info("memory")["used_memory"])
        self.samples.append(Sample(time.monotonic() - self.started, rss, fds, used))


def slope_per_hour(points: Sequence[tuple[float, float]]) -> float:
    """The least-squares slope of (seconds, value) points, per hour."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var = sum((x - mean_x) ** 2 for x, _ in points)
    if var == 0:
        return 0.0
    cov = sum((x - mean_x) * (y - mean_y) for x, y in points)
    return cov / var * 3600


def start(workdir: Path, ttl_s: int) -> tuple[Fleet, Client]:
    workdir.mkdir(parents=True, exist_ok=True)
    fleet = Fleet(workdir=workdir)
    fleet.ensure_redis(private=True, appendonly=True)
    fleet.start_replay(latency_ms=50)
    fleet.env["CCHATQ_RESULT_TTL_S"] = str(ttl_s)
    fleet.start_workers()
    fleet.wait_served()
    return fleet, Client(fleet.redis_url, ttl_s=ttl_s, config=fleet.config())


def check_batch(soak: Soak, sub: Submission, answers: dict[str, str], label: str) -> Row:
    return tally(soak.client.redis, label, sub.order, answers)


def run(args: argparse.Namespace) -> int:
    root = Path(tempfile.mkdtemp(prefix="cchatq-soak-"))
    print(f"fleet logs under {root}", flush=True)
    fleet, client = start(root, args.ttl_s)
    rows: list[Row] = []
    with fleet:
        soak = Soak(fleet, client, args.batch_size)
        killer = Killer(fleet, client.redis, args.seed)
        end = soak.started + args.minutes * 60
        next_batch = next_sample = next_kill = soak.started
        next_kill += args.kill_every_s
        number = 0
        checked = 0
        while time.monotonic() < end:
            now = time.monotonic()
            if now >= next_batch:
                soak.submit(number)
                number += 1
                next_batch += args.batch_every_s
            if now >= next_sample:
                soak.sample()
                next_sample += args.sample_every_s
            if args.kill_every_s and now >= next_kill:
                killer.kill_one()
                next_kill += args.kill_every_s
            # a batch is checked once it has had `settle_s` to end, long before its keys expire
            while checked < len(soak.batches) and now - soak.batches[checked][0] > args.settle_s:
                _, sub, answers = soak.batches[checked]
                rows.append(check_batch(soak, sub, answers, f"batch {checked}"))
                checked += 1
            time.sleep(0.2)
        deadline = time.monotonic() + args.settle_s
        while checked < len(soak.batches):
            time.sleep(max(0.0, min(1.0, deadline - time.monotonic())))
            _, sub, answers = soak.batches[checked]
            rows.append(check_batch(soak, sub, answers, f"batch {checked}"))
            checked += 1
        soak.sample()
        return report(soak, rows, killer, args, remove_dumps(fleet.workdir))


def report(
    soak: Soak, rows: list[Row], killer: Killer, args: argparse.Namespace, dumps: list[str]
) -> int:
    total = Row("soak: all batches", sum(r.expected for r in rows))
    for r in rows:
        total.finished += r.finished
        total.ok += r.ok
        total.step_failed += r.step_failed
        total.other_errors += r.other_errors
        total.duplicates += r.duplicates
        total.hung += r.hung
    total.wall_s = time.monotonic() - soak.started
    flat = [s for s in soak.samples if s.at_s >= min(args.ttl_s, total.wall_s / 2)]
    slopes = {
        "worker RSS": slope_per_hour([(s.at_s, s.worker_rss_kb / 1024) for s in flat]),
        "worker fds": slope_per_hour([(s.at_s, s.worker_fds) for s in flat]),
        "Redis used": slope_per_hour([(s.at_s, s.redis_used_bytes / 2**20) for s in flat]),
    }
    units = {"worker RSS": "MiB", "worker fds": "fds", "Redis used": "MiB"}
    lost = total.expected - total.finished
    total.goal = "met" if not (lost or total.duplicates or total.hung) else "NOT MET"
    total.notes.append(f"kills: {sum(killer.kills.values())} ({dict(killer.kills)})")
    for name, slope in slopes.items():
        first, last = (flat[0], flat[-1]) if flat else (None, None)
        span = "" if first is None or last is None else f" over {len(flat)} samples"
        total.notes.append(f"{name}: {slope:+.2f} {units[name]}/hour{span}")
    for s in soak.samples[:: max(1, len(soak.samples) // 12)]:
        total.notes.append(
            f"  at {s.at_s / 60:5.1f} min: workers {s.worker_rss_kb / 1024:.0f} MiB, "
            f"{s.worker_fds} fds; Redis {s.redis_used_bytes / 2**20:.1f} MiB"
        )
    total.notes.extend(n for r in rows for n in r.notes if n.startswith("duplicate"))
    total.notes.extend(dumps)
    print_table([total])
    return 0 if total.goal == "met" else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.soak",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--minutes", type=float, default=60.0, help="how long the load runs")
    parser.add_argument("--batch-size", type=int, default=40, help="sessions a batch")
    parser.add_argument("--batch-every-s", type=float, default=10.0)
    parser.add_argument("--kill-every-s", type=float, default=60.0, help="0: no kills")
    parser.add_argument("--sample-every-s", type=float, default=30.0)
    parser.add_argument("--ttl-s", type=int, default=600, help="session keys' TTL")
    parser.add_argument(
        "--settle-s", type=float, default=180.0, help="a batch is checked this long after submit"
    )
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    if args.settle_s >= args.ttl_s:
        parser.error("--settle-s must be under --ttl-s: a batch is checked before it expires")
    try:
        return run(args)
    except redis.RedisError as exc:
        print(f"soak: Redis failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    threading.current_thread().name = "soak"
    sys.exit(main())
