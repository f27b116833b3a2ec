"""make soak's report (bench/soak_report.py): the batches' verdicts summed into one, whose
validity decides the goal, and the slopes it fits."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from bench.chaos_report import Row
from bench.history import Verdict
from bench.soak_report import Chaos, Sample, report, slope_per_hour, sum_verdicts


def verdict(run: str, **counts: int) -> Verdict:
    clean: dict[str, Any] = {
        "submitted": 40, "ended": 40, "lost": 0, "unexpected": 0, "double_endings": 0,
        "tool_calls": 40, "tool_answered_twice": 0, "tool_unanswered": 0,
    }  # fmt: skip
    return Verdict(run, log_judged=True, **{**clean, **counts})


def test_sum_verdicts_adds_every_count_and_keeps_a_few_examples() -> None:
    lost = Verdict(
        "batch 1", 40, 38, 2, 0, 0, 40, 0, 0, log_judged=True, model_calls=81, rounds=80,
        extra_unexplained=1, examples={"lost": ("s/1", "s/2"), "extra model calls": ("s/3",)},
    )  # fmt: skip
    twice = verdict("batch 2", tool_answered_twice=1, model_calls=80, rounds=80)
    twice = dataclasses.replace(twice, examples={"lost": ("t/1", "t/2")})
    total = sum_verdicts("soak", [verdict("batch 0"), lost, twice])
    assert (total.submitted, total.ended, total.lost) == (120, 118, 2)
    assert (total.tool_calls, total.tool_answered_twice) == (120, 1)
    assert (total.model_calls, total.rounds, total.extra_unexplained) == (161, 160, 1)
    assert total.examples == {"lost": ("s/1", "s/2", "t/1"), "extra model calls": ("s/3",)}
    assert not total.valid


def test_sum_verdicts_of_valid_batches_is_valid() -> None:
    total = sum_verdicts("soak", [verdict("batch 0"), verdict("batch 1")])
    assert total.valid and total.log_judged
    assert (total.submitted, total.ended) == (80, 80)


def test_slope_per_hour() -> None:
    assert slope_per_hour([(0.0, 10.0), (1800.0, 11.0), (3600.0, 12.0)]) == pytest.approx(2.0)
    assert slope_per_hour([(0.0, 10.0)]) == 0.0


def row(number: int, v: Verdict) -> Row:
    return Row(f"batch {number}", 40, finished=40, ok=40, verdict=v)


SAMPLES = [Sample(at_s, 200 * 1024, 60, 5 * 2**20) for at_s in (0.0, 100.0, 200.0, 300.0)]
CHAOS = Chaos({"llm main": 2}, [90.0, 180.0], 30.0, "")


def test_goal_met_only_with_a_valid_history_and_slopes(capsys: pytest.CaptureFixture[str]) -> None:
    valid = [row(0, verdict("batch 0")), row(1, verdict("batch 1"))]
    assert report(valid, SAMPLES, CHAOS, 400, 300, []) == 0
    out = capsys.readouterr().out
    assert "history valid" in out and "partitions: 2 of 30 s" in out
    assert "worker RSS: +0.00 MiB/hour over 2 samples" in out

    invalid = [row(0, verdict("batch 0")), row(1, verdict("batch 1", double_endings=1))]
    assert report(invalid, SAMPLES, CHAOS, 400, 300, []) == 1
    assert "NOT MET: history invalid" in capsys.readouterr().out

    assert report(valid, SAMPLES[:1], CHAOS, 400, 300, []) == 1
    assert "no slopes" in capsys.readouterr().out
