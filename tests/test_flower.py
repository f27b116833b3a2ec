"""Flower on a running fleet shows each step of a session as its own task, with ids only.
Task events are off by default (they cost every hop); Flower switches them on."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import requests

from fixtures.demo_batch import WEATHER
from producer.fleet import free_port
from tests.conftest import Running
from tests.test_pipeline import run_poisoned, run_specs

pytestmark = pytest.mark.fleet


def test_flower_lists_every_step_with_ids_only(
    running: Running, tmp_path: Path, fresh_id: str
) -> None:
    port = free_port()
    env = {**os.environ, "REDIS_URL": running.redis_url, "FLOWER_UNAUTHENTICATED_API": "true"}
    cmd = [sys.executable, "-m", "producer.cli", "flower", "--port", str(port)]
    log = open(tmp_path / "flower.log", "wb")  # noqa: SIM115 - closed below
    flower = subprocess.Popen(
        cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        workers: dict[str, object] = {}
        while time.monotonic() < deadline and len(workers) < 3:
            with contextlib.suppress(requests.ConnectionError, ValueError):
                workers = requests.get(f"{base}/api/workers?refresh=1", timeout=5).json()
            time.sleep(0.5)
        assert len(workers) >= 3, (tmp_path / "flower.log").read_text()[-2000:]
        # Flower broadcasts enable_events every 5 s: wait until it sees a probe session
        deadline = time.monotonic() + 30
        seen = False
        while time.monotonic() < deadline and not seen:
            probe_id = f"{fresh_id}/probe/{time.monotonic_ns()}"
            probe = {
                "id": probe_id,
                "model": "replay/plain",
                "messages": [{"role": "user", "content": "x"}],
            }
            run_specs(running.client, [probe], tmp_path)
            time.sleep(0.5)
            seen = (
                f"{running.client.session_key(probe_id)}.r0"
                in requests.get(f"{base}/api/tasks", timeout=5).json()
            )
        assert seen, "Flower never received task events"
        secret = f"Nowhere{fresh_id}"
        spec: dict[str, Any] = {
            "id": f"{fresh_id}/flower",
            "model": "replay/weather",
            "messages": [{"role": "user", "content": f"Weather in {secret}?"}],
            "tools": [dict(WEATHER)],
        }
        run_specs(running.client, [spec], tmp_path)
        sk = str(running.client.session_key(spec["id"]))
        expected = {
            f"{sk}.r0": "cchatq.round",
            f"{sk}.r0.t0": "cchatq.tool",
            f"{sk}.r1": "cchatq.round",  # the last round writes the result: no finish task
        }
        tasks: dict[str, dict[str, object]] = {}
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not set(expected) <= set(tasks):
            tasks = requests.get(f"{base}/api/tasks", timeout=5).json()
            time.sleep(0.5)
        assert {tid: tasks[tid]["name"] for tid in expected if tid in tasks} == expected
        for tid in expected:
            shown = f"{tasks[tid].get('args')} {tasks[tid].get('kwargs')}"
            assert sk in shown and secret not in shown
            # the user's id, shown (never an argument): Flower's search finds the session
            assert tasks[tid].get("kwargs") == repr({"session": spec["id"]})
        last = settled(base, f"{sk}.r1")
        assert (last["state"], last.get("result")) == ("SUCCESS", repr({"outcome": "ok"}))
        found = requests.get(
            f"{base}/api/tasks", params={"search": f"kwargs:session={spec['id']}"}, timeout=5
        ).json()
        assert set(expected) <= set(found)
        # a dead-lettered step: its task is a FAILURE, and its session ends step_failed
        sk, record = run_poisoned(running.client, tmp_path, f"{fresh_id}/flower-poison")
        assert record["body"]["error"]["code"] == "step_failed"
        assert settled(base, f"{sk}.r0.t0")["state"] == "FAILURE"
        finish = settled(base, f"{sk}.fin")
        assert (finish["state"], finish.get("result")) == (
            "SUCCESS",
            repr({"outcome": "step_failed"}),
        )
    finally:
        os.killpg(flower.pid, signal.SIGTERM)
        flower.wait(timeout=15)
        log.close()


def settled(base: str, task_id: str, timeout_s: float = 20) -> dict[str, Any]:
    """A task as Flower shows it once its end event came (SUCCESS, FAILURE or RETRY)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(requests.RequestException, ValueError):
            info = requests.get(f"{base}/api/task/info/{task_id}", timeout=5).json()
            if info.get("state") in ("SUCCESS", "FAILURE"):
                return dict(info)
        assert time.monotonic() < deadline, f"task {task_id} never ended in Flower"
        time.sleep(0.1)
