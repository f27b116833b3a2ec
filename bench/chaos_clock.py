"""The chaos scenario `clock-skew` (`python -m bench.chaos clock-skew`): the fleet on two
"hosts" whose wall clocks are off by minutes, each worker process started under libfaketime
(fixtures/clock_skew.py; `make faketime`): host A, 2 minutes ahead, runs an llm worker and the
control worker (the reconciler); host B, 2 minutes behind, runs another llm worker and the
tools worker. The producer's clock is right. The reconciler is made to bite: no progress for
5 s counts as a stall, a pass every second, and a fleet deadline of 100 s, shorter than the
4 minutes between the hosts.

A batch of weather sessions (round, tool call, round), first on the same fleet with right
clocks (the baseline: a 5 s stall on 2 cores nudges sessions that wait in a queue, whatever
the clocks), then on the skewed hosts, and what a wall-clock comparison would cost, read from
Redis, the replay server and the workers' logs:

- extra model calls: the replay server's requests beyond the rounds the records hold (goal
  <= 0.5% of the rounds);
- sessions ended early: deadline_exceeded bodies (goal 0, and every session ok);
- leases taken from live workers: "lease of a process that is gone taken over" lines, and
  consumers declared dead ("stopped beating") while no worker was stopped (goal 0);
- the reconciler's nudges and its overdue ends, from its reconciler.pass events (shown).
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests

from bench.chaos_fleet import (
    expected,
    problems_of,
    verdict_of,
    wait_in_process,
    weather_objects,
)
from bench.chaos_report import Row, dead_letters, log_digest, remove_dumps, tally
from bench.history_read import check_run, mark_run
from fixtures.clock_skew import missing_reason, skewed_env
from producer.client import Client
from producer.fleet import Fleet
from producer.specfile import load_spec_from_objects
from schemas import keys
from schemas.session_record import read_record

SKEW_S = 120
# the reconciler made to bite: a wall-clock comparison would find live sessions stalled and
# past the deadline (100 s is less than the 240 s between the two hosts)
RECONCILER_ENV = {
    "CCHATQ_STALL_AFTER_S": "5",
    "CCHATQ_RECONCILE_EVERY_S": "1",
    "CCHATQ_SESSION_DEADLINE_S": "100",
}
EXTRA_CALLS_GOAL = 0.005  # of the rounds
TAKE_OVER_LINE = "lease of a process that is gone taken over"
SWEPT_LINE = "stopped beating"


@dataclass
class SkewCounts:
    """What clocks that disagree could cost a batch."""

    rounds: int = 0  # the rounds its records hold (one model call each)
    model_calls: int = 0  # the replay server's requests while it ran
    ended_early: int = 0  # deadline_exceeded bodies
    take_overs: int = 0  # leases taken over (no worker was stopped: from live ones)
    swept: int = 0  # consumers declared dead, their messages handed out again
    nudged: int = 0  # sessions the reconciler re-drove
    overdue: int = 0  # sessions the reconciler ended past the deadline

    @property
    def extra_calls(self) -> int:
        return self.model_calls - self.rounds


def count_skew(r: Any, sks: list[str], model_calls: int, logs: Path) -> SkewCounts:
    counts = SkewCounts(model_calls=model_calls)
    for start in range(0, len(sks), 1000):
        for raw in r.mget([keys.record(sk) for sk in sks[start : start + 1000]]):
            if raw is None:
                continue
            record = read_record(raw).record
            transcript = record.get("transcript") or []
            counts.rounds += sum(1 for m in transcript if m.get("role") == "assistant")
            error = (record.get("body") or {}).get("error")
            if isinstance(error, dict) and error.get("code") == "deadline_exceeded":
                counts.ended_early += 1
    for _, fields in r.xrange(keys.TRACE):
        for event in keys.trace_events(fields):
            if event.get("event") == "reconciler.pass":
                counts.nudged += int(event.get("nudged") or 0)
                counts.overdue += int(event.get("overdue") or 0)
    for log in sorted(logs.glob("*.log")):
        text = log.read_text(errors="replace")
        counts.take_overs += text.count(TAKE_OVER_LINE)
        counts.swept += text.count(SWEPT_LINE)
    return counts


def measured_skew_s(env: dict[str, str]) -> float:
    """How far off a process started with `env` reads the wall clock (a probe of the same
    mechanism the workers start under)."""
    probe = [sys.executable, "-c", "import time; time.sleep(0.01); print(time.time())"]
    before = time.time()
    out = subprocess.run(probe, env=env, capture_output=True, text=True, timeout=30, check=True)
    return float(out.stdout) - (before + time.time()) / 2


def start_skewed_fleet(workdir: Path, skew_s: int) -> tuple[Fleet, dict[str, float]]:
    """Redis and the replay server (right clocks), then host A's workers (llm, control),
    `skew_s` ahead, and host B's (llm, tools), `skew_s` behind (0: right clocks, under
    libfaketime all the same); the skew each host's processes read, as probed."""
    fleet = Fleet(workdir=workdir)
    fleet.ensure_redis(private=True)
    fleet.start_replay()
    hosts = {"A": skewed_env(skew_s, workdir / "a"), "B": skewed_env(-skew_s, workdir / "b")}
    for queue, host in (("llm", "A"), ("control", "A"), ("llm", "B"), ("tools", "B")):
        fleet.start_worker(queue, extra_env={**RECONCILER_ENV, **hosts[host]})
    fleet.wait_served(("llm", "control", "tools"), timeout_s=120)
    probes = {host: measured_skew_s(fleet.worker_env(env)) for host, env in hosts.items()}
    return fleet, probes


