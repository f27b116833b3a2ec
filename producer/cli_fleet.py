"""`cchatq up` and `cchatq down` (producer/local_fleet.py). `up` prints only shell lines on
stdout, for `eval "$(cchatq up)"`; everything for people goes to stderr."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from producer.local_fleet import (
    REPLAY_DEFAULT_BACKEND,
    FleetRecord,
    UpFailed,
    UpOptions,
    fleet_dir,
    running_fleet,
    start_fleet,
    stop_processes,
)
from schemas import task_names
from schemas.config import ConfigError

EXIT_UP_FAILED = 1


def _say(line: str = "") -> None:
    print(line, file=sys.stderr)


def cmd_up(args: argparse.Namespace) -> int:
    folder = fleet_dir(args.dir)
    try:
        record = running_fleet(folder)
    except (OSError, ValueError, TypeError) as exc:
        _say(f"{folder}/fleet.json cannot be read ({exc}); remove {folder} to start afresh")
        return EXIT_UP_FAILED
    if record is not None:
        _say(f"a fleet is up in {folder} already: nothing started")
        print("\n".join(record.exports()), flush=True)
        return 0
    if folder.exists() and any(folder.iterdir()):
        _say(f"{folder} holds no fleet but is not empty: name another one with --dir")
        return EXIT_UP_FAILED
    options = UpOptions(args.flower, args.metrics, args.latency_ms, args.cluster)
    try:
        record = start_fleet(folder, options, os.environ)
    except UpFailed as exc:
        _say(f"cchatq up: {exc}")
        return EXIT_UP_FAILED
    except ConfigError as exc:  # the configuration the environment names; nothing started
        _say(str(exc))
        return EXIT_UP_FAILED
    print("\n".join(record.exports()), flush=True)
    _tell(record, folder, args.dir)
    return 0


def _tell(record: FleetRecord, folder: Path, given_dir: str | None) -> None:
    pids = {p.name: p.pid for p in record.processes}
    _say(f"cchatq fleet up in {folder}")
    if record.redis_private:
        _say(f"  redis    {record.redis_url}  (its own redis-server, pid {pids['redis']})")
    else:
        _say(f"  redis    {record.redis_url}  (REDIS_URL's)")
    if record.state_url:
        nodes = [p.pid for p in record.processes if p.name.startswith("redis-cluster-")]
        _say(f"  state    {record.state_url}  (a Redis Cluster of {len(nodes)}, pids {nodes})")
    if record.replay_url:
        _say(f"  replay   {record.replay_url}  (the replay LLM server, pid {pids['replay']})")
        _say(f"  config   {record.config}  (default backend {REPLAY_DEFAULT_BACKEND})")
    else:
        _say("  config   the environment's (CCHATQ_CONFIG or CCHATQ_BACKENDS): no replay server")
    _say(f"  workers  {', '.join(task_names.ALL_QUEUES)}: one per queue")
    if record.flower_url:
        _say(f"  flower   {record.flower_url}")
    if record.metrics_url:
        _say(f"  metrics  {record.metrics_url}")
    _say(f"  logs     {folder / 'logs'}")
    if sys.stdout.isatty():
        _say('the lines above are for your shell: eval "$(cchatq up)" sets them')
    down = "cchatq down" + (f" --dir {given_dir}" if given_dir else "")
    _say("next:")
    _say("  cchatq submit FILE --out results.jsonl")
    _say("  cchatq status")
    _say("  cchatq view")
    _say(f"  {down}")


def cmd_down(args: argparse.Namespace) -> int:
    folder = fleet_dir(args.dir)
    try:
        record = FleetRecord.load(folder)
    except (OSError, ValueError, TypeError) as exc:
        _say(f"{folder}/fleet.json cannot be read ({exc}): nothing stopped")
        return EXIT_UP_FAILED
    if record is None:
        _say(f"no fleet in {folder}")
        return 0
    stopped = {p.pid for p in stop_processes(record.processes)}
    width = max((len(p.name) for p in record.processes), default=0)
    for process in record.processes:
        state = "stopped" if process.pid in stopped else "was not running"
        _say(f"  {process.name:<{width}} pid {process.pid:<8} {state}")
    shutil.rmtree(folder)
    _say(f"removed {folder}")
    return 0


def _masters(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"a number of masters, 1 or more, not {text!r}")
    return int(text)


def add_fleet_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    dir_help = "the fleet's folder (default: $CCHATQ_FLEET_DIR, else ./.cchatq-fleet)"
    p = sub.add_parser(
        "up",
        help="start a private local fleet (Redis, the replay server, a worker per queue) and "
        'print the shell lines that point cchatq at it: eval "$(cchatq up)"',
    )
    p.add_argument("--dir", help=dir_help)
    p.add_argument("--flower", action="store_true", help="Flower too (port 5555 or a free one)")
    p.add_argument("--metrics", action="store_true", help="the metrics exporter too")
    p.add_argument("--latency-ms", type=int, default=0, help="the replay server's delay")
    p.add_argument(
        "--cluster",
        type=_masters,
        default=0,
        metavar="N",
        help="keep the sessions' state on a local Redis Cluster of N masters (exported as "
        "CCHATQ_STATE_URL); the broker stays on the private Redis (REDIS_URL), since Celery's "
        "cannot run on a cluster. Refused with REDIS_URL set",
    )
    p.set_defaults(fn=cmd_up)
    p = sub.add_parser("down", help="stop what `cchatq up` started and remove its folder")
    p.add_argument("--dir", help=dir_help)
    p.set_defaults(fn=cmd_down)
