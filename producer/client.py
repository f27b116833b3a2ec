"""The producer's client: submitting sessions (producer/submitting.py), waiting for their
response fds (producer/waiting.py) and looking them up (producer/lookups.py), over one Redis
connection and one Celery app. Talks to Redis and sends tasks by name; never imports the
worker. Key layout: `schemas/keys.py`."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from celery import Celery

from producer.batch import Batch
from producer.broker_queues import AmqpQueues, celery_broker, fleet_queue_type

# the connection's settings and helpers live with the state reader (no Celery there);
# named here too, where callers have always found them
from producer.state_reader import CLIENT_NAME as CLIENT_NAME
from producer.state_reader import DEFAULT_TTL_S as DEFAULT_TTL_S
from producer.state_reader import RECONNECT_BACKOFF_S as RECONNECT_BACKOFF_S
from producer.state_reader import RECONNECT_S as RECONNECT_S
from producer.state_reader import reconnecting as reconnecting
from producer.state_reader import result_ttl_s as result_ttl_s
from producer.state_reader import state_client
from producer.submitting import Rerun
from producer.waiting import Waiting
from schemas import redis_links
from schemas.amqp_broker import is_amqp
from schemas.config import read_config
from schemas.fleet_clock import FleetClock, server_ms
from schemas.fleet_config import FleetConfig
from schemas.redis_url import is_sentinel, kombu_broker, redacted
from schemas.spec_types import Spec


class Client(Waiting):
    def __init__(
        self,
        redis_url: str,
        ttl_s: int | None = None,
        config: FleetConfig | None = None,
        namespace: str | None = None,
        lookup_batch: str | None = None,
        broker_url: str | None = None,
        queue_type: str | None = None,
    ) -> None:
        """`config`: the fleet's configuration (its backends), which `submit` checks specs
        against; by default the one this process's environment names, as the workers read it
        (CCHATQ_CONFIG / CCHATQ_BACKENDS). A ConfigError if that is wrong. `namespace`: where
        spec ids are claimed and looked up (default: the configuration's); `lookup_batch`: an
        id looked up is the run that batch ran. `ttl_s`: the TTL of what it writes (default:
        CCHATQ_RESULT_TTL_S, as the workers read it, else a day; a ConfigError if that is
        no number of seconds). `broker_url`: the broker when it is not `redis_url`'s Redis:
        another Redis, or RabbitMQ (schemas/fleet_urls.py). `queue_type`: RabbitMQ's queues'
        (classic, quorum; default: CCHATQ_QUEUE_TYPE, as the workers read it)."""
        # Any: redis-py annotates replies as bytes | str; this client never decodes (bytes).
        self.redis: Any = state_client(redis_url)
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
        # what reads the broker's queues (depths, consumers) for the fleet's status: the
        # state's Redis unless apart, another Redis, or RabbitMQ's queues (AmqpQueues)
        self.broker_queues: Any = self.redis
        if is_amqp(broker_url):
            self.broker_queues = AmqpQueues(broker_url)
            kind = queue_type or fleet_queue_type(os.environ)
            broker: dict[str, Any] = celery_broker(broker_url, kind)
        else:
            if broker_url != redis_url:
                self.broker_queues = state_client(broker_url)
            url, transport_options = kombu_broker(broker_url)  # a Sentinel's: kombu's form
            broker = {
                "broker_url": url,
                "broker_transport_options": {**redis_links.broker_options(), **transport_options},
            }
        self.celery = Celery("cchatq-producer")
        first_s, longest_s = RECONNECT_BACKOFF_S
        self.celery.conf.update(
            **broker,
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
        if self.broker_queues is not self.redis:
            self.broker_queues.close()

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
