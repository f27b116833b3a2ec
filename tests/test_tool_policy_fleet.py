"""Issue 9's tool policy on a real fleet: Redis, Celery workers, the replay server and the
`nap` WASM tool (fixtures/guests/nap.c) run by wasmtime. The tools worker runs 6 threads, so
that max_parallel, not the worker, is what bounds a session's calls in flight."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fixtures.demo_scenarios import WEATHER, weather_json
from producer.client import Client
from producer.fleet import Fleet
from schemas import keys
from tests.conftest import Running
from tests.test_pipeline import run_specs, submit_specs, wait_for

pytestmark = pytest.mark.fleet

TOOLS_THREADS = 6


@pytest.fixture(scope="module")
def wide_tools(base_fleet: Fleet) -> Iterator[Running]:
    url = base_fleet.redis_url.rsplit("/", 1)[0] + "/7"
    fleet = Fleet(
        redis_url=url,
        replay_url=base_fleet.replay_url,
        workdir=base_fleet.workdir / "db7",
        env=dict(base_fleet.env),
    )
    fleet.workdir.mkdir(exist_ok=True)
    client = Client(url)
    client.redis.flushdb()
    try:
        fleet.start_worker("tools", pool="threads", concurrency=TOOLS_THREADS)
        for queue in ("llm", "control", "background"):
            fleet.start_worker(queue)
        yield Running(fleet=fleet, redis_url=url, client=client)
    finally:
        fleet.stop()
        client.close()


def nap(**policy: Any) -> dict[str, Any]:
    tool: dict[str, Any] = {
        "module": "nap.wasm",
        "export": "nap",
        "function": {"name": "nap", "parameters": {"type": "object"}},
    }
    if policy:
        tool["policy"] = policy
    return tool


def calling(*calls: tuple[str, dict[str, Any]], tools: list[dict[str, Any]], **extra: Any) -> Any:
    markers = " ".join(f"[[call:{name} {json.dumps(args)}]]" for name, args in calls)
    return {
        "id": f"policy/{uuid.uuid4().hex[:10]}",
        "model": "replay/call",
        "messages": [{"role": "user", "content": f"Please run {markers}"}],
        "tools": tools,
        **extra,
    }


def run_one(running: Running, spec: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
    return run_specs(running.client, [spec], tmp_path, timeout_s=90)[spec["id"]]


def envelopes(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The tool messages the model read, in call order, parsed."""
    return [json.loads(m["content"]) for m in record["transcript"] if m["role"] == "tool"]


def test_a_tool_past_its_own_timeout_fails_while_a_slower_allowed_sibling_answers(
    wide_tools: Running, tmp_path: Path
) -> None:
    weather = {**WEATHER, "policy": {"timeout_ms": 5000}}
    nap_long = {**nap(timeout_ms=2000), "function": {"name": "nap_long", "parameters": {}}}
    spec = calling(
        ("nap", {"ms": 3000}),
        ("get_weather", {"city": "Oslo"}),
        ("nap_long", {"ms": 400, "tag": "slow-but-allowed"}),
        tools=[nap(timeout_ms=300), weather, nap_long],
        limits={"tool_timeout_ms": 200},  # the session default: the tools' own timeouts win
    )
    timed_out, city, slow = envelopes(run_one(wide_tools, spec, tmp_path))
    assert (timed_out["ok"], timed_out["error"]["code"]) == (False, "TIMEOUT")
    assert timed_out["error"]["message"] == "tool timed out after 300 ms"
    assert timed_out["metrics"]["latency_ms"] >= 300
    assert city["ok"] and city["data"] == json.loads(weather_json("Oslo"))
    assert slow["ok"] and slow["data"] == {"tag": "slow-but-allowed", "attempt": 0}


def test_a_tool_failing_twice_succeeds_on_its_second_retry(
    wide_tools: Running, tmp_path: Path
) -> None:
    spec = calling(
        ("nap", {"fail_first": 2, "tag": "t"}),
        tools=[nap(max_retries=2, retry_backoff_ms=20)],
    )
    [answer] = envelopes(run_one(wide_tools, spec, tmp_path))
    assert answer["ok"] and answer["data"] == {"tag": "t", "attempt": 2}
    assert answer["metrics"]["retries"] == 2
    one_retry = calling(("nap", {"fail_first": 2}), tools=[nap(max_retries=1)])
    [failed] = envelopes(run_one(wide_tools, one_retry, tmp_path))
    assert failed["error"] == {"code": "RUNTIME_ERROR", "message": "tool rc: -5"}
    assert failed["metrics"]["retries"] == 1


