"""Steps published on RabbitMQ (worker/edges/broker_amqp.py): the AMQP message is the one
Celery's `send_task` publishes, field by field (so a Celery that changes its protocol fails
here, not in a fleet); a publish no queue takes, or that no broker confirms, raises the
StoreError that makes its step retry. On the local RabbitMQ, in a vhost of its own
(fixtures/rabbitmq_vhost.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import amqp
import pytest
from celery import Celery

from fixtures.rabbitmq_vhost import rabbitmq_here, vhost
from schemas import keys, task_names
from schemas.amqp_broker import CLASSIC
from worker.config import load_settings
from worker.edges.broker_amqp import AmqpSender, connection_options
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
