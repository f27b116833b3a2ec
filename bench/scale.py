"""`python -m bench.scale` (`make bench-scale`): how sessions/s grow with the fleet, and what the
state store pays for it.

A worker unit is one worker for each of the queues llm, tools and control, with their default
pools and concurrency (producer/fleet.py WORKER_PROFILES). The same batch of two-round weather
sessions (bench/__main__.py's, model latency 0), `--sessions-per-unit` a unit, runs on 1, 2, 4,
8 and 16 units -- the sizes the machine's cores hold (bench/scale_figures.py) -- against two
state back ends: one plain Redis, and a 3-master Redis Cluster (producer/local_cluster.py). The
broker is a private plain Redis of its own in both, so both pay the same broker.

Each row starts everything afresh: the state's Redis or cluster, the broker's Redis, a replay
server per unit (one would cap the fleet before the state store does: it is the model's stand-in,
not what is measured) and the units' workers, and stops them all by pid afterwards. The clock
runs from the submit to the last result, once every worker is served and a warm-up batch has
compiled the tool and opened the connections.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import uuid
from collections.abc import Sequence
from contextlib import ExitStack
from typing import Any

import redis

from bench import scale_figures as sf
from bench.__main__ import weather_spec
from bench.cost import redis_commands
from bench.goals import run_batch
from producer.client import Client
from producer.fleet import Fleet
from producer.local_cluster import LocalCluster
from schemas.fleet_urls import STATE_VARIABLE
from schemas.spec_types import Spec
from schemas.task_names import QUEUE_CONTROL, QUEUE_LLM, QUEUE_TOOLS

UNIT_QUEUES = (QUEUE_LLM, QUEUE_TOOLS, QUEUE_CONTROL)
PLAIN, CLUSTER = "redis", "cluster-3"
BACKENDS = (PLAIN, CLUSTER)
CLUSTER_MASTERS = 3
SESSIONS_PER_UNIT = 500
WARM_SESSIONS_PER_UNIT = 10
SERVED_TIMEOUT_S = 60.0  # and this much more per unit: a loaded machine boots them slowly
SERVED_TIMEOUT_PER_UNIT_S = 15.0
# a batch that has not ended by then failed: this much, plus a second per 10 sessions
BATCH_TIMEOUT_S = 300.0
# each counters() sample's own commands that the next sample's INFO commandstats counts: its
# INFO commandstats (counted once it has answered), INFO cpu and DBSIZE
OWN_COMMANDS = {"info": 2, "dbsize": 1}


def counters(node: Any) -> sf.Counters:
    """A Redis's CPU, commands so far and keys (commandstats first: see OWN_COMMANDS)."""
    commands = redis_commands(node)
    cpu = node.info("cpu")
    return sf.Counters(
        float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"]), commands, int(node.dbsize())
    )


def batch(tag: str, n: int) -> list[Spec]:
    return [weather_spec(f"{tag}/{i}") for i in range(n)]


def start_units(fleet: Fleet, units: int) -> None:
    """`units` replay servers, and one worker for each of UNIT_QUEUES on each; returns once
    every worker consumes from the broker (wait_served: `units` consumers a queue)."""
    for _ in range(units):
        replay = {"CCHATQ_REPLAY_URL": fleet.start_replay()}  # the built-in `replay` backend's
        for queue in UNIT_QUEUES:
            fleet.start_worker(queue, extra_env=replay)
    fleet.wait_served(
        UNIT_QUEUES,
        timeout_s=SERVED_TIMEOUT_S + SERVED_TIMEOUT_PER_UNIT_S * units,
        already=dict.fromkeys(UNIT_QUEUES, units - 1),
    )


