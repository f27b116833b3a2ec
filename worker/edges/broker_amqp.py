"""Publishing steps on RabbitMQ: each step's messages on a channel in confirm mode, as the AMQP
message Celery's `send_task` would publish (tests/test_broker_amqp.py holds it to that), to
the default exchange with its queue as routing key, `mandatory` (a message no queue takes
comes back instead of being acked and dropped). A step's messages go out together and wait
for their confirms once (~250 us of CPU a message).

py-amqp's connections are not thread-safe, and one channel a thread on a shared connection
breaks, so each process keeps a small pool of connections, each with one confirmed channel,
made as threads need them (at most one a thread publishing at once) and used by one thread
at a time. A worker declares the fleet's queues and, on quorum queues, the delay queues of its
put-offs as it starts (declare_fleet; worker/edges/amqp_topology.py); a process that did not
declares them with its first connection.

A publish that fails (the connection lost, no confirm in CONFIRM_TIMEOUT_S, a nack, a message
returned) is tried once more on a new connection, which declares the queues again; then it
raises BrokerUnconfirmedError and the step is retried. A message tried twice may be
delivered twice: steps are idempotent (a step id, a lease, first writer wins).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import amqp
from amqp import spec
from kombu.utils.url import parse_url

from schemas import redis_links, task_names
from worker.edges import amqp_topology
from worker.edges.task_protocol import TaskMessage, task_headers
from worker.errors import BrokerUnconfirmedError

log = logging.getLogger(__name__)
CONFIRM_TIMEOUT_S = 10.0  # a step's confirms, after its last message went out
AMQP_PORT, AMQPS_PORT = 5672, 5671


def amqp_form(message: TaskMessage) -> amqp.Message:
    """A task message as `send_task` publishes it on RabbitMQ: the JSON body as is (no
    base64), the protocol-2 headers as the message's headers."""
    return amqp.Message(
        message.body(),
        content_type="application/json",
        content_encoding="utf-8",
        application_headers=dict(message.headers),
        correlation_id=message.task_id,
        reply_to="",
        delivery_mode=2,
        priority=0,
    )


@dataclass(frozen=True)
class PutOff:
    """A delivery to run again at `due_ms` (Redis's clock), as its task's request says it:
    the same task id, root and parent, shown kwargs, and `retries` (one more than the
    delivery's for a step's RetryLater; the same for another hop of one)."""

    name: str
    args: list[str | int]
    task_id: str
    root_id: str | None
    parent_id: str | None
    retries: int
    shown: str  # the delivery's kwargsrepr: its session's spec id
    due_ms: int

    def message(self) -> TaskMessage:
        """The message Celery's `task.retry` would send, due at `due_ms`, with no eta (the
        delay queues hold it, not the worker)."""
        headers = task_headers(self.name, self.args, self.task_id)
        headers.update(
            root_id=self.root_id or self.task_id,
            parent_id=self.parent_id,
            retries=self.retries,
            kwargsrepr=self.shown,
        )
        # its wait on the queue counts from when it falls due, as a retry's does
        headers[task_names.SENT_HEADER] = headers[task_names.DUE_HEADER] = self.due_ms
        queue = task_names.ROUTES.get(self.name, task_names.QUEUE_CONTROL)  # Celery's default
        return TaskMessage(queue, self.task_id, self.args, headers)


class Unconfirmed(Exception):
    """The broker nacked a message or returned it unrouted (a connection that still works)."""


# (message, exchange, routing key)
Outgoing = tuple[amqp.Message, str, str]


class ConfirmedChannel:
    """A py-amqp channel in confirm mode on a connection of its own: publishes a batch and
    waits for all its confirms (RabbitMQ may ack several with `multiple`)."""

    def __init__(self, connection: amqp.Connection) -> None:
        self.connection = connection
        self.channel = connection.channel()
        self.channel.confirm_select()
        self._published = 0  # delivery tags count from 1 a channel
        self._confirmed = 0
        self._nacked = 0
        self._returned: list[str] = []
        self.channel.events["basic_ack"].add(self._on_ack)
        self.channel.events["basic_nack"].add(self._on_nack)
        self.channel.events["basic_return"].add(self._on_return)

    def _on_ack(self, tag: int, multiple: bool) -> None:
        self._confirmed = max(self._confirmed, tag)

    def _on_nack(self, tag: int, multiple: bool) -> None:
        self._nacked += 1
        self._confirmed = max(self._confirmed, tag)

    def _on_return(self, exc: Exception, exchange: str, routing_key: str, message: Any) -> None:
        self._returned.append(routing_key)

    def publish(self, batch: Sequence[Outgoing]) -> None:
        """Every message of `batch`, then their confirms. Unconfirmed on a nack or a return
        (RabbitMQ sends a message's return before its ack); the connection's own errors (and
        socket.timeout past CONFIRM_TIMEOUT_S) go through."""
        for message, exchange, routing_key in batch:
            self.channel.basic_publish(
                message, exchange=exchange, routing_key=routing_key, mandatory=True
            )
            self._published += 1
        while self._confirmed < self._published:
            self.channel.wait([spec.Basic.Ack, spec.Basic.Nack], timeout=CONFIRM_TIMEOUT_S)
        returned, self._returned = self._returned, []
        nacked, self._nacked = self._nacked, 0
        if returned:
            raise Unconfirmed(f"no queue took a message for {sorted(set(returned))}")
        if nacked:
            raise Unconfirmed(f"the broker nacked {nacked} messages")

    def close(self, graceful: bool = True) -> None:
        """Close the connection; not `graceful` (it failed, or no confirm came): its socket
        only, as waiting for the broker's close-ok could wait for ever."""
        try:
            if graceful:
                self.connection.close()
                return
        except Exception:
            pass
        self.connection.collect()


