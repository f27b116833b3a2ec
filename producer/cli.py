"""`cchatq`: submit batches, inspect sessions, run workers and the demo. Parses and delegates."""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import urlencode

import fixtures
from producer.backend_check import backend_check
from producer.batch import batch_line, result_line
from producer.batches import Batches
from producer.client import Client, ModuleExpiredError, SpecConflictError, Submission
from producer.fleet import REPLAY_PROTOCOL_PATHS, Fleet, replay_backend_name, worker_command
from producer.fleet_status import read_fleet_status, unserved
from producer.openai_batch import (
    ResultFiles,
    ToolsFileError,
    converter,
    errors_path,
    load_tool_bindings,
    openai_lines,
)
from producer.report import Progress, batch_states, summary
from producer.specfile import SpecFileError, load_spec_file, load_spec_from_objects
from producer.user_stream import pipe_lines
from producer.validation_progress import validation_progress
from schemas import task_names
from schemas.bodies import dump_text
from schemas.config import ConfigError, FleetConfig, read_config
from schemas.spec_types import Spec, spec_from_json, spec_to_json

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_FLOWER_URL = "http://127.0.0.1:5555"  # CCHATQ_FLOWER_URL: where `status` points
DEMO_FILE = Path(fixtures.__file__).parent / "demo" / "sessions.jsonl"


def _redis_url() -> str:
    return os.environ.get("REDIS_URL", DEFAULT_REDIS_URL)


MAX_LISTED = 20  # rejected lines listed, then how many more

# `cchatq submit`'s exit codes (README: Results)
EXIT_OK = 0  # every session ended ok
EXIT_FAILED = 1  # every session ended, some with an error body
EXIT_REJECTED = 2  # the input was rejected: nothing enqueued
EXIT_INTERRUPTED = 3  # Ctrl-C or --timeout-s: the sessions left keep running on the fleet


class BatchInterrupted(Exception):
    """The wait stopped (Ctrl-C, or its timeout) before every session of the batch ended."""

    def __init__(self, batch: str, done: int, total: int) -> None:
        super().__init__(f"batch {batch}: {done} of {total} done")
        self.batch, self.done, self.total = batch, done, total


def result_files(fmt: str, out: Path, errors: str | None = None) -> ResultFiles:
    """Where a batch's result lines go: `cchatq` (one file) or `openai` (OpenAI Batch output
    lines, failed requests in the errors file: `errors`, else beside `out`)."""
    if fmt == "openai":
        return ResultFiles(out, openai_lines(program_body), Path(errors or errors_path(out)))

    def line(sk: str, record: dict[str, Any], batch: str, attempt: int) -> tuple[bool, str]:
        return False, batch_line(record, batch, attempt)

    return ResultFiles(out, line)


def program_body(record: dict[str, Any]) -> dict[str, Any]:
    """A program run's OpenAI Batch `response.body`: its result line's fields."""
    return {k: v for k, v in result_line(record).items() if k not in ("id", "kind", "error")}


def warn_unserved(client: Client, specs: Sequence[Spec], stream: TextIO = sys.stderr) -> None:
    """A needed queue no worker takes from: say so, rather than wait in silence."""
    for queue in unserved(read_fleet_status(client.redis), specs):
        stream.write(
            f"warning: no worker takes from queue {queue!r}: its steps wait until one does"
            f" (cchatq worker --queues {queue})\n"
        )


def run_batch(
    client: Client,
    specs: list[Spec],
    out: Path,
    timeout_s: float | None,
    stream: TextIO = sys.stderr,
    rerun: bool = False,
    files: ResultFiles | None = None,
) -> list[dict[str, Any]]:
    """Submit, show progress, write one JSON line per session (with its batch and which
    attempt of its id it is; or, with `files`, in their format), print the summary. Each line
    is written (and flushed) as its session finishes, so a producer that dies keeps what it
    had; once all are in, the files are rewritten in input order."""
    started = time.monotonic()
    files = files or result_files("cchatq", out)
    sub: Submission = client.enqueue(specs, rerun=rerun)
    warn_unserved(client, specs, stream)

    reused = len(sub.order) - len(sub.new)
    stream.write(
        f"batch {sub.batch}: {len(sub.new)} sessions enqueued"
        + (f", {reused} already submitted" if reused else "")
        + "\n"
    )
    records: dict[str, dict[str, Any]] = {}
    states = batch_states(client, sub, records)
    progress = Progress(len(sub.order), stream, already=sub.done, states=states)
    with files, progress:
        try:
            for sk, record in client.wait(sub, timeout_s=timeout_s):
                records[sk] = record
                files.write(sk, record, sub.batch, sub.attempts[sk])
                progress.update(sk, record)
        except (KeyboardInterrupt, TimeoutError):
            raise BatchInterrupted(sub.batch, len(records), len(sub.order)) from None
    ordered = [records[sk] for sk in sub.order]
    files.rewrite((sk, records[sk], sub.batch, sub.attempts[sk]) for sk in sub.order)
    stream.write(f"results: {files}\n{summary(ordered, time.monotonic() - started)}\n")
    return ordered


