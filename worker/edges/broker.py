"""kombu's Redis transport, with one Redis client object per channel: kombu builds a new
`redis.Redis` for every publish and every ack (`Channel.conn_or_acquire`), which cost the llm
worker ~14% of its CPU (profile in the issue-8 closing note). The client object is only a
handle on the channel's connection pool and is thread-safe, so one per channel serves them all;
what goes over the wire is unchanged."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kombu.transport import redis as kombu_redis


class Channel(kombu_redis.Channel):
    _shared_client: Any = None

    @contextmanager
    def conn_or_acquire(self, client: Any = None) -> Iterator[Any]:
        if client:
            yield client
            return
        if self._shared_client is None:
            self._shared_client = self._create_client()  # type: ignore[no-untyped-call]
        yield self._shared_client


class Transport(kombu_redis.Transport):
    Channel = Channel


TRANSPORT = f"{__name__}:Transport"
