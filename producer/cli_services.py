"""`cchatq worker`, `flower`, `replay-server` and `metrics`: the commands that run one of the
fleet's long-lived processes in the foreground (a Celery worker, Flower, the replay LLM server,
the Prometheus exporter)."""

from __future__ import annotations

import argparse
import os
import sys
import threading

from producer.cli_common import EXIT_REJECTED, broker_url, reach_redis, redis_url
from producer.fleet import worker_command
from schemas import task_names
from schemas.config import ConfigError, read_config


def cmd_metrics(args: argparse.Namespace) -> int:
    from producer.metrics import Exporter

    reach_redis(redis_url())
    exporter = Exporter(redis_url(), broker_url())
    exporter.serve(args.port, args.address)
    print(f"metrics on http://{args.address}:{args.port}/metrics", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        exporter.close()
    return 0


def known_queues(value: str) -> str:
    """`--queues`: one or more of the fleet's queues, comma-separated (a typo is refused)."""
    unknown = [q for q in value.split(",") if q not in task_names.ALL_QUEUES]
    if unknown or not value:
        known = ", ".join(task_names.ALL_QUEUES)
        raise argparse.ArgumentTypeError(f"unknown queue {','.join(unknown)!r}; known: {known}")
    return value


def cmd_worker(args: argparse.Namespace) -> int:
    try:  # a wrong configuration is named here, not in a Celery boot traceback
        read_config()
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return EXIT_REJECTED
    cmd = worker_command(args.queues, args.pool, args.concurrency, args.name)
    os.execv(cmd[0], cmd)


def cmd_flower(args: argparse.Namespace) -> int:
    """Flower on the fleet's broker. FLOWER_BASIC_AUTH (`user:password[,user2:password2]`)
    turns its basic auth on: Flower reads the variable itself, so the password is never on a
    command line (`ps` shows those). Set but empty it is dropped, as Flower would otherwise
    take it for one empty credential and let no one in."""
    env = dict(os.environ)
    auth = env.pop("FLOWER_BASIC_AUTH", "").strip()
    if auth:
        if not all(":" in pair.strip(":") for pair in auth.split(",")):
            print("FLOWER_BASIC_AUTH: expected user:password[,user2:password2]", file=sys.stderr)
            return EXIT_REJECTED
        env["FLOWER_BASIC_AUTH"] = auth
    cmd = [sys.executable, "-m", "celery", "-A", "worker.tasks", "flower",
           f"--port={args.port}", f"--address={args.address}"]  # fmt: skip
    if args.persistent:  # its task history kept across restarts, in --db
        cmd += ["--persistent=True", f"--db={args.db}"]
    os.execve(cmd[0], cmd, env)


def cmd_replay_server(args: argparse.Namespace) -> int:
    cmd = [sys.executable, "-m", "fixtures.replay", "--host", args.host, "--port", str(args.port),
           "--latency-ms", str(args.latency_ms)]  # fmt: skip
    os.execv(cmd[0], cmd)


def add_metrics_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("metrics", help="serve the fleet's Prometheus metrics (reads Redis)")
    p.add_argument("--port", type=int, default=9808)
    p.add_argument("--address", default="127.0.0.1")
    p.set_defaults(fn=cmd_metrics)


def add_service_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("worker", help="run a Celery worker for one queue with its default pool")
    p.add_argument(
        "--queues",
        required=True,
        type=known_queues,
        help=" | ".join(task_names.ALL_QUEUES) + " (or several, comma-separated)",
    )
    p.add_argument("--pool")
    p.add_argument("--concurrency", type=int)
    p.add_argument("--name")
    p.set_defaults(fn=cmd_worker)

    p = sub.add_parser(
        "flower", help="run Flower on this fleet (basic auth from FLOWER_BASIC_AUTH)"
    )
    p.add_argument("--port", type=int, default=5555)
    p.add_argument("--address", default="127.0.0.1")
    p.add_argument(
        "--persistent", action="store_true", help="keep its task history across restarts, in --db"
    )
    p.add_argument("--db", default="flower.db", help="with --persistent: the file (flower.db)")
    p.set_defaults(fn=cmd_flower)

    p = sub.add_parser("replay-server", help="run the replay LLM server")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8011)
    p.add_argument("--latency-ms", type=int, default=0)
    p.set_defaults(fn=cmd_replay_server)
