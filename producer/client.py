"""The producer's client: submitting sessions (producer/submitting.py), waiting for their
response fds (producer/waiting.py) and looking them up (producer/lookups.py), over one Redis
connection and one Celery app. Talks to Redis and sends tasks by name; never imports the
worker. Key layout: `schemas/keys.py`."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import redis
from celery import Celery
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from producer.batch import Batch
from producer.redis_connect import redis_client
from producer.submitting import Rerun
from producer.waiting import Waiting
from schemas import redis_links
from schemas.config import ConfigError, read_config
from schemas.fleet_clock import FleetClock, server_ms
from schemas.fleet_config import FleetConfig
from schemas.redis_url import is_sentinel, kombu_broker, redacted
from schemas.spec_types import Spec

DEFAULT_TTL_S = 86_400
# A restart of Redis (or a failover) is ridden out: each command, pipeline or publish is tried
# again on a connection error for about this long before the error reaches the caller (longer
# through a partition, where each try also spends its connect or socket timeout).
RECONNECT_S = 60.0
CLIENT_NAME = "cchatq-producer"  # its connections in Redis's CLIENT LIST
RECONNECT_BACKOFF_S = (0.05, 1.0)  # first and longest pause between two tries


class Client(Waiting):
    def __init__(
        self,
        redis_url: str,
        ttl_s: int | None = None,
        config: FleetConfig | None = None,
        namespace: str | None = None,
        lookup_batch: str | None = None,
        broker_url: str | None = None,
    ) -> None:
        """`config`: the fleet's configuration (its backends), which `submit` checks specs
        against; by default the one this process's environment names, as the workers read it
        (CCHATQ_CONFIG / CCHATQ_BACKENDS). A ConfigError if that is wrong. `namespace`: where
        spec ids are claimed and looked up (default: the configuration's); `lookup_batch`: an
        id looked up is the run that batch ran. `ttl_s`: the TTL of what it writes (default:
        CCHATQ_RESULT_TTL_S, as the workers read it, else a day; a ConfigError if that is
        no number of seconds). `broker_url`: the broker's Redis when it is not `redis_url`'s
        (schemas/fleet_urls.py)."""
        # Any: redis-py annotates replies as bytes | str; this client never decodes (bytes).
        self.redis: Any = _client(redis_url)
        self.shown_url = redacted(redis_url)  # as messages show it
        # Redis's clock: when a session was submitted is compared by the fleet's reconciler
        # on it, whatever this host's wall clock says
        self.clock = FleetClock(lambda: server_ms(self.redis.time()))
        self.ttl_s = ttl_s if ttl_s is not None else result_ttl_s()
        self.config = config if config is not None else read_config()
        self.namespace = namespace or self.config.namespace
        self.lookup_batch = lookup_batch
        if is_sentinel(redis_url):  # a submit returns once a replica holds it
            self.replicas_to_wait = 1
        broker_url = broker_url or redis_url
        # the broker's Redis (queues, consumers) for the fleet's status: the state's unless apart
        self.broker_redis: Any = self.redis
        if broker_url != redis_url:
            self.broker_redis = redis_client(
                broker_url,
                client_name=CLIENT_NAME,
                **reconnecting(),
                **redis_links.client_options(),
            )
        broker, transport_options = kombu_broker(broker_url)  # a Sentinel's: kombu's form
        self.celery = Celery("cchatq-producer", broker=broker)
        first_s, longest_s = RECONNECT_BACKOFF_S
        self.celery.conf.update(
            broker_transport_options={**redis_links.broker_options(), **transport_options},
            task_serializer="json",
            accept_content=["json"],
            task_ignore_result=True,
            task_publish_retry_policy={
                "max_retries": int(RECONNECT_S / longest_s),
                "interval_start": first_s,
                "interval_step": first_s,
                "interval_max": longest_s,
            },
        )

    def close(self) -> None:
        self.redis.close()
        if self.broker_redis is not self.redis:
            self.broker_redis.close()

    def submit(
        self,
        specs: Iterable[Mapping[str, Any] | Spec],
        rerun: Rerun = "none",
        check_keys: bool = True,
        base_dir: Path | None = None,
        namespace: str | None = None,
    ) -> Batch:
        """Validate and enqueue sessions and program runs (spec objects as a spec file's lines
        are, or Spec values), exactly as `cchatq submit` does: a SpecFileError lists every
        problem (`<specs>:N: field: message`, N counting from 1) and nothing is enqueued; a
        SpecConflictError names ids already submitted with another spec (unless `rerun` is
        "changed" or "all"). `namespace`: where the ids are claimed (default the client's;
        BATCH_SCOPE: the batch's own). `check_keys`: refuse a backend whose API key variable
        is unset here. Module paths are relative to `base_dir` (default: the working
        directory)."""
        loaded = self._validate(specs, check_keys, base_dir)
        return Batch(self, self.enqueue(loaded, rerun=rerun, namespace=namespace))


def _client(url: str) -> Any:
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
