"""What the fleet holds right now, read from Redis: `cchatq status` (no id) prints it and the
metrics exporter's gauges serve it. Reads only (the broker's bookkeeping: worker/edges/broker.py,
key names in schemas/keys.py), a few round trips whatever the fleet's size. On a RabbitMQ
broker its queues are read with passive declares (producer/broker_queues.py): the messages
ready and the consumers of each, and nothing of what consumers took (`taken` is empty).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from producer.broker_queues import AmqpQueues
from producer.stored_specs import StoredSpec
from producer.stored_specs import needed_queues as needed_queues  # its home before
from schemas import fleet_keys, keys
from schemas.rate_state import ControllerStatus, controller_status
from schemas.redis_memory import RedisMemory, eviction_warning
from schemas.redis_url import redacted
from schemas.spec_types import Spec
from schemas.task_names import (
    ALL_QUEUES,
)


@dataclass(frozen=True)
class FleetStatus:
    queued: dict[str, int]  # tasks waiting on each queue
    # tasks taken by a worker and not acknowledged yet (running), per queue; on RabbitMQ
    # unknown (AMQP does not say), so empty
    taken: dict[str, int]
    # worker processes taking tasks (their broker consumers beating); on RabbitMQ the
    # consumers of the fleet's queues (a worker taking from two counts twice)
    consumers: int
    consumers_by_queue: dict[str, int]  # of those, how many take from each queue
    active_sessions: int  # sessions submitted and not finished
    dead_letters: int  # steps dead-lettered (those the stream keeps)
    # each backend/account/model's rate controller: window, pace, in flight, 429s, last change
    rate_controllers: list[ControllerStatus] = field(default_factory=list)
    # Redis's memory: its maxmemory (0: none), what it uses, its maxmemory-policy
    redis_memory: dict[str, int | str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)  # e.g. a policy that may evict our keys

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class QueueStatus:
    """What the broker's queues say: FleetStatus's fields of the same names."""

    queued: dict[str, int]
    taken: dict[str, int]
    consumers: int
    consumers_by_queue: dict[str, int]


def read_fleet_status(client: Any, broker: Any = None) -> FleetStatus:
    """The fleet's state from the state's Redis (`client`) and the broker's queues (`broker`:
    another Redis, or an AmqpQueues on RabbitMQ: schemas/fleet_urls.py)."""
    queues = broker_status(client if broker is None else broker)
    pipe = client.pipeline(transaction=False)
    pipe.zcard(keys.ACTIVE)
    pipe.xlen(keys.DEADLETTER)  # 0 for none
    active, dead_letters = pipe.execute()
    return FleetStatus(
        queued=queues.queued,
        taken=queues.taken,
        consumers=queues.consumers,
        consumers_by_queue=queues.consumers_by_queue,
        active_sessions=int(active),
        dead_letters=int(dead_letters),
        rate_controllers=read_rate_controllers(client),
        **_memory(client),
    )


def broker_status(broker: Any) -> QueueStatus:
    """What the broker's queues say: a Redis broker's (its lists and our bookkeeping of its
    consumers), or RabbitMQ's (an AmqpQueues: what consumers took unknown)."""
    if isinstance(broker, AmqpQueues):
        counts = broker.counts(ALL_QUEUES)
        by_queue = {queue: counts[queue][1] for queue in ALL_QUEUES}
        waiting = {queue: counts[queue][0] for queue in ALL_QUEUES}
        return QueueStatus(waiting, {}, sum(by_queue.values()), by_queue)
    pipe = broker.pipeline(transaction=False)
    for queue in ALL_QUEUES:
        pipe.llen(queue)
    pipe.smembers(fleet_keys.BROKER_CONSUMERS)
    *depths, members = pipe.execute()
    consumers = sorted(m.decode() for m in members)
    pipe = broker.pipeline(transaction=False)
    for consumer in consumers:
        pipe.get(fleet_keys.broker_alive(consumer))
        pipe.lrange(fleet_keys.broker_taken(consumer), 0, -1)
        pipe.hvals(fleet_keys.broker_unacked(consumer))
    replies = pipe.execute()
    taken = dict.fromkeys(ALL_QUEUES, 0)
    serving: dict[str, set[str]] = {queue: set() for queue in ALL_QUEUES}
    for n, consumer in enumerate(consumers):
        alive, moved, held = replies[3 * n : 3 * n + 3]
        for queue in (alive or b"").decode().split(","):
            if queue in serving:
                serving[queue].add(process_of(consumer))
        for queue in [_moved_queue(m) for m in moved] + [_held_queue(h) for h in held]:
            taken[queue] = taken.get(queue, 0) + 1
    return QueueStatus(
        queued=dict(zip(ALL_QUEUES, depths, strict=True)),
        taken=taken,
        consumers=len(set().union(*serving.values())),
        consumers_by_queue={queue: len(procs) for queue, procs in serving.items()},
    )


