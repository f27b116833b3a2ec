"""Flower on a running fleet, behind basic auth (FLOWER_BASIC_AUTH), shows each step of a
session as its own task, with ids only, and every task of a session, a retried and
dead-lettered step and the finish step that ends its session too, shows the session's spec id
as its keyword arguments, which Flower's search finds. Task events are off by default (they
cost every hop); Flower switches them on."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests

from fixtures.demo_scenarios import WEATHER
from producer.fleet import free_port
from tests.conftest import Running
from tests.test_pipeline import run_poisoned, run_specs

pytestmark = pytest.mark.fleet


@dataclass
class Flower:
    base: str
    auth: tuple[str, str]
    log: Path

    def get(self, path: str, **params: str) -> Any:
        response = requests.get(f"{self.base}{path}", params=params, auth=self.auth, timeout=5)
        response.raise_for_status()
        return response.json()

    def tasks_of(self, sk: str) -> dict[str, dict[str, Any]]:
        """The tasks Flower lists of a session: its step ids start with its key."""
        return {tid: t for tid, t in self.get("/api/tasks").items() if tid.startswith(sk + ".")}


@pytest.fixture(scope="module")
def flower(
    running: Running, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Flower, dict[str, str]]]:
    """`cchatq flower` with basic auth, once it lists the workers and sees task events."""
    workdir = tmp_path_factory.mktemp("flower")
    port = free_port()
    auth = ("ops", f"pw-{uuid.uuid4().hex[:12]}")
    env = {**os.environ, "REDIS_URL": running.redis_url, "FLOWER_BASIC_AUTH": ":".join(auth)}
    env.pop("FLOWER_UNAUTHENTICATED_API", None)
    cmd = [sys.executable, "-m", "producer.cli", "flower", "--port", str(port),
           "--persistent", "--db", str(workdir / "flower.db")]  # fmt: skip
    log = workdir / "flower.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    shown = Flower(f"http://127.0.0.1:{port}", auth, log)
    try:
        deadline = time.monotonic() + 30
        workers: dict[str, object] = {}
        while time.monotonic() < deadline and len(workers) < 3:
            with contextlib.suppress(requests.RequestException, ValueError):
                workers = shown.get("/api/workers", refresh="1")
            time.sleep(0.5)
        assert len(workers) >= 3, log.read_text()[-2000:]
        # Flower broadcasts enable_events every 5 s: wait until it sees a probe session
        deadline = time.monotonic() + 30
        seen = False
        while time.monotonic() < deadline and not seen:
            probe_id = f"probe/{uuid.uuid4().hex[:10]}"
            probe = {"id": probe_id, "model": "replay/plain",
                     "messages": [{"role": "user", "content": "x"}]}  # fmt: skip
            run_specs(running.client, [probe], workdir)
            time.sleep(0.5)
            seen = f"{running.client.session_key(probe_id)}.r0" in shown.get("/api/tasks")
        assert seen, "Flower never received task events"
        yield shown, env
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=15)


def test_flower_asks_for_the_basic_auth_credentials(flower: tuple[Flower, dict[str, str]]) -> None:
    shown, _ = flower
    assert requests.get(f"{shown.base}/api/tasks", timeout=5).status_code == 401
    wrong = requests.get(f"{shown.base}/api/tasks", auth=("ops", "nope"), timeout=5)
    assert wrong.status_code == 401
    assert requests.get(f"{shown.base}/api/tasks", auth=shown.auth, timeout=5).status_code == 200


def test_flower_lists_every_step_with_ids_only(
    running: Running, flower: tuple[Flower, dict[str, str]], tmp_path: Path, fresh_id: str
) -> None:
    shown, _ = flower
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
    tasks = wait_tasks(shown, sk, set(expected))
    assert {tid: t["name"] for tid, t in tasks.items()} == expected
    for tid, task in tasks.items():
        shown_text = f"{task.get('args')} {task.get('kwargs')}"
        assert sk in shown_text and secret not in shown_text, tid
        # the user's id, shown (never an argument): Flower's search finds the session
        assert task.get("kwargs") == repr({"session": spec["id"]}), tid
    last = settled(shown, f"{sk}.r1")
    assert (last["state"], last.get("result")) == ("SUCCESS", repr({"outcome": "ok"}))
    found = shown.get("/api/tasks", search=f"kwargs:session={spec['id']}")
    assert set(found) == set(expected)


def test_a_dead_lettered_session_shows_its_id_on_every_task(
    running: Running, flower: tuple[Flower, dict[str, str]], tmp_path: Path, fresh_id: str
) -> None:
    """Its tool step, retried until it is dead-lettered (a FAILURE), and the finish step the
    dead letter publishes show the session's spec id as their keyword arguments."""
    shown, _ = flower
    spec_id = f"{fresh_id}/flower-poison"
    sk, record = run_poisoned(running.client, tmp_path, spec_id)
    assert record["body"]["error"]["code"] == "step_failed"
    tool = settled(shown, f"{sk}.r0.t0")
    assert tool["state"] == "FAILURE" and tool.get("retries", 0) >= 1, tool
    finish = settled(shown, f"{sk}.fin")
    assert (finish["state"], finish.get("result")) == ("SUCCESS", repr({"outcome": "step_failed"}))
    tasks = wait_tasks(shown, sk, {f"{sk}.r0", f"{sk}.r0.t0", f"{sk}.fin"})
    assert {tid: t.get("kwargs") for tid, t in tasks.items()} == dict.fromkeys(
        tasks, repr({"session": spec_id})
    )
    assert set(shown.get("/api/tasks", search=f"kwargs:session={spec_id}")) == set(tasks)


