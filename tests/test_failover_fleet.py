"""A fleet on a `sentinel://` REDIS_URL: a primary, its replica and three sentinels of our own
(bench/sentinel_fleet.py), real workers and the producer on that URL. The pools wait for a
free connection as before; a demoted master's READONLY sends a client to the promoted one;
and a primary SIGKILLed mid-batch loses no session: the replica is promoted and every session
ends, those whose last writes were lost re-driven by the broker's sweep or the reconciler.
The tests run in order: the last one kills the primary."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from bench.chaos_fleet import expected, wait_records, weather_objects
from bench.sentinel_fleet import HOST, MASTER_NAME, SentinelRedis
from producer.client import Client, reconnecting
from producer.fleet import Fleet
from producer.redis_connect import redis_client
from producer.specfile import load_spec_from_objects
from worker.edges.redis_pool import connection_pool

pytestmark = pytest.mark.fleet

SESSIONS = 40
FLEET_ENV = {  # a reconciler that looks every second at sessions quiet for 4 s
    "CCHATQ_STALL_AFTER_S": "4",
    "CCHATQ_RECONCILE_EVERY_S": "1",
    "CCHATQ_CONSUMER_DEAD_AFTER_S": "5",
}


@pytest.fixture(scope="module")
def sentinel_fleet(base_fleet: Fleet) -> Iterator[tuple[Fleet, SentinelRedis]]:
    fleet = Fleet(
        replay_url=base_fleet.replay_url,
        workdir=base_fleet.workdir / "sentinel",
        env={**base_fleet.env, **FLEET_ENV},
    )
    fleet.workdir.mkdir(exist_ok=True)
    sentinels = SentinelRedis(fleet, down_after_ms=1000, failover_timeout_ms=3000)
    try:
        sentinels.start()
        yield fleet, sentinels
    finally:
        sentinels.stop()
        fleet.stop()


def test_the_store_pool_waits_for_a_free_connection_to_the_master(
    sentinel_fleet: tuple[Fleet, SentinelRedis],
) -> None:
    fleet, sentinels = sentinel_fleet
    pool = connection_pool(fleet.redis_url, max_connections=2, wait_s=0.3)
    held = [pool.get_connection(), pool.get_connection()]
    assert {c.port for c in held} == {sentinels.master_port()}
    with pytest.raises(redis.ConnectionError, match="No connection available"):
        pool.get_connection()  # waits 0.3 s, then says so, as the blocking pool did
    pool.release(held.pop())
    held.append(pool.get_connection())
    for connection in held:
        pool.release(connection)
    pool.disconnect()


def test_status_says_which_master_the_sentinels_name(
    sentinel_fleet: tuple[Fleet, SentinelRedis],
) -> None:
    fleet, sentinels = sentinel_fleet
    cmd = [sys.executable, "-m", "producer.cli", "status"]
    shown = subprocess.run(cmd, env=fleet.worker_env(), capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    where = json.loads(shown.stdout)["redis"]
    assert where.startswith(f"{fleet.redis_url} (master '{MASTER_NAME}' named by 3 sentinels)")
    assert where.endswith(f"now at {HOST}:{sentinels.master_port()}")


def test_a_demoted_masters_readonly_sends_clients_to_the_promoted_one(
    sentinel_fleet: tuple[Fleet, SentinelRedis],
) -> None:
    """After a failover the old master is a replica: a client that reaches it (a sentinel that
    has not heard of the promotion yet names it: played here by the first answer) is answered
    READONLY, drops that connection and asks again, and its write lands on the promoted one."""
    fleet, sentinels = sentinel_fleet
    worker = redis.Redis(connection_pool=connection_pool(fleet.redis_url, 4, 5))
    producer = redis_client(fleet.redis_url, **reconnecting())
    worker.set("cq:test:before", 1)
    producer.set("cq:test:before", 2)
    old = sentinels.master_port()
    with redis.Redis(HOST, sentinels.sentinel_ports[0]) as sentinel:
        sentinel.execute_command("SENTINEL", "FAILOVER", MASTER_NAME)
    promoted = sentinels.wait_promoted(old)
    sentinels.wait_replica(old)
    for client, name in ((worker, "worker"), (producer, "producer")):
        pool: Any = client.connection_pool  # a Sentinel pool, whatever redis-py annotates
        pool.disconnect()
        lagging(pool.sentinel_manager, (HOST, old))
        client.set(f"cq:test:after:{name}", name)
    with redis.Redis(*promoted.address) as master:
        found = master.mget("cq:test:after:worker", "cq:test:after:producer")
    assert found == [b"worker", b"producer"]
    with redis.Redis(HOST, old) as demoted:
        refused = demoted.info("errorstats").get("errorstat_READONLY", {}).get("count", 0)
    assert refused == 2  # each client was answered READONLY once, and went on
    worker.close()
    producer.close()


def lagging(manager: Any, stale: tuple[str, int]) -> None:
    """The sentinels' first answer names `stale`; the next ones are theirs."""
    real = manager.discover_master
    answers = iter([stale])
    manager.discover_master = lambda name: next(answers, None) or real(name)


def test_the_primary_killed_mid_batch_loses_no_session(
    sentinel_fleet: tuple[Fleet, SentinelRedis],
) -> None:
    fleet, sentinels = sentinel_fleet
    for queue in ("llm", "tools", "control"):
        fleet.start_worker(queue)
    fleet.wait_served(("llm", "tools", "control"))
    client = Client(fleet.redis_url, config=fleet.config())
    objects: list[dict[str, Any]] = weather_objects(f"fo-{uuid.uuid4().hex[:6]}", SESSIONS, 300)
    ids = [o["id"] for o in objects]
    sub = client.enqueue(load_spec_from_objects(objects))
    with redis.Redis(HOST, sentinels.master_port()) as master:  # it returned once a replica
        assert master.info("commandstats")["cmdstat_wait"]["calls"] == 1  # held the batch
    assert wait_records(client, ids, 5, time.monotonic() + 60), "the batch did not start"
    old = sentinels.kill_master()
    promoted = sentinels.wait_promoted(old)
    # read, never waited for: no producer nudges, the fleet finishes what it acknowledged
    ended = wait_records(client, ids, SESSIONS, promoted.at + 120)
    records = [client.record(i) for i in ids]
    missing = [i for i, r in zip(ids, records, strict=True) if r is None]
    assert ended and not missing, f"not ended within 120 s of the promotion: {missing[:5]}"
    answers = expected(objects)
    wrong = {
        r["id"]: r.get("body")
        for r in records
        if r is not None
        and (
            r["status"] != "ok" or r["body"]["choices"][0]["message"]["content"] != answers[r["id"]]
        )
    }
    assert not wrong, wrong
    assert client.redis.connection_pool.get_master_address() == promoted.address
    retired = client.stored_records(sub.order)  # each ended: retired, its meta in its record
    assert all(s is not None and s.meta.get("state") == "done" for s in retired)
    client.close()