def run_row(backend: str, units: int, sessions_per_unit: int) -> sf.Row:
    """One batch on `units` units against `backend`, everything started for it and stopped."""
    with ExitStack() as stack:
        # stopped in reverse: the workers first, then the state's Redis they write to
        state = stack.enter_context(Fleet())
        if backend == CLUSTER:
            cluster = stack.enter_context(LocalCluster(masters=CLUSTER_MASTERS, fleet=state))
            state_url, node_urls = cluster.url, cluster.urls
        else:
            state_url = state.ensure_redis(private=True)
            node_urls = [state_url]
        # the fleet's own Redis is the broker's (REDIS_URL), which wait_served reads the
        # workers' consumers from; the state goes apart by CCHATQ_STATE_URL
        fleet = stack.enter_context(Fleet(env={STATE_VARIABLE: state_url}))
        broker_url = fleet.ensure_redis(private=True)
        start_units(fleet, units)
        client = Client(state_url, config=fleet.config(), broker_url=broker_url)
        stack.callback(client.close)
        # each master on its own (not through the cluster client): its counters are its own
        nodes = [redis.Redis.from_url(url) for url in node_urls]
        broker = redis.Redis.from_url(broker_url)
        for conn in [*nodes, broker]:
            stack.callback(conn.close)

        tag = f"scale-{backend}-{units}-{uuid.uuid4().hex[:6]}"
        run_batch(client, batch(f"{tag}-warm", WARM_SESSIONS_PER_UNIT * units))
        sessions = sessions_per_unit * units
        specs = batch(tag, sessions)  # validated before the clock
        timeout_s = BATCH_TIMEOUT_S + sessions / 10

        before = [counters(node) for node in nodes]
        broker_cpu_s = counters(broker).cpu_s
        producer_cpu_s = time.process_time()
        started = time.perf_counter()
        ok = run_batch(client, specs, timeout_s=timeout_s)
        wall_s = time.perf_counter() - started
        producer_cpu_s = time.process_time() - producer_cpu_s
        after = [counters(node) for node in nodes]
        broker_cpu_s = counters(broker).cpu_s - broker_cpu_s
        return sf.Row(
            backend=backend,
            units=units,
            sessions=sessions,
            ok=ok,
            wall_s=wall_s,
            state=tuple(a.since(b, OWN_COMMANDS) for a, b in zip(after, before, strict=True)),
            broker_cpu_s=broker_cpu_s,
            producer_cpu_s=producer_cpu_s,
        )


def _numbers(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated unit counts") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: unit counts >= 1")
    return values


def _backends(text: str) -> list[str]:
    chosen = [part.strip() for part in text.split(",") if part.strip()]
    unknown = sorted(set(chosen) - set(BACKENDS))
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"{unknown or text!r}: choose from {', '.join(BACKENDS)}")
    return chosen


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.scale",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--sizes",
        type=_numbers,
        default=list(sf.DEFAULT_SIZES),
        help="units to run, comma-separated (default 1,2,4,8,16; those the cores do not hold "
        f"are left out: {sf.CORES_PER_UNIT} cores a unit; 1 always runs)",
    )
    parser.add_argument(
        "--sessions-per-unit", type=int, default=SESSIONS_PER_UNIT, help="default %(default)s"
    )
    parser.add_argument(
        "--backends", type=_backends, default=list(BACKENDS), help="default redis,cluster-3"
    )
    args = parser.parse_args(argv)
    if args.sessions_per_unit < 1:
        parser.error("--sessions-per-unit must be >= 1")
    return args


def _exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # through the rows' ExitStacks, which stop what they started


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit)  # `timeout` or a CI's cancel: no process left behind
    cores = os.cpu_count() or 1
    sizes, left_out = sf.sizes_to_run(args.sizes, cores)
    rows: list[sf.Row] = []
    for backend in args.backends:
        for units in sizes:
            print(f"{backend}: {units} unit(s), {args.sessions_per_unit * units} sessions ...",
                  file=sys.stderr, flush=True)  # fmt: skip
            rows.append(run_row(backend, units, args.sessions_per_unit))
    print(f"\nstate back ends against worker units ({cores} cores; a unit = one llm, tools and "
          "control worker; broker on a plain Redis of its own)\n")  # fmt: skip
    print(sf.report(rows, cores, left_out))
    return 0 if all(r.ok == r.sessions for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
