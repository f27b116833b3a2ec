# mypy: disable-error-code="no-untyped-call"
"""cchatq's broker channel (worker/edges/broker.py) on the master a Redis Sentinel names, for a
sentinel:// REDIS_URL (schemas/redis_url.py turns it into kombu's form)."""

from __future__ import annotations

from kombu.transport import redis as kombu_redis

from worker.edges.broker import Channel
from worker.edges.redis_pool import FollowingConnection


class SentinelChannel(Channel, kombu_redis.SentinelChannel):
    """The same channel on the master a Redis Sentinel names: kombu's SentinelChannel gives it
    its connection pool (each connection asks the sentinels; one whose server answers READONLY
    is dropped as a connection error, and the consumer reconnects to the promoted replica)."""

    from_transport_options = (  # type: ignore[assignment]
        *kombu_redis.SentinelChannel.from_transport_options,
        "consumer_dead_after_s",
    )
    connection_class = FollowingConnection


class SentinelTransport(kombu_redis.SentinelTransport):
    Channel = SentinelChannel


SENTINEL_TRANSPORT = f"{__name__}:SentinelTransport"