def scenario_clock_skew(root: Path, n: int, deadline_s: float, seed: int) -> list[Row]:
    reason = missing_reason()
    if reason is not None:
        return [
            Row(
                f"clock-skew: hosts {SKEW_S:+d} s and {-SKEW_S:+d} s",
                n,
                goal="- (not run: " + reason + ")",
            )
        ]
    baseline = run_hosts(root / "clock-skew-baseline", 0, n, deadline_s, seed)
    baseline.goal = "-"
    return [baseline, run_hosts(root / "clock-skew", SKEW_S, n, deadline_s, seed)]


def run_hosts(workdir: Path, skew_s: int, n: int, deadline_s: float, seed: int) -> Row:
    """One batch on hosts `skew_s` ahead and behind (0: the baseline, right clocks)."""
    name = f"clock-skew: hosts {skew_s:+d} s and {-skew_s:+d} s"
    if not skew_s:
        name = "clock-skew: baseline, right clocks"  # started as the skewed ones are
    workdir.mkdir(parents=True, exist_ok=True)
    fleet, probes = start_skewed_fleet(workdir, skew_s)
    with fleet:
        client = Client(fleet.redis_url)
        warm = client.enqueue(load_spec_from_objects(weather_objects(f"warm-{seed}", 20)))
        wait_in_process(client, warm, 120)
        root_url = fleet.replay_url.removesuffix("/v1")
        requests.post(f"{root_url}/reset", timeout=5).raise_for_status()  # not the warm-up's
        client.redis.delete(keys.TRACE)  # the reconciler's passes from here on
        objects = weather_objects(f"skew-{uuid.uuid4().hex[:6]}", n)
        mark, delivered = mark_run(fleet.replay_url), list[str]()
        sub = client.enqueue(load_spec_from_objects(objects))
        wall = wait_in_process(client, sub, deadline_s, delivered)
        row = tally(client.redis, name, sub.order, expected(objects))
        row.wall_s = wall
        row.verdict = check_run(row.scenario, client, objects, mark, delivered)
        calls = int(requests.get(f"{root_url}/stats", timeout=5).json()["requests"])
        counts = count_skew(client.redis, sub.order, calls, fleet.logs)
        row.notes[:0] = notes(counts, probes)
        row.goal = verdict_of(problems_of(row) + skew_problems(row, counts))
        row.notes.extend(dead_letters(client.redis))
        row.notes.extend(["log digest:", *log_digest(fleet.workdir), *remove_dumps(fleet.workdir)])
        client.close()
    return row


def notes(counts: SkewCounts, probes: dict[str, float]) -> list[str]:
    rounds = max(counts.rounds, 1)
    share = 100 * counts.extra_calls / rounds
    shown = ", ".join(f"{host} {skew:+.1f} s" for host, skew in probes.items())
    lines = [f"hosts' clocks as probed: {shown}"]
    if any(abs(skew) >= 1 for skew in probes.values()):
        lines.append(
            "(trace events are stamped on their host's clock, shown only: quiet times between "
            "two hosts' events below are off by the skew)"
        )
    return [
        *lines,
        f"extra model calls: {counts.extra_calls} / {counts.rounds} rounds ({share:.2f}%; "
        f"model requests {counts.model_calls})",
        f"sessions ended early (deadline_exceeded): {counts.ended_early}",
        f"leases taken over from live workers: {counts.take_overs}; consumers declared dead: "
        f"{counts.swept}",
        f"reconciler: {counts.nudged} nudges of sessions with no progress, {counts.overdue} "
        "ended past the deadline",
    ]


def skew_problems(row: Row, counts: SkewCounts) -> list[str]:
    problems = []
    if row.ok < row.expected:
        problems.append(f"{row.expected - row.ok} not ok")
    if counts.extra_calls > EXTRA_CALLS_GOAL * counts.rounds:
        problems.append(f"{counts.extra_calls} extra model calls")
    if counts.ended_early:
        problems.append(f"{counts.ended_early} ended early")
    if counts.take_overs or counts.swept:
        problems.append(f"{counts.take_overs + counts.swept} taken from live workers")
    return problems
