"""The broker's consumers as Redis holds them (worker/edges/broker.py): their keys, outside the
session keyspace (cq:*) like kombu's own, their heartbeats, whether one is abandoned, and every
message they took and did not acknowledge."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from time import monotonic
from typing import Any

from celery.worker import state as worker_state

from schemas import fleet_keys
from worker.edges import liveness

log = logging.getLogger("worker.edges.broker")

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


def running_tasks() -> set[str]:
    """The ids of the tasks this process runs right now (Celery's worker state). A channel
    that closed under them (its connection lost) does not give their messages back: their
    task still runs, and acknowledges them when it ends; handed out again, they would run
    twice, a model call too once the step's lease ran out in the outage."""
    return {str(request.id) for request in list(worker_state.active_requests)}


def task_id(headers: dict[str, Any] | None) -> str:
    """The task id a message's headers carry (Celery's protocol 2: a step's id)."""
    return str((headers or {}).get("id", ""))


# (payload, exchange, routing key, pipeline): the channel's _do_restore_message
Restore = Callable[[Any, str, str, Any], None]


def restore_consumer(client: Any, consumer: str, restore_message: Restore) -> None:
    """Every message a consumer that stopped beating holds goes back on its queue, but those
    of tasks this very process still runs (a consumer of its own, whose channel closed
    when the connection was lost): they stay held until their tasks end and acknowledge
    them. A consumer that holds nothing more leaves the set."""
    held, taken = unacked_key(consumer), taken_key(consumer)
    running = running_tasks() if liveness.holder_of(consumer) == liveness.this_process() else set()

    def restore(pipe: Any) -> None:
        entries = {tag: json.loads(raw) for tag, raw in pipe.hgetall(held).items()}
        moved = [(raw, json.loads(raw)) for raw in pipe.lrange(taken, 0, -1)]
        back = {t: e for t, e in entries.items() if task_id(e[0].get("headers")) not in running}
        gone = [(r, p) for r, p in moved if task_id(p.get("headers")) not in running]
        given = len(back) + len(gone)
        kept = len(entries) + len(moved) - given
        pipe.multi()
        for payload, exchange, routing_key in back.values():
            restore_message(payload, exchange, routing_key, pipe)
        for _, payload in gone:
            delivery = payload["properties"]["delivery_info"]
            restore_message(payload, delivery["exchange"], delivery["routing_key"], pipe)
        if kept:  # only what went back leaves; the rest stays held until its task acks it
            for tag in back:
                pipe.hdel(held, tag)
            for raw, _ in gone:
                pipe.lrem(taken, 1, raw)
        else:
            pipe.delete(held, taken)
            pipe.srem(CONSUMERS_KEY, consumer)
        outcome[:] = [given, kept]  # this try's: a try that lost the race is tried again

    # WATCH: a second sweeper racing this one finds them changed, reads them again (given
    # none) and says nothing: only the sweeper whose EXEC moved them logs it
    outcome = [0, 0]
    client.transaction(restore, held, taken)
    given, kept = outcome
    if given:
        log.warning(
            "consumer %s stopped beating: %d of its messages handed out again%s",
            consumer, given, f" ({kept} still running here)" if kept else "",
        )  # fmt: skip