def _most_in_flight(answers: list[dict[str, Any]]) -> int:
    edges = sorted(
        [(a["data"]["start_ms"], 1) for a in answers] + [(a["data"]["end_ms"], -1) for a in answers]
    )  # an end before a start at the same millisecond: back to back is not overlap
    most = now = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most


@pytest.mark.parametrize(("max_parallel", "bound"), [(2, 2), (6, 6)])
def test_max_parallel_bounds_a_sessions_tool_tasks_in_flight(
    wide_tools: Running, tmp_path: Path, max_parallel: int, bound: int
) -> None:
    calls = [("nap", {"ms": 400, "times": 1, "tag": f"c{i}"}) for i in range(6)]
    spec = calling(*calls, tools=[nap()], limits={"max_parallel": max_parallel})
    answers = envelopes(run_one(wide_tools, spec, tmp_path))
    assert [a["data"]["tag"] for a in answers] == [f"c{i}" for i in range(6)]  # call order
    most = _most_in_flight(answers)
    assert most <= bound
    if max_parallel == 6:  # the same worker does run more at once when allowed: the bound is real
        assert most > 2


def test_a_fallback_answers_when_the_primary_traps(wide_tools: Running, tmp_path: Path) -> None:
    boom = {
        "module": "trap.wasm",
        "export": "boom",
        "function": {"name": "boom", "parameters": {"type": "object"}},
        "policy": {"fallback": "nap"},
    }
    spec = calling(("boom", {"tag": "fb"}), tools=[boom, nap()])
    record = run_one(wide_tools, spec, tmp_path)
    [answer] = envelopes(record)
    assert answer == {
        "ok": True,
        "data": {"tag": "fb", "attempt": 0},
        "error": None,
        "metrics": {
            "latency_ms": answer["metrics"]["latency_ms"],
            "retries": 0,
            "fallback": "nap",
        },
    }
    assert isinstance(answer["metrics"]["latency_ms"], int)
    said = record["body"]["choices"][0]["message"]["content"]
    assert said == 'Tool said: {"tag":"fb","attempt":0}'  # the model read the data


def test_a_limit_ends_with_a_final_answer_that_names_the_limit(
    wide_tools: Running, tmp_path: Path
) -> None:
    spec = {
        "id": f"policy/{uuid.uuid4().hex[:10]}",
        "model": "replay/loop",
        "messages": [{"role": "user", "content": "Loop forever"}],
        "tools": [{**WEATHER, "module": "weather.wasm"}],
        "limits": {"max_iterations": 2},
    }
    record = run_one(wide_tools, spec, tmp_path)
    assert record["status"] == "ok"
    body = record["body"]
    assert body["choices"][0]["message"]["content"] == "Final answer after 2 turns"
    assert body["_spear"]["limit"] == {
        "code": "tool_call_limit",
        "message": "exceeded max_iterations",
    }
    skipped = envelopes(record)[-1]
    assert skipped["error"] == {"code": "NOT_RUN", "message": "skipped: exceeded max_iterations"}


def test_a_high_risk_tool_runs_only_with_a_grant(wide_tools: Running, tmp_path: Path) -> None:
    risky = nap(risk_level="high")
    denied = calling(("nap", {"tag": "x"}), tools=[risky])
    [answer] = envelopes(run_one(wide_tools, denied, tmp_path))
    assert answer["error"]["code"] == "PERMISSION_DENIED"
    assert answer["metrics"] == {"latency_ms": 0, "retries": 0}  # it never ran
    granted = calling(("nap", {"tag": "x"}), tools=[risky], permissions={"grant": ["nap"]})
    [ran] = envelopes(run_one(wide_tools, granted, tmp_path))
    assert ran["ok"] and ran["data"] == {"tag": "x", "attempt": 0}


