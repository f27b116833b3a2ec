"""`cchatq batch`: list batches; one's status (a status word, counts, ISO times), its results
(now, or once every session ended with --wait), cancel what still runs, retry what failed."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from producer.batch_tally import BatchTally
from producer.batches import BatchCounts, Batches, BatchSummary, iso_utc
from producer.cli_common import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_REJECTED,
    connect,
    plural,
    reach_redis,
    redis_url,
)
from producer.state_reader import state_reader

if TYPE_CHECKING:  # the Client, its Celery app and the spec validators: only where used
    from producer.client import Client

WAIT_POLL_S = 0.5  # `batch results --wait`: how often the batch's states are read


def add_batch_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    p = sub.add_parser("batch", help="list batches, or one's status, results, cancel or retry")
    p.add_argument("action", choices=["list", "status", "results", "cancel", "retry"])
    p.add_argument("batch", nargs="?")
    p.add_argument("--json", action="store_true", help="with status: one JSON object")
    p.add_argument(
        "--out", default="results.jsonl", help="with results or retry: the file to write"
    )
    p.add_argument(
        "--wait", action="store_true", help="with results: first wait until every session ended"
    )
    p.add_argument(
        "--timeout-s", type=float, default=None, help="with results --wait: wait at most this long"
    )
    p.add_argument(
        "--failed",
        action="store_true",
        help="with retry: the sessions that failed (the default), less those that would fail "
        "the same way again",
    )
    p.add_argument(
        "--codes",
        metavar="CODE,...",
        help="with retry: only the sessions that ended with these error codes",
    )
    p.add_argument(
        "--include-4xx",
        action="store_true",
        help="with retry: the sessions that would fail the same way again too (a provider's "
        "4xx, invalid_request, guest_error)",
    )
    p.set_defaults(fn=cmd_batch)
    return p


def cmd_batch(args: argparse.Namespace) -> int:
    """`cchatq batch list | status B | results B | cancel B | retry B`."""
    codes = None
    if args.codes is not None:  # a typo is named before anything is read
        from producer.retry_choice import UnknownCodes, parse_codes

        try:
            codes = parse_codes(args.codes)
        except UnknownCodes as exc:
            print(f"cchatq batch retry --codes: {exc}", file=sys.stderr)
            return EXIT_REJECTED
    if args.action == "status" and args.batch is not None:
        return status(args.batch, args.json)
    client = connect()
    batches = Batches(client)
    if args.action == "list":
        for batch, submitted_ms, sessions in batches.recent():
            print(f"{batch}  {iso_utc(submitted_ms)}  {plural(sessions, 'session')}")
        return EXIT_OK
    if args.batch is None:
        print(f"cchatq batch {args.action}: which batch?", file=sys.stderr)
        return EXIT_REJECTED
    summary = batches.summary(args.batch)
    if summary is None:
        print(f"unknown batch: {args.batch}", file=sys.stderr)
        return EXIT_REJECTED
    if args.action == "cancel":
        asked = batches.cancel(args.batch)
        print(f"batch {args.batch}: cancel requested for {plural(asked, 'session')}")
        return EXIT_OK
    if args.action == "retry":
        return retry(args, client, batches, codes)
    if args.wait:
        summary = wait_ended(batches, summary, args.timeout_s)
    return write_results(args, batches, summary)


def status(batch: str, as_json: bool) -> int:
    """`cchatq batch status B`, read with Redis alone (producer/state_reader.py): no Celery
    app, no spec validators to load."""
    url = redis_url()
    reach_redis(url)
    reader = state_reader(url)
    try:
        counts = BatchCounts(reader.redis, BatchTally(reader.redis))
        summary = counts.summary(batch)
    finally:
        reader.close()
    if summary is None:
        print(f"unknown batch: {batch}", file=sys.stderr)
        return EXIT_REJECTED
    text = json.dumps(summary.to_json(), indent=2, sort_keys=True)
    print(text if as_json else shown_summary(summary))
    return EXIT_OK


def shown_summary(summary: BatchSummary) -> str:
    """`cchatq batch status B`: a few lines for a person (--json for a program)."""
    order = ("queued", "running", "done", "gone")
    about = {"queued": "~", "running": "~", "gone": "~"} if summary.sampled else {}
    states = ", ".join(
        f"{about.get(s, '')}{summary.states[s]} {s}" for s in order if summary.states.get(s)
    )
    outcomes = ", ".join(f"{n} {code}" for code, n in sorted(summary.outcomes.items()))
    lines = [
        f"batch {summary.batch}: {summary.status}",
        f"  sessions:     {plural(summary.sessions, 'session')}"
        + (f" ({states})" if states else ""),
        f"  outcomes:     {outcomes or 'none yet'}",
    ]
    if summary.sampled:
        lines.append(f"  estimated:    ~ from a sample of {plural(summary.sampled, 'session')}")
    if summary.cancelling:
        lines.append(f"  cancelling:   {plural(summary.cancelling, 'session')}")
    if summary.submitted_ms:
        lines.append(f"  submitted_at: {iso_utc(summary.submitted_ms)}")
    if summary.completed_ms is not None:
        lines.append(f"  completed_at: {iso_utc(summary.completed_ms)}")
    return "\n".join(lines)


def wait_ended(batches: Batches, summary: BatchSummary, timeout_s: float | None) -> BatchSummary:
    """Until no session of the batch is queued or running (or `timeout_s`, or Ctrl-C): its
    summary then. The results are written either way: what ended by then."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    shown = -1
    try:
        while summary.unfinished:
            if summary.unfinished != shown:
                shown = summary.unfinished
                left = plural(shown, "session")
                print(f"batch {summary.batch}: waiting for {left}", file=sys.stderr, flush=True)
            if deadline is not None and time.monotonic() >= deadline:
                break
            time.sleep(WAIT_POLL_S)
            summary = batches.summary(summary.batch) or summary
    except KeyboardInterrupt:
        pass
    return summary


