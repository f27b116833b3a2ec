"""The producer's connection to the fleet's state, and a reader of it that needs nothing more:
`cchatq batch status` answers with Redis alone, without the Celery app and the spec validators
the Client loads (about half a second of imports on 2 cores)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from producer.redis_connect import redis_client
from schemas import redis_links

DEFAULT_TTL_S = 86_400
# A restart of Redis (or a failover) is ridden out: each command, pipeline or publish is tried
# again on a connection error for about this long before the error reaches the caller (longer
# through a partition, where each try also spends its connect or socket timeout).
RECONNECT_S = 60.0
CLIENT_NAME = "cchatq-producer"  # its connections in Redis's CLIENT LIST
RECONNECT_BACKOFF_S = (0.05, 1.0)  # first and longest pause between two tries
PIPELINE_SIZE = 1000  # sessions per Redis round trip (a submit's writes, a batch's reads)


@dataclass
class StateReader:
    """The fleet's state at a URL, read with Redis alone."""

    redis: Any  # redis-py, replies as bytes
    ttl_s: int

    def close(self) -> None:
        self.redis.close()


def state_reader(url: str) -> StateReader:
    return StateReader(state_client(url), result_ttl_s())


def state_client(url: str) -> Any:
    """The producer's client of a Redis: named, riding out a restart (reconnecting)."""
    return redis_client(
        url, client_name=CLIENT_NAME, **reconnecting(), **redis_links.client_options()
    )


def result_ttl_s(environ: Mapping[str, str] | None = None) -> int:
    """The fleet's key TTL, CCHATQ_RESULT_TTL_S, which the workers read too: a producer that
    wrote its specs and claims for a day on a fleet whose keys live ten minutes would hold
    every finished session's spec in Redis for the day."""
    raw = (os.environ if environ is None else environ).get("CCHATQ_RESULT_TTL_S", "")
    if not raw:
        return DEFAULT_TTL_S
    if not raw.isdigit() or int(raw) <= 0:
        from schemas.config import ConfigError  # marshmallow's: only to say what is wrong

        raise ConfigError("environment", [("CCHATQ_RESULT_TTL_S", f"{raw!r}: not seconds > 0")])
    return int(raw)


def reconnecting() -> dict[str, Any]:
    """redis-py client options that try a command again on a connection error, with backoff,
    for about RECONNECT_S: a client from `from_url` otherwise does not retry at all."""
    first_s, longest_s = RECONNECT_BACKOFF_S
    return {
        "retry": Retry(
            ExponentialBackoff(cap=longest_s, base=first_s), int(RECONNECT_S / longest_s)
        ),
        "retry_on_error": [redis.ConnectionError, redis.TimeoutError],
    }
