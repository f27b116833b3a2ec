# mypy: disable-error-code="no-untyped-call"
"""The state store's connection pool, from REDIS_URL (schemas/redis_url.py): a thread that finds
no connection free waits for one (a BlockingConnectionPool sized to the worker's concurrency),
whether the URL names one server or the master a Redis Sentinel names.

On Sentinel, every new connection asks the sentinels where the master is, and a connection whose
server answers READONLY (a failover demoted it) is dropped as a ConnectionError (redis-py's
SentinelManagedConnection). Such errors, and timeouts, are tried again on a fresh connection for
about FAILOVER_RIDE_S, so a step rides out a promotion instead of failing and spending a try; a
paused primary's commands time out after redis_links.SOCKET_TIMEOUT_S (no command of the
worker blocks longer: its blocking reads wait one second at most).
"""

from __future__ import annotations

import os
from typing import Any

import redis
from redis.backoff import ExponentialBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry
from redis.sentinel import Sentinel, SentinelConnectionPool, SentinelManagedConnection

from schemas import keys, redis_links
from schemas.redis_url import SentinelUrl, is_sentinel, parse_sentinel_url

SENTINEL_TIMEOUT_S = 1.0  # a sentinel that does not answer this fast: the next one is asked
FAILOVER_RIDE_S = 30.0
BACKOFF_S = (0.05, 1.0)  # first and longest pause between two tries


# this process's pid, kept by a fork hook: redis-py's pools ask os.getpid() (a system call) twice
# a command, to notice a fork; that was 2.5% of an llm worker's CPU
_PID = [os.getpid()]
os.register_at_fork(after_in_child=lambda: _PID.__setitem__(0, os.getpid()))


class ForkNoticing:
    """A pool mixin that notices a fork from the pid the fork hook keeps, and only then asks
    redis-py's own check (which resets the pool in the child)."""

    pid: int

    def _checkpid(self) -> None:
        if self.pid != _PID[0]:
            super()._checkpid()  # type: ignore[misc]


class BlockingPool(ForkNoticing, redis.BlockingConnectionPool):
    """redis-py's blocking pool: a thread finding no connection free waits for one."""


class FollowingConnection(SentinelManagedConnection):
    """A connection to the master that asks the sentinels where it is each time it opens a
    socket. redis-py's asks only when the pool hands it out: a command retried on the same
    connection reconnected to the address it had, the dead master's, for as long as its
    retries lasted (redis/redis-py#3874)."""

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


class BlockingSentinelPool(ForkNoticing, SentinelConnectionPool, redis.BlockingConnectionPool):
    """redis-py's Sentinel pool with the blocking pool's wait for a free connection (its
    LIFO queue of at most `max_connections`): the Sentinel pool's master discovery and
    `owns_connection` (connections to a demoted master are not given back) over it."""


class StateCluster(RedisCluster):
    """redis-py's cluster client, with MGET over keys of several slots taken as one MGET a
    slot (a session's keys share a slot; a read over sessions, the reconciler's or a
    producer's, spans many)."""

    def mget(self, keys: Any, *args: Any) -> Any:
        return self.mget_nonatomic(keys, *args)


def is_cluster(client: Any) -> bool:
    return isinstance(client, RedisCluster)


class NodeRouting:
    """Where a store's pipelines go (a part of RedisStore, which sets `client` and `cluster`):
    a session's to the node holding its slot, the fleet-wide writes apart on a cluster."""

    client: Any
    cluster: bool

    def on(self, sk: str) -> Any:
        """The client of session `sk`'s pipelines and transactions: on a cluster, the node
        holding its slot (every key of a session shares it: schemas/keys.py), where they run
        as on one Redis; this store's client otherwise."""
        if not self.cluster:
            return self.client
        return self.client.get_node_from_key(keys.meta(sk)).redis_connection

    def fleet_pipe(self, pipe: Any) -> Any:
        """Where a session's pipeline `pipe` sends its fleet-wide writes (the reconciler's
        index, the fleet's trace, the batches told): into `pipe` on one Redis; on a cluster,
        where their keys are in other slots, into a pipeline of their own, which the caller
        executes (`flush_fleet`)."""
        return self.client.pipeline(transaction=False) if self.cluster else pipe

    @staticmethod
    def flush_fleet(fleet: Any, pipe: Any) -> None:
        """Execute the fleet-wide pipeline `fleet_pipe(pipe)` gave, when it is one of its own."""
        if fleet is not pipe and len(fleet):
            fleet.execute()


# whether the Redis at a URL runs in cluster mode, asked once a process (a worker's main
# process asks as it starts: its pool's children inherit the answer)
_cluster_mode: dict[str, bool] = {}


def cluster_mode(url: str, strict: bool = False) -> bool:
    """Whether the Redis at `url` runs in cluster mode (INFO's `cluster_enabled:1`). A Redis
    that does not answer raises redis-py's error when `strict` (a worker starting waits for
    it); otherwise it is taken for a plain one, and asked again next time (its client's first
    command says why it cannot be reached)."""
    if url not in _cluster_mode:
        if is_sentinel(url):
            return False
        probe = redis.Redis.from_url(url, **redis_links.client_options())
        try:
            _cluster_mode[url] = bool(probe.info("cluster").get("cluster_enabled"))
        except redis.RedisError:
            if strict:
                raise
            return False
        finally:
            probe.close()
    return _cluster_mode[url]


def pooled_client(url: str, max_connections: int, wait_s: float = 30.0) -> Any:
    """A client of the Redis at `url` on a pool of at most `max_connections` (connection_pool),
    of the whole cluster when it runs in cluster mode (`max_connections` to each node). Any:
    its replies are bytes, which redis-py's annotations cannot say."""
    if cluster_mode(url):
        return StateCluster.from_url(
            url,
            max_connections=max_connections,
            connection_pool_class=BlockingPool,
            timeout=wait_s,
            **redis_links.client_options(),
        )
    return redis.Redis(connection_pool=connection_pool(url, max_connections, wait_s))


def connection_pool(url: str, max_connections: int, wait_s: float) -> redis.ConnectionPool:
    """A pool of at most `max_connections`; a thread waits up to `wait_s` for a free one."""
    if not is_sentinel(url):
        return BlockingPool.from_url(
            url, max_connections=max_connections, timeout=wait_s, **redis_links.client_options()
        )
    return sentinel_pool(parse_sentinel_url(url), max_connections, wait_s)


def sentinel_pool(url: SentinelUrl, max_connections: int, wait_s: float) -> BlockingSentinelPool:
    asking = {"socket_connect_timeout": SENTINEL_TIMEOUT_S, "socket_timeout": SENTINEL_TIMEOUT_S}
    manager = Sentinel(list(url.sentinels), sentinel_kwargs=asking)
    first_s, longest_s = BACKOFF_S
    return BlockingSentinelPool(
        url.master_name,
        manager,
        connection_class=FollowingConnection,
        max_connections=max_connections,
        timeout=wait_s,
        db=url.db,
        username=url.username,
        password=url.password,
        **redis_links.client_options(),
        retry=Retry(ExponentialBackoff(cap=longest_s, base=first_s), int(FAILOVER_RIDE_S)),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
    )
