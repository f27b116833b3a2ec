"""The workers' Celery configuration: the reliability settings of docs/architecture.md section
4, on a Redis broker (kombu's transport with our bookkeeping of taken messages) or on
RabbitMQ (worker/edges/amqp_topology.py)."""

from __future__ import annotations

from typing import Any

from schemas import redis_links
from schemas.redis_url import kombu_broker
from schemas.task_names import ROUTES
from worker.config import Settings
from worker.edges import amqp_topology, broker, broker_sentinel

SENTINEL_HEALTH_CHECK_S = 5
BROKER_BEAT_S = 2  # a consumer's heartbeat, well inside consumer_dead_after_s


def celery_config(settings: Settings) -> dict[str, Any]:
    """Reliability settings of docs/architecture.md section 4."""
    return {
        "broker_connection_retry_on_startup": True,
        # a lost broker is tried again every few seconds (broker_connection.py): as many tries
        # as cover about as long as kombu's default 100 growing ones did
        "broker_connection_max_retries": redis_links.broker_max_retries(),
        **(
            amqp_topology.celery_broker(settings.urls.broker, settings.queue_type)
            if settings.urls.amqp
            else _redis_broker(settings)
        ),
        "task_serializer": "json",
        "accept_content": ["json"],
        "result_serializer": "json",
        "task_ignore_result": True,
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "task_routes": {name: {"queue": queue} for name, queue in ROUTES.items()},
        "task_default_queue": "control",
        # the backstop only: deadlines inside WASM are epoch interruptions
        "task_time_limit": max(settings.visibility_timeout_s - 10, 60),
        # Task events cost a hop ~2 ms more (measured: bench/); Flower switches them on
        # (enable_events) while it runs, so a watched fleet still shows every step.
        "worker_send_task_events": False,
        "worker_hijack_root_logger": False,
    }


def _redis_broker(settings: Settings) -> dict[str, Any]:
    """kombu's Redis transport with our bookkeeping of taken messages (edges/broker.py)."""
    # a sentinel:// URL: kombu's form of it, its master's name, and our channel on Sentinel
    url, sentinel = kombu_broker(settings.urls.broker)
    transport = broker_sentinel.SENTINEL_TRANSPORT if sentinel else broker.TRANSPORT
    sentinel_options: dict[str, Any] = dict(sentinel)
    if sentinel:  # a take from a paused master is dropped after brpop_timeout + this
        sentinel_options["health_check_interval"] = SENTINEL_HEALTH_CHECK_S
    return {
        "broker_url": url,
        "broker_transport": transport,  # kombu's Redis transport, one client a channel
        "broker_transport_options": {
            # timeouts, keepalive and health checks: a silently cut link errors in seconds
            **redis_links.broker_options(),
            "visibility_timeout": settings.visibility_timeout_s,
            # the consumer loop's timer: each tick beats for the worker's consumers and gives
            # back the messages of consumers that stopped beating (edges/broker.py)
            "unacked_restore_interval": BROKER_BEAT_S,
            "unacked_restore_throttle": 1,
            "consumer_dead_after_s": max(settings.consumer_dead_after_s, 2 * BROKER_BEAT_S + 1),
            **sentinel_options,
        },
    }
