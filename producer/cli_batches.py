"""`cchatq submit`: validate, enqueue, wait with progress, write the results (cchatq or OpenAI
Batch lines) as they arrive. `cchatq batch retry` runs its sessions the same way
(producer/cli_batch.py)."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from producer.backend_check import backend_check
from producer.batch import batch_line
from producer.cli_common import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_REJECTED,
    connect,
    fleet_config,
    plural,
)
from producer.client import Client
from producer.fleet_status import read_fleet_status, unserved
from producer.openai_batch import ToolsFileError, converter, load_tool_bindings
from producer.openai_output import ResultFiles, errors_path, openai_lines
from producer.report import Progress, Summary, batch_states
from producer.specfile import SpecFileError, load_stored_specs
from producer.stored_specs import ModuleChangedError, StoredSpec
from producer.submitting import (
    BATCH_SCOPE,
    Rerun,
    SpecConflictError,
    Submission,
)
from producer.validation_progress import validation_progress
from schemas.spec_types import Spec

MAX_LISTED = 20  # rejected lines listed, then how many more (all of them: --all-issues)


@dataclass(frozen=True)
class BatchRun:
    """A batch waited for to its end: how many sessions, how many failed, and (when asked
    for) their records in input order."""

    sessions: int
    failed: int
    records: list[dict[str, Any]] = field(default_factory=list)


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


def warn_unserved(
    client: Client, specs: Sequence[Spec | StoredSpec], stream: TextIO | None = None
) -> None:
    """A needed queue no worker takes from: say so, rather than wait in silence (on `stream`,
    else sys.stderr as it is when called: this module is imported when a command runs)."""
    stream = stream or sys.stderr
    for queue in unserved(read_fleet_status(client.redis, client.broker_queues), specs):
        stream.write(
            f"warning: no worker takes from queue {queue!r}: its steps wait until one does"
            f" (cchatq worker --queues {queue})\n"
        )


def run_batch(
    client: Client,
    specs: Sequence[Spec | StoredSpec],
    out: Path,
    timeout_s: float | None,
    stream: TextIO | None = None,
    rerun: Rerun = "none",
    files: ResultFiles | None = None,
    namespace: str | None = None,
    keep_records: bool = False,
) -> BatchRun:
    """Submit, show progress, write one JSON line per session (with its batch and which
    attempt of its id it is; or, with `files`, in their format), print the summary. Each line
    is written (and flushed) as its session finishes, so a producer that dies keeps what it
    had; once all are in, the lines are copied again in input order. Only counts are kept of
    the records (and the records themselves with `keep_records`: the demo checks them)."""
    started = time.monotonic()
    stream = stream or sys.stderr
    files = files or result_files("cchatq", out)
    sub: Submission = client.enqueue(specs, rerun=rerun, namespace=namespace)
    if sub.warning:
        stream.write(sub.warning + "\n")
    warn_unserved(client, specs, stream)

    reused = len(sub.order) - len(sub.new)
    stream.write(
        f"batch {sub.batch}: {plural(len(sub.new), 'session')} enqueued"
        + (f", {reused} already submitted" if reused else "")
        + "\n"
    )
    finished: set[str] = set()
    kept: dict[str, dict[str, Any]] = {}
    totals = Summary()
    states = batch_states(client, sub, finished)
    progress = Progress(len(sub.order), stream, already=sub.done, states=states)
    with files, progress:
        try:
            for sk, record in client.wait(sub, timeout_s=timeout_s):
                finished.add(sk)
                files.write(sk, record, sub.batch, sub.runs[sk].attempt)
                progress.update(sk, record)
                totals.add(record)
                if keep_records:
                    kept[sk] = record
        except (KeyboardInterrupt, TimeoutError):
            raise BatchInterrupted(sub.batch, len(finished), len(sub.order)) from None
    files.reorder(sub.order)
    stream.write(f"results: {files}\n{totals.text(time.monotonic() - started)}\n")
    ordered = [kept[sk] for sk in sub.order if sk in kept]
    return BatchRun(totals.sessions, totals.sessions - totals.ok, ordered)


def unwritable(path: Path) -> str:
    """Why `path` cannot be written ("" if it can), leaving no file behind that was not there:
    a submit refused later writes nothing."""
    existed = path.exists()
    try:
        path.open("a").close()
    except OSError as exc:
        return exc.strerror or str(exc)
    if not existed:
        path.unlink()
    return ""


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
            loaded = load_stored_specs(args.file, check, convert, on_progress)
    except ToolsFileError as exc:
        print(f"rejected, nothing enqueued:\n{exc}", file=sys.stderr)
        return EXIT_REJECTED
    except SpecFileError as exc:
        shown = exc.listing(
            None if args.all_issues else MAX_LISTED, " (--all-issues lists them all)"
        )
        print(f"rejected, nothing enqueued:\n{shown}", file=sys.stderr)
        return EXIT_REJECTED
    out = Path(args.out)
    files = result_files(args.format, out, args.errors, args.include)
    if not args.no_wait:  # a results file that cannot be written is found before anything runs
        for path, flag in zip(files.paths, ("--out", "--errors"), strict=False):
            problem = unwritable(path)
            if problem:
                print(f"rejected, nothing enqueued: {flag} {path}: {problem}", file=sys.stderr)
                return EXIT_REJECTED
    client = connect(config, namespace=args.namespace)
    # an OpenAI Batch file's custom_ids are its own, as OpenAI scopes them; --resample gives
    # a file's ids a scope of their own too, so each submit samples them again
    own_scope = args.resample or (convert.requests > 0 and args.namespace is None)
    namespace = BATCH_SCOPE if own_scope else None
    try:
        if args.no_wait:
            sub = client.enqueue(loaded, rerun=args.rerun, namespace=namespace)
            if sub.warning:
                print(sub.warning, file=sys.stderr)
            print(f"batch {sub.batch}: {plural(len(sub.new), 'session')} enqueued")
            warn_unserved(client, loaded)
            return EXIT_OK
        records = run_batch(
            client, loaded, out, args.timeout_s, rerun=args.rerun, files=files, namespace=namespace
        )
    except SpecConflictError as exc:
        lines = {s.id: s.line for s in loaded}

        def named(spec_id: str) -> str:  # an OpenAI request's id is its custom_id
            return "custom_id" if spec_id in convert.request_ids else "id"

        print("rejected, nothing enqueued:", file=sys.stderr)
        listed = exc.spec_ids if args.all_issues else exc.spec_ids[:MAX_LISTED]
        for spec_id in listed:
            print(
                f"{args.file}:{lines[spec_id]}: {named(spec_id)}: {spec_id!r} was already"
                " submitted with a"
                f" different spec in namespace {client.namespace!r} (--rerun changed runs the"
                " changed ids again, as their next attempt; --namespace NS submits elsewhere)",
                file=sys.stderr,
            )
        if len(exc.spec_ids) > len(listed):
            more = len(exc.spec_ids) - len(listed)
            print(f"... and {more} more (--all-issues lists them all)", file=sys.stderr)
        return EXIT_REJECTED
    except ModuleChangedError as exc:
        print(f"rejected, nothing enqueued: {exc}", file=sys.stderr)
        return EXIT_REJECTED
    except BatchInterrupted as stop:
        return interrupted(stop, out)
    finally:
        client.close()
    return ended(records)


def ended(run: BatchRun) -> int:
    """The exit code of a batch whose every session ended."""
    return EXIT_FAILED if run.failed else EXIT_OK


def interrupted(stop: BatchInterrupted, out: Path) -> int:
    print(
        f"{stop}; the rest keep running on the fleet. Their results so far are in {out};"
        f" `cchatq batch results {stop.batch} --out FILE` collects them all.",
        file=sys.stderr,
    )
    return EXIT_INTERRUPTED