def write_results(args: argparse.Namespace, batches: Batches, summary: BatchSummary) -> int:
    """What ended of the batch, in --out: exit 3 naming what has not ended."""
    from producer.cli_batches import result_files

    written, failed = 0, 0
    with result_files(args.format, Path(args.out), args.errors, args.include) as files:
        for member, record in batches.results(args.batch):
            if record is not None and member.claim is not None:
                files.write(member.claim.sk, record, args.batch, member.claim.attempt)
                written += 1
                failed += record.get("status") != "ok"
    left = summary.sessions - written
    shown = f"batch {args.batch}: {written} of {plural(summary.sessions, 'result')} in {files}"
    print(shown, file=sys.stderr)
    if left:
        print(
            f"{plural(left, 'session')} not finished (`cchatq batch status {args.batch}`,"
            f" or `cchatq batch results {args.batch} --wait`)",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    return EXIT_FAILED if failed else EXIT_OK


def retry(
    args: argparse.Namespace, client: Client, batches: Batches, codes: frozenset[str] | None
) -> int:
    """The failed sessions chosen (producer/retry_choice.py) run again as their ids' next
    attempts, in a new batch waited for as a submit is."""
    from producer.cli_batches import BatchInterrupted, ended, interrupted, result_files, run_batch
    from producer.retry_choice import choose
    from producer.submitting import ModuleExpiredError

    choice = choose(batches.failed_sessions(args.batch), codes, args.include_4xx)
    if choice.skipped:
        print(choice.skipped_line(args.batch), file=sys.stderr)
    again = batches.specs_of([s.sk for s in choice.chosen])
    if not again:
        which = f"with {', '.join(sorted(codes))}" if codes else "to run again"
        print(f"batch {args.batch}: no failed session {which}", file=sys.stderr)
        return EXIT_OK
    out = Path(args.out)
    files = result_files(args.format, out, args.errors, args.include)
    try:  # in the batch's own namespace: an OpenAI file's ids are found only there
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
