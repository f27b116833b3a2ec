"""The rate bench's figures (bench/rate_figures.py) on synthetic timelines, and the pieces of
bench/rate.py that need no fleet: the definitions must hold before a 4-minute run is read."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import rate
from bench import rate_figures as rf

T0 = 1_000_000.0  # a whole epoch second: the scenario's t0


def events(t0: float = T0) -> rf.Events:
    return rf.Events(t0, halved_at=t0 + 60, restored_at=t0 + 120, joined_at=t0 + 150)


def steady(start: int, seconds: int, accepted: int, refused: int = 0) -> list[list[int]]:
    return [[start + s, accepted, refused] for s in range(seconds)]


def ideal_run(sessions: int = 3600) -> list[list[int]]:
    """A controller that keeps exactly to the limit: 20/s, 10/s from 60 s, 20/s from 120 s."""
    t = int(T0)
    timeline = steady(t, 60, 20) + steady(t + 60, 60, 10) + steady(t + 120, 200, 20)
    left, out = sessions, []
    for second, acc, ref in timeline:
        taken = min(acc, left)
        left -= taken
        out.append([second, taken, ref])
    return out


def test_a_window_weighs_each_second_by_its_overlap() -> None:
    timeline = [[10, 4, 2], [11, 8, 0]]
    assert rf.window(timeline, 10, 12) == (12, 2)
    assert rf.window(timeline, 10.5, 11.25) == (2 + 2, 1)
    assert rf.window(timeline, 12, 20) == (0, 0)


def test_utilisation_is_accepted_over_what_the_limit_allowed() -> None:
    timeline = steady(100, 10, 18)
    assert rf.utilisation(timeline, 100, 110, 20) == pytest.approx(0.9)
    assert rf.utilisation(timeline, 105, 110, 10) == pytest.approx(1.8)
    assert rf.utilisation(timeline, 110, 105, 20) is None  # an empty phase


def test_the_429_share_counts_refused_over_all_requests_in_the_window() -> None:
    timeline = steady(100, 10, 19, 1) + steady(110, 10, 20)
    assert rf.share_429(timeline) == pytest.approx(10 / 400)
    assert rf.share_429(timeline, 110, 120) == 0
    assert rf.share_429(timeline, 200, 210) is None


def test_the_backlog_ends_when_fewer_than_two_seconds_worth_are_left() -> None:
    # 3600 sessions: 1200 by 60 s, 600 more by 120 s, 1800 at 20/s: the last 40 go in 208-210
    timeline = ideal_run()
    end = rf.backlog_end(timeline, events(), 3600)
    assert end == T0 + 209  # after second 208, 20 were left (< 40)
    # at the halved limit the threshold is 20: 1220 left after second 60 would not do
    assert rf.backlog_end(steady(int(T0), 70, 0), events(), 10) == T0 + 1
    # sessions that failed leave the backlog when they end
    failed_at = [T0 + 5.5] * 3580
    assert rf.backlog_end(steady(int(T0), 10, 0), events(), 3600, failed_at) == T0 + 6


def test_no_backlog_end_while_sessions_were_left() -> None:
    assert rf.backlog_end(steady(int(T0), 30, 20), events(), 3600) is None


def test_recovery_is_counted_from_the_restore_to_the_end_of_a_good_3_s_average() -> None:
    t = int(T0)
    immediate = steady(t + 110, 10, 10) + steady(t + 120, 30, 20)
    assert rf.recovery_s(immediate, events(), None) == 3  # seconds 120-122
    slow = steady(t + 120, 10, 10) + steady(t + 130, 20, 18)
    # 16/s on average (80% of 20): 129-131 has 10 + 18 + 18 = 46 < 48, 130-132 has 54
    assert rf.recovery_s(slow, events(), None) == 13
    assert rf.recovery_s(slow, events(), until=T0 + 132) is None  # the backlog ended first
    late = rf.Events(T0, T0 + 60, T0 + 120.4, T0 + 150)  # the restore 0.4 s late
    assert rf.recovery_s(immediate, late, None) == pytest.approx(3.6)
    assert rf.recovery_s(steady(t + 120, 60, 15), events(), None) is None


def test_an_ideal_run_meets_every_goal() -> None:
    timeline = ideal_run()
    limits = {"accepted": 3600, "refused": 0, "timeline": timeline}
    fig = rf.figures("openai", "adaptive", limits, events(), {"ok": 3600}, [], 3600)
    assert fig.util == [pytest.approx(1.0)] * 3
    assert fig.t_end_s == 209
    assert fig.share_429 == 0 and fig.share_429_join == 0
    assert fig.recovery_s == 3
    assert all(rf.verdicts(fig))
    lines = rf.table([fig])
    assert lines[0].split()[:3] == ["protocol", "mode", "util"]
    assert "NOT MET" not in lines[2] and "100.0% met" in lines[2]


def test_a_slow_controller_fails_its_goals_and_says_which() -> None:
    t = int(T0)
    timeline = steady(t, 60, 10, 1) + steady(t + 60, 60, 10) + steady(t + 120, 100, 12, 2)
    limits = {"accepted": 0, "refused": 0, "timeline": timeline}
    outcomes = {"ok": 3000, "provider_unavailable": 4, "unfinished": 7}
    fig = rf.figures("gemini", "before", limits, events(), outcomes, [T0 + 30] * 4, 3011)
    assert fig.util[0] == pytest.approx(0.5) and fig.util[1] == pytest.approx(1.0)
    assert fig.t_end_s is None and fig.util[2] == pytest.approx(0.6)  # to the timeline's end
    assert fig.failed == {"provider_unavailable": 4} and fig.unfinished == 7
    assert fig.recovery_s is None
    assert rf.verdicts(fig) == [False, True, False, False, False, False, False, False]
    row = rf.table([fig])[2]
    assert "50.0% NOT MET" in row and "never NOT MET" in row and "4 NOT MET" in row
    assert fig.as_json()["failed"] == {"provider_unavailable": 4}


def test_scaled_events_scale_the_margins_and_the_join_window() -> None:
    e = rf.Events(T0, T0 + 15, T0 + 30, T0 + 37.5, margin_s=2.5, join_window_s=5)
    timeline = steady(int(T0), 15, 20) + steady(int(T0) + 15, 15, 10) + steady(int(T0) + 30, 30, 20)
    timeline[40][2] = 5  # second 40, inside [37.5, 42.5)
    fig = rf.figures("openai", "adaptive", {"timeline": timeline}, e, {"ok": 10}, [], 10_000)
    assert fig.util == [pytest.approx(1.0)] * 3
    assert fig.share_429_join == pytest.approx(5 / 105)


def test_sessions_are_one_call_each_on_their_protocol() -> None:
    specs = rate.session_specs("gemini", "run", 3)
    assert [s.id for s in specs] == ["run/0", "run/1", "run/2"]
    assert {s.provider for s in specs} == {"replay-gemini"}
    assert {s.model for s in specs} == {"replay-plain"}
    assert rate.session_specs("anthropic", "run", 1)[0].model == "replay/plain"


def test_before_turns_adaptive_control_off_on_every_backend() -> None:
    backends = rate.static_backends("http://127.0.0.1:1/v1")
    assert {"replay-openai", "replay-anthropic", "replay-gemini"} <= set(backends)
    assert all(b["adaptive"] is False for b in backends.values())


def test_an_outcome_is_ok_or_the_error_code() -> None:
    assert rate.outcome({"status": "ok", "body": {"choices": []}}) == "ok"
    failed = {"status": "error", "body": {"error": {"code": "provider_unavailable"}}}
    assert rate.outcome(failed) == "provider_unavailable"
    assert rate.outcome({"status": "cancelled"}) == "cancelled"


def test_rate_control_lines_are_read_from_the_worker_logs(tmp_path: Path) -> None:
    prefix = "[2026-01-01 00:00:00,000: INFO/MainProcess] step=ab.r0 worker.edges.rate_control: "
    (tmp_path / "llm-1.log").write_text(
        f"{prefix}rate control replay-openai/-/replay/plain: slow start, window 32.0, pace none\n"
        "something else\n"
        f"{prefix}rate control replay-openai/-/replay/plain: 429 cut, window 8.0, pace 4.48 req/s\n"
    )
    assert rate.rate_control_lines(tmp_path) == [
        ("replay-openai/-/replay/plain", "slow start"),
        ("replay-openai/-/replay/plain", "429 cut"),
    ]


def test_the_run_shape_is_summed_per_10_s() -> None:
    assert rate.per_ten_s(steady(int(T0), 12, 2, 1), T0) == "0s:20/10 10s:4/2"


def test_the_command_line_refuses_unknown_protocols() -> None:
    with pytest.raises(SystemExit):
        rate.main(["--protocols", "openai,cohere"])
