"""A stopping consumer's give-back (worker/edges/broker_pending.py) when Redis does not answer:
its messages stay held in Redis for a sweeper, with no emergency dump and no wait per message."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis

from worker.edges.broker_pending import PENDING_HOLDS, PENDING_LOCK, give_back_all


@dataclass
class Message:
    delivery_tag: str


def test_messages_redis_could_not_take_back_stay_held_for_a_sweeper() -> None:
    tried: list[str] = []

    def restore(message: Any) -> None:
        tried.append(message.delivery_tag)
        raise redis.ConnectionError("Error 111 connecting to 10.0.0.1:6379. Connection refused.")

    messages = [Message(f"t{n}") for n in range(5)]
    with PENDING_LOCK:
        PENDING_HOLDS["t4"] = ("held", b"{}")  # its hold never reached Redis: only here
    try:
        errors = give_back_all(restore, messages, set(), "consumer.1@host")
    finally:
        with PENDING_LOCK:
            PENDING_HOLDS.pop("t4", None)
    assert tried == ["t0"]  # Redis did not answer: the others are not tried one by one
    assert [message.delivery_tag for _, message in errors] == ["t4"]  # kombu dumps that one
