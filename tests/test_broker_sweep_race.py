"""Two workers sweep the same dead consumer at once: one moves its messages back, the other,
whose transaction lost the race (WATCH), says nothing of messages it did not move."""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

import pytest
import redis

from producer.fleet import Fleet
from worker.edges.broker_consumers import CONSUMERS_KEY, restore_consumer, taken_key

pytestmark = pytest.mark.fleet
REDIS_DB = 15
MESSAGE = {
    "body": "",
    "headers": {"id": "step-1"},
    "properties": {"delivery_info": {"exchange": "", "routing_key": "race-queue"}},
}


def _dead_consumer(client: redis.Redis) -> str:
    consumer = f"race-{uuid.uuid4().hex[:8]}"
    client.lpush(taken_key(consumer), json.dumps(MESSAGE))
    client.sadd(CONSUMERS_KEY, consumer)
    return consumer


@pytest.mark.parametrize("rival_first", [False, True])
def test_only_the_sweeper_that_moved_the_messages_logs_it(
    base_fleet: Fleet, caplog: pytest.LogCaptureFixture, rival_first: bool
) -> None:
    url = base_fleet.redis_url.rsplit("/", 1)[0] + f"/{REDIS_DB}"
    client, rival = redis.Redis.from_url(url), redis.Redis.from_url(url)
    consumer = _dead_consumer(client)
    restored: list[str] = []

    def restore_message(payload: Any, exchange: str, routing_key: str, pipe: Any) -> None:
        restored.append(routing_key)
        if rival_first:  # between this sweeper's reads and its EXEC, the rival moves them
            rival.delete(taken_key(consumer))
            rival.srem(CONSUMERS_KEY, consumer)

    try:
        with caplog.at_level(logging.WARNING, logger="worker.edges.broker_consumers"):
            restore_consumer(client, consumer, restore_message)
        logged = caplog.text.count("handed out again")
        assert restored == ["race-queue"]  # its one try read the message
        assert logged == (0 if rival_first else 1)
        assert not client.exists(taken_key(consumer))
        assert not client.sismember(CONSUMERS_KEY, consumer)
    finally:
        client.delete(taken_key(consumer))
        client.srem(CONSUMERS_KEY, consumer)
        client.close()
        rival.close()