def test_cchatq_trace_lists_a_mixed_sessions_events_in_order_and_no_text(
    wide_tools: Running, tmp_path: Path
) -> None:
    canary = f"canary{uuid.uuid4().hex[:8]}"
    spec = calling(
        ("nap", {"fail_first": 1, "tag": canary}),
        ("get_wether", {"city": canary}),
        tools=[nap(max_retries=1, retry_backoff_ms=0)],
    )
    spec["messages"][0]["content"] += f" {canary}"
    record = run_one(wide_tools, spec, tmp_path)
    assert canary in json.dumps(record)  # the canary did travel: prompt, argument, output
    env = {**os.environ, "REDIS_URL": wide_tools.redis_url}
    traced = subprocess.run(
        [sys.executable, "-m", "producer.cli", "trace", spec["id"]],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert traced.returncode == 0, traced.stderr
    assert canary not in traced.stdout
    events = [json.loads(line) for line in traced.stdout.splitlines()]
    assert [(e["event"], e.get("tool"), e.get("error")) for e in events] == [
        ("session.started", None, None),
        ("model.call.started", None, None),
        ("model.call.finished", None, None),
        ("tool.call.failed", "get_wether", "TOOL_NOT_FOUND"),
        ("tool.call.started", "nap", None),
        ("tool.call.retried", "nap", "RUNTIME_ERROR"),
        ("tool.call.finished", "nap", None),
        ("model.call.started", None, None),
        ("model.call.finished", None, None),
        ("session.finished", None, None),
    ]
    assert all(e["session"] == spec["id"] for e in events)
    fleet = wide_tools.client.redis.xrevrange("cq:trace", count=200)
    fleet_events = [e for _, fields in fleet for e in keys.trace_events(fields)]
    assert canary not in repr(fleet) and len(fleet_events) >= len(events)
    sk = wide_tools.client.session_key(spec["id"])
    assert sk is not None and wide_tools.client.redis.ttl(keys.record(sk)) > 0  # retired with
    assert not wide_tools.client.redis.exists(keys.trace(sk))  # its events
    follow = subprocess.run(
        [sys.executable, "-m", "producer.cli", "trace", spec["id"], "--follow"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert follow.stdout == traced.stdout  # a finished session: --follow returns at its end


def test_a_200_kib_output_reaches_the_model_as_an_excerpt_and_the_store_keeps_it_whole(
    wide_tools: Running, tmp_path: Path
) -> None:
    big = {
        "module": "large_output.wasm",
        "export": "big_output",
        "function": {"name": "big_output", "parameters": {"type": "object"}},
    }
    n = 200 * 1024
    spec = calling(("big_output", {"bytes": n}), tools=[big], limits={"max_tool_output_bytes": n})
    record = run_one(wide_tools, spec, tmp_path)
    [answer] = envelopes(record)
    assert (answer["truncated"], answer["bytes"]) == (True, n)
    assert len(answer["data"].encode()) < 17_000 and "bytes omitted" in answer["data"]
    call_id = answer["ref"]
    env = {**os.environ, "REDIS_URL": wide_tools.redis_url}
    whole = subprocess.run(
        [sys.executable, "-m", "producer.cli", "result", spec["id"], "--tool-output", call_id],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert whole.returncode == 0, whole.stderr
    assert whole.stdout == ("0123456789" * (n // 10 + 1))[:n]
    missing = subprocess.run(
        [sys.executable, "-m", "producer.cli", "result", spec["id"], "--tool-output", "nope"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert missing.returncode == 1 and "no output of call nope" in missing.stderr


def test_a_background_tool_runs_for_seconds_with_progress_while_other_sessions_finish(
    wide_tools: Running, tmp_path: Path
) -> None:
    """Wait mode: the round waits for a 5 s background call without holding a worker slot;
    a session submitted after it, on the same workers, finishes before it."""
    long_call = calling(
        ("nap", {"ms": 5000, "progress": 1, "tag": "bg"}),
        tools=[nap(background=True, timeout_ms=600_000)],
    )
    quick = calling(("nap", {"tag": "quick"}), tools=[nap()])
    client = wide_tools.client
    first = submit_specs(client, [long_call], tmp_path, name="long.jsonl")
    wait_for(lambda: any(e["event"] == "task.progress" for e in client.trace(long_call["id"])))
    second = submit_specs(client, [quick], tmp_path, name="quick.jsonl")
    [(_, quick_record)] = list(client.wait(second, timeout_s=60))
    assert quick_record["status"] == "ok"
    assert (client.status(long_call["id"]) or {}).get("state") != "done"  # still napping
    [(_, record)] = list(client.wait(first, timeout_s=60))
    [answer] = envelopes(record)
    assert answer["ok"] and answer["data"] == {"tag": "bg", "attempt": 0}
    assert answer["metrics"]["latency_ms"] >= 5000
    events = list(client.trace(long_call["id"]))
    names = [e["event"] for e in events]
    assert names.index("task.submitted") < names.index("tool.call.started")
    assert names.index("task.completed") > names.index("tool.call.finished")
    percents = [e["percent"] for e in events if e["event"] == "task.progress"]
    assert percents[-1] == 100 and len(percents) >= 3 and percents == sorted(percents)


def test_an_async_background_task_answers_at_once_and_task_status_delivers_it(
    wide_tools: Running, tmp_path: Path
) -> None:
    """A 5 s async task, polled every ~200 ms: a session submitted after it, on the same
    workers, finishes first."""
    spec = calling(
        ("nap", {"ms": 5000, "progress": 1, "tag": "async"}),
        tools=[nap(background=True, background_mode="async")],
        limits={"max_iterations": 80},
    )
    spec["model"] = "replay/poll"
    spec["messages"][0]["content"] += " [[latency_ms:200]]"
    client = wide_tools.client
    first = submit_specs(client, [spec], tmp_path, name="async.jsonl")
    wait_for(lambda: any(e["event"] == "task.progress" for e in client.trace(spec["id"])))
    quick = calling(("nap", {"tag": "quick"}), tools=[nap()])
    [(_, quick_record)] = list(client.wait(submit_specs(client, [quick], tmp_path), timeout_s=60))
    assert quick_record["status"] == "ok"
    assert (client.status(spec["id"]) or {}).get("state") != "done"
    [(_, record)] = list(client.wait(first, timeout_s=60))
    answers = [e["data"] for e in envelopes(record)]
    assert answers[0] == {"task_id": "task-0-0", "status": "submitted"}
    assert any(a["status"] == "running" and "percent" in a for a in answers[1:-1])
    assert answers[-1] == {
        "task_id": "task-0-0",
        "status": "completed",
        "result": {"tag": "async", "attempt": 0},
        "error": None,
    }
    said = record["body"]["choices"][0]["message"]["content"]
    assert said.startswith("Tool said: ") and '"status":"completed"' in said


def test_cchatq_cancel_stops_a_running_background_call(wide_tools: Running, tmp_path: Path) -> None:
    """A 60 s background call, cancelled once it reports progress: the session ends cancelled
    at once, and the call stops at its next report (well inside wait_for's 20 s)."""
    spec = calling(
        ("nap", {"ms": 60_000, "progress": 1}),
        tools=[nap(background=True, timeout_ms=120_000)],
    )
    client = wide_tools.client
    sub = submit_specs(client, [spec], tmp_path, name="cancel.jsonl")
    wait_for(lambda: any(e["event"] == "task.progress" for e in client.trace(spec["id"])))
    assert client.cancel(spec["id"])
    [(_, record)] = list(client.wait(sub, timeout_s=30))
    assert record["body"]["error"]["code"] == "cancelled"

    # the session retired as it ended: what its call says after that is in the fleet's stream
    def fleet_events() -> list[dict[str, Any]]:
        found = [e for _, f in client.redis.xrange(keys.TRACE) for e in keys.trace_events(f)]
        return [e for e in found if e.get("session") == spec["id"]]

    wait_for(lambda: any(e["event"] == "task.failed" for e in fleet_events()))
    [stopped] = [e for e in fleet_events() if e["event"] == "tool.call.failed"]
    assert stopped["error"] == "NOT_RUN" and stopped["latency_ms"] < 20_000


def test_a_long_output_summed_up_by_a_model(wide_tools: Running, tmp_path: Path) -> None:
    big = {
        "module": "large_output.wasm",
        "export": "big_output",
        "function": {"name": "big_output", "parameters": {"type": "object"}},
    }
    limits = {
        "compress": "summarize",
        "compress_model": "replay/summary",
        "max_tool_output_bytes": 65536,
    }
    spec = calling(("big_output", {"bytes": 40_000}), tools=[big], limits=limits)
    [answer] = envelopes(run_one(wide_tools, spec, tmp_path))
    assert answer["data"] == "Summary of 40000 characters: 01234567890123456789"
    assert (answer["truncated"], answer["summarized"], answer["bytes"]) == (True, True, 40_000)
