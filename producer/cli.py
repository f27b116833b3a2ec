"""`cchatq`: submit batches, inspect sessions, run workers and the demo. Parses and delegates
(producer/cli_batches.py, cli_programs.py, cli_services.py, ...)."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import asdict
from importlib import metadata
from typing import TYPE_CHECKING, Any

from producer.batch import result_line
from producer.batches import iso_utc
from producer.cli_batch import add_batch_parser
from producer.cli_common import (
    EXIT_OK,
    EXIT_REJECTED,
    EXIT_UNREACHABLE,
    RedisUnreachable,
    broker_url,
    broker_where,
    check_redis_url,
    connect,
    flower_curl,
    flower_links,
    infrastructure_line,
    redis_url,
    redis_where,
)
from schemas import keys
from schemas.bodies import dump_text
from schemas.protocols import NAMES as PROTOCOL_NAMES

if TYPE_CHECKING:
    from producer.client import Client

# a session's meta times (epoch ms) -> how `cchatq status ID` shows them (ISO-8601 UTC)
SHOWN_TIMES = {"submitted_ms": "submitted_at", "finished_ms": "finished_at"}


def shown_status(status: dict[str, Any]) -> dict[str, Any]:
    """A session's status as `cchatq status ID` prints it: its times ISO-8601 UTC."""
    shown = dict(status)
    for field, name in SHOWN_TIMES.items():
        value = shown.pop(field, None)
        if isinstance(value, str) and value.isdigit():
            shown[name] = iso_utc(int(value))
        elif value is not None:
            shown[field] = value
    return shown


def id_client(args: argparse.Namespace) -> Client:
    """A client that finds an id's run where `--namespace` or `--batch` says."""
    return connect(namespace=args.namespace, lookup_batch=args.batch)


def cmd_status(args: argparse.Namespace) -> int:
    client = id_client(args)
    if args.id is None:  # the fleet: tasks queued and running per queue, workers, sessions
        from producer.fleet_status import read_fleet_status

        fleet = read_fleet_status(client.redis, client.broker_queues)
        sys.stderr.write("".join(f"{w}\n" for w in fleet.warnings))  # loud: not only in JSON
        shown = fleet.to_json()
        # Redis memory a session holds: sampled, a finished one's and a running one's
        from producer.session_memory import session_memory

        shown["session_memory"] = asdict(session_memory(client.redis))
        shown["redis"] = redis_where(redis_url(), client.redis)
        if broker_url() != redis_url():
            shown["broker"] = broker_where(broker_url(), client.broker_queues)
        print(json.dumps(shown, indent=2))
        return 0
    status = client.status(args.id)
    if status is None:
        print(f"unknown session id: {args.id}", file=sys.stderr)
        return 1
    status["flower_search"], status["flower_tasks"] = flower_links(args.id)
    status["flower_curl"] = flower_curl(status["flower_tasks"])
    print(json.dumps(shown_status(status), indent=2, sort_keys=True))
    return 0


def cmd_result(args: argparse.Namespace) -> int:
    client = id_client(args)
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
    client = id_client(args)
    if client.status(args.id) is None:
        print(f"unknown session id: {args.id}", file=sys.stderr)
        return 1
    for event in client.trace(args.id, follow=args.follow):
        print(json.dumps(event, separators=(",", ":")), flush=True)
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    if not id_client(args).cancel(args.id):
        print(f"unknown session id: {args.id}", file=sys.stderr)
        return 1
    print(f"cancel requested: {args.id}")
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    """`cchatq config check`: the configuration the workers and submit would read, checked
    whole (exit 2 naming each problem), then its backends and whether each key is set here,
    its model aliases and its MCP servers."""
    from schemas.config import ConfigError, read_config

    environ = dict(os.environ)
    if args.file:
        environ.pop("CCHATQ_BACKENDS", None)
        environ["CCHATQ_CONFIG"] = args.file
    try:
        config = read_config(environ)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return EXIT_REJECTED
    try:
        check_redis_url(redis_url())
    except RedisUnreachable as exc:  # its form only: config check never connects
        print(exc, file=sys.stderr)
        return EXIT_REJECTED
    print(f"configuration: {config.source}; default backend: {config.default_backend}")
    print(f"redis: {redis_where(redis_url())}")
    for name, backend in sorted(config.backends.items()):
        key = "no key"
        if backend.api_key_env:
            found = "set" if environ.get(backend.api_key_env) else "NOT SET here"
            key = f"${backend.api_key_env} {found}"
        print(f"  {name:<24} {backend.protocol:<16} {backend.base_url}  {key}")
    for name, alias in sorted(config.models.items()):
        print(f"  model {name:<18} -> {alias.backend} {alias.model}")
    fleet = config.tool_defaults
    for server_id, server in sorted(fleet.mcp_servers.items()):
        where = server.command[0] if server.command else server.url
        usable = sorted(n for n, e in fleet.environments.items() if server_id in e.mcp_servers)
        envs = ", ".join(usable) or "no environment"
        print(f"  mcp {server_id:<20} {server.transport:<16} {where}  usable in: {envs}")
    return EXIT_OK


def version() -> str:
    try:
        return metadata.version("cchatq")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


# The commands whose modules load the Celery app, the spec validators or the local fleet are
# imported when they run (and the parsers that name them when the whole parser is built):
# `cchatq batch ...` parses with the batch command's parser alone, and `batch status` answers
# with Redis alone (producer/state_reader.py).


