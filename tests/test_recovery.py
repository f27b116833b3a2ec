"""At-least-once delivery: a tools worker SIGKILLed mid-batch loses no session, and no tool
message is duplicated. Runs on its own Redis database; the killed worker's unacknowledged
tasks come back once its consumer has stopped beating for a few seconds (edges/broker.py)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fixtures.demo_scenarios import CITIES, WEATHER, weather_json
from producer.client import Client
from producer.fleet import Fleet
from producer.specfile import load_spec_file
from schemas import fleet_keys, keys
from tests.conftest import GUESTS, Running, _workers
from tests.test_pipeline import assert_tool_messages_paired, submit_specs
from worker.edges.broker_consumers import taken_messages

pytestmark = pytest.mark.fleet

CONSUMER_DEAD_AFTER_S = 5
SPIN = {"module": "spin.wasm", "export": "spin", "name": "spin", "parameters": {"type": "object"}}


@pytest.fixture()
def crashable(base_fleet: Fleet) -> Iterator[Running]:
    yield from _workers(
        base_fleet, db=3, extra_env={"CCHATQ_CONSUMER_DEAD_AFTER_S": str(CONSUMER_DEAD_AFTER_S)}
    )


def test_tools_worker_sigkilled_mid_batch_loses_nothing(
    crashable: Running, tmp_path: Path, fresh_id: str
) -> None:
    specs: list[dict[str, Any]] = []
    for n in range(30):
        cities = [CITIES[(n + j) % len(CITIES)] for j in range(3)]
        specs.append({
            "id": f"{fresh_id}/par/{n}",
            "model": "replay/parallel",
            "messages": [{"role": "user", "content": f"Weather in {', '.join(cities)}?"}],
            "tools": [dict(WEATHER)],
        })  # fmt: skip
    for n in range(10):
        # slow tool calls keep the tools worker busy, so the kill lands mid-execution
        specs.append({
            "id": f"{fresh_id}/spin/{n}",
            "model": "replay/call",
            "messages": [{"role": "user", "content": "[[call:spin {}]]"}],
            "tools": [dict(SPIN)],
            "limits": {"tool_timeout_ms": 400},
        })  # fmt: skip
    sub = submit_specs(crashable.client, specs, tmp_path)
    tools_worker = next(
        p for name, p in crashable.fleet.workers.items() if name.startswith("tools")
    )

    records = {}
    waiter = crashable.client.wait(sub, timeout_s=90)
    for _, record in waiter:
        records[record["id"]] = record
        if len(records) == 3:
            break
    busy = len(taken_messages(crashable.client.redis))
    crashable.fleet.kill(tools_worker)  # SIGKILL to the worker and its pool processes
    time.sleep(0.5)
    crashable.fleet.start_worker("tools")
    try:
        for _, record in waiter:
            records[record["id"]] = record
    except TimeoutError:
        pytest.fail(diagnose(crashable, [sk for sk in sub.order if sub.ids[sk] not in records]))

    assert busy > 0, "the kill did not land mid-batch"
    assert len(records) == len(specs)
    for n in range(30):
        record = records[f"{fresh_id}/par/{n}"]
        cities = [CITIES[(n + j) % len(CITIES)] for j in range(3)]
        assert record["status"] == "ok"
        assert record["body"]["choices"][0]["message"]["content"] == " | ".join(
            weather_json(c) for c in cities
        )
        assert record["metrics"]["tool_calls"] == 3
    for n in range(10):
        record = records[f"{fresh_id}/spin/{n}"]
        assert record["status"] == "ok"
        assert "tool timed out after 400 ms" in record["body"]["choices"][0]["message"]["content"]
    for record in records.values():
        assert_tool_messages_paired(record)


def diagnose(running: Running, stuck: list[str]) -> str:
    """What Redis holds for sessions that never finished (a failure message, not a check)."""
    r = running.client.redis
    lines = [f"{len(stuck)} sessions stuck; unacked={len(taken_messages(r))}",
             f"queues={ {q: r.llen(q) for q in ('llm', 'tools', 'control')} }"]  # fmt: skip
    for sk in stuck:
        found = sorted(k.decode() for k in r.scan_iter(f"cq:*{sk}*", count=1000))
        lines.append(f"{sk}: {r.hgetall(keys.meta(sk))} {found}")
        lines.extend(
            f"  {k} = {r.get(k) if r.type(k) == b'string' else r.type(k)}"
            for k in found
            if ":out:" not in k
        )
    lines.append(f"unacked: {[v[:160] for v in taken_messages(r)]}")
    for consumer in sorted(c.decode() for c in r.smembers(fleet_keys.BROKER_CONSUMERS)):
        held = r.llen(fleet_keys.broker_taken(consumer)) + r.hlen(
            fleet_keys.broker_unacked(consumer)
        )
        beat = r.get(fleet_keys.broker_alive(consumer))  # who holds what, and who still beats
        lines.append(f"consumer {consumer}: holds {held}, beats {beat!r}")
    for name, proc in running.fleet.workers.items():  # which pid is which, and what it said
        log = running.fleet.log_of(name)
        said = log.read_text(errors="replace").splitlines() if log.exists() else []
        tail = [line for line in said if line.startswith("[")][-12:]  # records, not the banner
        lines.append(f"worker {name} pid {proc.pid} exit {proc.poll()}:")
        lines.extend(f"  | {line[:240]}" for line in tail)
    return "\n".join(lines)


def test_a_lost_message_is_recovered_by_the_waiting_producer(
    running: Running, tmp_path: Path, fresh_id: str
) -> None:
    """The start message goes to a broker no worker reads (a message the broker lost): the
    session's state is in Redis, so a nudge publishes its next step again and it finishes."""
    lost = Client(running.redis_url)
    lost.celery.conf.broker_url = running.redis_url.rsplit("/", 1)[0] + "/9"  # a black hole
    spec: dict[str, Any] = {
        "id": f"{fresh_id}/lost",
        "model": "replay/weather",
        "messages": [{"role": "user", "content": "Weather in Lima?"}],
        "tools": [dict(WEATHER)],
    }
    path = tmp_path / "lost.jsonl"
    path.write_text(
        json.dumps({**spec, "tools": [{**WEATHER, "module": str(GUESTS / "weather.wasm")}]}) + "\n"
    )
    sub = lost.enqueue([s.spec for s in load_spec_file(path)])
    lost.close()
    (record,) = dict(running.client.wait(sub, timeout_s=30, stall_s=1.0)).values()
    assert record["status"] == "ok"
    assert (
        record["body"]["choices"][0]["message"]["content"]
        == f"Weather report: {weather_json('Lima')}"
    )


