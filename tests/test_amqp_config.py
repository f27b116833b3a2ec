"""RabbitMQ as the broker, configured (schemas/amqp_broker.py, schemas/fleet_urls.py): an
amqp:// URL is taken for the broker only, the state must name a Redis (one line saying so),
CCHATQ_QUEUE_TYPE is checked, and the workers' and the producer's Celery configurations
declare the same queues (RabbitMQ refuses a second declaration that differs). No broker is
reached here."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from producer.broker_queues import celery_broker as producer_broker
from schemas.amqp_broker import QUEUE_TYPES
from schemas.config import ConfigError
from schemas.task_names import ALL_QUEUES
from worker.config import load_settings
from worker.edges import amqp_topology
from worker.wiring import celery_config

BROKER = "amqp://app:s3cret@rabbit:5672/cchatq"
STATE = "redis://state:6379/0"


def test_the_broker_may_be_rabbitmq_and_the_state_a_redis() -> None:
    settings = load_settings({"CCHATQ_STATE_URL": STATE, "CCHATQ_BROKER_URL": BROKER})
    assert settings.urls.amqp and not settings.urls.shared
    assert settings.queue_type == "classic"
    also = load_settings({"REDIS_URL": STATE, "CCHATQ_BROKER_URL": "amqps://rabbit/"})
    assert also.urls.amqp and also.urls.state == STATE
    assert not load_settings({"REDIS_URL": STATE}).urls.amqp


@pytest.mark.parametrize(
    ("env", "variable", "says"),
    [
        ({"REDIS_URL": BROKER}, "REDIS_URL", "set CCHATQ_STATE_URL to the Redis"),
        ({"CCHATQ_STATE_URL": BROKER}, "CCHATQ_STATE_URL", "can be the broker only"),
        ({"CCHATQ_BROKER_URL": "amqp://h:x/v"}, "CCHATQ_BROKER_URL", "not a port number"),
        ({"CCHATQ_BROKER_URL": "amqp://h/v?heartbeat=5"}, "CCHATQ_BROKER_URL", "no query"),
        ({"CCHATQ_QUEUE_TYPE": "stream"}, "CCHATQ_QUEUE_TYPE", "classic or quorum"),
    ],
)
def test_a_worker_refuses_what_it_cannot_use_in_one_line(
    env: dict[str, str], variable: str, says: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        load_settings(env)
    ((named, why),) = refused.value.problems
    assert named == variable and says in why and "\n" not in why
    assert "s3cret" not in str(refused.value)


def _declared(queues: list[Any]) -> list[tuple[Any, ...]]:
    """What a queue's declaration says: RabbitMQ compares all of it."""
    return [
        (
            q.name,
            q.exchange.name,
            q.exchange.type,
            q.exchange.durable,
            q.routing_key,
            q.durable,
            q.auto_delete,
            q.queue_arguments,
        )
        for q in queues
    ]


@pytest.mark.parametrize("kind", QUEUE_TYPES)
def test_workers_and_producers_declare_the_same_queues(kind: str) -> None:
    env = {"CCHATQ_STATE_URL": STATE, "CCHATQ_BROKER_URL": BROKER, "CCHATQ_QUEUE_TYPE": kind}
    config = celery_config(load_settings(env))
    assert "broker_transport" not in config  # kombu's amqp transport, as the URL says
    assert config["broker_url"] == BROKER
    assert config["broker_transport_options"] == {"confirm_publish": True}
    assert config["broker_heartbeat"] == 10
    queues = config["task_queues"]
    assert [q.name for q in queues] == list(ALL_QUEUES)
    assert all(q.durable and q.queue_arguments == {"x-queue-type": kind} for q in queues)
    assert _declared(queues) == _declared(producer_broker(BROKER, kind)["task_queues"])
    # Celery's own delayed delivery (quorum queues) is not set up: the delay queues are ours
    steps = amqp_topology.AmqpConsumer.Blueprint.default_steps
    assert config["worker_consumer"] == "worker.edges.amqp_topology:AmqpConsumer"
    assert not any("delayed_delivery" in s for s in steps) and len(steps) >= 8


def test_the_cli_says_what_to_set_when_the_state_names_rabbitmq() -> None:
    env = {"REDIS_URL": BROKER, "PATH": "/usr/bin:/bin"}
    ran = subprocess.run(
        [sys.executable, "-m", "producer.cli", "status"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert ran.returncode == 4, ran.stderr
    assert ran.stderr.strip().splitlines() == [
        "cchatq: REDIS_URL 'amqp://app:***@rabbit:5672/cchatq' names RabbitMQ, which can be the"
        " broker only: set CCHATQ_STATE_URL to the Redis of the sessions' state"
    ]