def fleet_config() -> FleetConfig | None:
    """The configuration shared with the workers, or None after saying what is wrong with it."""
    try:
        return read_config()
    except ConfigError as exc:
        print(f"rejected, nothing enqueued:\n{exc}", file=sys.stderr)
        return None


def cmd_submit(args: argparse.Namespace) -> int:
    """Exit codes: EXIT_OK, EXIT_FAILED, EXIT_REJECTED, EXIT_INTERRUPTED."""
    config = fleet_config()
    if config is None:
        return EXIT_REJECTED
    check = backend_check(config, check_keys=not args.no_key_check)
    try:  # OpenAI Batch request lines are made specs, their tools bound by --tools
        bindings = load_tool_bindings(args.tools) if args.tools else None
        with validation_progress(args.file, sys.stderr) as on_progress:
            loaded = load_spec_file(
                args.file,
                check,
                convert=converter(bindings, args.provider),
                on_progress=on_progress,
            )
    except (ToolsFileError, SpecFileError) as exc:
        print(f"rejected, nothing enqueued:\n{exc}", file=sys.stderr)
        return EXIT_REJECTED
    out = Path(args.out)
    files = result_files(args.format, out, args.errors)
    if not args.no_wait:  # a results file that cannot be written is found before anything runs
        for path, flag in zip(files.paths, ("--out", "--errors"), strict=False):
            try:
                path.open("a").close()
            except OSError as exc:
                print(f"rejected, nothing enqueued: {flag} {path}: {exc.strerror}", file=sys.stderr)
                return EXIT_REJECTED
    client = Client(_redis_url(), config=config)
    try:
        if args.no_wait:
            sub = client.enqueue([s.spec for s in loaded], rerun=args.rerun)
            print(f"batch {sub.batch}: {len(sub.new)} sessions enqueued")
            warn_unserved(client, [s.spec for s in loaded])
            return EXIT_OK
        specs = [s.spec for s in loaded]
        records = run_batch(client, specs, out, args.timeout_s, rerun=args.rerun, files=files)
    except SpecConflictError as exc:
        lines = {s.spec.id: s.line for s in loaded}
        print("rejected, nothing enqueued:", file=sys.stderr)
        for spec_id in exc.spec_ids[:MAX_LISTED]:
            print(
                f"{args.file}:{lines[spec_id]}: id: {spec_id!r} was already submitted with a"
                " different spec (--rerun runs every submitted id again, as a new attempt)",
                file=sys.stderr,
            )
        if len(exc.spec_ids) > MAX_LISTED:
            print(f"... and {len(exc.spec_ids) - MAX_LISTED} more", file=sys.stderr)
        return EXIT_REJECTED
    except BatchInterrupted as stop:
        return interrupted(stop, out)
    finally:
        client.close()
    return ended(records)


def ended(records: list[dict[str, Any]]) -> int:
    """The exit code of a batch whose every session ended."""
    return EXIT_OK if all(r.get("status") == "ok" for r in records) else EXIT_FAILED


def interrupted(stop: BatchInterrupted, out: Path) -> int:
    print(
        f"{stop}; the rest keep running on the fleet. Their results so far are in {out};"
        f" `cchatq batch results {stop.batch} --out FILE` collects them all.",
        file=sys.stderr,
    )
    return EXIT_INTERRUPTED


