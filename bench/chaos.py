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
  stall          10 streamed sessions whose stream stalls after some content, keepalives every
                 15 s (bench/chaos_stall.py): each abandoned by 75 s, retried, and ok.
  redis-full     a Redis at maxmemory 24mb (noeviction), 3,000 sessions of 2 KB prompts
  aof-full       the AOF's disk full for 20 s mid-batch (bench/chaos_redis_full.py)
  failover       300 sessions on a sentinel:// fleet whose primary is SIGKILLed mid-batch, then
                 paused until its replica is promoted (bench/chaos_failover.py).
  partition      worker hosts in network namespaces cut silently 30 s mid-batch: one host, the
                 whole fleet, the whole fleet while Redis restarts (bench/chaos_partition.py;
                 root). `partition-long`: 5-minute cuts, run only when named.
  clock-skew     500 sessions on two hosts whose wall clocks are 2 minutes ahead and behind
                 (libfaketime): no session ended early, no extra model call.

`--broker amqp` (or CCHATQ_CHAOS_BROKER=amqp) runs `kill` and `faults` with the fleet's broker on
the local RabbitMQ (a vhost of each fleet's own, deleted as the run exits; `--queue-type quorum`
for quorum queues), its state on its Redis.

One row per run: sessions finished of those submitted, how many ended step_failed, with another
error body, with a duplicated tool message (a tool message twice for one call id, more tool
messages or executed calls than calls, or a call's tool.call.finished trace event twice), hung
(not finished by the deadline), the wall time, and the run's history verdict (bench/history.py:
nothing lost, nothing unexpected, no session ended twice, no tool call id answered twice; its
line under the table counts the model calls beyond one a round and the usage checked). Under
the table: what each run saw (kills, Redis downtime, faults), its dead letters and the
commonest warnings of the fleet's logs, whose directory is kept.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from bench.chaos_clock import scenario_clock_skew
from bench.chaos_failover import scenario_failover
from bench.chaos_faults import scenario_faults
from bench.chaos_fleet import BROKER_VARIABLE, QUEUE_TYPE_VARIABLE
from bench.chaos_kill import scenario_kill
from bench.chaos_partition import scenario_partition, scenario_partition_long
from bench.chaos_redis_full import scenario_aof_full, scenario_redis_full
from bench.chaos_report import Row, print_table
from bench.chaos_restarts import scenario_producer_kill, scenario_redis
from bench.chaos_stall import scenario_stall
from bench.history import print_verdicts
from schemas.amqp_broker import QUEUE_TYPES

Scenario = Callable[[Path, int, float, int], list[Row]]  # (root, sessions, deadline_s, seed)

# each scenario: what runs it, and its sessions when --sessions does not say
RUNS: dict[str, tuple[Scenario, int]] = {
    "kill": (scenario_kill, 1000),
    "redis-restart": (scenario_redis, 300),
    "faults": (scenario_faults, 300),
    "producer-kill": (scenario_producer_kill, 300),
    "stall": (scenario_stall, 10),
    "redis-full": (scenario_redis_full, 3000),
    "aof-full": (scenario_aof_full, 300),
    "failover": (scenario_failover, 300),
    "clock-skew": (scenario_clock_skew, 500),
    "partition": (scenario_partition, 300),
    "partition-long": (scenario_partition_long, 300),
}
NAMED_ONLY = ("partition-long",)  # run only when asked for
AMQP_SCENARIOS = ("kill", "faults")  # those whose fleet may have its broker on RabbitMQ
SCENARIOS = tuple(name for name in RUNS if name not in NAMED_ONLY)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.chaos",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "scenarios",
        nargs="*",
        metavar="scenario",
        help=f"of {', '.join(RUNS)} (default: all but {', '.join(NAMED_ONLY)})",
    )
    parser.add_argument(
        "--sessions", type=int, help="sessions per run (default: each scenario's own, 10 to 1000)"
    )
    parser.add_argument(
        "--deadline-s",
        type=float,
        default=300.0,
        help="a session not finished this long after its batch's submit is hung",
    )
    parser.add_argument("--seed", type=int, default=1, help="seeds the kills and the faults")
    parser.add_argument(
        "--broker",
        choices=("redis", "amqp"),
        default=os.environ.get(BROKER_VARIABLE, "redis"),
        help=f"the fleet's broker: its Redis, or the local RabbitMQ ({', '.join(AMQP_SCENARIOS)})",
    )
    parser.add_argument(
        "--queue-type",
        choices=QUEUE_TYPES,
        default=os.environ.get(QUEUE_TYPE_VARIABLE) or "classic",
        help="RabbitMQ's queues (--broker amqp)",
    )
    args = parser.parse_args(argv)
    default = AMQP_SCENARIOS if args.broker == "amqp" else SCENARIOS
    chosen = list(dict.fromkeys(args.scenarios or default))
    unknown = sorted(set(chosen) - set(RUNS))
    if unknown:
        parser.error(f"unknown scenarios {unknown}: choose from {', '.join(RUNS)}")
    if args.broker == "amqp" and set(chosen) - set(AMQP_SCENARIOS):
        parser.error(f"--broker amqp runs {', '.join(AMQP_SCENARIOS)} only")
    os.environ[BROKER_VARIABLE], os.environ[QUEUE_TYPE_VARIABLE] = args.broker, args.queue_type
    root = Path(tempfile.mkdtemp(prefix="cchatq-chaos-"))
    print(f"fleet logs under {root}", flush=True)
    rows: list[Row] = []
    for name in chosen:
        run, default_sessions = RUNS[name]
        n = args.sessions or default_sessions
        started = time.monotonic()
        new = run(root, n, args.deadline_s, args.seed)
        rows.extend(new)
        print(f"\n== {name} ({time.monotonic() - started:.0f} s)", flush=True)
        print_table(new)
    print("\n== all runs")
    print_table(rows, notes=False)
    print("\n== histories")
    print_verdicts([r.verdict for r in rows if r.verdict is not None])
    met = all(r.goal in ("met", "-") or r.goal.startswith("- ") for r in rows)
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
