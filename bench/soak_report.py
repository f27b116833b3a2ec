"""make soak's report (bench/soak.py): the batches' rows and history verdicts summed into one
row, the memory and descriptor slopes, the kills and partitions, and the goal."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bench.chaos_fleet import verdict_of
from bench.chaos_report import Row, print_table
from bench.history import EXAMPLES, Verdict

# Verdict's counts, summed over the batches (the rest: run, log_judged, examples)
COUNTS = tuple(
    f.name for f in dataclasses.fields(Verdict) if f.name not in ("run", "log_judged", "examples")
)
UNITS = {"worker RSS": "MiB", "worker fds": "fds", "Redis used": "MiB"}


@dataclass
class Sample:
    at_s: float
    worker_rss_kb: int
    worker_fds: int
    redis_used_bytes: int


@dataclass
class Chaos:
    """What was done to the fleet: kills by kind, each partition's start (s into the soak),
    and why there were none when partitions were off ("" when on)."""

    kills: dict[str, int]
    partitions_s: list[float]
    partition_s: float
    partitions_off: str


def slope_per_hour(points: Sequence[tuple[float, float]]) -> float:
    """The least-squares slope of (seconds, value) points, per hour."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var = sum((x - mean_x) ** 2 for x, _ in points)
    if var == 0:
        return 0.0
    cov = sum((x - mean_x) * (y - mean_y) for x, y in points)
    return cov / var * 3600


def sum_verdicts(run: str, verdicts: Sequence[Verdict]) -> Verdict:
    """The batches' verdicts as one: every count summed, the model calls judged when some
    batch's were (those that were not add nothing to them), a few example ids per check."""
    counts: dict[str, Any] = {name: sum(getattr(v, name) for v in verdicts) for name in COUNTS}
    examples: dict[str, list[str]] = {}
    for v in verdicts:
        for check, ids in v.examples.items():
            found = examples.setdefault(check, [])
            found.extend(ids[: EXAMPLES - len(found)])
    return Verdict(
        run,
        log_judged=any(v.log_judged for v in verdicts),
        examples={check: tuple(ids) for check, ids in examples.items()},
        **counts,
    )


def sum_rows(scenario: str, rows: Sequence[Row]) -> Row:
    total = Row(scenario, sum(r.expected for r in rows))
    for r in rows:
        total.finished += r.finished
        total.ok += r.ok
        total.step_failed += r.step_failed
        total.other_errors += r.other_errors
        total.duplicates += r.duplicates
        total.hung += r.hung
    return total


def report(
    rows: Sequence[Row],
    samples: Sequence[Sample],
    chaos: Chaos,
    ttl_s: float,
    wall_s: float,
    dumps: list[str],
) -> int:
    """Print the soak's row and notes; 0 when its goal is met: every batch's history valid
    (bench/history.py), none lost, hung or with a tool call twice, and slopes fitted."""
    total = sum_rows("soak: all batches", rows)
    total.wall_s = wall_s
    verdicts = [r.verdict for r in rows if r.verdict is not None]
    total.verdict = sum_verdicts(total.scenario, verdicts)
    # once the first keys expire (or past half the run, when it is shorter than their TTL)
    flat = [s for s in samples if s.at_s >= min(ttl_s, wall_s / 2)]
    slopes = {
        "worker RSS": slope_per_hour([(s.at_s, s.worker_rss_kb / 1024) for s in flat]),
        "worker fds": slope_per_hour([(s.at_s, s.worker_fds) for s in flat]),
        "Redis used": slope_per_hour([(s.at_s, s.redis_used_bytes / 2**20) for s in flat]),
    }
    problems = [] if total.verdict.valid else ["history invalid"]
    lost = total.expected - total.finished
    problems += [f"{n} {what}" for n, what in ((lost, "not ended"), (total.duplicates,
                 "duplicates"), (total.hung, "hung")) if n]  # fmt: skip
    if len(flat) < 2:
        problems.append(f"no slopes ({len(flat)} samples after {min(ttl_s, wall_s / 2):.0f} s)")
    if len(verdicts) < len(rows):
        problems.append(f"{len(rows) - len(verdicts)} batches not judged")
    total.goal = verdict_of(problems)
    total.notes.append(f"batches {len(rows)}, each judged as a history of its own")
    judged = sum(1 for v in verdicts if v.log_judged)
    if judged < len(verdicts):
        total.notes.append(f"model calls judged in {judged} of {len(verdicts)} batches")
    total.notes.append(f"kills: {sum(chaos.kills.values())} ({dict(sorted(chaos.kills.items()))})")
    if chaos.partitions_off:
        total.notes.append(f"partitions: none ({chaos.partitions_off})")
    else:
        starts = ", ".join(f"{at / 60:.1f}" for at in chaos.partitions_s)
        total.notes.append(
            f"partitions: {len(chaos.partitions_s)} of {chaos.partition_s:.0f} s, the llm and "
            f"tools workers' host cut silently (at {starts or '-'} min)"
        )
    for name, slope in slopes.items():
        total.notes.append(f"{name}: {slope:+.2f} {UNITS[name]}/hour over {len(flat)} samples")
    for s in samples[:: max(1, len(samples) // 12)]:
        total.notes.append(
            f"  at {s.at_s / 60:5.1f} min: workers {s.worker_rss_kb / 1024:.0f} MiB, "
            f"{s.worker_fds} fds; Redis {s.redis_used_bytes / 2**20:.1f} MiB"
        )
    total.notes.extend(f"  {v.line()}" for v in verdicts if not v.valid)
    total.notes.extend(n for r in rows for n in r.notes if n.startswith("duplicate"))
    total.notes.extend(dumps)
    print_table([total])
    return 0 if total.goal == "met" else 1
