# mypy: disable-error-code="no-untyped-call"
"""The producer's Redis clients, from REDIS_URL's forms (schemas/redis_url.py): a `redis://`,
`rediss://` or `unix://` URL as redis-py reads it; a `sentinel://` URL as a client of the
master the sentinels name, which asks them again when a connection fails or its server answers
READONLY (a failover demoted it)."""

from __future__ import annotations

from typing import Any

import redis
from redis.cluster import RedisCluster
from redis.sentinel import Sentinel, SentinelManagedConnection

from schemas import redis_links
from schemas.redis_url import SentinelUrl, check_redis_url

# how long a sentinel may take to connect and to answer before the next one is asked
SENTINEL_TIMEOUT_S = 2.0


class FollowingConnection(SentinelManagedConnection):
    """A connection to the master that asks the sentinels where it is each time it opens a
    socket. redis-py's asks only when the pool hands it out: a command retried on the same
    connection reconnected to the address it had, the dead master's, for as long as its
    retries lasted (redis/redis-py#3874). The worker has its twin (the producer never
    imports the worker)."""

    _addressed = False  # connect_to set the address the sentinels just gave

    def connect_to(self, address: tuple[str, int]) -> None:
        self._addressed = True
        super().connect_to(address)

    def connect_check_health(
        self, check_health: bool = True, retry_socket_connect: bool = True
    ) -> None:
        if self._sock is None and self.connection_pool.is_master and not self._addressed:
            self.host, self.port = self.connection_pool.get_master_address()
        self._addressed = False
        super().connect_check_health(
            check_health=check_health, retry_socket_connect=retry_socket_connect
        )

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        """NOREPLICAS (a master with min-replicas-to-write that lost its replicas: most often
        one cut off or paused while the sentinels promoted another) is taken as READONLY is:
        the connection is dropped and the sentinels asked again."""
        try:
            return super().read_response(*args, **kwargs)
        except redis.ResponseError as exc:
            if not str(exc).startswith("NOREPLICAS") or not self.connection_pool.is_master:
                raise
            self.disconnect()
            raise redis.ConnectionError("the master has no replica in reach") from exc


class StateCluster(RedisCluster):
    """redis-py's cluster client, with MGET over keys of several slots taken as one MGET a
    slot (the worker has its twin: the producer never imports the worker)."""

    def mget(self, keys: Any, *args: Any) -> Any:
        return self.mget_nonatomic(keys, *args)


def redis_client(url: str, whole_cluster: bool = True, **options: Any) -> Any:
    """A client of the Redis at `url` with redis-py's `options` (retries, timeouts, client
    name): of the whole cluster when that Redis runs in cluster mode (unless not
    `whole_cluster`: of that one node). A RedisUrlError (a ValueError, one line) for a URL of
    no Redis form. Any: replies are bytes (never decoded), which redis-py's annotations cannot
    say."""
    sentinel = check_redis_url(url)
    if sentinel is not None:
        return sentinel_client(sentinel, **options)
    client = redis.Redis.from_url(url, **options)
    if not whole_cluster or not _cluster_enabled(client):
        return client
    client.close()
    return StateCluster.from_url(url, **options)


def _cluster_enabled(client: Any) -> bool:
    """Whether `client`'s Redis runs in cluster mode; one that cannot be asked now is taken for
    a plain one (the caller's next command says why it cannot be reached)."""
    try:
        return bool(client.info("cluster").get("cluster_enabled"))
    except redis.RedisError:
        return False


def is_cluster(client: Any) -> bool:
    return isinstance(client, RedisCluster)


def sentinel_client(url: SentinelUrl, **options: Any) -> Any:
    """A client of the master `url`'s sentinels name: each new connection asks them where it
    is (redis-py's SentinelConnectionPool), and a READONLY answer drops the connection as a
    ConnectionError, so a client that retries those reaches the promoted replica."""
    timeout_s = min(options.get("socket_timeout") or SENTINEL_TIMEOUT_S, SENTINEL_TIMEOUT_S)
    asking = {"socket_connect_timeout": timeout_s, "socket_timeout": timeout_s}
    # a paused master: given up (redis_links), unless the caller says how soon
    options.setdefault("socket_timeout", redis_links.SOCKET_TIMEOUT_S)
    manager = Sentinel(list(url.sentinels), sentinel_kwargs=asking)
    return manager.master_for(
        url.master_name,
        connection_class=FollowingConnection,
        db=url.db,
        username=url.username,
        password=url.password,
        **options,
    )
