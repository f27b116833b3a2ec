"""`cchatq view` over a live fleet (Redis database 11): a small batch with a program run that
waits on its user stream, seen running (live rows, its frames), then finished (counts, rate,
the session's thread and timeline, its trace as JSONL, its Flower link). Every wait is on a
state the viewer shows, bounded."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from starlette.testclient import TestClient

from fixtures.demo_scenarios import KINDS
from producer.client import Client
from producer.fleet import Fleet
from producer.viewer.app import create_app
from producer.viewer.fleet_source import FleetSource
from schemas.fleet_config import FleetConfig
from tests.conftest import Running, _workers
from tests.test_pipeline import submit_specs, wait_for

pytestmark = pytest.mark.fleet
REDIS_DB = 11


def q(value: str) -> str:
    return quote(value, safe="")


@pytest.fixture(scope="module")
def fleet11(base_fleet: Fleet) -> Iterator[Running]:
    yield from _workers(base_fleet, db=REDIS_DB)


@pytest.fixture()
def http(fleet11: Running) -> Iterator[TestClient]:
    source = FleetSource(Client(fleet11.redis_url, config=FleetConfig()), fleet11.redis_url)
    with TestClient(create_app(source), base_url="http://127.0.0.1") as client:
        yield client


def _run(http: TestClient, key: str) -> dict[str, Any]:
    return next(r for r in http.get("/api/runs").json()["runs"] if r["key"] == key)


def test_a_batch_seen_running_then_finished(
    fleet11: Running, http: TestClient, tmp_path: Path, fresh_id: str
) -> None:
    specs = []
    for k in range(3):
        spec, _ = KINDS["two_rounds"](k)
        specs.append({**spec, "id": f"{fresh_id}/two/{k}"})
    failing, _ = KINDS["provider_error"](0)
    specs.append({**failing, "id": f"{fresh_id}/bad"})
    echo = f"{fresh_id}/echo"  # runs until its user closes its stream
    specs.append({"id": echo, "program": {"module": "prog_user_stream_echo.wasm"}})
    sub = submit_specs(fleet11.client, specs, tmp_path)

    # running: the four sessions end, the program waits on its user
    def only_the_program_runs() -> bool:
        batch = http.get(f"/api/batch/{sub.batch}").json()
        return batch["run"]["done"] == 4 and batch["run"]["running"] == 1

    wait_for(only_the_program_runs, timeout_s=90)
    batch_row = _run(http, sub.batch)
    assert batch_row["status"] == "running" and batch_row["failures"] == {"provider_error": 1}
    assert batch_row["rate"] is not None and batch_row["rate"] > 0
    assert _run(http, echo)["kind"] == "program" and _run(http, echo)["status"] == "running"
    runs_page = http.get("/").text
    assert f'data-batch="{sub.batch}"' in runs_page and 'data-live="true"' in runs_page
    assert f'data-kind="program" data-run="{echo}"' in runs_page
    program = http.get(f"/api/session/{q(echo)}").json()
    assert program["live"] is True and program["status"] == "running"

    stream = fleet11.client.stream(echo)
    stream.send("hello viewer")

    def echoed() -> bool:
        frames = http.get(f"/api/session/{q(echo)}").json()["program"]["frames"]
        return any(f["direction"] == "out" and f["text"] == "hello viewer" for f in frames)

    wait_for(echoed, timeout_s=60)
    assert "hello viewer" in http.get(f"/session/{q(echo)}").text
    stream.close()

    wait_for(lambda: _run(http, sub.batch)["status"] == "done", timeout_s=90)
    done = _run(http, sub.batch)
    assert (done["done"], done["failed"], done["queued"], done["running"]) == (5, 1, 0, 0)
    assert 'data-live="false"' in http.get("/?fragment=runs").text  # nothing runs now

    batch = http.get(f"/api/batch/{sub.batch}").json()
    statuses = {r["spec_id"]: (r["status"], r["code"]) for r in batch["rows"]}
    assert statuses[f"{fresh_id}/bad"] == ("error", "provider_error")
    assert statuses[echo] == ("ok", None)
    two = next(r for r in batch["rows"] if r["spec_id"] == f"{fresh_id}/two/0")
    assert (two["rounds"], two["tools"], two["tokens"] > 0) == (3, ["calculate"], True)
    page = http.get(f"/batch/{sub.batch}").text
    assert page.count("<tr data-session=") == 5

    session_id = f"{fresh_id}/two/0"
    view = http.get(f"/api/session/{q(session_id)}").json()
    assert view["status"] == "ok" and view["live"] is False
    kinds = [s["kind"] for s in view["timeline"]]
    assert kinds.count("round") == 3 and kinds.count("tool") == 2 and kinds[-1] == "finish"
    assert "queue_wait" in kinds
    calls = [c for m in view["messages"] for c in m["tool_calls"]]
    assert [c["name"] for c in calls] == ["calculate", "calculate"] and all(c["ok"] for c in calls)
    html = http.get(f"/session/{q(session_id)}").text
    assert 'id="flower-link"' in html and "kwargs%3Asession%3D" in html
    link = f'id="trace-link" href="/api/session/{q(session_id)}/trace?batch={sub.batch}"'
    assert link in html
    trace = http.get(f"/api/session/{q(session_id)}/trace")
    events = [json.loads(line) for line in trace.text.splitlines()]
    assert events[0]["event"] == "session.started" and events[-1]["event"] == "session.finished"

    program = http.get(f"/api/session/{q(echo)}").json()
    assert program["status"] == "ok" and program["program"]["exit_code"] == 0
    assert "session closed" in program["program"]["stdout"]
    assert http.get(f"/session/{q(fresh_id + '/nope')}").status_code == 404
