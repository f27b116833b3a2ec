# mypy: disable-error-code="no-untyped-call"
"""How a worker reconnects to its broker: kombu's connection at redis_links' pace, through
Celery's AMQP class (`Celery(amqp=AMQP)`)."""

from __future__ import annotations

from typing import Any

from celery.app.amqp import AMQP as CeleryAMQP
from kombu.connection import Connection as KombuConnection

from schemas import redis_links


class Connection(KombuConnection):
    """kombu's connection, retrying a lost broker at redis_links' pace: Celery's consumer
    calls ensure_connection without intervals, and kombu's own (2 s, then 2 s more each try,
    up to 30 s) left a worker idle up to 30 s after a partition healed. A try during a
    partition costs its connect timeout too, so tries come every few seconds."""

    def ensure_connection(
        self,
        errback: Any = None,
        max_retries: int | None = None,
        interval_start: float = redis_links.BROKER_RETRY_FIRST_S,
        interval_step: float = redis_links.BROKER_RETRY_S,
        interval_max: float = redis_links.BROKER_RETRY_S,
        **kwargs: Any,
    ) -> Connection:
        super().ensure_connection(
            errback, max_retries, interval_start, interval_step, interval_max, **kwargs
        )
        return self


class AMQP(CeleryAMQP):  # type: ignore[misc]
    """Celery's messaging class with our Connection (`Celery(amqp=AMQP)`)."""

    Connection = Connection
    BrokerConnection = Connection
