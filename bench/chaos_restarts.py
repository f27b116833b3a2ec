"""The chaos suite's `redis-restart` and `producer-kill` scenarios: Redis or the waiting producer
killed mid-batch."""

from __future__ import annotations

import signal
import subprocess
import time
import uuid
from pathlib import Path

from bench.chaos_fleet import (
    expected,
    problems_of,
    result_lines,
    results_written,
    session_keys,
    spawn_producer,
    start_fleet,
    verdict_of,
    wait_records,
    weather_objects,
    write_spec_file,
)
from bench.chaos_report import (
    Row,
    crash_summary,
    dead_letters,
    finished_count,
    log_digest,
    remove_dumps,
    tally,
)
from bench.history_read import check_run, mark_run
from producer.client import Client

REDIS_DOWN_S = 0.5


REDIS_VARIANTS: tuple[tuple[str, int, bool], ...] = (
    ("SIGKILL, append-only file", signal.SIGKILL, True),
    ("SIGTERM, append-only file", signal.SIGTERM, True),
    ("SIGKILL, no persistence", signal.SIGKILL, False),
)


def scenario_redis(root: Path, n: int, deadline_s: float, seed: int) -> list[Row]:
    rows = []
    for number, (variant, sig, aof) in enumerate(REDIS_VARIANTS):
        workdir = root / f"redis-restart-{number}"
        fleet, client = start_fleet(workdir, appendonly=aof, latency_ms=100)
        with fleet:
            objects = weather_objects(f"redis{number}-{uuid.uuid4().hex[:6]}", n)
            ids = [o["id"] for o in objects]
            spec_file = write_spec_file(workdir / "sessions.jsonl", objects)
            out = workdir / "results.jsonl"
            timeout_s = deadline_s if aof else min(deadline_s, 60.0)
            started = time.monotonic()
            deadline = started + timeout_s
            mark = mark_run(fleet.replay_url)
            producer = spawn_producer(fleet, spec_file, out, timeout_s)
            mid = wait_records(client, ids, n // 3, deadline)
            before = finished_count(client.redis, session_keys(client, ids))
            down_s = fleet.restart_redis(sig, REDIS_DOWN_S)
            try:
                code: int | None = producer.wait(timeout=timeout_s + 30)
            except subprocess.TimeoutExpired:
                code = None
            producer_s = time.monotonic() - started
            reader = Client(fleet.redis_url)  # the fleet may finish what the producer did not see
            wait_records(reader, ids, n, deadline)
            fleet_s = time.monotonic() - started
            sks = session_keys(reader, ids)
            row = tally(reader.redis, f"redis-restart: {variant}", sks, expected(objects))
            row.wall_s = max(fleet_s, producer_s)
            written, statuses = results_written(out)
            delivered = [str(r["id"]) for r in result_lines(out)]
            row.verdict = check_run(row.scenario, reader, objects, mark, delivered)
            row.notes.insert(
                0,
                f"restarted {'mid-batch' if mid else 'late'} with {before}/{n} finished; down "
                f"{down_s:.2f} s; producer exit {code} after {producer_s:.1f} s, results written "
                f"{written}/{n} {dict(statuses)}; the fleet finished {row.finished}/{n} by the "
                f"deadline ({timeout_s:.0f} s)",
            )
            if not aof and written > row.finished:
                # records of sessions the producer had read were lost with Redis's data: they
                # are not hung (their results are in the producer's file)
                row.notes.insert(
                    1,
                    f"{n - row.finished} records lost with Redis's data; the producer's file "
                    f"holds {written}/{n} results (it submitted the lost unfinished ones again)",
                )
                row.hung = n - written
            problems = problems_of(row)
            if written < n:
                problems.append(f"{n - written} results not written")
            if code != 0:
                problems.append(f"producer exit {code}")
            row.goal = verdict_of(problems) if aof else "- (informational)"
            if code != 0:
                log = workdir / f"producer-{spec_file.stem}.log"
                row.notes.extend(["producer's error:", *crash_summary(log)])
            row.notes.extend(dead_letters(reader.redis))
            row.notes.extend(
                ["log digest:", *log_digest(fleet.workdir), *remove_dumps(fleet.workdir)]
            )
            reader.close()
            client.close()
        rows.append(row)
    return rows


def scenario_producer_kill(root: Path, n: int, deadline_s: float, seed: int) -> list[Row]:
    workdir = root / "producer-kill"
    fleet, client = start_fleet(workdir, latency_ms=100)
    with fleet:
        objects = weather_objects(f"pkill-{uuid.uuid4().hex[:6]}", n)
        ids = [o["id"] for o in objects]
        spec_file = write_spec_file(workdir / "sessions.jsonl", objects)
        started = time.monotonic()
        mark = mark_run(fleet.replay_url)
        producer = spawn_producer(fleet, spec_file, workdir / "results.jsonl", deadline_s)
        mid = wait_records(client, ids, max(n // 10, 1), started + deadline_s)
        before = finished_count(client.redis, session_keys(client, ids))
        fleet.kill(producer)
        killed_at = time.monotonic()
        reader = Client(fleet.redis_url)  # reads results, never waits: no producer nudges
        wait_records(reader, ids, n, started + deadline_s)
        wall = time.monotonic() - started
        sks = session_keys(reader, ids)
        row = tally(reader.redis, "producer-kill: cchatq submit SIGKILLed", sks, expected(objects))
        row.wall_s = wall
        written = [str(r["id"]) for r in result_lines(workdir / "results.jsonl")]
        row.verdict = check_run(row.scenario, reader, objects, mark, written)
        row.notes.insert(
            0,
            (
                f"producer killed {'mid-wait' if mid else 'late'} with {before}/{n} "
                f"finished; the rest took {time.monotonic() - killed_at:.1f} s "
                "with no producer"
            ),
        )
        row.goal = verdict_of(problems_of(row))
        row.notes.extend(dead_letters(reader.redis))
        row.notes.extend(["log digest:", *log_digest(fleet.workdir), *remove_dumps(fleet.workdir)])
        reader.close()
        client.close()
    return [row]
