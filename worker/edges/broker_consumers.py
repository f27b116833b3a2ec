"""The broker's consumers as Redis holds them (worker/edges/broker.py): their keys, outside the
session keyspace (cq:*) like kombu's own, their heartbeats, whether one is abandoned, and every
message they took and did not acknowledge."""

from __future__ import annotations

from time import monotonic
from typing import Any

from schemas import fleet_keys
from worker.edges import liveness

# Broker bookkeeping, outside the session keyspace (cq:*) like kombu's own keys: no TTL, and
# bounded: a hash empties as its messages are acked, a consumer leaves the set when swept.
# The key names live in schemas/fleet_keys.py: the metrics exporter reads them too.
CONSUMERS_KEY = fleet_keys.BROKER_CONSUMERS
unacked_key = fleet_keys.broker_unacked
taken_key = fleet_keys.broker_taken
alive_key = fleet_keys.broker_alive


def taken_messages(client: Any) -> list[bytes]:
    """Every message taken by a consumer and not acknowledged yet, fleet-wide (tests, ops)."""
    taken: list[bytes] = []
    for consumer in client.smembers(CONSUMERS_KEY):
        taken.extend(client.hvals(unacked_key(consumer.decode())))
        taken.extend(client.lrange(taken_key(consumer.decode()), 0, -1))
    return taken


def abandoned(consumer: str) -> bool:
    """A consumer of this machine whose process is gone, or of this process but no longer
    live in it (its channel closed when the connection was lost): its messages go back at
    once, not after its heartbeat runs out (liveness)."""
    holder = liveness.holder_of(consumer)
    return holder == liveness.this_process() or liveness.process_gone(holder)


def beat(pipe: Any, consumers: dict[str, list[str]], dead_after_s: int) -> None:
    """Each consumer's heartbeat, holding the queues it takes from ("-": none yet)."""
    for consumer, queues in sorted(consumers.items()):
        pipe.set(alive_key(consumer), ",".join(queues) or "-", ex=dead_after_s)
    if consumers:
        pipe.sadd(CONSUMERS_KEY, *consumers)


class OwnBeats:
    """When this process last beat, and until when its sweeps wait for others' heartbeats: a
    process whose own beats stopped long enough for its heartbeat to run out (a silent
    network cut, a stall) was most likely not alone, so the heartbeats it finds run out may
    have run out for the same cut; their owners beat again within seconds of the heal."""

    beaten_at = 0.0
    quiet_until = 0.0

    @classmethod
    def beaten(cls, dead_after_s: float) -> None:
        now = monotonic()
        if cls.beaten_at and now - cls.beaten_at > dead_after_s:
            cls.quiet_until = now + dead_after_s
        cls.beaten_at = now
