# mypy: disable-error-code="no-untyped-call"
"""The fleet's queues on RabbitMQ (schemas/amqp_broker.py), as Celery consumes them and as the
step publisher (worker/edges/broker_amqp.py) declares them, and the delay queues that put a
step off on quorum queues.

Every queue of the fleet is durable, of the type CCHATQ_QUEUE_TYPE names, and declared by
every worker and producer alike with the same arguments (RabbitMQ refuses another set).

Put-offs (a step's `RetryLater`): on classic queues Celery's own eta is used, the worker
holding the message until it falls due. A quorum queue's consumer has no global prefetch, so
held messages would take its prefetch slots, and Celery's native delayed delivery counts whole
seconds; there a put-off goes through a delay queue instead: a headers exchange routes a
message by its DELAY_HEADER to the queue of that many milliseconds, whose TTL expires it at
its head (one TTL a queue: first in, first out), and dead-letters it to the default exchange
with its own routing key, that is into its step's queue. A put-off of up to a second takes
the bucket that rounds it up to 100 ms, so it comes back never early and at most 100 ms (and
the broker's hop) late; a longer one takes the longest bucket that does not pass it, comes
back early, and is put off again for what is left (tasks.py). The TTL counts on the broker
from enqueue: no clock is compared across hosts.
"""

from __future__ import annotations

import math
from typing import Any

from celery.worker.consumer.consumer import Consumer
from kombu.entity import Exchange, Queue

from schemas.amqp_broker import HEARTBEAT_S, QUORUM, queue_arguments
from schemas.task_names import ALL_QUEUES

DELAY_EXCHANGE = "cchatq.delay"
DELAY_HEADER = "cchatq-delay-ms"  # which delay queue a put-off message is routed to
FINE_STEP_MS = 100
FINE_MS = tuple(range(FINE_STEP_MS, 1_001, FINE_STEP_MS))  # up to a second: rounded up
COARSE_MS = (2_000, 4_000, 8_000, 16_000, 32_000, 64_000)  # longer: hops, each never past due
BUCKETS_MS = FINE_MS + COARSE_MS


def delay_queue(bucket_ms: int) -> str:
    return f"{DELAY_EXCHANGE}.{bucket_ms}ms"


def hop_ms(remaining_ms: int) -> int:
    """The delay queue a put-off with `remaining_ms` to go takes next (0: none, it is due):
    up to a second, the bucket that rounds it up; beyond, the longest that does not pass it."""
    if remaining_ms <= 0:
        return 0
    if remaining_ms <= FINE_MS[-1]:
        return math.ceil(remaining_ms / FINE_STEP_MS) * FINE_STEP_MS
    return max(b for b in BUCKETS_MS if b <= remaining_ms)


def celery_queues(kind: str) -> list[Queue]:
    """The fleet's queues as Celery declares and consumes them (task_queues)."""
    return [
        Queue(
            name,
            Exchange(name, "direct", durable=True),
            routing_key=name,
            durable=True,
            queue_arguments=queue_arguments(kind),
        )
        for name in ALL_QUEUES
    ]


class AmqpConsumer(Consumer):  # type: ignore[misc]
    """Celery's consumer without its native delayed delivery, which it would set up on quorum
    queues (28 queues of its own, and a warning per direct exchange): put-offs go through
    this module's delay queues instead."""

    class Blueprint(Consumer.Blueprint):  # type: ignore[misc]
        default_steps = [s for s in Consumer.Blueprint.default_steps if "delayed_delivery" not in s]


def celery_broker(url: str, kind: str) -> dict[str, Any]:
    """The broker part of the workers' Celery configuration on RabbitMQ: confirmed publishes,
    heartbeats, the fleet's queues. None of the Redis transport's bookkeeping: RabbitMQ hands
    out again at once what a lost connection had taken."""
    return {
        "broker_url": url,
        "broker_heartbeat": HEARTBEAT_S,
        "broker_transport_options": {"confirm_publish": True},
        "task_queues": celery_queues(kind),
        "worker_consumer": f"{__name__}:{AmqpConsumer.__name__}",
    }


def declare(channel: Any, kind: str) -> None:
    """The fleet's queues on a py-amqp channel, and on quorum queues the delay exchange and
    its queues, bound by their DELAY_HEADER."""
    for name in ALL_QUEUES:
        arguments = queue_arguments(kind)
        channel.queue_declare(name, durable=True, auto_delete=False, arguments=arguments)
    if kind != QUORUM:
        return
    channel.exchange_declare(DELAY_EXCHANGE, "headers", durable=True, auto_delete=False)
    for bucket in BUCKETS_MS:
        delayed: dict[str, Any] = {
            **queue_arguments(kind),
            "x-message-ttl": bucket,
            "x-dead-letter-exchange": "",
            # dead-lettered only once its step's queue confirmed it (a broker restart between
            # loses nothing); that needs publishes refused, not heads dropped, when full
            "x-dead-letter-strategy": "at-least-once",
            "x-overflow": "reject-publish",
        }
        name = delay_queue(bucket)
        channel.queue_declare(name, durable=True, auto_delete=False, arguments=delayed)
        binding = {"x-match": "all", DELAY_HEADER: bucket}
        channel.queue_bind(name, DELAY_EXCHANGE, routing_key="", arguments=binding)
