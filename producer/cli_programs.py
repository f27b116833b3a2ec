"""`cchatq run`, `cchatq stream` and `cchatq demo`: one agent program on the fleet, talking
with a running program, and the demo batch on a fleet of its own."""

from __future__ import annotations

import argparse
import sys
import uuid
from pathlib import Path
from typing import Any

import fixtures
from producer.backend_check import backend_check
from producer.cli_batches import BatchInterrupted, run_batch, warn_unserved
from producer.cli_common import (
    EXIT_INTERRUPTED,
    EXIT_REJECTED,
    connect,
    fleet_config,
    plural,
)
from producer.client import Client
from producer.fleet import Fleet, replay_backend_name
from producer.specfile import SpecFileError, file_problem, load_spec_file, load_spec_from_objects
from producer.user_stream import RunEnded, pipe_lines
from schemas import task_names
from schemas.spec_types import Spec, spec_from_json, spec_to_json

DEMO_FILE = Path(fixtures.__file__).parent / "demo" / "sessions.jsonl"


def log_origin(log: dict[str, Any]) -> str:
    """Where a program's log line comes from: nothing for its own, the tool call for a
    forked tool's (`sum call_1` and the stream it wrote to, unless its `log` hostcall)."""
    if log.get("source") != "tool":
        return ""
    stream = log.get("stream", "log")
    return f"{log.get('tool')} {log.get('call_id')}{'' if stream == 'log' else ' ' + stream}: "


def cmd_run(args: argparse.Namespace) -> int:
    """Run one program on the fleet: its stdout on ours, its logs and stderr on our stderr,
    its exit code as ours (1 when it ended in an error)."""
    spec: dict[str, Any] = {
        "id": f"run/{uuid.uuid4().hex[:12]}",
        "program": {"module": str(Path(args.module).resolve()), "args": list(args.arg)},
        "limits": {"run_timeout_ms": args.timeout_ms},
    }
    if args.stdin:
        try:
            spec["program"]["stdin"] = Path(args.stdin).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            print(f"rejected: --stdin {args.stdin}: {file_problem(exc)}", file=sys.stderr)
            return EXIT_REJECTED
    if args.provider:
        spec["provider"] = args.provider
    if args.model:
        spec["model"] = args.model
    config = fleet_config()
    if config is None:
        return EXIT_REJECTED
    try:
        loaded = load_spec_from_objects([spec], check=backend_check(config))
    except SpecFileError as exc:
        print(f"rejected:\n{exc}", file=sys.stderr)
        return EXIT_REJECTED
    client = connect(config)
    run_id = spec["id"]
    print(f"run {run_id}", file=sys.stderr, flush=True)  # first: to cancel or look it up
    try:
        sub = client.enqueue(loaded)
        warn_unserved(client, loaded)
        record = next(iter(client.wait(sub, timeout_s=args.timeout_ms / 1000 + 60)))[1]
    except (KeyboardInterrupt, TimeoutError):
        print(
            f"run {run_id} keeps running on the fleet: `cchatq result {run_id}` once it ends,"
            f" `cchatq cancel {run_id}` to stop it",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    finally:
        client.close()
    sys.stdout.write(record.get("stdout", ""))
    sys.stderr.write(record.get("stderr", ""))
    for log in record.get("logs", []):  # as the guest wrote it: a line may end in its newline
        message = str(log["message"])
        end = "" if message.endswith("\n") else "\n"
        print(f"[{log['level']}] {log_origin(log)}{message}", file=sys.stderr, end=end)
    error = (record.get("body") or {}).get("error")
    if error:
        print(f"program failed: {error.get('code')}: {error.get('message')}", file=sys.stderr)
        return 1
    return int(record.get("exit_code") or 0)


def cmd_stream(args: argparse.Namespace) -> int:
    """Talk to a running program: stdin lines in, the lines it writes out (user stream N);
    then how the run ended on stderr, and 0 if it ended ok, else 1. A run that already
    ended is named with how it ended, and nothing is sent: EXIT_REJECTED."""
    client = connect(namespace=args.namespace, lookup_batch=args.batch)
    try:
        stream = client.stream(args.id, args.stream_id)
        ending = pipe_lines(stream, sys.stdin, sys.stdout)
    except RunEnded as exc:
        print(exc.args[0], file=sys.stderr)
        return EXIT_REJECTED
    except LookupError as exc:
        print(exc.args[0], file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    finally:
        client.close()
    print(f"run {args.id} ended ({ending.how})", file=sys.stderr)
    return 0 if ending.ok else 1


def cmd_demo(args: argparse.Namespace) -> int:
    from fixtures.demo_batch import check, on_backend

    loaded = load_spec_file(DEMO_FILE)[: args.limit]
    run = uuid.uuid4().hex[:8]  # fresh ids, so a shared Redis never answers from an earlier run
    backend = replay_backend_name(args.provider, args.stream)
    specs = [
        spec_from_json(
            on_backend({**spec_to_json(s.spec), "id": f"{run}:{s.spec.id}"}, backend, args.provider)
        )
        for s in loaded
    ]
    problems: list[tuple[str, str]] = []
    fleet = Fleet()  # its folder is removed as it stops, unless something failed
    try:
        records = _run_demo(fleet, specs, backend, args)
        problems = [
            (r["id"], p) for r in records for p in check({**r, "id": r["id"].split(":", 1)[1]})
        ]
    except BatchInterrupted as stop:
        print(f"{stop}: the demo fleet stops now", file=sys.stderr)
        fleet.keep = True
        return EXIT_INTERRUPTED
    except BaseException:
        fleet.keep = True
        raise
    finally:
        fleet.keep = fleet.keep or bool(problems)
        fleet.stop()
        if fleet.keep:
            print(f"the demo fleet's logs: {fleet.workdir}", file=sys.stderr)
    for spec_id, problem in problems[:20]:
        print(f"  MISMATCH {spec_id}: {problem}", file=sys.stderr)
    verdict = "all match" if not problems else plural(len(problems), "mismatch", "mismatches")
    checked = plural(len(records), "session")
    print(f"checked {checked} against expected outcomes: {verdict}", file=sys.stderr)
    return 1 if problems else 0


def _run_demo(
    fleet: Fleet, specs: list[Spec], backend: str, args: argparse.Namespace
) -> list[dict[str, Any]]:
    # always a Redis of its own: never a user's (REDIS_URL), nor workers already on it
    redis_url = fleet.ensure_redis(private=True)
    replay_url = fleet.start_replay()
    fleet.start_workers()
    fleet.wait_served()
    queues = "/".join(task_names.ALL_QUEUES)
    print(f"redis {redis_url}  replay {replay_url} ({backend})  workers {queues}", file=sys.stderr)
    client = Client(redis_url, config=fleet.config())
    try:
        return run_batch(client, specs, Path(args.out), args.timeout_s, keep_records=True).records
    finally:
        client.close()
