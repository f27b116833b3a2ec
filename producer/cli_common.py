"""What the `cchatq` commands share: where Redis is, the exit codes, the fleet's configuration."""

from __future__ import annotations

import os
import shlex
import sys
from urllib.parse import urlencode

from schemas.config import ConfigError, FleetConfig, read_config

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_FLOWER_URL = "http://127.0.0.1:5555"  # CCHATQ_FLOWER_URL: where session links point


def redis_url() -> str:
    return os.environ.get("REDIS_URL", DEFAULT_REDIS_URL)


# `cchatq submit`'s exit codes (README: Submitting and results)
EXIT_OK = 0  # every session ended ok
EXIT_FAILED = 1  # every session ended, some with an error body
EXIT_REJECTED = 2  # the input was rejected: nothing enqueued
EXIT_INTERRUPTED = 3  # Ctrl-C or --timeout-s: the sessions left keep running on the fleet


def fleet_config() -> FleetConfig | None:
    """The configuration shared with the workers, or None after saying what is wrong with it."""
    try:
        return read_config()
    except ConfigError as exc:
        print(f"rejected, nothing enqueued:\n{exc}", file=sys.stderr)
        return None


def flower_links(spec_id: str) -> tuple[str, str]:
    """Flower's search for a session's step tasks and its tasks API link: every step task of
    the session shows its spec id as kwargs (worker/edges/dispatch.py). `cchatq status ID`
    prints both, and `cchatq view` links them."""
    search = f"kwargs:session={spec_id}"
    flower = os.environ.get("CCHATQ_FLOWER_URL", DEFAULT_FLOWER_URL).rstrip("/")
    return search, f"{flower}/api/tasks?{urlencode({'search': search})}"


def flower_curl(tasks_url: str) -> str:
    """The shell line that fetches a Flower API link: with the credentials of
    FLOWER_BASIC_AUTH when it is set, named by the variable (a secret is never printed)."""
    auth = '-u "$FLOWER_BASIC_AUTH" ' if os.environ.get("FLOWER_BASIC_AUTH", "").strip() else ""
    return f"curl {auth}{shlex.quote(tasks_url)}"
