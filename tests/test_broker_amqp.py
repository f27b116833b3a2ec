"""Steps published on RabbitMQ (worker/edges/broker_amqp.py): the AMQP message is the one
Celery's `send_task` publishes, field by field (so a Celery that changes its protocol fails
here, not in a fleet); a publish no queue takes, or that no broker confirms, raises the
StoreError that makes its step retry; the delay queues' hops never pass a put-off's due
time. On the local RabbitMQ, in a vhost of its own (fixtures/rabbitmq_vhost.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import amqp
import pytest
from celery import Celery

from fixtures.rabbitmq_vhost import rabbitmq_here, vhost
from schemas import keys, task_names
from schemas.amqp_broker import CLASSIC, QUORUM
from worker.config import load_settings
from worker.edges import amqp_topology
from worker.edges.broker_amqp import AmqpSender, PutOff, connection_options
from worker.edges.dispatch import task_message
from worker.edges.task_protocol import TaskMessage, task_headers
from worker.errors import BrokerUnconfirmedError, StoreError
from worker.wiring import celery_config

pytestmark = pytest.mark.fleet


@pytest.fixture(scope="module")
def broker_url() -> Iterator[str]:
    why_not = rabbitmq_here()
    if why_not:
        pytest.skip(why_not)
    with vhost("cchatq-test-publish") as url:
        yield url


def _got(url: str, queue: str) -> amqp.Message:
    connection = amqp.Connection(**connection_options(url))
    connection.connect()
    try:
        channel = connection.channel()
        message = channel.basic_get(queue, no_ack=True)
        assert message is not None, f"nothing on {queue}"
        return message
    finally:
        connection.close()


def _shown(message: amqp.Message) -> dict[str, Any]:
    """Its properties but the headers (compared apart) and reply_to (a reply queue per app,
    which no step's task uses: their results are ignored)."""
    apart = {"application_headers", "reply_to"}
    return {k: v for k, v in message.properties.items() if k not in apart}


def test_the_published_message_is_the_one_send_task_publishes(broker_url: str) -> None:
    settings = load_settings({"CCHATQ_STATE_URL": "redis://h/0", "CCHATQ_BROKER_URL": broker_url})
    app = Celery("contract")
    app.conf.update(celery_config(settings))
    args: list[str | int] = ["sk-1", 2, 0]
    step = keys.tool_step("sk-1", 2, 0)
    queue = task_names.ROUTES[task_names.TOOL]
    sent = 1_700_000_000_123
    app.send_task(
        task_names.TOOL, args=args, task_id=step, queue=queue, argsrepr=repr(args),
        headers={task_names.SENT_HEADER: sent},
    )  # fmt: skip
    theirs = _got(broker_url, queue)
    sender = AmqpSender(broker_url, CLASSIC, 2)
    try:
        headers = task_headers(task_names.TOOL, args, step, sent_ms=sent)
        sender.send([TaskMessage(queue, step, args, headers)])
    finally:
        sender.close()
    ours = _got(broker_url, queue)
    assert ours.headers == theirs.headers
    assert _shown(ours) == _shown(theirs)
    assert ours.body == theirs.body
    # the Redis form's headers are the same
    redis_form = json.loads(task_message(task_names.TOOL, args, step, queue, sent_ms=sent))
    assert redis_form["headers"] == theirs.headers


def test_a_message_no_queue_takes_or_no_broker_confirms_fails_its_step(broker_url: str) -> None:
    sender = AmqpSender(broker_url, CLASSIC, 2)
    lost = TaskMessage("no-such-queue", "t1", ["sk"], task_headers(task_names.ROUND, ["sk"], "t1"))
    try:
        with pytest.raises(BrokerUnconfirmedError) as refused:
            sender.send([lost])
        assert "no-such-queue" in str(refused.value) and isinstance(refused.value, StoreError)
    finally:
        sender.close()
    nobody = AmqpSender("amqp://guest:guest@127.0.0.1:1/x", CLASSIC, 2)
    with pytest.raises(BrokerUnconfirmedError):
        nobody.send([lost])


def test_a_put_off_is_the_retry_celery_would_send_with_its_due_time() -> None:
    step = PutOff(
        name=task_names.ROUND, args=["sk", 1], task_id="sk.r1", root_id="sk.r0",
        parent_id="sk.t0.0", retries=2, shown="{'session': 'eval/1'}", due_ms=1_000,
    )  # fmt: skip
    message = step.message()
    assert message.queue == task_names.QUEUE_LLM
    headers = message.headers
    assert (headers["id"], headers["root_id"], headers["parent_id"]) == (
        "sk.r1",
        "sk.r0",
        "sk.t0.0",
    )
    assert (headers["retries"], headers["kwargsrepr"], headers["eta"]) == (2, step.shown, None)
    assert headers[task_names.SENT_HEADER] == headers[task_names.DUE_HEADER] == 1_000


@pytest.mark.parametrize(
    "remaining_ms", [*range(-5, 3_000, 97), 999, 1_000, 1_001, 64_000, 100_000]
)
def test_a_hop_never_passes_a_put_offs_due_time_unless_it_is_the_last(remaining_ms: int) -> None:
    hop = amqp_topology.hop_ms(remaining_ms)
    if remaining_ms <= 0:
        assert hop == 0
    elif remaining_ms <= 1_000:  # the last hop: never early, at most 100 ms late
        assert hop in amqp_topology.BUCKETS_MS and 0 <= hop - remaining_ms < 100
    else:  # comes back early, put off again for what is left
        assert hop in amqp_topology.BUCKETS_MS and 1_000 <= hop <= remaining_ms


def test_the_delay_queues_hold_a_message_for_its_hop(broker_url: str) -> None:
    """On quorum queues: a message sent later lands in its step's queue after its hop, not
    before (the TTL counts on the broker)."""
    with vhost("cchatq-test-delay") as url:
        sender = AmqpSender(url, QUORUM, 1)
        try:
            headers = task_headers(task_names.ROUND, ["sk", 1], "sk.r1")
            message = TaskMessage(task_names.QUEUE_LLM, "sk.r1", ["sk", 1], headers)
            now_ms = 1_000_000
            assert sender.send_later(message, now_ms + 250, lambda: now_ms) == 300
            connection = amqp.Connection(**connection_options(url))
            connection.connect()
            channel = connection.channel()
            assert channel.basic_get(task_names.QUEUE_LLM, no_ack=True) is None
            got: list[amqp.Message] = []
            channel.basic_consume(task_names.QUEUE_LLM, callback=got.append, no_ack=True)
            connection.drain_events(timeout=5)
            assert [m.headers["id"] for m in got] == ["sk.r1"]
            assert got[0].headers["x-death"][0]["queue"] == amqp_topology.delay_queue(300)
            connection.close()
        finally:
            sender.close()
