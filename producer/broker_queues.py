# mypy: disable-error-code="no-untyped-call"
"""The producer's side of a RabbitMQ broker (schemas/amqp_broker.py): its Celery
configuration (start tasks sent with publisher confirms, the fleet's queues declared as the
workers declare them) and what `cchatq status` reads of its queues (passive declares: the
messages ready and the consumers of each). A Redis broker's are read by fleet_status.py."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

from amqp.exceptions import NotFound
from kombu.connection import Connection
from kombu.entity import Exchange, Queue

from schemas.amqp_broker import (
    QUEUE_TYPE_VARIABLE,
    AmqpUrlError,
    is_amqp,
    queue_arguments,
    queue_type,
)
from schemas.config import ConfigError
from schemas.task_names import ALL_QUEUES

CONNECT_TIMEOUT_S = 2.0  # a status read, or the CLI's first contact, says so within seconds


def fleet_queue_type(env: Mapping[str, str]) -> str:
    """CCHATQ_QUEUE_TYPE as the workers read it: a ConfigError naming it if it is none."""
    try:
        return queue_type(env)
    except AmqpUrlError as exc:
        raise ConfigError("environment", [(QUEUE_TYPE_VARIABLE, str(exc))]) from None


def celery_broker(url: str, kind: str) -> dict[str, Any]:
    """The producer Celery app's broker settings on RabbitMQ. Its queues are declared exactly
    as worker/edges/amqp_topology.py declares them (a direct exchange of the queue's name,
    durable, of the fleet's type): RabbitMQ refuses a declaration that differs."""
    queues = [
        Queue(
            name,
            Exchange(name, "direct", durable=True),
            routing_key=name,
            durable=True,
            queue_arguments=queue_arguments(kind),
        )
        for name in ALL_QUEUES
    ]
    # no heartbeats: a producer's connection idles between submits, and nothing would beat it
    return {
        "broker_url": url,
        "broker_heartbeat": 0,
        "broker_transport_options": {"confirm_publish": True},
        "task_queues": queues,
    }


class AmqpQueues:
    """RabbitMQ's queues of the fleet at `url`, read with passive declares on a connection
    made at the first read and again after one failed."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._connection: Connection | None = None

    def counts(self, queues: Sequence[str] = ALL_QUEUES) -> dict[str, tuple[int, int]]:
        """Each queue's (messages ready, consumers); (0, 0) for one not declared yet. What
        consumers hold unacknowledged AMQP does not say (RabbitMQ's management API does)."""
        try:
            return self._counts(queues)
        except Exception:
            self.close()  # a connection that failed: the next read makes another
            raise

    def _counts(self, queues: Sequence[str]) -> dict[str, tuple[int, int]]:
        if self._connection is None:
            self._connection = Connection(self.url, connect_timeout=CONNECT_TIMEOUT_S)
            self._connection.connect()
        out: dict[str, tuple[int, int]] = {}
        channel = self._connection.channel()
        try:
            for queue in queues:
                try:
                    _, messages, consumers = channel.queue_declare(queue=queue, passive=True)
                except NotFound:  # the channel is closed with it: another for the rest
                    out[queue] = (0, 0)
                    channel = self._connection.channel()
                    continue
                out[queue] = (int(messages), int(consumers))
        finally:
            with contextlib.suppress(Exception):
                channel.close()
        return out

    def ping(self) -> None:
        """Connect (once): raises what the connection raised when RabbitMQ cannot be reached."""
        self.counts(())

    def close(self) -> None:
        if self._connection is not None:
            with contextlib.suppress(Exception):
                self._connection.release()
            self._connection = None


def broker_reader(url: str, redis_client: Any) -> Any:
    """What reads the broker's queues: an AmqpQueues on RabbitMQ, else `redis_client(url)`."""
    return AmqpQueues(url) if is_amqp(url) else redis_client(url)
