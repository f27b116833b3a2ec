# mypy: disable-error-code="no-untyped-call"
"""kombu's Redis transport, cheaper per message, with the same messages on the same lists:

- one Redis client object per channel: kombu builds a new `redis.Redis` for every publish and
  every ack (`Channel.conn_or_acquire`), which cost the llm worker ~14% of its CPU. The client
  is only a handle on the channel's connection pool and is thread-safe, so one serves them all;
- a consumer of one queue takes a message with BLMOVE into its own list of taken messages:
  taking and holding are one atomic command (kombu: BRPOP, then ZADD + HSET in MULTI/EXEC, so
  a worker killed between the two lost the message), and an ack is one LREM (kombu: ZREM +
  HDEL in MULTI/EXEC). A consumer of several queues keeps BRPOP and holds what it takes in
  its own hash (one HSET; the ack one HDEL);
- unacknowledged messages are kept per consumer, with a heartbeat, instead of in one hash with
  a time index. A consumer beats every `unacked_restore_interval` seconds; when one stops (its
  process died, or its channel closed without giving its messages back), any other worker puts
  its messages back on their queues after `consumer_dead_after_s` (a transport option), and a
  worker of the same machine at once if that consumer's process is gone, or is its own and
  closed that channel (a lost connection). kombu instead restores a message once it is older
  than the visibility timeout, which must outlast the longest step, so a killed worker's steps
  waited minutes; and a slow step that outlived it ran twice while its worker was still alive.
  The acks of one tick of a consumer loop are written together, in one round trip.

A Redis that refuses writes (redis_errors.refusal: OOM, MISCONF, READONLY, LOADING) stops
nothing: the take (BLMOVE, BRPOP) backs off and tries again, an ack, a hold or a give-back it
refuses waits in this process and is written on the next beats (a message meanwhile stays
held in Redis, so a sweeper can still hand it out again), a sweep waits, and a consumer that
could not beat lately sweeps no one (their heartbeats ran out for the same refusal). One
warning line says so, and one when writes are taken again; Celery sees no error.

A worker that lost its broker connection tries again at a steady few seconds' pace
(broker_connection.py), not kombu's growing 2, 4 ... 30 s, and its
connections carry the timeouts and keepalive of schemas/redis_links.py (wiring's transport
options): a silently cut link errors within seconds and the worker serves again within
seconds of the network's return.

The consumer loop calls `restore_visible` on a timer (`unacked_restore_interval`): that call
beats and sweeps. A pool that runs tasks on the loop's own thread (`solo`) cannot beat while a
task runs, so a step longer than `consumer_dead_after_s` would be handed out again (its lease
makes the second copy wait); cchatq's workers use threads or prefork.
"""

from __future__ import annotations

import logging
import uuid
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from queue import Empty
from time import monotonic
from typing import Any

from kombu.transport import redis as kombu_redis
from kombu.transport import virtual

from schemas import json_codec
from worker.edges import liveness
from worker.edges.broker_consumers import (
    CONSUMERS_KEY,
    OwnBeats,
    abandoned,
    alive_key,
    beat,
    restore_consumer,
    running_tasks,
    taken_key,
    task_id,
    unacked_key,
)
from worker.edges.broker_pending import (
    PENDING_FORGETS,
    PENDING_HOLDS,
    PENDING_LOCK,
    PENDING_RESTORES,
    REFUSED,
    TAKE_PAUSES_S,
    give_back_all,
    later,
    refused,
    write_acks,
    write_pending,
)
from worker.edges.broker_taken import TAKEN, Taken, release, settled, took

log = logging.getLogger(__name__)

# the consumers of this process (one per consuming channel): the timer beats for all of them
_LIVE: weakref.WeakSet[QoS] = weakref.WeakSet()
_TICKING: list[bool] = []  # a consumer loop writes the acks each tick (empty: none runs)


