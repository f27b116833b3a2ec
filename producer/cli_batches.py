"""`cchatq submit` and `cchatq batch`: validate, enqueue, wait with progress, write the results
(cchatq or OpenAI Batch lines) as they arrive, and collect, cancel or retry a batch later."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from producer.backend_check import backend_check
from producer.batch import batch_line
from producer.batches import Batches
from producer.cli_common import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_REJECTED,
    fleet_config,
    redis_url,
)
from producer.client import Client
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
from producer.specfile import SpecFileError, load_spec_file
from producer.submitting import (
    BATCH_SCOPE,
    ModuleExpiredError,
    Rerun,
    SpecConflictError,
    Submission,
)
from producer.validation_progress import validation_progress
from schemas.spec_types import Spec

MAX_LISTED = 20  # rejected lines listed, then how many more


class BatchInterrupted(Exception):
    """The wait stopped (Ctrl-C, or its timeout) before every session of the batch ended."""

    def __init__(self, batch: str, done: int, total: int) -> None:
        super().__init__(f"batch {batch}: {done} of {total} done")
        self.batch, self.done, self.total = batch, done, total


def result_files(
    fmt: str, out: Path, errors: str | None = None, include: Sequence[str] = ()
) -> ResultFiles:
    """Where a batch's result lines go: `cchatq` (one file) or `openai` (OpenAI Batch output
    lines, failed requests in the errors file: `errors`, else beside `out`; `include`
    "transcript": each line with its rounds and tool calls)."""
    if fmt == "openai":
        lines = openai_lines(transcript="transcript" in include)
        return ResultFiles(out, lines, Path(errors or errors_path(out)))

    def line(sk: str, record: dict[str, Any], batch: str, attempt: int) -> tuple[bool, str]:
        return False, batch_line(record, batch, attempt)

    return ResultFiles(out, line)


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
    rerun: Rerun = "none",
    files: ResultFiles | None = None,
    namespace: str | None = None,
) -> list[dict[str, Any]]:
    """Submit, show progress, write one JSON line per session (with its batch and which
    attempt of its id it is; or, with `files`, in their format), print the summary. Each line
    is written (and flushed) as its session finishes, so a producer that dies keeps what it
    had; once all are in, the files are rewritten in input order."""
    started = time.monotonic()
    files = files or result_files("cchatq", out)
    sub: Submission = client.enqueue(specs, rerun=rerun, namespace=namespace)
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
                files.write(sk, record, sub.batch, sub.runs[sk].attempt)
                progress.update(sk, record)
        except (KeyboardInterrupt, TimeoutError):
            raise BatchInterrupted(sub.batch, len(records), len(sub.order)) from None
    ordered = [records[sk] for sk in sub.order]
    files.rewrite((sk, records[sk], sub.batch, sub.runs[sk].attempt) for sk in sub.order)
    stream.write(f"results: {files}\n{summary(ordered, time.monotonic() - started)}\n")
    return ordered


def cmd_submit(args: argparse.Namespace) -> int:
    """Exit codes: EXIT_OK, EXIT_FAILED, EXIT_REJECTED, EXIT_INTERRUPTED."""
    config = fleet_config()
    if config is None:
        return EXIT_REJECTED
    check = backend_check(config, check_keys=not args.no_key_check)
    try:  # OpenAI Batch request lines are made specs, their tools bound by --tools
        bindings = load_tool_bindings(args.tools) if args.tools else None
        convert = converter(bindings, args.provider)
        with validation_progress(args.file, sys.stderr) as on_progress:
            loaded = load_spec_file(args.file, check, convert=convert, on_progress=on_progress)
    except (ToolsFileError, SpecFileError) as exc:
        print(f"rejected, nothing enqueued:\n{exc}", file=sys.stderr)
        return EXIT_REJECTED
    out = Path(args.out)
    files = result_files(args.format, out, args.errors, args.include)
    if not args.no_wait:  # a results file that cannot be written is found before anything runs
        for path, flag in zip(files.paths, ("--out", "--errors"), strict=False):
            try:
                path.open("a").close()
            except OSError as exc:
                print(f"rejected, nothing enqueued: {flag} {path}: {exc.strerror}", file=sys.stderr)
                return EXIT_REJECTED
    client = Client(redis_url(), config=config, namespace=args.namespace)
    # an OpenAI Batch file's custom_ids are its own, as OpenAI scopes them; --resample gives
    # a file's ids a scope of their own too, so each submit samples them again
    own_scope = args.resample or (convert.requests > 0 and args.namespace is None)
    namespace = BATCH_SCOPE if own_scope else None
    try:
        if args.no_wait:
            sub = client.enqueue([s.spec for s in loaded], rerun=args.rerun, namespace=namespace)
            print(f"batch {sub.batch}: {len(sub.new)} sessions enqueued")
            warn_unserved(client, [s.spec for s in loaded])
            return EXIT_OK
        specs = [s.spec for s in loaded]
        records = run_batch(
            client, specs, out, args.timeout_s, rerun=args.rerun, files=files, namespace=namespace
        )
    except SpecConflictError as exc:
        lines = {s.spec.id: s.line for s in loaded}

        def named(spec_id: str) -> str:  # an OpenAI request's id is its custom_id
            return "custom_id" if spec_id in convert.request_ids else "id"

        print("rejected, nothing enqueued:", file=sys.stderr)
        for spec_id in exc.spec_ids[:MAX_LISTED]:
            print(
                f"{args.file}:{lines[spec_id]}: {named(spec_id)}: {spec_id!r} was already"
                " submitted with a"
                f" different spec in namespace {client.namespace!r} (--rerun changed runs the"
                " changed ids again, as their next attempt; --namespace NS submits elsewhere)",
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
    client = Client(redis_url())
    batches = Batches(client)
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
        files = result_files(args.format, out, args.errors, args.include)
        try:  # a new batch of their next attempts, waited for as a submit is
            records = run_batch(
                client,
                again,
                out,
                None,
                rerun="all",
                files=files,
                namespace=batches.namespace(args.batch),
            )
        except ModuleExpiredError as exc:
            print(f"batch {args.batch}: {exc}", file=sys.stderr)
            return EXIT_REJECTED
        except BatchInterrupted as stop:
            return interrupted(stop, out)
        return ended(records)
    written, failed = 0, 0
    with result_files(args.format, Path(args.out), args.errors, args.include) as files:
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