def test_a_step_longer_than_the_dead_after_time_runs_once_while_its_worker_lives(
    crashable: Running, tmp_path: Path, fresh_id: str
) -> None:
    """kombu handed a message out again once it was older than the visibility timeout, worker
    alive or not; a beating consumer keeps what it holds however long the step takes."""
    spec: dict[str, Any] = {
        "id": f"{fresh_id}/long",
        "model": "replay/call",
        "messages": [{"role": "user", "content": "[[call:spin {}]]"}],
        "tools": [dict(SPIN)],
        "limits": {"tool_timeout_ms": (CONSUMER_DEAD_AFTER_S + 2) * 1000},
    }
    sub = submit_specs(crashable.client, [spec], tmp_path)
    (record,) = dict(crashable.client.wait(sub, timeout_s=60)).values()
    assert record["status"] == "ok"
    sk = str(crashable.client.session_key(f"{fresh_id}/long"))
    ran = [e for e in crashable.client.run_trace(sk) if e.get("kind") == "tool"]
    assert [e["delivery"] for e in ran] == [1]  # one counted try (a step's last event says)


def test_an_llm_worker_killed_during_a_model_call_is_taken_over_quickly(
    crashable: Running, tmp_path: Path, fresh_id: str
) -> None:
    """Issue 10: the killed worker's round step is leased for 15 s at most (its lease is short
    and was renewed only while it lived), not for the model's 120 s timeout; its message comes
    back once its consumer stops beating (5 s here). The session finishes ok within 30 s of the
    kill, and the round it was in is not counted as a failed try."""
    spec: dict[str, Any] = {
        "id": f"{fresh_id}/llm-kill",
        "model": "replay/plain",
        "messages": [{"role": "user", "content": f"Hello {fresh_id} [[latency_ms:3000]]"}],
    }
    sub = submit_specs(crashable.client, [spec], tmp_path)
    sk = sub.order[0]
    step = keys.round_step(sk, 0)

    def leased() -> bool:
        state = crashable.client.redis.get(keys.step_state(step))
        return state is not None and state.startswith(b"lease")

    deadline = time.monotonic() + 30
    while not leased():  # the model call is in flight
        assert time.monotonic() < deadline, "the round never started"
        time.sleep(0.02)
    llm = next(p for name, p in crashable.fleet.workers.items() if name.startswith("llm"))
    crashable.fleet.kill(llm)
    crashable.fleet.start_worker("llm")
    try:
        (record,) = dict(crashable.client.wait(sub, timeout_s=30)).values()
    except TimeoutError:
        pytest.fail(diagnose(crashable, [sk]))
    assert record["status"] == "ok"
    assert record["body"]["choices"][0]["message"]["content"] == f"Echo: Hello {fresh_id}"
    ends = ("model.call.finished", "session.finished")  # a step's last event says its try
    ran = [e for e in crashable.client.run_trace(sk) if e["event"] in ends and "delivery" in e]
    assert [e["delivery"] for e in ran] == [2]  # the killed try, then this one


