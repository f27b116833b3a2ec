"""Issue 10, point 5: the metrics exporter's values move as a small batch runs (a real fleet,
the exporter in process, scraped over HTTP). The events behind the rate-limit, reconciler and
step metrics are made on the twins, and counted by the exporter's counters."""

from __future__ import annotations

import json
import re
import socket
import uuid
from pathlib import Path
from typing import Any

import pytest
import requests
from prometheus_client import CollectorRegistry

from fixtures.demo_scenarios import WEATHER, background_wait
from producer import metrics
from producer.metrics import Exporter, TraceCounters
from schemas import keys
from schemas.step_kinds import step_kind
from tests.conftest import Running
from tests.test_engine import WEATHER_FN
from tests.test_pipeline import submit_specs, wait_for
from tests.test_steps import (
    SK,
    WEATHER_SCRIPT,
    ReconcileTwin,
    pipeline,
    reply,
    spec,
    submit,
)
from worker.session.reconciler import Reconciler
from worker.session.twins.models import OpenRateControl

KINDS = ("start", "round", "tool", "background", "finish", "program")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def sample(text: str, name: str, **labels: str) -> float:
    """The value of one sample of the exposition `text` (0 when it is not there yet)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        metric, _, value = line.rpartition(" ")
        if metric == (f"{name}{{{want}}}" if want else name):
            return float(value)
    return 0.0


def counted(*events: dict[str, Any]) -> CollectorRegistry:
    registry = CollectorRegistry()
    counters = TraceCounters(registry)
    for made in events:
        counters.count(made)
    return registry


def test_a_rate_limited_round_is_traced_and_counted() -> None:
    p = pipeline([reply("hello")])
    p.runner.models.control = OpenRateControl(wait_s=[0.5, 0.25])
    submit(p, spec())
    p.drain()
    events = [e.to_json() for e in p.store.traces[SK]]
    waits = [e for e in events if e["event"] == "rate_limit.waited"]
    assert [(e["backend"], e["wait_ms"], e["kind"], e["session"]) for e in waits] == [
        ("replay", 500, "round", "t/1"),
        ("replay", 250, "round", "t/1"),
    ]
    # the twin's queue passes no arrival: the delivery alone says how the step ran
    expected = {"event", "session", "ts_ms", "kind", "backend", "wait_ms", "reason", "delivery"}
    assert all(set(e) == expected for e in waits)
    assert {e["reason"] for e in waits} == {"window"}
    # what the put-off tries had made is gone with them: one start of the model call
    assert [e["event"] for e in events].count("model.call.started") == 1
    registry = counted(*events)
    assert registry.get_sample_value("cchatq_rate_limit_waits_total", {"backend": "replay"}) == 2
    seconds = registry.get_sample_value(
        "cchatq_rate_limit_wait_seconds_total", {"backend": "replay"}
    )
    assert seconds == 0.75


def test_reconciler_passes_are_fleet_events_and_counted() -> None:
    p = pipeline(WEATHER_SCRIPT)
    submit(p, spec(WEATHER_FN))
    p.queue.run_next(p.runner)  # round 0 ran and published its tool step ...
    p.queue.pending.clear()  # ... which the broker lost
    reconciler = Reconciler(p.runner, ReconcileTwin(p.store, [SK, "gone"]))
    assert reconciler.turn() == 1  # nudged SK, forgot "gone" (no spec)
    assert reconciler.turn() == 0  # another worker's turn: no pass, no event
    p.drain()
    assert reconciler.turn() == 0  # SK is done; the twin still lists "gone"
    passes = [e.to_json() for e in p.store.traces[""]]  # no session: the fleet's stream only
    assert [(e["event"], e["nudged"], e["forgotten"]) for e in passes] == [
        ("reconciler.pass", 1, 1),
        ("reconciler.pass", 0, 1),
    ]
    assert not any(e.event == "reconciler.pass" for e in p.store.traces[SK])
    registry = counted(*passes)
    actions = {
        action: registry.get_sample_value("cchatq_reconciler_actions_total", {"action": action})
        for action in ("pass", "nudged", "forgotten")
    }
    assert actions == {"pass": 2, "nudged": 1, "forgotten": 2}


def test_each_step_s_kind_and_duration_ride_its_last_event() -> None:
    p = pipeline(WEATHER_SCRIPT)
    submit(p, spec(WEATHER_FN))
    p.drain()
    events = [e.to_json() for e in p.store.traces[SK]]
    timed = [(e["event"], e["kind"]) for e in events if "step_ms" in e]
    assert timed == [
        ("model.call.finished", "round"),  # round 0's last event
        ("tool.call.finished", "tool"),
        ("session.finished", "round"),  # round 1 ended the session in place
    ]
    assert all(isinstance(e["step_ms"], int) and e["step_ms"] >= 0 for e in events if "kind" in e)
    assert "" not in p.store.traces  # no step made a write of its own for its duration
    # a step that made no event (a chunk's start step, here of no session) gets one of its own
    p.runner.start("b2", 0)
    (finished,) = [e.to_json() for e in p.store.traces[""]]
    assert (finished["event"], finished["kind"], finished["session"]) == (
        "step.finished",
        "start",
        "",
    )
    registry = counted(*events, finished)
    for kind, count in (("round", 2), ("tool", 1), ("start", 1)):
        assert registry.get_sample_value("cchatq_step_seconds_count", {"kind": kind}) == count


def test_step_kinds_are_read_from_step_ids() -> None:
    assert [
        step_kind(step)
        for step in (
            keys.start_step("batch.x", 3),
            keys.round_step(SK, 12),
            keys.tool_step(SK, 0, 1),
            keys.background_step(SK, 0, 1),
            keys.finish_step(SK),
            keys.program_step(SK),
            "nonsense",
        )
    ] == ["start", "round", "tool", "background", "finish", "program", "?"]


def test_the_dashboard_queries_only_metrics_the_exporter_has() -> None:
    dashboard = json.loads((Path(metrics.__file__).parent / "grafana_dashboard.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    queried = {
        re.sub(r"_(total|bucket|count|sum)$", "", name)
        for name in re.findall(r"cchatq_\w+", " ".join(exprs))
    }
    families = {family.name for family in counted().collect()}
    gauges = {"cchatq_queue_depth", "cchatq_tasks_unacked", "cchatq_sessions_active"}
    assert queried - families == gauges | {"cchatq_dead_letters"}
    assert {"cchatq_step_seconds", "cchatq_reconciler_actions"} <= queried
    assert {"cchatq_rate_limit_waits", "cchatq_rate_limit_wait_seconds"} <= queried


@pytest.mark.fleet
def test_metrics_move_as_a_batch_runs(running: Running, tmp_path: Path) -> None:
    exporter = Exporter(running.redis_url)
    port = free_port()
    exporter.serve(port, "127.0.0.1")
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        before = requests.get(url, timeout=5).text
        assert "cchatq_queue_depth" in before and "cchatq_sessions_active" in before
        run = uuid.uuid4().hex[:8]
        specs: list[dict[str, Any]] = [
            {
                "id": f"{run}/m/{n}",
                "model": "replay/weather",
                "messages": [{"role": "user", "content": f"Weather in Oslo {n}?"}],
                "tools": [dict(WEATHER)],
            }
            for n in range(4)
        ]
        # every kind of step in one chunk: a background call, a program run, and a session
        # cancelled while its slow first round runs (a finish step ends it)
        specs.append({**background_wait(0)[0], "id": f"{run}/m/bg"})
        specs.append(
            {"id": f"{run}/m/prog", "program": {"module": "prog_chat.wasm", "stdin": "hi\n"}}
        )
        slow = {**specs[0], "id": f"{run}/m/cancel", "tools": [dict(WEATHER)]}
        slow["messages"] = [{"role": "user", "content": "Weather in Oslo? [[latency_ms:2000]]"}]
        specs.append(slow)
        sub = submit_specs(running.client, specs, tmp_path)
        sk = str(running.client.session_key(slow["id"]))
        wait_for(lambda: running.client.redis.hget(keys.meta(sk), "state") == b"round 0")
        assert running.client.cancel(slow["id"])
        records = {r["id"]: r for _, r in running.client.wait(sub, timeout_s=120)}
        assert records.pop(slow["id"])["body"]["error"]["code"] == "cancelled"
        assert all(r["status"] == "ok" for r in records.values()), records

        def scrape() -> str:
            return requests.get(url, timeout=5).text

        def steps(text: str) -> dict[str, float]:
            return {k: sample(text, "cchatq_step_seconds_count", kind=k) for k in KINDS}

        def counted() -> bool:
            text = scrape()
            ran = steps(text)
            return (
                sample(text, "cchatq_sessions_finished_total", outcome="ok") >= 6  # a program's too
                and sample(text, "cchatq_sessions_finished_total", outcome="cancelled") >= 1
                and ran["round"] >= 4 * 2 + 2 + 1 + 1  # the cancelled session's round 0 ran
                and ran["tool"] >= 4 + 1  # the background call's tool step handed it over
                and all(ran[k] >= 1 for k in ("start", "background", "finish", "program"))
            )

        wait_for(counted)  # the exporter follows the trace stream as it is written
        text = scrape()
        calls = sample(text, "cchatq_model_calls_total", backend="replay", outcome="finished")
        assert calls >= 8  # 2 rounds a session
        assert sample(text, "cchatq_tool_calls_total", tool="get_weather", outcome="ok") >= 4
        assert sample(text, "cchatq_tokens_total", backend="replay", direction="out") > 0
        assert sample(text, "cchatq_tool_call_seconds_count", tool="get_weather") >= 4
        assert sample(text, "cchatq_step_seconds_sum", kind="round") > 0
        # the background call napped 300 ms in its step
        assert sample(text, "cchatq_step_seconds_sum", kind="background") >= 0.3

        # a control worker's reconciler passes every 10 s, nudging nothing here
        def passed() -> bool:
            return sample(scrape(), "cchatq_reconciler_actions_total", action="pass") >= 1

        wait_for(passed, timeout_s=25)
        text = scrape()
        assert sample(text, "cchatq_reconciler_actions_total", action="nudged") == 0
        assert sample(text, "cchatq_reconciler_actions_total", action="forgotten") == 0
    finally:
        exporter.close()
