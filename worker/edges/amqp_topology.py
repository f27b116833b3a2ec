# mypy: disable-error-code="no-untyped-call"
"""The fleet's queues on RabbitMQ (schemas/amqp_broker.py), as Celery consumes them and as the
step publisher (worker/edges/broker_amqp.py) declares them.

Every queue of the fleet is durable, of the type CCHATQ_QUEUE_TYPE names, and declared by
every worker and producer alike with the same arguments (RabbitMQ refuses another set).
"""

from __future__ import annotations

from typing import Any

from kombu.entity import Exchange, Queue

from schemas.amqp_broker import HEARTBEAT_S, queue_arguments
from schemas.task_names import ALL_QUEUES


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


def celery_broker(url: str, kind: str) -> dict[str, Any]:
    """The broker part of the workers' Celery configuration on RabbitMQ: confirmed publishes,
    heartbeats, the fleet's queues. None of the Redis transport's bookkeeping: RabbitMQ hands
    out again at once what a lost connection had taken."""
    return {
        "broker_url": url,
        "broker_heartbeat": HEARTBEAT_S,
        "broker_transport_options": {"confirm_publish": True},
        "task_queues": celery_queues(kind),
    }


def declare(channel: Any, kind: str) -> None:
    """The fleet's queues on a py-amqp channel."""
    for name in ALL_QUEUES:
        arguments = queue_arguments(kind)
        channel.queue_declare(name, durable=True, auto_delete=False, arguments=arguments)
