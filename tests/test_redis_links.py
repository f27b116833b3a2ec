"""Every Redis connection carries schemas/redis_links.py's timeouts, keepalive and health checks
(the worker's store and broker, the producer's client and publisher); blocking commands block
less than the socket timeout; a worker retries a lost broker at a steady few seconds' pace; a
server that stops answering makes a command fail instead of waiting forever."""

from __future__ import annotations

import socket
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from producer.client import Client
from schemas import redis_links
from schemas.fleet_config import FleetConfig
from worker.config import load_settings
from worker.edges import broker, broker_connection
from worker.edges.store import RedisStore
from worker.errors import StoreError
from worker.wiring import celery_config


def test_blocking_commands_block_less_than_the_socket_timeout() -> None:
    assert redis_links.BLOCK_CAP_S < redis_links.SOCKET_TIMEOUT_S
    assert redis_links.block_s(1.0) == 1.0
    assert redis_links.block_s(30.0) == redis_links.BLOCK_CAP_S
    assert redis_links.block_s(0) == redis_links.BLOCK_CAP_S  # 0 is Redis's "forever"
    assert redis_links.block_ms(500) == 500
    assert redis_links.block_ms(0) == redis_links.block_ms(60_000) == 4_000
    # the broker's BLMOVE / BRPOP (kombu's brpop_timeout) is within the cap too
    assert broker.Transport.brpop_timeout <= redis_links.BLOCK_CAP_S


@pytest.mark.skipif(sys.platform != "linux", reason="TCP_USER_TIMEOUT and TCP_KEEPIDLE: Linux")
def test_keepalive_options_name_the_linux_tcp_options() -> None:
    options = redis_links.keepalive_options()
    assert options[socket.TCP_KEEPIDLE] == redis_links.KEEPALIVE_IDLE_S
    assert options[socket.TCP_KEEPINTVL] == redis_links.KEEPALIVE_INTERVAL_S
    assert options[socket.TCP_KEEPCNT] == redis_links.KEEPALIVE_COUNT
    assert options[socket.TCP_USER_TIMEOUT] == redis_links.USER_TIMEOUT_MS


def _hardened(kwargs: dict[str, Any]) -> None:
    for name, value in redis_links.client_options().items():
        assert kwargs[name] == value, name


def test_the_store_broker_and_producer_connections_are_hardened() -> None:
    store = RedisStore.from_url("redis://127.0.0.1:1/0", ttl_s=60, max_connections=2)
    _hardened(store.client.connection_pool.connection_kwargs)
    options = celery_config(load_settings({}))["broker_transport_options"]
    _hardened(options)
    assert options["retry_on_timeout"] is False
    # kombu's Redis channel reads each of these names from the transport options
    assert set(redis_links.broker_options()) <= set(broker.Channel.from_transport_options)
    client = Client("redis://127.0.0.1:1/0", config=FleetConfig())
    try:
        _hardened(client.redis.connection_pool.connection_kwargs)
        _hardened(client.celery.conf.broker_transport_options)
    finally:
        client.close()


def test_a_lost_broker_is_retried_every_few_seconds() -> None:
    """Celery's consumer calls ensure_connection without intervals: ours are redis_links'."""
    seen: dict[str, Any] = {}

    class Probe(broker_connection.Connection):
        def _ensure_connection(self, *args: Any, **kwargs: Any) -> Any:
            seen["args"] = args
            return None

    Probe("redis://127.0.0.1:1/0", transport=broker.Transport).ensure_connection(None, 7)
    _errback, max_retries, first_s, step_s, longest_s = seen["args"]
    assert (max_retries, first_s, longest_s) == (7, 1.0, redis_links.BROKER_RETRY_S)
    assert step_s <= redis_links.BROKER_RETRY_S
    assert broker_connection.AMQP.Connection is broker_connection.Connection
    config = celery_config(load_settings({}))
    # as long in all as kombu's 100 growing tries were (about 50 minutes)
    assert config["broker_connection_max_retries"] * redis_links.BROKER_RETRY_S >= 2_400


@pytest.fixture()
def mute_server() -> Iterator[int]:
    """A TCP server that accepts connections and never answers (a hung or cut-off Redis)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield int(server.getsockname()[1])
    stop.set()
    thread.join(timeout=5)
    for conn in accepted:
        conn.close()
    server.close()


def test_a_server_that_never_answers_fails_a_command_instead_of_hanging(mute_server: int) -> None:
    store = RedisStore.from_url(f"redis://127.0.0.1:{mute_server}/0", ttl_s=60, max_connections=2)
    with pytest.raises(StoreError):
        store.is_cancelled("some-session")