@pytest.fixture()
def reconciled(base_fleet: Fleet) -> Iterator[Running]:
    """Workers whose reconciler looks every second for sessions quiet for 2 s."""
    env = {"CCHATQ_RECONCILE_EVERY_S": "1", "CCHATQ_STALL_AFTER_S": "2"}
    yield from _workers(base_fleet, db=4, extra_env=env)


def test_a_no_wait_batch_with_a_lost_message_finishes_with_no_producer(
    reconciled: Running, tmp_path: Path, fresh_id: str
) -> None:
    """Issue 10: the start message goes to a broker no worker reads, and nobody waits (a
    `--no-wait` submit, a producer that died): the fleet's reconciler finds the session quiet
    and publishes its next step from stored state."""
    lost = Client(reconciled.redis_url)
    lost.celery.conf.broker_url = reconciled.redis_url.rsplit("/", 1)[0] + "/9"  # a black hole
    specs: list[dict[str, Any]] = [
        {
            "id": f"{fresh_id}/nowait/{n}",
            "model": "replay/weather",
            "messages": [{"role": "user", "content": f"Weather in {CITIES[n]}?"}],
            "tools": [{**WEATHER, "module": str(GUESTS / "weather.wasm")}],
        }
        for n in range(3)
    ]
    path = tmp_path / "nowait.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in specs))
    lost.enqueue([s.spec for s in load_spec_file(path)])  # and no wait
    lost.close()
    client = reconciled.client
    deadline = time.monotonic() + 40
    while any(client.record(s["id"]) is None for s in specs):  # reading results, not waiting
        unfinished = [s["id"] for s in specs if client.record(s["id"]) is None]
        assert time.monotonic() < deadline, diagnose(
            reconciled, [str(client.session_key(i)) for i in unfinished]
        )
        time.sleep(0.1)
    for n, s in enumerate(specs):
        record = client.record(s["id"])
        assert record is not None and record["status"] == "ok"
        assert record["body"]["choices"][0]["message"]["content"] == (
            f"Weather report: {weather_json(CITIES[n])}"
        )
    assert client.redis.zscore(keys.ACTIVE, str(client.session_key(specs[0]["id"]))) is None


def test_a_resubmission_after_data_loss_never_trusts_markers_of_the_earlier_run(
    running: Running, tmp_path: Path, fresh_id: str
) -> None:
    """Issue 10: Redis lost the session (its claim, spec and result) while steps of the first
    run were still in flight; those steps then wrote their outputs and published markers.
    The resubmitted run is a new generation (a new session key), so it runs every step
    itself instead of finding round 0 "published" and waiting forever."""
    spec: dict[str, Any] = {
        "id": f"{fresh_id}/lost",
        "model": "replay/weather",
        "messages": [{"role": "user", "content": "Weather in Oslo?"}],
        "tools": [dict(WEATHER)],
    }
    client = running.client
    first = submit_specs(client, [dict(spec)], tmp_path)
    assert dict(client.wait(first, timeout_s=30))[first.order[0]]["status"] == "ok"
    old = first.order[0]
    lost = [
        keys.id_claim(keys.DEFAULT_NAMESPACE, spec["id"]),
        keys.spec(old),
        keys.meta(old),
        keys.response(old),
    ]
    # the first run retired as it ended (its markers and replies gone with it): a step of it
    # still running would write keys of its own generation, which the next run never reads
    assert not client.redis.exists(keys.step_state(keys.round_step(old, 0)))
    client.redis.delete(*lost, keys.record(old))
    again = submit_specs(client, [dict(spec)], tmp_path, name="again.jsonl")
    assert again.new == {again.order[0]} and again.order[0] != old
    assert again.order[0][:16] == old[:16]  # the same spec id's digest, a new generation
    record = dict(client.wait(again, timeout_s=30))[again.order[0]]
    assert record["status"] == "ok"
    assert record["body"]["choices"][0]["message"]["content"] == (
        f"Weather report: {weather_json('Oslo')}"
    )
    assert client.session_key(spec["id"]) == again.order[0]
