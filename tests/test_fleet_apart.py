"""A fleet whose sessions' state and broker are two Redis servers (CCHATQ_STATE_URL and
CCHATQ_BROKER_URL, schemas/fleet_urls.py): the demo batch runs exactly as on one Redis, the
state's Redis holds no broker key and the broker's no session key, and `cchatq status` reads
each from its own."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from prometheus_client import CollectorRegistry
from redis.crc import key_slot

from bench.__main__ import weather_spec
from bench.chaos_fleet import weather_objects
from bench.history_read import check_run, mark_run
from fixtures.demo_batch import check, demo_specs
from producer.client import Client
from producer.fleet import Fleet
from producer.fleet_status import read_fleet_status
from producer.metrics import TraceCounters
from producer.session_memory import session_memory
from producer.specfile import load_spec_from_objects
from schemas import fleet_keys, keys
from schemas.task_names import ALL_QUEUES
from tests.conftest import Running
from tests.test_pipeline import run_specs, wait_for

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
    fleet = read_fleet_status(running.client.redis, running.client.broker_queues)
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
    fleet = read_fleet_status(on_cluster.client.redis, on_cluster.client.broker_queues)
    assert fleet.active_sessions == 0


def sessions_finished(registry: CollectorRegistry) -> float:
    """What the exporter's counter of finished sessions says, every outcome's."""
    return sum(
        s.value for m in registry.collect() for s in m.samples
        if s.name == "cchatq_sessions_finished_total"
    )  # fmt: skip


def test_the_fleets_trace_is_sharded_on_a_cluster_and_the_metrics_read_every_shard(
    on_cluster: Running, tmp_path: Path, fresh_id: str
) -> None:
    """No master takes every step's XADD of the fleet's trace: a session's entries go to the
    shard its key picks, and the metrics exporter's follower counts them all."""
    redis_client = on_cluster.client.redis
    shards = fleet_keys.trace_shards(True)

    def ended_in_shards() -> int:
        return sum(
            1 for shard in shards for _, fields in redis_client.xrange(shard)
            for e in keys.trace_events(fields) if e.get("event") == "session.finished"
        )  # fmt: skip

    before = ended_in_shards()
    specs = [{**spec, "id": f"{fresh_id}/{spec['id']}"} for spec, _ in demo_specs(30)]
    records = run_specs(on_cluster.client, specs, tmp_path)
    wait_for(lambda: ended_in_shards() >= before + len(records), timeout_s=30)
    ended = ended_in_shards()  # with the chats of its program runs
    registry = CollectorRegistry()
    counters = TraceCounters(registry)
    stop = threading.Event()
    follower = threading.Thread(
        target=counters.follow, args=(redis_client, stop, 200, "0"), daemon=True
    )
    follower.start()
    try:
        wait_for(lambda: sessions_finished(registry) == ended, timeout_s=30)
    finally:
        stop.set()
        follower.join(timeout=10)
    used = [k for k in shards if redis_client.exists(k)]
    slots = {key_slot(k.encode()) for k in used}
    assert len(used) >= 4 and len(slots) == len(used)
    assert not redis_client.exists(keys.TRACE)


def test_a_finished_session_keeps_its_record_response_and_claim(
    apart: tuple[Running, str], fresh_id: str
) -> None:
    """A session retires as it ends: of its keys only its record and its response fd stay
    (with its id's claim), under 2 KB together for a two-round weather session, and its
    status, result and trace still read as before (from the record)."""
    running, _ = apart
    client = running.client
    specs = [weather_spec(f"{fresh_id}/w{n}") for n in range(20)]
    batch = client.submit(specs)
    assert all(r.ok for r in batch.results(timeout_s=120))
    for spec in specs:
        sk = client.session_key(spec.id)
        assert sk is not None
        held = {k.decode() for k in client.redis.scan_iter(f"*{{{sk}}}*", count=1000)}
        assert held == {keys.record(sk), keys.response(sk)}, spec.id
    memory = session_memory(client.redis)
    assert memory.sampled_finished == 20 and memory.finished_keys == 3.0
    assert memory.finished_bytes is not None and memory.finished_bytes <= 2048
    status = client.status(specs[0].id)
    assert status is not None and status["state"] == "done" and status["outcome"] == "ok"
    events = [e["event"] for e in client.trace(specs[0].id)]
    assert events[0] == "session.started" and events[-1] == "session.finished"
    assert events.count("tool.call.finished") == 1
    summary = batch.status()
    assert summary.states == {"done": 20} and summary.outcomes == {"ok": 20}


def test_workers_killed_on_a_cluster_leave_a_valid_history(
    on_cluster: Running, fresh_id: str
) -> None:
    """Weather sessions on the cluster while the llm worker, then the tools worker, is
    SIGKILLed mid-batch and started again: the history checker (bench/history.py) finds every
    session ended once, every tool call answered once and no model call made twice but those
    the kills cut short."""
    client, fleet = on_cluster.client, on_cluster.fleet
    objects = weather_objects(f"cluster-kill-{fresh_id}", 40, latency_ms=300)
    mark = mark_run(fleet.replay_url)
    sub = client.enqueue(load_spec_from_objects(objects))
    delivered: list[str] = []
    results = client.wait(sub, timeout_s=180, poll_s=0.05)
    for queue, after in (("llm", 5), ("tools", 15)):
        while len(delivered) < after:
            delivered.append(str(next(results)[1]["id"]))
        victim = next(p for name, p in fleet.workers.items() if name.startswith(f"{queue}-"))
        fleet.kill(victim)
        fleet.workers = {n: p for n, p in fleet.workers.items() if p is not victim}
        fleet.start_worker(queue)
    delivered += [str(record["id"]) for _, record in results]
    verdict = check_run("cluster-kill", client, objects, mark, delivered)
    assert verdict.valid, verdict
    assert verdict.ended == 40 and verdict.lost == 0 and verdict.double_endings == 0
