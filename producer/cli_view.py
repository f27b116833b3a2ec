"""`cchatq view`: the local web viewer (producer/viewer/). Its web stack is the optional extra
`view`: without it the command says how to install it, in one line."""

from __future__ import annotations

import argparse
import os
import sys

from producer.cli_common import EXIT_REJECTED

VIEW_PACKAGES = ("starlette", "jinja2", "uvicorn", "markupsafe", "anyio", "h11", "click")
INSTALL_HINT = (
    "cchatq view needs the `view` extra (starlette, jinja2, uvicorn): pip install 'cchatq[view]'"
)


def cmd_view(args: argparse.Namespace) -> int:
    try:
        from producer.viewer.serve import run_viewer
    except ImportError as exc:
        if (exc.name or "").split(".")[0] not in VIEW_PACKAGES:
            raise
        print(INSTALL_HINT, file=sys.stderr)
        return EXIT_REJECTED
    token = args.token or os.environ.get("CCHATQ_VIEW_TOKEN") or None
    return run_viewer(args.files, args.host, args.port, token)


def add_view_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "view", help="browse batches and sessions in a local web page (a fleet, or results files)"
    )
    p.add_argument(
        "files", nargs="*", metavar="FILE", help="results files to read (no Redis); none: the fleet"
    )
    p.add_argument("--port", type=int, default=8808)
    p.add_argument("--host", default="127.0.0.1", help="a non-loopback address needs --token")
    p.add_argument(
        "--token", help="every request must carry it (?token=T once, or Authorization: Bearer T)"
    )
    p.set_defaults(fn=cmd_view)