class QoS(kombu_redis.QoS):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.consumer = liveness.named(uuid.uuid4().hex[:12])
        self._registered = False
        self.acks: deque[Callable[[Any], None]] = deque()  # until the loop's next tick
        _LIVE.add(self)

    def register(self, client: Any) -> None:
        """Known to the sweepers before it holds anything."""
        if not self._registered:
            pipe = client.pipeline(transaction=False)
            beat(pipe, {self.consumer: self.queues()}, self.channel.consumer_dead_after_s)
            pipe.execute()
            self._registered = True

    def queues(self) -> list[str]:
        """The queues this consumer takes from (what its heartbeat says: `cchatq status`)."""
        return sorted(self.channel.active_queues)

    def append(self, message: Any, delivery_tag: str) -> None:
        if delivery_tag in TAKEN:  # held already, in this consumer's list
            virtual.QoS.append(self, message, delivery_tag)
            return
        delivery = message.delivery_info
        entry = json_codec.dumps([message._raw, delivery["exchange"], delivery["routing_key"]])
        try:
            with self.channel.conn_or_acquire() as client:
                self.register(client)
                client.hset(unacked_key(self.consumer), delivery_tag, entry)
        except Exception as exc:
            # BRPOP took it (it needs no memory) but its hold was refused: it runs, and its
            # hold is written on the next beats (until then only this process has it)
            if not refused(exc):
                raise
            with PENDING_LOCK:
                PENDING_HOLDS[delivery_tag] = (unacked_key(self.consumer), entry)
        virtual.QoS.append(self, message, delivery_tag)

    def ack(self, delivery_tag: str) -> None:
        """Forgotten on the consumer loop's next tick, in one round trip with the others."""
        with PENDING_LOCK:  # a hold never written, or removed by its step, needs no forgetting
            unwritten = PENDING_HOLDS.pop(delivery_tag, None) is not None
        if not unwritten and not settled(delivery_tag):
            self.acks.append(self.forgetting(delivery_tag))
            if not _TICKING:  # no consumer loop (kombu used by hand): written now
                self.write_acks()
        virtual.QoS.ack(self, delivery_tag)

    def write_acks(self) -> None:
        with self.channel.conn_or_acquire() as client:
            write_acks(client, self.acks)

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        if requeue:
            message = self._delivered[delivery_tag]
            try:
                self.channel._restore(message, leftmost=True)
            except Exception as exc:
                if not later(exc):
                    raise
                # still held in Redis (the give-back is one transaction): given back on the
                # next beats, or by a sweeper if this consumer stops
                with PENDING_LOCK:
                    PENDING_RESTORES[delivery_tag] = (self.channel, message)
        else:
            self._forget_now(delivery_tag)
        virtual.QoS.ack(self, delivery_tag)

    def _forget_now(self, delivery_tag: str) -> None:
        with PENDING_LOCK:  # a hold never written needs no forgetting
            if PENDING_HOLDS.pop(delivery_tag, None) is not None:
                return
        forget = self.forgetting(delivery_tag)
        try:
            with self.channel.conn_or_acquire() as client:
                forget(client)
        except Exception as exc:
            if not later(exc):
                raise
            with PENDING_LOCK:  # the step is done: a sweep meanwhile only runs it again
                PENDING_FORGETS.append(forget)

    def forgetting(self, delivery_tag: str) -> Callable[[Any], None]:
        """What drops a message from what this consumer holds, issued on a client or a
        pipeline: an LREM of the bytes BLMOVE moved, or an HDEL of the hash's entry."""
        moved = release(delivery_tag)
        if moved is not None:
            return lambda client: client.lrem(moved.held_in, 1, moved.raw)
        held = unacked_key(self.consumer)
        return lambda client: client.hdel(held, delivery_tag)

    def forget(self, client: Any, delivery_tag: str) -> None:
        """Drop a message from what this consumer holds (`client` may be a pipeline)."""
        self.forgetting(delivery_tag)(client)

    def restore_unacked(self, client: Any = None) -> Any:
        """At shutdown: every message taken and not acked goes back (Channel._restore). A
        Redis that refuses writes is tried for SHUTDOWN_RESTORE_S; what it still refuses is
        left held in Redis, where a sweeper hands it out again once this consumer's heartbeat
        runs out, so no emergency dump is written for it. Only a message whose hold Redis
        never took (BRPOP, then a refused HSET) is in this process alone: kombu dumps those
        (its "UNABLE TO RESTORE" line, and a file in the temporary directory)."""
        self._flush()
        self.write_acks()
        with PENDING_LOCK:
            again = [m for c, m in PENDING_RESTORES.values() if c is self.channel]
        running = running_tasks()  # their tasks acknowledge them as they end (a lost link)
        queue = [
            m for m in (*again, *self._delivered.values()) if task_id(m.headers) not in running
        ]
        self._delivered.clear()
        return give_back_all(self.channel._restore, queue, set(self._dirty), self.consumer)

    def restore_visible(self, start: int = 0, num: int = 10, interval: int = 10) -> None:
        """The consumer loop's timer: beat for this process's consumers, write what Redis
        refused before, then give back the messages of every consumer that stopped beating."""
        try:
            self._beat_and_sweep()
        except Exception as exc:
            if not refused(exc):
                raise
            self.channel.refused_beat_at = monotonic()

    def _beat_and_sweep(self) -> None:
        live = {qos.consumer: qos.queues() for qos in list(_LIVE)}
        with self.channel.conn_or_acquire() as client:
            pipe = client.pipeline(transaction=False)
            beat(pipe, live, self.channel.consumer_dead_after_s)
            pipe.smembers(CONSUMERS_KEY)
            known = {c.decode() for c in pipe.execute()[-1]} - set(live)
            REFUSED.accepted()
            OwnBeats.beaten(self.channel.consumer_dead_after_s)
            write_pending(client)
            if not known:
                return
            # heartbeats that ran out while this process could not beat either (Redis refused
            # its beats, or it was cut off) ran out for the same cause, not a death: only the
            # consumers known gone are swept until it has beaten that long again
            refused_at = self.channel.refused_beat_at
            dead_after_s = self.channel.consumer_dead_after_s
            quiet = (refused_at and monotonic() - refused_at < dead_after_s) or (
                monotonic() < OwnBeats.quiet_until
            )
            others = sorted(known)
            pipe = client.pipeline(transaction=False)
            for consumer in others:
                pipe.exists(alive_key(consumer))
            for consumer, alive in zip(others, pipe.execute(), strict=True):
                if abandoned(consumer) or (not alive and not quiet):
                    self._restore_consumer(client, consumer)

    def _restore_consumer(self, client: Any, consumer: str) -> None:
        restore_consumer(client, consumer, self.channel._do_restore_message)

    def close(self) -> None:
        _LIVE.discard(self)  # what it did not give back, a sweeper will


