"""A session ends once, on a real fleet: `cchatq cancel` while its round's model call is in
flight gives one session.finished (in the session's trace stream and the fleet's), after the
round's own events, counted once by the metrics exporter, and the record's usage holds the
tokens of the call that completed. Redis database 9."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from prometheus_client import CollectorRegistry

from producer.fleet import Fleet
from producer.metrics import TraceCounters
from schemas import keys
from tests.conftest import Running, _workers
from tests.test_pipeline import submit_specs, wait_for

pytestmark = pytest.mark.fleet

REDIS_DB = 9
CALL_LATENCY_MS = 3000  # long enough that the cancel lands while the call is in flight


@pytest.fixture(scope="module")
def fleet9(base_fleet: Fleet) -> Iterator[Running]:
    yield from _workers(base_fleet, db=REDIS_DB)


def stream_events(client: redis.Redis, stream: str) -> list[dict[str, Any]]:
    """Every event of a trace stream, in the order its entries were appended."""
    entries: Any = client.xrange(stream)
    return [e for _, fields in entries for e in keys.trace_events(fields)]


def cli_trace(running: Running, spec_id: str, *flags: str) -> list[dict[str, Any]]:
    """`cchatq trace ID` as a user runs it, against this fleet's Redis."""
    done = subprocess.run(
        [sys.executable, "-m", "producer.cli", "trace", spec_id, *flags],
        env={**running.fleet.env, "REDIS_URL": running.redis_url},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


def _retired(client: Any, sk: str) -> bool:
    stored = client.stored_records([sk])[0]
    return stored is not None and stored.retired


def test_a_cancel_during_a_model_call_ends_the_session_once_with_the_calls_usage(
    fleet9: Running, tmp_path: Path, fresh_id: str
) -> None:
    client = fleet9.client
    spec: dict[str, Any] = {
        "id": f"{fresh_id}/cancel-mid-call",
        "model": "replay/slow",
        "messages": [{"role": "user", "content": f"wait [[latency_ms:{CALL_LATENCY_MS}]]"}],
        "flags": {"metrics": True},
    }
    sub = submit_specs(client, [spec], tmp_path)
    sk = sub.order[0]
    # the round's step holds its lease while its model call is in flight
    wait_for(lambda: client.redis.hget(keys.meta(sk), "state") == b"round 0")
    wait_for(lambda: (client.redis.get(keys.step_state(keys.round_step(sk, 0))) or b"") != b"")
    assert not client.redis.exists(keys.model_out(sk, 0))  # not answered yet
    assert client.cancel(spec["id"])
    record = dict(client.wait(sub, timeout_s=30))[sk]

    assert record["body"]["error"]["code"] == "cancelled"
    # the session retires as it ends: its events folded into its record, and a step that
    # comes after (the finish step's message) adds none
    wait_for(lambda: _retired(client, sk))
    mine = list(client.run_trace(sk))
    called = [e for e in mine if e["event"] == "model.call.finished"]  # the call that completed
    assert len(called) == 1 and called[0]["tokens_in"] + called[0]["tokens_out"] > 0
    usage = record["metrics"]["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (
        called[0]["tokens_in"], called[0]["tokens_out"],
    )  # fmt: skip
    finished = [e for e in mine if e["event"] == "session.finished"]
    assert len(finished) == 1, mine
    assert finished[0]["error"] == "cancelled"
    assert mine[-1]["event"] == "session.finished"  # the round's events come before it
    fleet_events = [
        e for e in stream_events(client.redis, keys.TRACE) if e["session"] == spec["id"]
    ]
    assert [e["event"] for e in fleet_events].count("session.finished") == 1

    counters = TraceCounters(CollectorRegistry())
    for event in fleet_events:
        counters.count(event)
    assert counters.sessions.labels("cancelled")._value.get() == 1

    printed = cli_trace(fleet9, spec["id"])
    assert [e["ts_ms"] for e in printed] == sorted(e["ts_ms"] for e in printed)
    assert [e["event"] for e in printed].count("session.finished") == 1
    assert printed[-1]["event"] == "session.finished"
    followed = cli_trace(fleet9, spec["id"], "--follow")
    assert followed == printed
