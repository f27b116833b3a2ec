"""`python -m bench.soak` (or `make soak`): the fleet under a steady mixed load for an hour, with
a worker process SIGKILLed every minute and a 30 s silent partition every 10 minutes, on a
private fleet (Redis with its append-only file, the replay server, one worker per queue).

Every `--batch-every-s` it submits a batch of weather sessions (round, tool call, round), on
the JSON and the streamed replay backends in turn; nobody waits on them. Every
`--sample-every-s` it samples the workers' resident memory (each worker's process tree), their
open file descriptors and Redis's used memory. Session keys live `--ttl-s` (a steady fleet
drops what it finished), so once the first batches expire every figure should be flat: the
slopes per hour are fitted over the samples after the first `--ttl-s`.

Partitions: the llm and tools workers run on a host in a network namespace (bench/netns.py),
the other queues' workers in the root namespace with Redis and the replay server; every
`--partition-every-s` that host's link is cut for `--partition-s`, silently (no FIN, no RST),
then healed. A killed worker comes back where it ran. Without root, `ip` and `nft` the soak
runs without partitions and says why.

Every batch is checked `--settle-s` after its submit, before its keys expire: each session has
exactly one ending, nothing hung, no tool call answered twice (bench/chaos_report.tally), and
its history judged (bench/history.py: nothing lost, no unexpected or double ending, no tool call
id answered twice; model calls beyond one a round counted). The goal is met when every batch's
history is valid and the slopes were fitted (bench/soak_report.py).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from bench import netns
from bench.chaos_fleet import expected, weather_objects
from bench.chaos_kill import Killer
from bench.chaos_report import Row, remove_dumps, tally
from bench.history_read import RunMark, check_run, mark_run
from bench.soak_report import Chaos, Sample, report
from producer.client import Client
from producer.fleet import Fleet, proc_stats, replay_backend_name
from producer.specfile import load_spec_from_objects
from producer.submitting import Submission
from schemas import task_names

PAGE_KB = os.sysconf("SC_PAGE_SIZE") // 1024
BACKENDS = (replay_backend_name("openai", False), replay_backend_name("anthropic", True))


HOST_QUEUES = ("llm", "tools")  # on the host that is cut; the others stay in the root namespace


@dataclass
class Batch:
    submitted_at: float  # monotonic
    sub: Submission
    objects: list[dict[str, Any]]
    mark: RunMark  # where its history begins (the replay log's next entry, the time)


@dataclass
class Soak:
    fleet: Fleet
    client: Client
    batch_size: int
    batches: list[Batch] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    def submit(self, number: int) -> None:
        run = f"soak{number}-{uuid.uuid4().hex[:6]}"
        objects = weather_objects(run, self.batch_size)
        for o in objects:  # the JSON and the streamed backend in turn
            o["provider"] = BACKENDS[number % len(BACKENDS)]
        mark = mark_run(self.fleet.replay_url)
        sub = self.client.enqueue(load_spec_from_objects(objects))
        self.batches.append(Batch(time.monotonic(), sub, objects, mark))

    def check(self, number: int) -> Row:
        """A batch's row and its history's verdict: its own batch only, as the next batches
        overlap it (their sessions are theirs)."""
        batch = self.batches[number]
        label = f"batch {number}"
        row = tally(self.client.redis, label, batch.sub.order, expected(batch.objects))
        row.verdict = check_run(
            label, self.client, batch.objects, batch.mark,
            namespace=batch.sub.namespace, batches=[batch.sub.batch],
        )  # fmt: skip
        return row

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


@dataclass
class Partitions:
    """Cuts of `host` (None: off, `off` says why): every `every_s`, for `cut_s`."""

    host: netns.Host | None
    every_s: float
    cut_s: float
    off: str = ""
    starts_s: list[float] = field(default_factory=list)  # each cut's start, into the soak
    heal_at: float = 0.0  # monotonic

    def tick(self, now: float, started: float, next_cut: float, end: float) -> float:
        """Cut or heal as it is due; returns when the next cut is due. No cut starts that
        would outlast the load."""
        if self.host is None:
            return next_cut
        if self.host.is_cut and now >= self.heal_at:
            self.host.heal()
        if now >= next_cut:
            if now + self.cut_s <= end:
                self.host.cut()
                self.heal_at = now + self.cut_s
                self.starts_s.append(now - started)
            next_cut += self.every_s
        return next_cut


def start(
    fleet: Fleet, ttl_s: int, net: netns.Network | None
) -> tuple[Client, netns.Host | None, Callable[[str], subprocess.Popen[bytes]]]:
    """Redis, the replay server and the workers, and how a queue's worker is started (again,
    after a kill): with `net`, the llm and tools workers on a host of their own, reaching Redis
    and the replay server at its gateway (both listen there besides 127.0.0.1), the others in
    the root namespace."""
    host = None if net is None else net.add_host()
    fleet.ensure_redis(private=True, appendonly=True, bind=[] if host is None else [host.gateway])
    fleet.start_replay(50, [] if host is None else ["--host", host.gateway])
    fleet.env["CCHATQ_RESULT_TTL_S"] = str(ttl_s)
    port = fleet.redis_url.rsplit(":", 1)[1]  # "<port>/0"

    def start_worker(queue: str) -> subprocess.Popen[bytes]:
        if host is None or queue not in HOST_QUEUES:
            return fleet.start_worker(queue)
        env = {"REDIS_URL": f"redis://{host.gateway}:{port}"}
        return fleet.start_worker(queue, extra_env=env, prefix=host.prefix())

    for queue in task_names.ALL_QUEUES:
        start_worker(queue)
    fleet.wait_served()
    return Client(fleet.redis_url, ttl_s=ttl_s, config=fleet.config()), host, start_worker


def run(args: argparse.Namespace) -> int:
    root = Path(tempfile.mkdtemp(prefix="cchatq-soak-"))
    print(f"fleet logs under {root}", flush=True)
    off = "--partition-every-s 0" if not args.partition_every_s else netns.missing()
    net = None if off else netns.Network()
    try:
        with Fleet(workdir=root) as fleet:
            client, host, start_worker = start(fleet, args.ttl_s, net)
            cuts = Partitions(host, args.partition_every_s, args.partition_s, off)
            return soak(args, fleet, client, cuts, start_worker)
    finally:
        if net is not None:
            net.close()  # the host's namespace and link, and what still runs in it


def soak(
    args: argparse.Namespace,
    fleet: Fleet,
    client: Client,
    cuts: Partitions,
    start_worker: Callable[[str], subprocess.Popen[bytes]],
) -> int:
    s = Soak(fleet, client, args.batch_size)
    killer = Killer(fleet, client.redis, args.seed, restart=start_worker)
    end = s.started + args.minutes * 60
    next_batch = next_sample = s.started
    next_kill = s.started + args.kill_every_s
    next_cut = s.started + args.partition_every_s
    rows: list[Row] = []
    try:
        while time.monotonic() < end:
            now = time.monotonic()
            next_cut = cuts.tick(now, s.started, next_cut, end)
            if now >= next_batch:
                s.submit(len(s.batches))
                next_batch += args.batch_every_s
            if now >= next_sample:
                s.sample()
                next_sample += args.sample_every_s
            if args.kill_every_s and now >= next_kill:
                killer.kill_one()
                next_kill += args.kill_every_s
            # a batch is checked once it has had `settle_s` to end, long before its keys expire
            while len(rows) < len(s.batches):
                if now - s.batches[len(rows)].submitted_at <= args.settle_s:
                    break
                rows.append(s.check(len(rows)))
            time.sleep(0.2)  # the loop's pace
    finally:
        if cuts.host is not None:
            cuts.host.heal()
    s.sample()  # the last under load: the checks below wait with none submitted
    wall_s = time.monotonic() - s.started
    for number in range(len(rows), len(s.batches)):  # the rest, each `settle_s` after its submit
        time.sleep(max(0.0, s.batches[number].submitted_at + args.settle_s - time.monotonic()))
        rows.append(s.check(number))
    chaos = Chaos(dict(killer.kills), cuts.starts_s, cuts.cut_s, cuts.off)
    return report(rows, s.samples, chaos, args.ttl_s, wall_s, remove_dumps(fleet.workdir))


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
    parser.add_argument("--partition-every-s", type=float, default=600.0, help="0: no partitions")
    parser.add_argument(
        "--partition-s", type=float, default=30.0, help="how long each partition lasts"
    )
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    if args.settle_s >= args.ttl_s:
        parser.error("--settle-s must be under --ttl-s: a batch is checked before it expires")
    if args.partition_every_s and not 0 < args.partition_s < args.partition_every_s:
        parser.error("--partition-s must be over 0 and under --partition-every-s")
    try:
        return run(args)
    except redis.RedisError as exc:
        print(f"soak: Redis failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    threading.current_thread().name = "soak"
    sys.exit(main())
