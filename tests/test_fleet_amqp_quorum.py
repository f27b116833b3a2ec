"""A fleet whose broker is RabbitMQ on quorum queues (CCHATQ_QUEUE_TYPE=quorum:
tests/amqp_fleet.py): the demo batch runs exactly as on Redis; a put-off goes through the
delay queues (worker/edges/amqp_topology.py), not held by the worker, and runs once, never
early and at most a second late, a long one after hops that each come back early and are
put off again; a worker SIGKILLed mid-batch loses no session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from producer.fleet import Fleet
from tests.amqp_fleet import (
    amqp_fleet,
    check_demo_batch,
    check_kill_loses_nothing,
    check_putoffs,
    putoff_delays,
)
from tests.conftest import Running

pytestmark = pytest.mark.fleet


@pytest.fixture(scope="module")
def quorum(base_fleet: Fleet) -> Iterator[Running]:
    yield from amqp_fleet(base_fleet, "quorum")


def test_a_batch_runs_on_quorum_queues(quorum: Running, tmp_path: Path, fresh_id: str) -> None:
    check_demo_batch(quorum, tmp_path, fresh_id)


def test_put_offs_go_through_the_delay_queues_and_run_when_due(quorum: Running) -> None:
    # 1.5 s: the 1 s delay queue, then what is left; 2.5 s: the 2 s one, then what is left
    ran = check_putoffs(quorum, [*putoff_delays(30, seed=2), 1_500, 2_500])
    assert all(len(r["via"]) == 1 and r["via"][0].startswith("cchatq.delay.") for r in ran)


def test_a_worker_killed_mid_batch_loses_no_session(quorum: Running, fresh_id: str) -> None:
    check_kill_loses_nothing(quorum, fresh_id)