def cmd_batch(args: argparse.Namespace) -> int:
    """`cchatq batch list | status B | results B --out F | cancel B | retry B --failed`."""
    batches = Batches(Client(_redis_url()))
    if args.action == "list":
        for batch, submitted_ms, sessions in batches.recent():
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(submitted_ms / 1000))
            print(f"{batch}  {when}  {sessions} sessions")
        return EXIT_OK
    if args.batch is None:
        print(f"cchatq batch {args.action}: which batch?", file=sys.stderr)
        return EXIT_REJECTED
    summary = batches.summary(args.batch)
    if summary is None:
        print(f"unknown batch: {args.batch}", file=sys.stderr)
        return EXIT_REJECTED
    if args.action == "status":
        print(json.dumps(summary.to_json(), indent=2, sort_keys=True))
        return EXIT_OK
    if args.action == "cancel":
        print(f"batch {args.batch}: cancel requested for {batches.cancel(args.batch)} sessions")
        return EXIT_OK
    if args.action == "retry":
        if not args.failed:
            print(
                "cchatq batch retry runs the failed sessions again: say --failed", file=sys.stderr
            )
            return EXIT_REJECTED
        again = batches.failed_specs(args.batch)
        if not again:
            print(f"batch {args.batch}: no failed session to run again", file=sys.stderr)
            return EXIT_OK
        out = Path(args.out)
        files = result_files(args.format, out, args.errors)
        try:  # a new batch of their next attempts, waited for as a submit is
            records = run_batch(batches.client, again, out, None, rerun=True, files=files)
        except ModuleExpiredError as exc:
            print(f"batch {args.batch}: {exc}", file=sys.stderr)
            return EXIT_REJECTED
        except BatchInterrupted as stop:
            return interrupted(stop, out)
        return ended(records)
    written, failed = 0, 0
    with result_files(args.format, Path(args.out), args.errors) as files:
        for member, record in batches.results(args.batch):
            if record is not None and member.claim is not None:
                files.write(member.claim.sk, record, args.batch, member.claim.attempt)
                written += 1
                failed += record.get("status") != "ok"
    left = summary.sessions - written
    shown = f"batch {args.batch}: {written} of {summary.sessions} results in {files}"
    print(shown, file=sys.stderr)
    if left:
        print(f"{left} not finished (`cchatq batch status {args.batch}`)", file=sys.stderr)
        return EXIT_INTERRUPTED
    return EXIT_FAILED if failed else EXIT_OK


def cmd_status(args: argparse.Namespace) -> int:
    client = Client(_redis_url())
    if args.id is None:  # the fleet: tasks queued and running per queue, workers, sessions
        print(json.dumps(read_fleet_status(client.redis).to_json(), indent=2))
        return 0
    status = client.status(args.id)
    if status is None:
        print(f"unknown session id: {args.id}", file=sys.stderr)
        return 1
    # every step task of the session shows its id as kwargs (worker/edges/dispatch.py)
    search = f"kwargs:session={args.id}"
    flower = os.environ.get("CCHATQ_FLOWER_URL", DEFAULT_FLOWER_URL).rstrip("/")
    status["flower_search"] = search
    status["flower_tasks"] = f"{flower}/api/tasks?{urlencode({'search': search})}"
    print(json.dumps(status, indent=2, sort_keys=True))
    return 0


def cmd_result(args: argparse.Namespace) -> int:
    client = Client(_redis_url())
    if args.tool_output is not None:
        output = client.tool_output(args.id, args.tool_output)
        if output is None:
            print(f"no output of call {args.tool_output} in {args.id}", file=sys.stderr)
            return 1
        sys.stdout.write(output)
        return 0
    record = client.record(args.id)
    if record is None:
        known = client.status(args.id) is not None
        print(
            f"{'not finished yet' if known else 'unknown session id'}: {args.id}", file=sys.stderr
        )
        return 1
    print(dump_text(result_line(record) if args.full else record["body"]))
    return 0


def cmd_trace(args: argparse.Namespace) -> int:
    client = Client(_redis_url())
    if client.status(args.id) is None:
        print(f"unknown session id: {args.id}", file=sys.stderr)
        return 1
    for event in client.trace(args.id, follow=args.follow):
        print(json.dumps(event, separators=(",", ":")), flush=True)
    return 0


