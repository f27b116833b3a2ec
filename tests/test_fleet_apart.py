"""A fleet whose sessions' state and broker are two Redis servers (CCHATQ_STATE_URL and
CCHATQ_BROKER_URL, schemas/fleet_urls.py): the demo batch runs exactly as on one Redis, the
state's Redis holds no broker key and the broker's no session key, and `cchatq status` reads
each from its own."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from fixtures.demo_batch import check, demo_specs
from producer.client import Client
from producer.fleet import Fleet
from producer.fleet_status import read_fleet_status
from schemas.task_names import ALL_QUEUES
from tests.conftest import Running
from tests.test_pipeline import run_specs

pytestmark = pytest.mark.fleet


@pytest.fixture(scope="module")
def apart(base_fleet: Fleet) -> Iterator[tuple[Running, str]]:
    """Workers for every queue with their state on a Redis of their own and their broker on
    another; the base fleet's replay server."""
    state, broker = Fleet(workdir=base_fleet.workdir / "state"), None
    state.workdir.mkdir()
    try:
        state_url = state.ensure_redis(private=True)
        broker = Fleet(workdir=base_fleet.workdir / "broker")
        broker.workdir.mkdir()
        broker_url = broker.ensure_redis(private=True)
        env = {**base_fleet.env, "CCHATQ_BROKER_URL": broker_url}
        fleet = Fleet(
            redis_url=state_url, replay_url=base_fleet.replay_url,
            workdir=base_fleet.workdir / "apart", env=env,
        )  # fmt: skip
        fleet.workdir.mkdir()
        client = Client(state_url, config=fleet.config(), broker_url=broker_url)
        try:
            for queue in ALL_QUEUES:
                fleet.start_worker(queue)
            yield Running(fleet=fleet, redis_url=state_url, client=client), broker_url
        finally:
            fleet.stop()
            client.close()
    finally:
        state.stop()
        if broker is not None:
            broker.stop()


def test_a_batch_runs_with_its_broker_apart(
    apart: tuple[Running, str], tmp_path: Path, fresh_id: str
) -> None:
    running, broker_url = apart
    specs = [{**spec, "id": f"{fresh_id}/{spec['id']}"} for spec, _ in demo_specs(21)]
    records = run_specs(running.client, specs, tmp_path)
    problems = {sid: check({**r, "id": sid.split("/", 1)[1]}) for sid, r in records.items()}
    assert len(records) == 21 and {s: p for s, p in problems.items() if p} == {}
    state_keys = {k.decode() for k in running.client.redis.scan_iter(count=1000)}
    broker_keys = {k.decode() for k in redis.Redis.from_url(broker_url).scan_iter(count=1000)}
    assert state_keys and all(k.startswith("cq:") for k in state_keys)
    assert broker_keys and not any(k.startswith("cq:") for k in broker_keys)
    fleet = read_fleet_status(running.client.redis, running.client.broker_redis)
    assert fleet.consumers_by_queue == dict.fromkeys(ALL_QUEUES, 1)
    assert fleet.active_sessions == 0


def test_cli_status_names_the_variable_of_a_broker_that_is_down(
    apart: tuple[Running, str],
) -> None:
    running, _ = apart
    env = {**running.fleet.worker_env(), "CCHATQ_BROKER_URL": "redis://127.0.0.1:1/0"}
    ran = subprocess.run(
        [sys.executable, "-m", "producer.cli", "status"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert ran.returncode == 4, ran.stderr
    assert "cannot reach Redis at redis://127.0.0.1:1/0" in ran.stderr
    assert "set CCHATQ_BROKER_URL" in ran.stderr
    ok = subprocess.run(
        [sys.executable, "-m", "producer.cli", "status"],
        env=running.fleet.worker_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    shown = json.loads(ok.stdout)
    assert shown["consumers_by_queue"] == dict.fromkeys(ALL_QUEUES, 1)
    assert shown["redis"] == running.redis_url and shown["broker"] != shown["redis"]


@pytest.fixture(scope="module")
def on_cluster(base_fleet: Fleet, state_cluster: str) -> Iterator[Running]:
    """Workers for every queue with their state on a 3-master Redis Cluster and their broker
    on a Redis of its own."""
    broker = Fleet(workdir=base_fleet.workdir / "cluster-broker")
    broker.workdir.mkdir()
    try:
        broker_url = broker.ensure_redis(private=True)
        env = {**base_fleet.env, "CCHATQ_BROKER_URL": broker_url}
        fleet = Fleet(
            redis_url=state_cluster, replay_url=base_fleet.replay_url,
            workdir=base_fleet.workdir / "on-cluster", env=env,
        )  # fmt: skip
        fleet.workdir.mkdir()
        client = Client(state_cluster, config=fleet.config(), broker_url=broker_url)
        client.redis.flushall()
        try:
            for queue in ALL_QUEUES:
                fleet.start_worker(queue)
            yield Running(fleet=fleet, redis_url=state_cluster, client=client)
        finally:
            fleet.stop()
            client.close()
    finally:
        broker.stop()


def test_a_batch_runs_with_its_state_on_a_cluster(
    on_cluster: Running, tmp_path: Path, fresh_id: str
) -> None:
    """The demo batch exactly as on one Redis; every master holds a share of the sessions'
    keys (each session's in one slot)."""
    specs = [{**spec, "id": f"{fresh_id}/{spec['id']}"} for spec, _ in demo_specs(42)]
    records = run_specs(on_cluster.client, specs, tmp_path)
    problems = {sid: check({**r, "id": sid.split("/", 1)[1]}) for sid, r in records.items()}
    assert len(records) == 42 and {s: p for s, p in problems.items() if p} == {}
    held = {n.name: n.redis_connection.dbsize() for n in on_cluster.client.redis.get_primaries()}
    assert len(held) == 3 and all(n > 0 for n in held.values()), held
    fleet = read_fleet_status(on_cluster.client.redis, on_cluster.client.broker_redis)
    assert fleet.active_sessions == 0
