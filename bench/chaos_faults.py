"""The chaos suite's `faults` scenario: the model answers 429s and 500s."""

from __future__ import annotations

import uuid
from pathlib import Path

import requests

from bench.chaos_fleet import (
    expected,
    problems_of,
    start_fleet,
    verdict_of,
    wait_in_process,
    weather_objects,
)
from bench.chaos_report import (
    Row,
    dead_letters,
    log_digest,
    remove_dumps,
    tally,
)
from bench.history_read import check_run, mark_run
from producer.specfile import load_spec_from_objects

RETRY_AFTER_S = 1


def scenario_faults(root: Path, n: int, deadline_s: float, seed: int) -> list[Row]:
    args = [
        "--fault-429-rate",
        "0.1",
        "--fault-500-rate",
        "0.05",
        "--retry-after-s",
        str(RETRY_AFTER_S),
        "--fault-seed",
        str(seed),
    ]
    fleet, client = start_fleet(root / "faults", replay_args=args)
    with fleet:
        root_url = fleet.replay_url.removesuffix("/v1")
        requests.post(f"{root_url}/reset", timeout=5).raise_for_status()  # not the warm-up's
        objects = weather_objects(f"faults-{uuid.uuid4().hex[:6]}", n)
        mark, delivered = mark_run(fleet.replay_url), list[str]()
        sub = client.enqueue(load_spec_from_objects(objects))
        wall = wait_in_process(client, sub, deadline_s, delivered)
        row = tally(
            client.redis, "faults: 10% 429 (Retry-After 1 s), 5% 500", sub.order, expected(objects)
        )
        row.wall_s = wall
        row.verdict = check_run(row.scenario, client, objects, mark, delivered)
        faults = requests.get(f"{root_url}/faults", timeout=5).json()
        stats = requests.get(f"{root_url}/stats", timeout=5).json()
        gap = faults["min_gap_after_429_s"]
        row.notes.insert(
            0,
            (
                f"model requests {stats['requests']}, faults injected {faults['injected']}; "
                f"retries after a 429: {faults['retries_after_429']}, early (< Retry-After): "
                f"{faults['early_retries']}, smallest gap {_seconds(gap)}, "
                f"429s never retried {faults['unretried_429']}"
            ),
        )
        problems = problems_of(row)
        if faults["early_retries"]:
            problems.append(f"{faults['early_retries']} retries before Retry-After")
        row.goal = verdict_of(problems)
        row.notes.extend(dead_letters(client.redis))
        row.notes.extend(["log digest:", *log_digest(fleet.workdir), *remove_dumps(fleet.workdir)])
        client.close()
    return [row]


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s"
