"""A fleet on RabbitMQ for tests/test_fleet_amqp*.py: its broker a vhost of its own on the local
RabbitMQ (deleted at the end, with every queue and exchange the fleet made), its state on a
private Redis, workers for every queue, the control one with a task more (tests/putoff_app.py).
And what those modules check on it, for each queue type."""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.chaos_fleet import expected, weather_objects
from bench.chaos_report import finished_count
from fixtures.demo_batch import check, demo_specs
from fixtures.rabbitmq_vhost import rabbitmq_here, vhost
from producer.client import Client
from producer.fleet import Fleet, worker_command
from producer.fleet_status import read_fleet_status
from producer.specfile import load_spec_from_objects
from schemas.task_names import ALL_QUEUES, QUEUE_CONTROL, QUEUE_LLM
from tests.conftest import Running
from tests.putoff_app import PUTOFF, RAN
from tests.test_pipeline import run_specs, wait_for


def amqp_fleet(base_fleet: Fleet, queue_type: str) -> Iterator[Running]:
    """Workers for every queue, their broker on a fresh vhost (`queue_type` queues), their
    state on a Redis of their own; the base fleet's replay server."""
    why_not = rabbitmq_here()
    if why_not:
        pytest.skip(why_not)
    state = Fleet(workdir=base_fleet.workdir / f"amqp-{queue_type}-state")
    state.workdir.mkdir()
    with vhost(f"cchatq-test-{queue_type}") as broker_url:
        try:
            state_url = state.ensure_redis(private=True)
            env = {**base_fleet.env, "CCHATQ_BROKER_URL": broker_url,
                   "CCHATQ_QUEUE_TYPE": queue_type}  # fmt: skip
            fleet = Fleet(
                redis_url=state_url, replay_url=base_fleet.replay_url,
                workdir=base_fleet.workdir / f"amqp-{queue_type}", env=env,
            )  # fmt: skip
            fleet.workdir.mkdir()
            client = Client(
                state_url, config=fleet.config(), broker_url=broker_url, queue_type=queue_type
            )
            try:
                for queue in ALL_QUEUES:
                    if queue == QUEUE_CONTROL:
                        start_putoff_worker(fleet)
                    else:
                        fleet.start_worker(queue)
                fleet.wait_served()
                yield Running(fleet=fleet, redis_url=state_url, client=client)
            finally:
                fleet.stop()
                client.close()
        finally:
            state.stop()


def start_putoff_worker(fleet: Fleet) -> None:
    """The control worker, on tests.putoff_app (cchatq's app and the put-off task)."""
    command = worker_command(QUEUE_CONTROL, name=f"control-{len(fleet.workers)}")
    command[command.index("worker.tasks")] = "tests.putoff_app"
    name = f"{QUEUE_CONTROL}-{len(fleet.workers)}"
    fleet.workers[name] = fleet.spawn(command, name, env=fleet.worker_env())


def check_demo_batch(running: Running, tmp_path: Path, fresh_id: str) -> None:
    """The demo batch exactly as on Redis; the state's Redis holds only the sessions' keys
    (no broker's); `status` reads the queues from RabbitMQ: none waiting, a consumer each,
    what consumers took unknown."""
    specs = [{**spec, "id": f"{fresh_id}/{spec['id']}"} for spec, _ in demo_specs(21)]
    records = run_specs(running.client, specs, tmp_path)
    problems = {sid: check({**r, "id": sid.split("/", 1)[1]}) for sid, r in records.items()}
    assert len(records) == 21 and {s: p for s, p in problems.items() if p} == {}
    state_keys = {k.decode() for k in running.client.redis.scan_iter(count=1000)}
    assert state_keys and all(k.startswith(("cq:", "test:")) for k in state_keys), state_keys
    fleet = read_fleet_status(running.client.redis, running.client.broker_queues)
    assert fleet.consumers_by_queue == dict.fromkeys(ALL_QUEUES, 1)
    assert fleet.queued == dict.fromkeys(ALL_QUEUES, 0)
    assert fleet.taken == {} and fleet.active_sessions == 0


def check_putoffs(running: Running, delays_ms: list[int]) -> list[dict[str, Any]]:
    """Put-offs of `delays_ms` through a worker's retry path: each runs once, never before it
    fell due, and at most a second after (Redis's clock, read by the worker that runs it)."""
    running.client.redis.delete(RAN)
    keys = [f"p{n}-{uuid.uuid4().hex[:6]}" for n in range(len(delays_ms))]
    for key, delay_ms in zip(keys, delays_ms, strict=True):
        running.client.celery.send_task(PUTOFF, [key, delay_ms], queue=QUEUE_CONTROL)
    ran: list[dict[str, Any]] = []
    while len(ran) < len(keys):  # each as it lands in the state's Redis (bounded)
        popped = running.client.redis.blpop([RAN], timeout=30)
        assert popped is not None, f"{len(ran)} of {len(keys)} put-offs ran"
        ran.append(json.loads(popped[1]))
    assert sorted(r["key"] for r in ran) == sorted(keys)
    late_ms = {r["key"]: r["ran_ms"] - r["due_ms"] for r in ran}
    # -1: both ends read Redis's clock through an offset measured to within a millisecond
    assert all(-1 <= late <= 1000 for late in late_ms.values()), late_ms
    assert all(r["retries"] == 1 for r in ran)
    return ran


def putoff_delays(n: int, seed: int) -> list[int]:
    """`n` put-offs of 0.2 to 0.9 s."""
    draw = random.Random(seed)
    return [draw.randint(200, 900) for _ in range(n)]


def check_kill_loses_nothing(running: Running, fresh_id: str) -> None:
    """The llm worker SIGKILLed mid-batch (its connection's unacknowledged messages handed
    out again by RabbitMQ) and started again: every session ends with its expected answer."""
    objects = weather_objects(f"kill-{fresh_id}", 40, latency_ms=300)
    sub = running.client.enqueue(load_spec_from_objects(objects))
    fleet = running.fleet
    # mid-batch: the first sessions have finished, the others' rounds are in the llm worker
    wait_for(lambda: finished_count(running.client.redis, sub.order) >= 1, timeout_s=60)
    at_kill = finished_count(running.client.redis, sub.order)
    (name,) = [n for n in fleet.workers if n.startswith(f"{QUEUE_LLM}-")]
    fleet.kill(fleet.workers.pop(name))
    fleet.start_worker(QUEUE_LLM)
    records = {r["id"]: r for _, r in running.client.wait(sub, timeout_s=120)}
    want = expected(objects)
    got = {
        sid: (r.get("body") or {}).get("choices", [{}])[0].get("message", {}).get("content")
        for sid, r in records.items()
    }
    assert got == want
    # the kill did hit rounds the worker held: RabbitMQ handed them out again, to the new one
    again = [e for sid in want for e in running.client.trace(sid) if (e.get("delivery") or 0) > 1]
    assert again, f"nothing held by the worker killed after {at_kill} sessions ended"