def cmd_metrics(args: argparse.Namespace) -> int:
    from producer.metrics import Exporter

    exporter = Exporter(_redis_url())
    exporter.serve(args.port, args.address)
    print(f"metrics on http://{args.address}:{args.port}/metrics", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        exporter.close()
    return 0


def cmd_stream(args: argparse.Namespace) -> int:
    """Talk to a running program: stdin lines in, the lines it writes out (user stream N)."""
    client = Client(_redis_url())
    try:
        stream = client.stream(args.id, args.stream_id)
        pipe_lines(stream, sys.stdin, sys.stdout)
    except LookupError as exc:
        print(exc.args[0], file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    finally:
        client.close()
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    if not Client(_redis_url()).cancel(args.id):
        print(f"unknown session id: {args.id}", file=sys.stderr)
        return 1
    print(f"cancel requested: {args.id}")
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    """`cchatq config check`: the configuration the workers and submit would read, checked
    whole (exit 2 naming each problem), then its backends and whether each key is set here."""
    environ = dict(os.environ)
    if args.file:
        environ.pop("CCHATQ_BACKENDS", None)
        environ["CCHATQ_CONFIG"] = args.file
    try:
        config = read_config(environ)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return EXIT_REJECTED
    print(f"configuration: {config.source}; default backend: {config.default_backend}")
    for name, backend in sorted(config.backends.items()):
        key = "no key"
        if backend.api_key_env:
            found = "set" if environ.get(backend.api_key_env) else "NOT SET here"
            key = f"${backend.api_key_env} {found}"
        print(f"  {name:<24} {backend.protocol:<16} {backend.base_url}  {key}")
    fleet = config.tool_defaults
    for server_id, server in sorted(fleet.mcp_servers.items()):
        where = server.command[0] if server.command else server.url
        usable = sorted(n for n, e in fleet.environments.items() if server_id in e.mcp_servers)
        envs = ", ".join(usable) or "no environment"
        print(f"  mcp {server_id:<20} {server.transport:<16} {where}  usable in: {envs}")
    return EXIT_OK


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
    cmd = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "worker.tasks",
        "flower",
        f"--port={args.port}",
        f"--address={args.address}",
    ]
    os.execv(cmd[0], cmd)


def cmd_replay_server(args: argparse.Namespace) -> int:
    cmd = [sys.executable, "-m", "fixtures.replay", "--host", args.host, "--port", str(args.port),
           "--latency-ms", str(args.latency_ms)]  # fmt: skip
    os.execv(cmd[0], cmd)


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
        spec["program"]["stdin"] = Path(args.stdin).read_text()
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
    client = Client(_redis_url(), config=config)
    run_id = spec["id"]
    print(f"run {run_id}", file=sys.stderr, flush=True)  # first: to cancel or look it up
    try:
        sub = client.enqueue(loaded)
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
    with Fleet() as fleet:
        # always a Redis of its own: never a user's (REDIS_URL), nor workers already on it
        redis_url = fleet.ensure_redis(private=True)
        replay_url = fleet.start_replay()
        fleet.start_workers()
        fleet.wait_served()
        print(
            f"redis {redis_url}  replay {replay_url} ({backend})  "
            f"workers llm/tools/control/programs  logs {fleet.workdir}",
            file=sys.stderr,
        )
        client = Client(redis_url, config=fleet.config())
        try:
            records = run_batch(client, specs, Path(args.out), args.timeout_s)
        except BatchInterrupted as stop:
            print(f"{stop}: the demo fleet stops now", file=sys.stderr)
            return EXIT_INTERRUPTED
        finally:
            client.close()
    problems = [(r["id"], p) for r in records for p in check({**r, "id": r["id"].split(":", 1)[1]})]
    for spec_id, problem in problems[:20]:
        print(f"  MISMATCH {spec_id}: {problem}", file=sys.stderr)
    verdict = "all match" if not problems else f"{len(problems)} mismatches"
    print(f"checked {len(records)} sessions against expected outcomes: {verdict}", file=sys.stderr)
    return 1 if problems else 0


def version() -> str:
    try:
        return metadata.version("cchatq")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cchatq", description="Batch LLM chat sessions with WASM tools."
    )
    parser.add_argument("--version", action="version", version=f"cchatq {version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "submit", help="validate a JSONL/JSON spec file, enqueue it, wait, write results"
    )
    p.add_argument("file")
    p.add_argument("--out", default="results.jsonl")
    p.add_argument("--timeout-s", type=float, default=None)
    p.add_argument("--no-wait", action="store_true")
    p.add_argument(
        "--rerun",
        action="store_true",
        help="run every id already submitted again, as its next attempt (a changed spec "
        "under an id already submitted is refused without it)",
    )
    p.add_argument(
        "--no-key-check",
        action="store_true",
        help="do not refuse a backend whose API key variable is unset here (when only the "
        "workers hold the keys)",
    )
    p.add_argument(
        "--tools",
        metavar="FILE",
        help="OpenAI Batch lines: a JSON file binding each function name of body.tools to a "
        'WASM module: {"name": {"module": PATH, "export": NAME}} (paths relative to FILE)',
    )
    p.add_argument(
        "--provider", help="OpenAI Batch lines: the backend that runs them (default_backend)"
    )
    _format_arguments(p)
    p.set_defaults(fn=cmd_submit)

    p = sub.add_parser("batch", help="list batches, or one's status, results or cancel")
    p.add_argument("action", choices=["list", "status", "results", "cancel", "retry"])
    p.add_argument("batch", nargs="?")
    p.add_argument(
        "--out", default="results.jsonl", help="with results or retry: the file to write"
    )
    p.add_argument(
        "--failed", action="store_true", help="with retry: the sessions that failed (required)"
    )
    _format_arguments(p)
    p.set_defaults(fn=cmd_batch)

    p = sub.add_parser("config", help="check the fleet's configuration and list its backends")
    p.add_argument("action", choices=["check"])
    p.add_argument("--file", help="this configuration file (default: what the environment names)")
    p.set_defaults(fn=cmd_config)

    p = sub.add_parser("status", help="a session's state, or the fleet's without an id")
    p.add_argument("id", nargs="?")
    p.set_defaults(fn=cmd_status)

    p = sub.add_parser("result", help="print a finished session's response body")
    p.add_argument("id")
    p.add_argument(
        "--full", action="store_true", help="the whole record: transcript and metrics too"
    )
    p.add_argument(
        "--tool-output", metavar="CALL_ID", help="one tool call's whole output (no excerpt)"
    )
    p.set_defaults(fn=cmd_result)

    p = sub.add_parser("trace", help="a session's trace events as JSONL (ids, codes, times)")
    p.add_argument("id")
    p.add_argument("--follow", action="store_true", help="wait for events until it finishes")
    p.set_defaults(fn=cmd_trace)

    p = sub.add_parser("metrics", help="serve the fleet's Prometheus metrics (reads Redis)")
    p.add_argument("--port", type=int, default=9808)
    p.add_argument("--address", default="127.0.0.1")
    p.set_defaults(fn=cmd_metrics)

    p = sub.add_parser(
        "stream", help="talk to a running program: stdin lines in, its user stream's lines out"
    )
    p.add_argument("id")
    p.add_argument("--stream-id", type=int, default=1, help="the user stream (default 1)")
    p.set_defaults(fn=cmd_stream)

    p = sub.add_parser("cancel", help="cancel a session at its next step boundary")
    p.add_argument("id")
    p.set_defaults(fn=cmd_cancel)

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

    p = sub.add_parser("flower", help="run Flower on this fleet")
    p.add_argument("--port", type=int, default=5555)
    p.add_argument("--address", default="127.0.0.1")
    p.set_defaults(fn=cmd_flower)

    p = sub.add_parser("replay-server", help="run the replay LLM server")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8011)
    p.add_argument("--latency-ms", type=int, default=0)
    p.set_defaults(fn=cmd_replay_server)

    p = sub.add_parser("run", help="run a WASM agent program on the fleet and wait for it")
    p.add_argument("module")
    p.add_argument("--arg", action="append", default=[], help="a program argument (repeatable)")
    p.add_argument("--stdin", help="a file given to the program as its stdin")
    p.add_argument("--provider", help="backend for its chats (its `backend` param wins)")
    p.add_argument("--model", help="model for its chats (its `model` param wins)")
    p.add_argument("--timeout-ms", type=int, default=60_000)
    p.set_defaults(fn=cmd_run)

    p = sub.add_parser("demo", help="run the demo batch on a local fleet it starts and stops")
    p.add_argument("--out", default="demo-results.jsonl")
    p.add_argument("--timeout-s", type=float, default=300)
    p.add_argument("--provider", default="openai", choices=sorted(REPLAY_PROTOCOL_PATHS),
                   help="the wire protocol the replay server is spoken to in")  # fmt: skip
    p.add_argument("--stream", action="store_true", help="streamed (SSE) model calls")
    p.add_argument("--limit", type=int, help="only the first N sessions of the demo batch")
    p.set_defaults(fn=cmd_demo)
    return parser


def _format_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--format",
        choices=["cchatq", "openai"],
        default="cchatq",
        help="results as cchatq lines, or as OpenAI Batch output lines (failed requests in "
        "the errors file)",
    )
    p.add_argument(
        "--errors",
        metavar="FILE",
        help="with --format openai: the errors file (default: beside --out, *.errors.jsonl)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "errors", None) and args.format != "openai":
        parser.error("--errors goes with --format openai")
    return int(args.fn(args))


if __name__ == "__main__":
    sys.exit(main())
