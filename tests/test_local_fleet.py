"""`cchatq up` and `cchatq down` as a user runs them: `eval "$(cchatq up)"` gives a shell a
fleet that runs a batch, `down` leaves no process of it and no folder. Each run marks its
environment with a token of its own, which every process `up` starts inherits; a process
whose environment holds it, left after `down`, is one it failed to stop."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import requests

from fixtures.demo_scenarios import WEATHER
from producer.fleet import Fleet, free_port, replay_backends
from tests.conftest import GUESTS

pytestmark = pytest.mark.fleet

REDIS_DB = 8
MARK = "CCHATQ_TEST_FLEET_MARK"


def clean_env(mark: str, venv_on_path: bool = True) -> dict[str, str]:
    """This environment without any fleet's address or configuration, marked; with this
    Python's scripts (cchatq) first on PATH, or (`venv_on_path` False) nowhere on it."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("REDIS_URL", "VIRTUAL_ENV") and not k.startswith(("CCHATQ_", "FLOWER_"))
    }
    scripts = str(Path(sys.executable).parent)
    path = [d for d in env.get("PATH", "").split(":") if d and d != scripts]
    env["PATH"] = ":".join([scripts, *path] if venv_on_path else path)
    env[MARK] = mark
    return env


def marked_processes(mark: str) -> list[int]:
    """Live processes whose environment holds `mark` (read from /proc)."""
    found = []
    needle = f"{MARK}={mark}".encode()
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    found.append(int(entry.name))
        except (OSError, IndexError):
            continue
    return found


def cchatq(
    *args: str, env: dict[str, str], cwd: Path, timeout_s: float = 150
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "producer.cli", *args],
        env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout_s,
    )  # fmt: skip


def exports(stdout: str) -> dict[str, str]:
    """`up`'s stdout as a shell evaluates it: each line must be `export NAME=VALUE`."""
    values = {}
    for line in stdout.splitlines():
        words = shlex.split(line)
        assert len(words) == 2 and words[0] == "export" and "=" in words[1], line
        name, value = words[1].split("=", 1)
        values[name] = value
    return values


