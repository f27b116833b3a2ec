"""Chaos scenarios of a Redis that fills up or cannot persist (`python -m bench.chaos
redis-full aof-full`), each on a private fleet of its own, 127.0.0.1 only:

  redis-full  Redis with `maxmemory 24mb`, noeviction; N sessions (default 3,000) of 2 KB
              prompts by `cchatq submit`: it must enqueue what fits, say so in one line (exit
              4) with no traceback, no worker may exit, every session it enqueued must end
              within 120 s, none half-applied. Then maxmemory is raised and the same file
              submitted again: all N end ok.
  aof-full    Redis with appendonly on a small tmpfs mounted in the scenario's own folder
              (root), N weather sessions (default 300); a third of the way in a filler file
              takes the tmpfs's last byte, so Redis's AOF write fails and writes (and PING)
              answer MISCONF for FULL_S; then the filler goes. No session may fail or be
              dead-lettered for it; progress must resume within 30 s of the space's return.
              The tmpfs is unmounted after, even on failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis

import fixtures
from bench.chaos_fleet import history_problems, result_lines, verdict_of
from bench.chaos_report import Row, dead_letters, finished_count, log_digest, remove_dumps, tally
from bench.history_read import check_run, mark_run
from fixtures.demo_scenarios import CITIES, WEATHER, weather_json
from producer.client import Client
from producer.fleet import Fleet
from schemas import keys
from schemas.session_record import read_record

GUESTS = Path(fixtures.__file__).parent / "guests"
MAXMEMORY = "24mb"
PROMPT_BYTES = 2048
ENDED_WITHIN_S = 120.0
RESUMED_WITHIN_S = 30.0
FULL_S = 20.0  # how long the AOF's disk stays full
TMPFS_SIZE = "48m"


def prompt_objects(run: str, n: int) -> list[dict[str, Any]]:
    """One-round sessions whose prompt is PROMPT_BYTES long (the replay server echoes it)."""
    pad = "x" * (PROMPT_BYTES - 40)
    return [
        {"id": f"{run}/{i}", "model": "replay/plain",
         "messages": [{"role": "user", "content": f"[{run} {i}] {pad}"}]}
        for i in range(n)
    ]  # fmt: skip


def echoes(objects: list[dict[str, Any]]) -> dict[str, str]:
    return {o["id"]: f"Echo: {o['messages'][0]['content']}" for o in objects}


def weather_objects(run: str, n: int) -> list[dict[str, Any]]:
    tool = {**WEATHER, "module": str(GUESTS / "weather.wasm")}
    return [
        {"id": f"{run}/{i}", "model": "replay/weather", "tools": [tool],
         "messages": [{"role": "user", "content": f"[{run} {i}] Weather in "
                       f"{CITIES[i % len(CITIES)]}? [[latency_ms:100]]"}]}
        for i in range(n)
    ]  # fmt: skip


def weather_answers(objects: list[dict[str, Any]]) -> dict[str, str]:
    return {
        o["id"]: f"Weather report: {weather_json(CITIES[i % len(CITIES)])}"
        for i, o in enumerate(objects)
    }


def write_lines(path: Path, objects: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(o) + "\n" for o in objects))
    return path


def submit(
    fleet: Fleet, spec_file: Path, out: Path, name: str, timeout_s: float
) -> tuple[int, str]:
    """`cchatq submit FILE` in a process of its own: its exit code and what it printed."""
    cmd = [sys.executable, "-m", "producer.cli", "submit", str(spec_file), "--out", str(out),
           "--timeout-s", str(timeout_s)]  # fmt: skip
    proc = fleet.spawn(cmd, name, env=fleet.worker_env())
    try:
        code = proc.wait(timeout=timeout_s + 60)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
    return code, fleet.log_of(name).read_text(errors="replace")


def tracebacks(fleet: Fleet) -> int:
    return sum(
        log.read_text(errors="replace").count("Traceback") for log in fleet.logs.glob("*.log")
    )


def exited_workers(fleet: Fleet) -> list[str]:
    return sorted(f"{name} ({proc.returncode})" for name, proc in fleet.workers.items()
                  if proc.poll() is not None)  # fmt: skip


def half_applied(r: Any, sks: list[str]) -> int:
    """Sessions whose end is half written: a record without its response or its end in the
    meta, or a response without its record (the ending script writes all three at once)."""
    pipe = r.pipeline(transaction=False)
    for sk in sks:
        pipe.get(keys.record(sk))
        pipe.exists(keys.response(sk))
        pipe.hget(keys.meta(sk), "ended_by")
    replies = pipe.execute()
    bad = 0
    for n in range(len(sks)):
        record, response, ended = replies[3 * n : 3 * n + 3]
        if record is not None and not ended:  # retired: its meta folded into its record
            ended = read_record(record).meta.get("ended_by")
        bad += bool(record) != bool(response) or (bool(record) and not ended)
    return bad


def spent_tries(r: Any) -> int:
    """Steps delivered more than once (a try counter past 1)."""
    return sum(
        1 for key in r.scan_iter(match="cq:tries:*", count=1000) if keys.tries_count(r.get(key)) > 1
    )


def wait_ended(r: Any, sks: list[str], deadline: float) -> float | None:
    """Until every session of `sks` has a record (the seconds it took), or None at `deadline`."""
    started = time.monotonic()
    while time.monotonic() < deadline:
        with contextlib.suppress(redis.RedisError):
            if finished_count(r, sks) >= len(sks):
                return time.monotonic() - started
        time.sleep(0.25)
    return None


def private_fleet(workdir: Path, log_dir: Path | None = None, aof: bool = False) -> Fleet:
    fleet = Fleet(workdir=workdir, log_dir=log_dir)
    fleet.ensure_redis(private=True, appendonly=aof)
    fleet.start_replay()
    fleet.start_workers()
    fleet.wait_served()
    return fleet


# --- redis-full -------------------------------------------------------------------------------


def scenario_redis_full(root: Path, n: int, deadline_s: float, seed: int) -> list[Row]:
    workdir = root / "redis-full"
    workdir.mkdir(parents=True, exist_ok=True)
    fleet = Fleet(workdir=workdir)
    with fleet:
        fleet.ensure_redis(private=True)
        admin = redis.Redis.from_url(fleet.redis_url)
        admin.config_set("maxmemory", MAXMEMORY)
        admin.config_set("maxmemory-policy", "noeviction")
        fleet.start_replay()
        fleet.start_workers()
        fleet.wait_served()
        objects = prompt_objects(f"full-{uuid.uuid4().hex[:6]}", n)
        ids = [o["id"] for o in objects]
        spec_file = write_lines(workdir / "sessions.jsonl", objects)
        client = Client(fleet.redis_url, config=fleet.config())
        mark = mark_run(fleet.replay_url)
        started = time.monotonic()
        code, said = submit(fleet, spec_file, workdir / "results-1.jsonl", "submit-1", 60)
        lines = [line for line in said.splitlines() if line.startswith("cchatq: Redis at")]
        claims = client.claims(ids)
        sks = [c.sk for c in claims if c is not None]
        ended_s = wait_ended(client.redis, sks, started + ENDED_WITHIN_S)
        first = tally(client.redis, "redis-full: 24 MB, first submit", sks, echoes(objects))
        first.wall_s = time.monotonic() - started
        # only what the submit said it enqueued was acknowledged: the rest is not lost
        acked = objects[: enqueued_of(lines[0]) if lines else len(sks)]
        delivered = [str(r["id"]) for r in result_lines(workdir / "results-1.jsonl")]
        first.verdict = check_run(first.scenario, client, acked, mark, delivered)
        info = admin.info("memory")
        first.notes[:0] = [
            f"submit exit {code}; its line: {lines[0] if lines else '(none)'}",
            f"lines naming Redis's memory: {len(lines)}; enqueued {len(sks)} of {n}; ended "
            + (
                f"within {ended_s:.1f} s"
                if ended_s is not None
                else f"NOT within {ENDED_WITHIN_S:.0f} s"
            ),
            f"used_memory {info['used_memory'] / 2**20:.1f} MB of {MAXMEMORY}, peak"
            f" {info['used_memory_peak'] / 2**20:.1f} MB",
        ]
        problems = _problems(first)
        if code != 4 or len(lines) != 1:
            problems.append(f"submit exit {code} with {len(lines)} lines (want 4 and one)")
        if ended_s is None:
            problems.append(f"not ended within {ENDED_WITHIN_S:.0f} s")
        first.goal, first_problems = "", problems
        # memory freed: maxmemory raised, the same file again
        admin.config_set("maxmemory", "0")
        started = time.monotonic()
        code2, _ = submit(fleet, spec_file, workdir / "results-2.jsonl", "submit-2", deadline_s)
        sks = [
            c.sk if c is not None else f"unclaimed:{i}"
            for i, c in zip(ids, client.claims(ids), strict=True)
        ]
        wait_ended(client.redis, sks, started + deadline_s)
        second = tally(client.redis, "redis-full: raised, same file", sks, echoes(objects))
        second.wall_s = time.monotonic() - started
        second.notes.insert(0, f"submit exit {code2}")
        delivered = [str(r["id"]) for r in result_lines(workdir / "results-2.jsonl")]
        # from the first submit's mark: the whole file's history, both submits' model calls
        second.verdict = check_run(second.scenario, client, objects, mark, delivered)
        problems2 = _problems(second) + ([f"submit exit {code2}"] if code2 != 0 else [])
        shared = _fleet_checks(fleet, client.redis, sks)
        first.goal = verdict_of(first_problems + shared)
        second.goal = verdict_of(problems2 + shared)
        second.notes.extend(["log digest:", *log_digest(fleet.logs), *remove_dumps(fleet.logs)])
        client.close()
    return [first, second]


def enqueued_of(line: str) -> int:
    """K of the submit's line "... enqueued K of N sessions ..." (0 when it names none)."""
    found = re.search(r"enqueued ([\d,]+) of", line)
    return int(found.group(1).replace(",", "")) if found else 0


