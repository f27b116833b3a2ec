"""`cchatq` against a real fleet (Redis DB 7): each worker process counted once per queue it
serves, `cchatq run` warned when no worker takes from the programs queue, and a batch whose
sessions fail with different codes: its status word and times, its results once all ended
(--wait), and `batch retry` choosing by code and skipping a provider's 4xx."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from producer.client import Client
from producer.fleet import Fleet
from producer.fleet_status import read_fleet_status
from producer.metrics import FleetGauges
from schemas.task_names import ALL_QUEUES, QUEUE_PROGRAMS
from tests.conftest import GUESTS, Running

pytestmark = pytest.mark.fleet
REDIS_DB = 7
SERVED = [q for q in ALL_QUEUES if q != QUEUE_PROGRAMS]  # programs: left unserved on purpose
ISO = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")


@pytest.fixture(scope="module")
def fleet7(base_fleet: Fleet) -> Iterator[Running]:
    """One worker for each queue but programs."""
    url = base_fleet.redis_url.rsplit("/", 1)[0] + f"/{REDIS_DB}"
    fleet = Fleet(
        redis_url=url, replay_url=base_fleet.replay_url,
        workdir=base_fleet.workdir / f"db{REDIS_DB}", env=dict(base_fleet.env),
    )  # fmt: skip
    fleet.workdir.mkdir(exist_ok=True)
    client = Client(url, config=fleet.config())
    client.redis.flushdb()
    try:
        for queue in SERVED:
            fleet.start_worker(queue)
        fleet.wait_served(SERVED)
        yield Running(fleet=fleet, redis_url=url, client=client)
    finally:
        fleet.stop()
        client.close()


def cli(running: Running, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "producer.cli", *args]
    env = running.fleet.worker_env()
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)


def test_each_worker_process_is_one_consumer_of_its_queue(fleet7: Running) -> None:
    fleet = read_fleet_status(fleet7.client.redis)
    assert fleet.consumers == len(SERVED)
    assert fleet.consumers_by_queue == {q: int(q in SERVED) for q in ALL_QUEUES}
    gauges = {m.name: m for m in FleetGauges(fleet7.client.redis).collect()}
    assert [s.value for s in gauges["cchatq_consumers"].samples] == [len(SERVED)]
    shown = json.loads(cli(fleet7, "status").stdout)
    assert shown["consumers"] == len(SERVED) and shown["consumers_by_queue"]["llm"] == 1


def test_run_warns_when_no_worker_takes_its_program(fleet7: Running) -> None:
    cmd = [sys.executable, "-m", "producer.cli", "run", str(GUESTS / "prog_chat.wasm"),
           "--model", "replay/plain", "--timeout-ms", "1000"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=fleet7.fleet.worker_env(), stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        first = proc.stderr.readline()
        warning = proc.stderr.readline()  # at once: not after the run's timeout
        assert first.startswith("run run/")
        assert warning == (
            "warning: no worker takes from queue 'programs': its steps wait until one does"
            " (cchatq worker --queues programs)\n"
        )
    finally:
        proc.kill()
        proc.wait(timeout=30)
    run_id = first.split()[1]
    assert cli(fleet7, "cancel", run_id).returncode == 0


def chat(spec_id: str, model: str, text: str = "hi") -> dict[str, Any]:
    return {"id": spec_id, "model": model, "messages": [{"role": "user", "content": text}]}


def test_a_failing_batch_its_status_results_and_retries(fleet7: Running, tmp_path: Path) -> None:
    run = uuid.uuid4().hex[:8]
    specs = [
        chat(f"{run}/ok1", "replay/plain"),
        chat(f"{run}/slow", "replay/plain", "slow [[latency_ms:1500]]"),
        chat(f"{run}/refused", "replay/bad_request"),  # HTTP 400: provider_error
        chat(f"{run}/garbled1", "replay/malformed"),
        chat(f"{run}/garbled2", "replay/malformed"),
    ]
    path = tmp_path / "batch.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in specs))
    submitted = cli(fleet7, "submit", str(path), "--no-wait")
    assert submitted.returncode == 0, submitted.stderr
    assert submitted.stdout.endswith(": 5 sessions enqueued\n")
    batch = submitted.stdout.split(":")[0].removeprefix("batch ")

    out = tmp_path / "all.jsonl"
    waited = cli(
        fleet7, "batch", "results", batch, "--wait", "--timeout-s", "90", "--out", str(out)
    )
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert waited.returncode == 1, waited.stderr  # every session ended, some failed
    assert f"batch {batch}: 5 of 5 results in" in waited.stderr
    codes = {x["id"].split("/")[1]: x["response"].get("error", {}).get("code") for x in lines}
    garbled = codes["garbled1"]
    assert codes == {"ok1": None, "slow": None, "refused": "provider_error",
                     "garbled1": garbled, "garbled2": garbled}  # fmt: skip
    assert garbled not in (None, "provider_error")

    status = json.loads(cli(fleet7, "batch", "status", batch, "--json").stdout)
    assert status["status"] == "completed" and status["states"] == {"done": 5}
    assert status["outcomes"] == {"ok": 2, "provider_error": 1, garbled: 2}
    assert ISO.match(status["submitted_at"]) and ISO.match(status["completed_at"])
    assert status["completed_at"] >= status["submitted_at"]
    shown = cli(fleet7, "batch", "status", batch).stdout.splitlines()
    assert shown[0] == f"batch {batch}: completed"
    assert shown[1].split() == ["sessions:", "5", "sessions", "(5", "done)"]

    unknown = cli(fleet7, "batch", "retry", batch, "--codes", "nope")
    assert unknown.returncode == 2 and unknown.stderr.count("\n") == 1
    assert "valid codes: cancelled," in unknown.stderr

    # by default: the failed sessions but the one the backend refused with a 400
    again = tmp_path / "again.jsonl"
    retried = cli(fleet7, "batch", "retry", batch, "--out", str(again))
    assert retried.returncode == 1, retried.stderr
    assert f"batch {batch}: 1 failed session skipped" in retried.stderr
    assert "1 provider_error: the backend refused the request" in retried.stderr
    assert ": 2 sessions enqueued" in retried.stderr
    rerun = sorted(
        (json.loads(x)["id"], json.loads(x)["attempt"]) for x in again.read_text().splitlines()
    )
    assert rerun == [(f"{run}/garbled1", 2), (f"{run}/garbled2", 2)]

    # named: that code only, the 4xx included
    named = tmp_path / "named.jsonl"
    retried = cli(fleet7, "batch", "retry", batch, "--codes", "provider_error", "--out", str(named))
    assert retried.returncode == 1 and "skipped" not in retried.stderr
    assert ": 1 session enqueued" in retried.stderr
    (line,) = [json.loads(x) for x in named.read_text().splitlines()]
    assert (line["id"], line["attempt"]) == (f"{run}/refused", 2)