class Channel(kombu_redis.Channel):
    QoS = QoS
    _shared_client: Any = None
    consumer_dead_after_s = 15
    refused_beat_at = 0.0  # when Redis last refused this consumer's beat (monotonic)
    _take_after = 0.0  # the take waits until then (monotonic): Redis refused it
    _take_pauses = 0  # refusals in a row, for the backoff
    from_transport_options = (  # type: ignore[assignment]
        *kombu_redis.Channel.from_transport_options,
        "consumer_dead_after_s",
    )

    @contextmanager
    def conn_or_acquire(self, client: Any = None) -> Iterator[Any]:
        if client:
            yield client
            return
        if self._shared_client is None:
            self._shared_client = self._create_client()
        yield self._shared_client

    _moving_from: str | None = None

    def _brpop_start(self, timeout: Any = None) -> None:
        """One queue: BLMOVE its next message into this consumer's list. Several: kombu's
        BRPOP over them all. Priorities are not used by cchatq (every message is on the
        queue's own list), so BLMOVE watches that list only."""
        if monotonic() < self._take_after:  # Redis refused the take: the next tick asks
            return
        try:
            self._send_take(timeout)
        except Exception as exc:  # a health check's PING refused too (MISCONF refuses PING)
            self._in_poll = None  # type: ignore[assignment]
            self._take_refused(exc)

    def _send_take(self, timeout: Any) -> None:
        if len(self.active_queues) != 1:
            self._moving_from = None
            super()._brpop_start(timeout)
            return
        qos: QoS = self.qos
        try:
            with self.conn_or_acquire() as client:  # not the blocking connection's client
                qos.register(client)
        except Exception as exc:
            self._take_refused(exc)
            return
        (queue,) = self._queue_cycle.consume(1)
        self._in_poll = self.client.connection
        self._brpop_sent_at = monotonic()  # type: ignore[assignment]
        self._moving_from = queue
        self.client.connection.send_command(
            "BLMOVE", queue, taken_key(qos.consumer), "RIGHT", "LEFT",
            timeout if timeout is not None else self.brpop_timeout,
        )  # fmt: skip

    def _take_refused(self, exc: BaseException) -> None:
        """Redis refused the take (BLMOVE needs memory; under MISCONF or on a replica, BRPOP
        too): wait, with backoff, instead of Celery's "Unrecoverable error"."""
        if not refused(exc):
            raise exc
        pause_s = TAKE_PAUSES_S[min(self._take_pauses, len(TAKE_PAUSES_S) - 1)]
        self._take_pauses += 1
        self._take_after = monotonic() + pause_s

    def _brpop_read(self, **options: Any) -> bool:
        try:
            taken = self._take_read(**options)
        except Exception as exc:
            self._take_refused(exc)
            raise Empty() from None
        self._take_pauses = 0
        return taken

    def _take_read(self, **options: Any) -> bool:
        queue = self._moving_from
        if queue is None:
            return bool(super()._brpop_read(**options))
        try:
            try:
                item = self.client.parse_response(self.client.connection, "BLMOVE", **options)
            except self.connection_errors:
                self.client.connection.disconnect()
                raise
            if not item:
                raise Empty()
            payload = json_codec.loads(item)
            tag, consumer = payload["properties"]["delivery_tag"], self.qos.consumer
            took(Taken(tag, taken_key(consumer), item, task_id(payload.get("headers"))))
            self.connection._deliver(payload, queue)
            return True
        finally:
            self._in_poll = None  # type: ignore[assignment]
            self._flush_brpop_reauth()

    def _receive(self) -> bool:
        """Fanout messages (Celery's remote control); a refusal of the health check's PING on
        the subscription (Redis refuses PING under MISCONF) waits like a refused take."""
        try:
            return bool(super()._receive())
        except Exception as exc:
            self._take_refused(exc)
            return False

    def _restore(self, message: Any, leftmost: bool = False) -> None:
        """Put one taken message back on its queue, then forget it (in that order: a crash
        between the two delivers it twice, never loses it)."""
        delivery = message.delivery_info
        qos: QoS = self.qos
        tag = message.delivery_tag
        moved = TAKEN.get(tag)
        with self.conn_or_acquire() as client:
            # one MULTI/EXEC: a Redis that refuses the LPUSH (it needs memory) refuses the
            # LREM with it, so the message stays held, never lost
            pipe = client.pipeline(transaction=True)
            self._do_restore_message(
                message._raw, delivery["exchange"], delivery["routing_key"], pipe, leftmost
            )
            if moved is not None:
                pipe.lrem(moved.held_in, 1, moved.raw)
            else:
                pipe.hdel(unacked_key(qos.consumer), tag)
            pipe.execute()
        release(tag)  # forgotten once given back

    def close(self) -> None:
        qos = self._qos  # only if this channel ever consumed
        super().close()
        if isinstance(qos, QoS):
            qos.close()


class Transport(kombu_redis.Transport):
    Channel = Channel

    def register_with_event_loop(self, connection: Any, loop: Any) -> None:
        super().register_with_event_loop(connection, loop)
        loop.on_tick.add(_write_acks)
        _TICKING.append(True)


def _write_acks() -> None:
    """Each tick of the consumer loop: its consumers' acks since the last."""
    for qos in [q for q in list(_LIVE) if q.acks]:
        qos.write_acks()


TRANSPORT = f"{__name__}:Transport"
