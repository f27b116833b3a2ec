"""One llm worker far above redis-py's default pool (100 connections): at --concurrency 300
every session of a batch whose model calls overlap ends ok, with no pool exhaustion."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fixtures.replay import ReplayServer
from producer.client import Client
from producer.fleet import Fleet, replay_backends
from tests.conftest import Running
from tests.test_pipeline import run_specs

pytestmark = pytest.mark.fleet

LLM_CONCURRENCY = 300
SESSIONS = 400
LATENCY_MS = 3000  # long enough that the worker's slots fill before the first calls return


@pytest.fixture()
def wide(base_fleet: Fleet) -> Iterator[tuple[Running, ReplayServer]]:
    """An llm worker at LLM_CONCURRENCY, and a replay server of this test's own (backend
    `wide`), so its in-flight peak is this batch's."""
    replay = ReplayServer().start()
    backends = {**replay_backends(base_fleet.replay_url), "wide": {"base_url": replay.url}}
    url = base_fleet.redis_url.rsplit("/", 1)[0] + "/6"
    fleet = Fleet(
        redis_url=url,
        replay_url=base_fleet.replay_url,
        workdir=base_fleet.workdir / "db6",
        env={**base_fleet.env, "CCHATQ_BACKENDS": json.dumps({"backends": backends})},
    )
    fleet.workdir.mkdir(exist_ok=True)
    client = Client(url)
    client.redis.flushdb()
    try:
        fleet.start_worker("llm", concurrency=LLM_CONCURRENCY)
        for queue in ("tools", "control"):
            fleet.start_worker(queue)
        yield Running(fleet=fleet, redis_url=url, client=client), replay
    finally:
        fleet.stop()
        client.close()
        replay.stop()


def test_an_llm_worker_at_concurrency_300_finishes_every_session(
    wide: tuple[Running, ReplayServer], tmp_path: Path
) -> None:
    running, replay = wide
    run = uuid.uuid4().hex[:8]
    specs: list[dict[str, Any]] = [
        {
            "id": f"{run}/wide/{i}",
            "provider": "wide",
            "model": "replay/plain",
            "messages": [{"role": "user", "content": f"hello {i} [[latency_ms:{LATENCY_MS}]]"}],
        }
        for i in range(SESSIONS)
    ]
    records = run_specs(running.client, specs, tmp_path, timeout_s=300)
    failed = {sid: r["body"] for sid, r in records.items() if r["status"] != "ok"}
    assert failed == {}
    assert len(records) == SESSIONS
    # the batch did put more calls in flight at once than the default pool has connections
    assert replay.stats()["max_in_flight"] > 100
