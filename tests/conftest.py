"""Shared test infrastructure: a private Redis, the replay server and real Celery workers,
all subprocesses started here and stopped by pid. Nothing depends on leftover state: the
Redis is our own, on a free port, and every test uses fresh session ids."""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests

from producer.client import Client
from producer.fleet import Fleet, replay_backends
from producer.local_cluster import LocalCluster
from schemas.task_names import ALL_QUEUES

ROOT = Path(__file__).resolve().parent.parent
GUESTS = ROOT / "fixtures" / "guests"
SLOW_LATENCY_MS = 200


@dataclass
class Running:
    fleet: Fleet
    redis_url: str
    client: Client

    def replay_stats(self, url: str | None = None) -> dict[str, int]:
        base = (url or self.fleet.replay_url).removesuffix("/v1")
        return dict(requests.get(base + "/stats", timeout=5).json())

    def slow_replay_reset(self) -> None:
        requests.post(self.fleet.env["CCHATQ_SLOW_URL"].removesuffix("/v1") + "/reset", timeout=5)


@pytest.fixture(scope="session")
def base_fleet(request: pytest.FixtureRequest) -> Iterator[Fleet]:
    """One private Redis and one replay server for the whole run. Its folder (every fleet's
    logs) is removed at the end, but kept when a test failed or CCHATQ_KEEP_FLEET_DIR=1."""
    fleet = Fleet()
    slow = Fleet(workdir=fleet.workdir / "slow")
    slow.workdir.mkdir()
    try:
        fleet.ensure_redis(private=True)
        fleet.start_replay()
        # a backend named `slow`: the replay server with 200 ms per completion
        slow_url = slow.start_replay(latency_ms=SLOW_LATENCY_MS)
        backends = {**replay_backends(fleet.replay_url), "slow": {"base_url": slow_url}}
        fleet.env["CCHATQ_BACKENDS"] = json.dumps({"backends": backends})
        fleet.env["CCHATQ_SLOW_URL"] = slow_url
        yield fleet
    finally:
        slow.stop()
        fleet.keep = request.session.testsfailed > 0
        fleet.stop()
        if fleet.kept:
            print(f"\nfleet logs kept in {fleet.workdir}", file=sys.__stderr__)


def _workers(
    base: Fleet,
    db: int,
    extra_env: dict[str, str] | None = None,
    config: dict[str, Any] | None = None,
    queues: Sequence[str] = ALL_QUEUES,
    env_of: Mapping[str, dict[str, str]] | None = None,
) -> Generator[Running, None, None]:
    """Workers for `queues` on Redis database `db` of the base fleet, its Redis flushed first.
    `config`: the configuration the workers and the client read, beside the base fleet's
    replay backends (which it may add to, under `backends`). `env_of`: more environment for
    the worker of one queue (beside `extra_env`, which all get)."""
    url = base.redis_url.rsplit("/", 1)[0] + f"/{db}"
    env = dict(base.env)
    if config is not None:
        backends = json.loads(base.env["CCHATQ_BACKENDS"])["backends"]
        merged = {**config, "backends": {**backends, **config.get("backends", {})}}
        env["CCHATQ_BACKENDS"] = json.dumps(merged)
    fleet = Fleet(redis_url=url, replay_url=base.replay_url, workdir=base.workdir / f"db{db}",
                  env=env)  # fmt: skip
    fleet.workdir.mkdir(exist_ok=True)
    client = Client(url, config=fleet.config())
    client.redis.flushdb()
    try:
        for queue in queues:
            fleet.start_worker(
                queue, extra_env={**(extra_env or {}), **(env_of or {}).get(queue, {})}
            )
        yield Running(fleet=fleet, redis_url=url, client=client)
    finally:
        fleet.stop()
        client.close()


@pytest.fixture(scope="session")
def state_cluster(base_fleet: Fleet) -> Iterator[str]:
    """A 3-master Redis Cluster of our own for the whole run: its URL."""
    cluster = LocalCluster(masters=3, fleet=base_fleet)
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def running(base_fleet: Fleet) -> Iterator[Running]:
    """Workers for llm, tools and control on Redis database 0."""
    yield from _workers(base_fleet, db=0)


@pytest.fixture()
def fresh_id() -> str:
    return uuid.uuid4().hex[:10]