def _memory(client: Any) -> dict[str, Any]:
    """Redis's memory, and the warning an evicting maxmemory-policy earns (the workers run on
    it only with CCHATQ_ALLOW_EVICTION=1)."""
    memory = RedisMemory.of(client)
    where = redacted(_url_of(client))
    return {
        "redis_memory": {
            "maxmemory_bytes": memory.maxmemory_bytes,
            "used_bytes": memory.used_bytes,
            "policy": memory.policy,
        },
        "warnings": [eviction_warning(memory, where)] if memory.evicts else [],
    }


def _url_of(client: Any) -> str:
    kwargs = getattr(getattr(client, "connection_pool", None), "connection_kwargs", {})
    host, port, db = kwargs.get("host", "?"), kwargs.get("port", "?"), kwargs.get("db", 0)
    return f"redis://{host}:{port}/{db}" if "path" not in kwargs else f"unix://{kwargs['path']}"


def read_rate_controllers(client: Any) -> list[ControllerStatus]:
    """Every rate controller the fleet used within its TTL, in two round trips."""
    ids = sorted(c.decode() for c in client.hkeys(fleet_keys.RATE_CONTROLLERS))
    if not ids:
        return []
    seconds, micros = client.time()
    now_ms = seconds * 1000 + micros / 1000
    pipe = client.pipeline(transaction=False)
    for cid in ids:
        pipe.hgetall(fleet_keys.rate_controller(cid))
        pipe.zcount(fleet_keys.rate_slots(cid), now_ms, "+inf")
    replies = pipe.execute()
    out = []
    for n, cid in enumerate(ids):
        raw, in_flight = replies[2 * n], replies[2 * n + 1]
        if raw:  # gone with its TTL: the index still names it until it is used again
            fields = {k.decode(): v.decode() for k, v in raw.items()}
            out.append(controller_status(cid, fields, int(in_flight), now_ms))
    return out


def process_of(consumer: str) -> str:
    """The worker process of a broker consumer: its name is `<unique>.<pid>@<host>`
    (worker/edges/liveness.py). A process has several (a channel consuming its queues, and
    others beating with no queue, "-"), so it is counted by this, once per queue it serves."""
    unique, dot, process = consumer.partition(".")
    return process if dot and process else unique


def _moved_queue(raw: bytes) -> str:
    """The queue of a message a consumer took with BLMOVE (the message as it was queued)."""
    return str(json.loads(raw)["properties"]["delivery_info"]["routing_key"])


def _held_queue(raw: bytes) -> str:
    """The queue of a message a consumer of several queues holds: [message, exchange, key]."""
    return str(json.loads(raw)[2])


def unserved(fleet: FleetStatus, specs: Sequence[Spec | StoredSpec]) -> list[str]:
    """The queues these sessions need that no worker takes from right now."""
    return [q for q in needed_queues(specs) if not fleet.consumers_by_queue.get(q)]