def cmd_submit(args: argparse.Namespace) -> int:
    from producer.cli_batches import cmd_submit as submit

    return submit(args)


def cmd_demo(args: argparse.Namespace) -> int:
    from producer.cli_programs import cmd_demo as demo

    return demo(args)


def cmd_run(args: argparse.Namespace) -> int:
    from producer.cli_programs import cmd_run as run

    return run(args)


def cmd_stream(args: argparse.Namespace) -> int:
    from producer.cli_programs import cmd_stream as stream

    return stream(args)


def batch_parser() -> argparse.ArgumentParser:
    """`cchatq batch ...` alone."""
    parser = argparse.ArgumentParser(
        prog="cchatq", description="Batch LLM chat sessions with WASM tools."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _format_arguments(add_batch_parser(sub))
    return parser


def build_parser() -> argparse.ArgumentParser:
    from producer.cli_batches import MAX_LISTED
    from producer.cli_fleet import add_fleet_parsers
    from producer.cli_services import add_metrics_parser, add_service_parsers
    from producer.cli_view import add_view_parser

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
        choices=["changed", "all"],
        default="none",
        help="ids already submitted in the namespace run again, as their next attempt: those "
        "whose spec changed, or all (without it, a changed spec under a submitted id is refused)",
    )
    p.add_argument(
        "--resample",
        action="store_true",
        help="the file's ids are this batch's own: every line runs again, and the namespace's "
        "runs of the same ids stay as they are",
    )
    _namespace_argument(p)
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
    p.add_argument(
        "--all-issues",
        action="store_true",
        help=f"list every rejected line (by default the first {MAX_LISTED})",
    )
    _format_arguments(p)
    p.set_defaults(fn=cmd_submit)

    _format_arguments(add_batch_parser(sub))

    p = sub.add_parser("config", help="check the fleet's configuration and list its backends")
    p.add_argument("action", choices=["check"])
    p.add_argument("--file", help="this configuration file (default: what the environment names)")
    p.set_defaults(fn=cmd_config)

    p = sub.add_parser("status", help="a session's state, or the fleet's without an id")
    p.add_argument("id", nargs="?")
    _lookup_arguments(p)
    p.set_defaults(fn=cmd_status)

    p = sub.add_parser("result", help="print a finished session's response body")
    p.add_argument("id")
    _lookup_arguments(p)
    p.add_argument(
        "--full", action="store_true", help="the whole record: transcript and metrics too"
    )
    p.add_argument(
        "--tool-output", metavar="CALL_ID", help="one tool call's whole output (no excerpt)"
    )
    p.set_defaults(fn=cmd_result)

    p = sub.add_parser("trace", help="a session's trace events as JSONL (ids, codes, times)")
    p.add_argument("id")
    _lookup_arguments(p)
    p.add_argument("--follow", action="store_true", help="wait for events until it finishes")
    p.set_defaults(fn=cmd_trace)

    add_view_parser(sub)
    add_fleet_parsers(sub)

    add_metrics_parser(sub)

    p = sub.add_parser(
        "stream", help="talk to a running program: stdin lines in, its user stream's lines out"
    )
    p.add_argument("id")
    p.add_argument("--stream-id", type=int, default=1, help="the user stream (default 1)")
    _lookup_arguments(p)
    p.set_defaults(fn=cmd_stream)

    p = sub.add_parser("cancel", help="cancel a session at its next step boundary")
    p.add_argument("id")
    _lookup_arguments(p)
    p.set_defaults(fn=cmd_cancel)

    add_service_parsers(sub)

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
    p.add_argument("--provider", default="openai", choices=sorted(PROTOCOL_NAMES),
                   help="the wire protocol the replay server is spoken to in")  # fmt: skip
    p.add_argument("--stream", action="store_true", help="streamed (SSE) model calls")
    p.add_argument("--limit", type=int, help="only the first N sessions of the demo batch")
    p.set_defaults(fn=cmd_demo)
    return parser


def _namespace_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--namespace",
        type=namespace_name,
        help="where spec ids are unique (default: the configuration's `namespace`, 'default')",
    )


def _lookup_arguments(p: argparse.ArgumentParser) -> None:
    """How an id command finds its run: in a namespace, or as a batch ran it."""
    _namespace_argument(p)
    p.add_argument("--batch", help="the run of the id that this batch ran")


def namespace_name(value: str) -> str:
    if not re.fullmatch(keys.NAMESPACE_PATTERN, value):
        raise argparse.ArgumentTypeError(f"{value!r}: {keys.NAMESPACE_RULE}")
    return value


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
    p.add_argument(
        "--include",
        action="append",
        choices=["transcript"],
        default=[],
        help="with --format openai: each output line also holds its rounds and tool calls "
        "(body._cchatq.transcript)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    parser = batch_parser() if given[:1] == ["batch"] else build_parser()
    args = parser.parse_args(given)
    if getattr(args, "errors", None) and args.format != "openai":
        parser.error("--errors goes with --format openai")
    if getattr(args, "include", None) and args.format != "openai":
        parser.error("--include goes with --format openai")
    try:
        return int(args.fn(args))
    except Exception as exc:  # Redis unreachable, full, refusing writes: one line, exit 4
        line = infrastructure_line(exc)
        if line is None:
            raise
        print(line, file=sys.stderr)
    return EXIT_UNREACHABLE


if __name__ == "__main__":
    sys.exit(main())
