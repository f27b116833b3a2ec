"""A fleet whose broker is RabbitMQ on classic queues (CCHATQ_BROKER_URL=amqp://..., state on
Redis: tests/amqp_fleet.py): the demo batch runs exactly as on Redis, `status` reads the
queues from RabbitMQ, put-offs (Celery's eta, held by the worker) run once, never early and
at most a second late, and a worker SIGKILLed mid-batch loses no session."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from producer.fleet import Fleet
from schemas.redis_url import redacted
from schemas.task_names import ALL_QUEUES
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
def classic(base_fleet: Fleet) -> Iterator[Running]:
    yield from amqp_fleet(base_fleet, "classic")


def test_a_batch_runs_with_its_broker_on_rabbitmq(
    classic: Running, tmp_path: Path, fresh_id: str
) -> None:
    check_demo_batch(classic, tmp_path, fresh_id)


def test_put_offs_run_when_due(classic: Running) -> None:
    ran = check_putoffs(classic, putoff_delays(30, seed=1))
    assert all(r["via"] == [] for r in ran)  # held by the worker, not by a delay queue


def test_a_worker_killed_mid_batch_loses_no_session(classic: Running, fresh_id: str) -> None:
    check_kill_loses_nothing(classic, fresh_id)


def test_cli_status_reads_the_queues_from_rabbitmq(classic: Running) -> None:
    env = classic.fleet.worker_env()
    ok = subprocess.run(
        [sys.executable, "-m", "producer.cli", "status"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    shown = json.loads(ok.stdout)
    assert shown["consumers_by_queue"] == dict.fromkeys(ALL_QUEUES, 1)
    assert shown["taken"] == {} and shown["broker"] == redacted(env["CCHATQ_BROKER_URL"])
    down = {**env, "CCHATQ_BROKER_URL": "amqp://guest:guest@127.0.0.1:1/x"}
    ran = subprocess.run(
        [sys.executable, "-m", "producer.cli", "status"],
        env=down, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert ran.returncode == 4, ran.stderr
    assert "cannot reach RabbitMQ at amqp://guest:***@127.0.0.1:1/x" in ran.stderr
    assert "set CCHATQ_BROKER_URL" in ran.stderr