def _fleet_checks(fleet: Fleet, r: Any, sks: list[str]) -> list[str]:
    problems = []
    found = tracebacks(fleet)
    if found:
        problems.append(f"{found} tracebacks in the logs")
    exited = exited_workers(fleet)
    if exited:
        problems.append(f"workers exited: {', '.join(exited)}")
    half = half_applied(r, sks)
    if half:
        problems.append(f"{half} half-applied endings")
    return problems


def _problems(row: Row) -> list[str]:
    out = history_problems(row)
    if row.finished < row.expected:
        out.append(f"{row.expected - row.finished} not finished")
    if row.step_failed:
        out.append(f"{row.step_failed} step_failed")
    if row.other_errors:
        out.append(f"{row.other_errors} other errors")
    return out


# --- aof-full ---------------------------------------------------------------------------------


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` mounted at `path` (root), unmounted after, even on failure."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(path: Path) -> Path:
    """A file that takes every free byte of `path`'s file system."""
    filler = path / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        for size in (1 << 20, 4096, 1):  # big blocks, then the last bytes
            with contextlib.suppress(OSError):
                while os.write(fd, b"\0" * size):
                    pass
    finally:
        os.close(fd)
    return filler


def refuses(r: Any) -> str:
    """What Redis answers a write now ("" when it takes it)."""
    try:
        r.set("cq:chaos:probe", "1", ex=60)
    except redis.RedisError as exc:
        return str(exc)[:120]
    return ""


def scenario_aof_full(root: Path, n: int, deadline_s: float, seed: int) -> list[Row]:
    workdir = root / "aof-full"
    logs = workdir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with tmpfs(workdir / "disk", TMPFS_SIZE) as disk:
        fleet = private_fleet(disk, log_dir=logs, aof=True)
        with fleet:
            client = Client(fleet.redis_url, config=fleet.config())
            objects = weather_objects(f"aof-{uuid.uuid4().hex[:6]}", n)
            ids = [o["id"] for o in objects]
            spec_file = write_lines(workdir / "sessions.jsonl", objects)
            mark = mark_run(fleet.replay_url)
            started = time.monotonic()
            out = workdir / "results.jsonl"
            cmd = [sys.executable, "-m", "producer.cli", "submit", str(spec_file), "--out",
                   str(out), "--timeout-s", str(deadline_s)]  # fmt: skip
            producer = fleet.spawn(cmd, "submit", env=fleet.worker_env())
            while finished_count(client.redis, _sks(client, ids)) < n // 3:
                if time.monotonic() - started > deadline_s:
                    break
                time.sleep(0.1)
            before = finished_count(client.redis, _sks(client, ids))
            filler = fill(disk)
            full_at = time.monotonic()
            answer = ""
            while not answer and time.monotonic() - full_at < 10:
                answer = refuses(client.redis)
                time.sleep(0.2)
            # read all along: an idle connection's health check (a PING) would be refused
            during = before
            while time.monotonic() - full_at < FULL_S:
                with contextlib.suppress(redis.RedisError):
                    during = finished_count(client.redis, _sks(client, ids))
                time.sleep(0.5)
            filler.unlink()
            freed_at = time.monotonic()
            resumed_s = None
            while time.monotonic() - freed_at < deadline_s:
                with contextlib.suppress(redis.RedisError):
                    if finished_count(client.redis, _sks(client, ids)) > during:
                        resumed_s = time.monotonic() - freed_at
                        break
                time.sleep(0.1)
            try:
                code: int | None = producer.wait(timeout=deadline_s)
            except subprocess.TimeoutExpired:
                code = None
            sks = _sks(client, ids)
            wait_ended(client.redis, sks, started + deadline_s)
            row = tally(client.redis, "aof-full: AOF disk full 20 s", sks, weather_answers(objects))
            row.wall_s = time.monotonic() - started
            delivered = [str(r["id"]) for r in result_lines(out)]
            row.verdict = check_run(row.scenario, client, objects, mark, delivered)
            row.notes[:0] = [
                f"disk filled with {before}/{n} finished; Redis answered a write: {answer!r}",
                f"finished while full: {during - before}; progress resumed "
                + (
                    f"{resumed_s:.1f} s after the space came back"
                    if resumed_s is not None
                    else "NEVER"
                ),
                f"producer exit {code}; steps run more than once: {spent_tries(client.redis)}",
            ]
            problems = _problems(row) + _fleet_checks(fleet, client.redis, sks)
            if not answer.startswith("MISCONF"):
                problems.append("Redis never refused a write (the disk did not fill)")
            if resumed_s is None or resumed_s > RESUMED_WITHIN_S:
                problems.append(f"progress not resumed within {RESUMED_WITHIN_S:.0f} s")
            if code != 0:
                problems.append(f"producer exit {code}")
            dead = dead_letters(client.redis)
            if dead:
                problems.append("dead letters")
            row.goal = verdict_of(problems)
            row.notes.extend([*dead, "log digest:", *log_digest(logs), *remove_dumps(logs)])
            client.close()
    return [row]


def _sks(client: Client, ids: list[str]) -> list[str]:
    claims = client.claims(ids)
    return [c.sk if c is not None else f"unclaimed:{i}" for i, c in zip(ids, claims, strict=True)]