def test_status_prints_a_flower_link_that_works_with_the_auth(
    running: Running, flower: tuple[Flower, dict[str, str]], tmp_path: Path, fresh_id: str
) -> None:
    """`cchatq status ID`'s curl line, run as printed with FLOWER_BASIC_AUTH set, fetches the
    session's tasks; the password itself is printed nowhere."""
    shown, env = flower
    spec: dict[str, Any] = {"id": f"{fresh_id}/linked", "model": "replay/plain",
            "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
    run_specs(running.client, [spec], tmp_path)
    sk = str(running.client.session_key(spec["id"]))
    wait_tasks(shown, sk, {f"{sk}.r0"})
    env = {**env, "CCHATQ_FLOWER_URL": shown.base}
    status = subprocess.run(
        [sys.executable, "-m", "producer.cli", "status", spec["id"]],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert status.returncode == 0, status.stderr
    assert shown.auth[1] not in status.stdout + status.stderr
    line = json.loads(status.stdout)["flower_curl"]
    assert line.startswith('curl -u "$FLOWER_BASIC_AUTH" '), line
    url = shlex.split(line)[-1]
    assert url == json.loads(status.stdout)["flower_tasks"]
    fetched = requests.get(url, auth=shown.auth, timeout=5)
    assert fetched.status_code == 200
    assert set(fetched.json()) == {f"{sk}.r0"}
    ran = subprocess.run(["bash", "-c", line + " -sf"], env=env, capture_output=True, text=True)
    assert ran.returncode == 0 and set(json.loads(ran.stdout)) == {f"{sk}.r0"}, ran.stderr


def wait_tasks(shown: Flower, sk: str, ids: set[str], timeout_s: float = 20) -> dict[str, Any]:
    """The session's tasks once Flower lists at least `ids` (and their kwargs)."""
    deadline = time.monotonic() + timeout_s
    while True:
        tasks = shown.tasks_of(sk)
        if ids <= set(tasks) and all(t.get("kwargs") is not None for t in tasks.values()):
            return tasks
        assert time.monotonic() < deadline, f"Flower lists {sorted(tasks)}, not {sorted(ids)}"
        time.sleep(0.2)


def settled(shown: Flower, task_id: str, timeout_s: float = 20) -> dict[str, Any]:
    """A task as Flower shows it once its end event came (SUCCESS or FAILURE)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(requests.RequestException, ValueError):
            info = shown.get(f"/api/task/info/{task_id}")
            if info.get("state") in ("SUCCESS", "FAILURE"):
                return dict(info)
        assert time.monotonic() < deadline, f"task {task_id} never ended in Flower"
        time.sleep(0.1)