def connection_options(url: str) -> dict[str, Any]:
    """py-amqp Connection arguments for an amqp:// or amqps:// URL, read as kombu reads it
    (the vhost after the host, percent-decoded; `/` when none)."""
    parts = parse_url(url)
    tls = parts["transport"] == "amqps"
    port = parts.get("port") or (AMQPS_PORT if tls else AMQP_PORT)
    return {
        "host": f"{parts.get('hostname') or 'localhost'}:{port}",
        "userid": parts.get("userid") or "guest",
        "password": parts.get("password") or "guest",
        "virtual_host": parts.get("virtual_host") or "/",
        "ssl": tls,
        "connect_timeout": redis_links.CONNECT_TIMEOUT_S,
        "heartbeat": 0,  # used in bursts by one thread: a dead one fails its publish, tried again
        "socket_settings": redis_links.keepalive_options(),
    }


# whether this process declared the fleet's queues (declare_fleet, as a worker starts): a
# prefork pool's children inherit it, and their senders do not declare them again
_declared_here = False


def declare_fleet(url: str, kind: str) -> None:
    """Declare the fleet's queues, and the delay queues on quorum queues, once as a worker
    starts: its first publish or put-off does not wait for them (a quorum queue takes tens of
    milliseconds to make, a loaded machine's more)."""
    global _declared_here
    connection = amqp.Connection(**connection_options(url))
    connection.connect()
    try:
        with connection.channel() as channel:
            amqp_topology.declare(channel, kind)
    finally:
        connection.close()
    _declared_here = True


class AmqpSender:
    """A process's confirmed publishes to RabbitMQ at `url` (a dispatch.BrokerApart): at most
    `size` connections, made as needed. `kind`: the fleet's queue type."""

    def __init__(self, url: str, kind: str, size: int) -> None:
        self.options = connection_options(url)
        self.kind = kind
        self.size = max(size, 1)
        self._idle: list[ConfirmedChannel] = []  # the most recently used first out
        self._made = 0
        # the fleet's queues declared: at the worker's start, else by the first connection
        # (again after a failed publish); by one thread while the others wait
        self._declared = _declared_here
        self._declaring = threading.Lock()
        self._free = threading.Condition()

    def send(self, messages: Sequence[TaskMessage]) -> None:
        """A step's messages, each to its queue, confirmed."""
        self._publish(lambda: [(amqp_form(m), "", m.queue) for m in messages])

    def send_later(self, message: TaskMessage, due_ms: int, now_ms: Callable[[], int]) -> int:
        """A put-off message due at `due_ms` (on `now_ms`'s clock) through the delay queue of
        its next hop (amqp_topology.hop_ms), or to its queue when it is due; the hop's
        milliseconds (0: none). The hop is reckoned once a channel is in hand: a connection
        that took its time to make is not added to the wait."""
        hops: list[int] = []

        def batch() -> list[Outgoing]:
            hop = amqp_topology.hop_ms(due_ms - now_ms())
            hops.append(hop)
            form = amqp_form(message)
            if not hop:
                return [(form, "", message.queue)]
            form.properties["application_headers"][amqp_topology.DELAY_HEADER] = hop
            return [(form, amqp_topology.DELAY_EXCHANGE, message.queue)]

        self._publish(batch)
        return hops[-1]

    def _publish(self, make: Callable[[], Sequence[Outgoing]]) -> None:
        failure: Exception = BrokerUnconfirmedError("not published")
        batch: Sequence[Outgoing] = ()
        for attempt in (1, 2):
            try:
                channel = self._take()
            except Exception as exc:  # the broker does not answer, or refused the declares
                failure = exc
                continue
            try:
                batch = make()
            except BaseException:
                self._give(channel)
                raise
            try:
                channel.publish(batch)
            except Exception as exc:
                failure = exc
                self._drop(channel)
                self._declared = False  # a queue may be gone: the next connection declares
                if attempt == 1:
                    log.warning("publish to RabbitMQ failed (%s): tried again", _said(exc))
                continue
            self._give(channel)
            return
        queues = sorted({key for _, _, key in batch})
        raise BrokerUnconfirmedError(f"messages for {queues} not confirmed: {_said(failure)}")

    def _take(self) -> ConfirmedChannel:
        with self._free:
            while not self._idle and self._made >= self.size:
                self._free.wait()
            if self._idle:
                return self._idle.pop()
            self._made += 1
        try:
            return self._connect()
        except BaseException:
            with self._free:
                self._made -= 1
                self._free.notify()
            raise

    def _connect(self) -> ConfirmedChannel:
        connection = amqp.Connection(**self.options)
        connection.connect()
        try:
            if not self._declared:
                with self._declaring, connection.channel() as channel:
                    if not self._declared:
                        amqp_topology.declare(channel, self.kind)
                        self._declared = True
            return ConfirmedChannel(connection)
        except BaseException:
            connection.collect()
            raise

    def _give(self, channel: ConfirmedChannel) -> None:
        with self._free:
            self._idle.append(channel)
            self._free.notify()

    def _drop(self, channel: ConfirmedChannel) -> None:
        channel.close(graceful=False)
        with self._free:
            self._made -= 1
            self._free.notify()

    def close(self) -> None:
        """Close the idle connections (a process that stops)."""
        with self._free:
            idle, self._idle = self._idle, []
            self._made -= len(idle)
        for channel in idle:
            channel.close()


def _said(exc: BaseException) -> str:
    """An error in one line: its class and first line (a broker's reply text, never a body)."""
    text = str(exc).strip().split("\n")[0][:200]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
