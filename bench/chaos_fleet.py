"""What every chaos scenario (bench/chaos.py) shares: the weather sessions it submits, a private
fleet to run them on, waiting for and reading back what they left, and a run's verdict."""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis

import fixtures
from bench.chaos_report import (
    Row,
    finished_count,
)
from fixtures.demo_scenarios import CITIES, WEATHER, weather_json
from producer.client import Client
from producer.fleet import Fleet
from producer.local_cluster import LocalCluster
from producer.specfile import load_spec_from_objects
from producer.submitting import Submission
from schemas.fleet_urls import fleet_urls
from schemas.spec_types import Spec

GUESTS = Path(fixtures.__file__).parent / "guests"
# `CCHATQ_CHAOS_CLUSTER=3 make chaos SCENARIOS=kill`: the sessions' state on a local cluster of
# that many masters (the scenarios that restart or cut Redis keep one Redis)
CLUSTER_VARIABLE = "CCHATQ_CHAOS_CLUSTER"


# --- sessions --------------------------------------------------------------------------------


def weather_objects(run: str, n: int, latency_ms: int = 0) -> list[dict[str, Any]]:
    """The bench's weather session (round, tool call, round), each with a first message of its
    own (the replay server keys a conversation by it)."""
    marker = f" [[latency_ms:{latency_ms}]]" if latency_ms else ""
    tool = {**WEATHER, "module": str(GUESTS / "weather.wasm")}
    return [
        {
            "id": f"{run}/{i}",
            "model": "replay/weather",
            "messages": [
                {"role": "user", "content": f"[{run} {i}] Weather in {city_of(i)}?{marker}"}
            ],
            "tools": [tool],
        }
        for i in range(n)
    ]


def city_of(i: int) -> str:
    return CITIES[i % len(CITIES)]


def weather_specs(run: str, n: int, latency_ms: int = 0) -> list[Spec]:
    return load_spec_from_objects(weather_objects(run, n, latency_ms))


def write_spec_file(path: Path, objects: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(o) + "\n" for o in objects))
    return path


# --- fleets ---------------------------------------------------------------------------------


def start_fleet(
    workdir: Path,
    appendonly: bool = False,
    latency_ms: int = 0,
    replay_args: Sequence[str] = (),
) -> tuple[Fleet, Client]:
    workdir.mkdir(parents=True, exist_ok=True)
    fleet = Fleet(workdir=workdir)
    fleet.ensure_redis(private=True, appendonly=appendonly)
    masters = int(os.environ.get(CLUSTER_VARIABLE) or 0)
    if masters:  # the state on a local cluster, the broker on the fleet's own Redis
        fleet.env["CCHATQ_STATE_URL"] = LocalCluster(masters, fleet=fleet).start()
    fleet.start_replay(latency_ms, replay_args)
    fleet.start_workers()
    client = fleet_client(fleet)
    warm = client.enqueue(weather_specs(f"warm-{uuid.uuid4().hex[:6]}", 20))  # compile, connect
    for _ in client.wait(warm, timeout_s=120, poll_s=0.05):
        pass
    return fleet, client


def fleet_client(fleet: Fleet) -> Client:
    """A producer of the fleet: on its state's Redis and its broker (apart on a cluster)."""
    urls = fleet_urls(fleet.worker_env())
    return Client(urls.state, config=fleet.config(), broker_url=urls.broker)


def wait_in_process(
    client: Client, sub: Submission, deadline_s: float, delivered: list[str] | None = None
) -> float:
    """Wait for a batch as a producer does (nudging when it stalls); the wall time. The id
    of each result handed out is added to `delivered`."""
    started = time.perf_counter()
    try:
        for _, record in client.wait(sub, timeout_s=deadline_s, poll_s=0.05):
            if delivered is not None:
                delivered.append(str(record.get("id")))
    except TimeoutError:
        pass
    return time.perf_counter() - started


def session_keys(client: Client, ids: Sequence[str]) -> list[str]:
    """The session keys of these spec ids' runs (a key that holds nothing for an id not
    claimed yet, or whose claim a restart lost)."""
    claims = client.claims(ids)
    return [f"unclaimed:{i}" if c is None else c.sk for i, c in zip(ids, claims, strict=True)]


def wait_records(client: Client, ids: Sequence[str], want: int, deadline: float) -> bool:
    """Poll Redis until `want` of these sessions have a record (a restarting Redis is
    retried), or until the monotonic `deadline`."""
    while time.monotonic() < deadline:
        try:
            if finished_count(client.redis, session_keys(client, ids)) >= want:
                return True
        except redis.RedisError:
            pass
        time.sleep(0.1)
    return False


def expected(objects: list[dict[str, Any]]) -> dict[str, str]:
    """Each spec id's expected answer."""
    return {o["id"]: f"Weather report: {weather_json(city_of(i))}" for i, o in enumerate(objects)}


def spawn_producer(fleet: Fleet, spec_file: Path, out: Path, timeout_s: float) -> Any:
    """`cchatq submit FILE --out OUT` in a process of its own (stopped by the fleet)."""
    cmd = [
        sys.executable,
        "-m",
        "producer.cli",
        "submit",
        str(spec_file),
        "--out",
        str(out),
        "--timeout-s",
        str(timeout_s),
    ]
    return fleet.spawn(cmd, f"producer-{spec_file.stem}", env=fleet.worker_env())


def results_written(out: Path) -> tuple[int, Counter[str]]:
    lines = result_lines(out)
    return len(lines), Counter(str(line.get("status")) for line in lines)


def result_lines(out: Path) -> list[dict[str, Any]]:
    if not out.exists():
        return []
    return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


# --- a run's verdict ----------------------------------------------------------------------


def history_problems(row: Row) -> list[str]:
    """The run's goal is not met when its history is invalid (bench/history.py)."""
    return [] if row.verdict is None or row.verdict.valid else ["history invalid"]


def problems_of(row: Row) -> list[str]:
    problems = history_problems(row)
    if row.finished < row.expected:
        problems.append(f"{row.expected - row.finished} not finished")
    if row.step_failed:
        problems.append(f"{row.step_failed} step_failed")
    if row.duplicates:
        problems.append(f"{row.duplicates} duplicates")
    if row.hung:
        problems.append(f"{row.hung} hung")
    return problems


def verdict_of(problems: list[str]) -> str:
    return "met" if not problems else "NOT MET: " + ", ".join(problems)