def spec_file(path: Path, prefix: str) -> Path:
    weather = {**WEATHER, "module": str(GUESTS / "weather.wasm")}
    specs: list[dict[str, Any]] = [
        {"id": f"{prefix}/plain", "model": "replay/plain",
         "messages": [{"role": "user", "content": "Say hello"}]},
        {"id": f"{prefix}/weather", "model": "replay/weather",
         "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [weather]},
        {"id": f"{prefix}/parallel", "model": "replay/parallel",
         "messages": [{"role": "user", "content": "Weather in Oslo, Lima?"}], "tools": [weather]},
    ]  # fmt: skip
    path.write_text("".join(json.dumps(s) + "\n" for s in specs))
    return path


def wait_until_gone(mark: str, timeout_s: float = 15) -> list[int]:
    """Processes of a run still alive once `down` returned: none, or those it left (after a
    short wait for exits the kernel has not finished)."""
    deadline = time.monotonic() + timeout_s
    while (left := marked_processes(mark)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def test_up_runs_a_batch_and_down_leaves_nothing(tmp_path: Path, fresh_id: str) -> None:
    mark = uuid.uuid4().hex
    env = clean_env(mark)
    folder = tmp_path / "fleet"
    # a stale record: an exited process, and a live one under a pid whose start time differs
    # (a pid reused by another program): up starts afresh and never signals the stranger
    stranger = subprocess.Popen(["sleep", "300"], start_new_session=True)
    exited = subprocess.run(["true"], check=True)
    assert exited.returncode == 0
    folder.mkdir()
    stale = {"dir": str(folder), "redis_url": "redis://127.0.0.1:1/0", "processes": [
        {"name": "gone", "pid": 999_999, "start_ticks": 1, "cmdline": [], "log": ""},
        {"name": "stranger", "pid": stranger.pid, "start_ticks": 1, "cmdline": [], "log": ""},
    ]}  # fmt: skip
    (folder / "fleet.json").write_text(json.dumps(stale))
    try:
        up = cchatq("up", "--dir", str(folder), env=env, cwd=tmp_path)
        assert up.returncode == 0, up.stderr
        assert stranger.poll() is None, "up signalled a process it did not start"
        shell = exports(up.stdout)
        assert set(shell) == {"REDIS_URL", "CCHATQ_CONFIG", "CCHATQ_REPLAY_URL"}, shell
        assert Path(shell["CCHATQ_CONFIG"]) == folder / "config.json"
        record = json.loads((folder / "fleet.json").read_text())
        names = sorted(p["name"].split("-")[0] for p in record["processes"])
        queues = ["background", "control", "llm", "programs", "tools"]
        assert names == sorted(["redis", "replay", *queues]), names
        assert {p.name for p in (folder / "logs").iterdir()} >= {"redis.log", "replay.log"}
        assert "cchatq down" in up.stderr and "cchatq submit" in up.stderr

        submit_env = {**env, **shell}
        specs = spec_file(tmp_path / "specs.jsonl", fresh_id)
        out = tmp_path / "results.jsonl"
        ran = cchatq("submit", str(specs), "--out", str(out), env=submit_env, cwd=tmp_path)
        assert ran.returncode == 0, ran.stderr
        results = [json.loads(line) for line in out.read_text().splitlines()]
        assert [r["status"] for r in results] == ["ok"] * 3
        assert {r["metrics"]["tool_calls"] for r in results} == {0, 1, 2}

        again = cchatq("up", "--dir", str(folder), env=env, cwd=tmp_path)
        assert again.returncode == 0, again.stderr
        assert exports(again.stdout) == shell
        assert json.loads((folder / "fleet.json").read_text()) == record, "it started more"
        assert len(marked_processes(mark)) >= len(record["processes"])
    finally:
        down = cchatq("down", "--dir", str(folder), env=env, cwd=tmp_path)
        alive_stranger = stranger.poll() is None
        stranger.kill()
        stranger.wait()
    assert down.returncode == 0, down.stderr
    assert alive_stranger, "down signalled a process it did not start"
    assert not folder.exists()
    assert wait_until_gone(mark) == []
    twice = cchatq("down", "--dir", str(folder), env=env, cwd=tmp_path)
    assert twice.returncode == 0
    assert twice.stderr.strip() == f"no fleet in {folder}"


def test_up_uses_a_redis_that_answers_and_the_configured_backends(
    base_fleet: Fleet, tmp_path: Path, fresh_id: str
) -> None:
    """REDIS_URL set: no redis-server of its own; CCHATQ_BACKENDS set: no replay server, the
    workers run on that configuration. With Flower (its API open on loopback, as no basic auth
    is set) and the metrics exporter."""
    mark = uuid.uuid4().hex
    url = base_fleet.redis_url.rsplit("/", 1)[0] + f"/{REDIS_DB}"
    config = {
        "backends": replay_backends(base_fleet.replay_url),
        "default_backend": "replay-openai",
    }
    env = {**clean_env(mark), "REDIS_URL": url, "CCHATQ_BACKENDS": json.dumps(config)}
    folder = tmp_path / "fleet"
    try:
        up = cchatq("up", "--dir", str(folder), "--flower", "--metrics", env=env, cwd=tmp_path)
        assert up.returncode == 0, up.stderr
        shell = exports(up.stdout)
        assert shell == {"REDIS_URL": url, "CCHATQ_FLOWER_URL": shell["CCHATQ_FLOWER_URL"]}
        record = json.loads((folder / "fleet.json").read_text())
        names = {p["name"].split("-")[0] for p in record["processes"]}
        queues = {"background", "control", "llm", "programs", "tools"}
        assert names == {*queues, "flower", "metrics"}, names
        workers = requests.get(f"{shell['CCHATQ_FLOWER_URL']}/api/workers", timeout=5)
        assert workers.status_code == 200
        metrics = requests.get(record["metrics_url"], timeout=5)
        assert "cchatq_consumers" in metrics.text
        specs = spec_file(tmp_path / "specs.jsonl", fresh_id)
        out = tmp_path / "results.jsonl"
        ran = cchatq("submit", str(specs), "--out", str(out), env=env, cwd=tmp_path)
        assert ran.returncode == 0, ran.stderr
    finally:
        down = cchatq("down", "--dir", str(folder), env=env, cwd=tmp_path)
    assert down.returncode == 0, down.stderr
    assert not folder.exists()
    assert wait_until_gone(mark) == []


def test_up_with_a_redis_url_that_does_not_answer_starts_nothing(tmp_path: Path) -> None:
    mark = uuid.uuid4().hex
    url = f"redis://127.0.0.1:{free_port()}/0"
    env = {**clean_env(mark), "REDIS_URL": url}
    folder = tmp_path / "fleet"
    up = cchatq("up", "--dir", str(folder), env=env, cwd=tmp_path)
    assert up.returncode != 0
    assert up.stdout == ""
    assert up.stderr.strip().splitlines() == [f"cchatq up: REDIS_URL={url} does not answer"]
    assert not folder.exists()
    assert marked_processes(mark) == []
