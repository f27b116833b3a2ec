"""A batch's live progress (producer/report.py): driven with a rich Console writing to a
StringIO, on a terminal and off one, with an injected clock (no sleeps, no wall time)."""

from __future__ import annotations

import io
from typing import Any

from rich.console import Console

from producer.lookups import SessionLookups
from producer.report import Progress, batch_states, summary
from producer.submitting import Submission
from producer.waiting import STATE_SAMPLE


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def ok() -> dict[str, Any]:
    return {"status": "ok", "metrics": {}}


def failed(code: str) -> dict[str, Any]:
    return {"status": "error", "body": {"error": {"code": code}}}


def console(terminal: bool) -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=terminal, width=160, color_system=None), out


def frame(progress: Progress) -> str:
    """One frame of the terminal display, as rich's refresh thread draws it."""
    con, out = console(True)
    con.print(progress)
    return out.getvalue()


def test_a_terminal_frame_shows_done_elapsed_eta_rate_states_and_failures_by_code() -> None:
    clock = Clock()
    progress = Progress(10, console(True)[0], states=lambda: (4, 2), clock=clock)
    assert progress.terminal
    progress.tick()  # the first look at the states
    clock.now += 20
    progress.update("a", ok())
    progress.update("b", failed("provider_error"))
    progress.update("c", failed("tool_error"))
    progress.update("d", failed("provider_error"))
    shown = frame(progress)
    assert "4/10" in shown
    assert "elapsed 0:00:20" in shown
    assert "0.20 sessions/s" in shown  # 4 in 20 s
    assert "ETA 0:00:30" in shown  # 6 left at 0.2/s
    # the sample said 4 of 6 queued; 6 are left
    assert "queued 4  running 2  done 4 (ok 1)" in shown
    assert "failed: provider_error 2, tool_error 1" in shown


def test_the_terminal_frame_is_redrawn_on_a_timer_not_only_when_a_session_ends() -> None:
    clock = Clock()
    progress = Progress(2, console(True)[0], clock=clock)
    assert "elapsed 0:00:00" in frame(progress) and "ETA -:--:--" in frame(progress)
    clock.now += 75  # nothing finished
    assert "elapsed 0:01:15" in frame(progress)
    assert "pending 2  done 0 (ok 0)" in frame(progress)  # no look at the states yet


def test_the_rate_and_eta_count_only_sessions_finished_by_this_run() -> None:
    """Resubmitted ids whose stored results come back at once do not inflate the rate."""
    clock = Clock()
    progress = Progress(8, console(True)[0], already={"old1", "old2", "old3"}, clock=clock)
    for sk in ("old1", "old2", "old3"):
        progress.update(sk, ok())
    clock.now += 10
    progress.update("new1", ok())
    now = progress.snapshot()
    assert (now.done, now.earlier) == (4, 3)
    assert now.rate == 0.1  # 1 session in 10 s, not 4
    assert now.eta_s == 40  # 4 left at 0.1/s
    shown = frame(progress)
    assert "4/8" in shown and "0.10 sessions/s" in shown and "ETA 0:00:40" in shown


def test_queued_and_running_follow_the_states_sample_against_those_left_now() -> None:
    clock = Clock()
    looks: list[tuple[int, int]] = [(3, 1)]
    progress = Progress(4, console(True)[0], states=lambda: looks[-1], clock=clock)
    progress.tick()
    assert progress.snapshot().counts() == "queued 3  running 1  done 0 (ok 0)"
    looks.append((0, 4))
    clock.now += 0.5
    progress.tick()  # too soon: the last look stands
    assert progress.snapshot().queued == 3
    progress.update("a", ok())  # one ended since: the sample's share of the 3 left
    assert progress.snapshot().counts() == "queued 2  running 1  done 1 (ok 1)"
    clock.now += 1
    progress.tick()
    assert progress.snapshot().counts() == "queued 0  running 3  done 1 (ok 1)"


def test_a_failed_look_at_the_states_keeps_the_last_one() -> None:
    clock = Clock()
    answers: list[Any] = [(1, 1), ConnectionError("redis down")]

    def states() -> tuple[int, int]:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    progress = Progress(2, console(True)[0], states=states, clock=clock)
    progress.tick()
    clock.now += 5
    progress.tick()
    assert progress.snapshot().counts() == "queued 1  running 1  done 0 (ok 0)"


def test_off_a_terminal_a_plain_line_at_most_every_ten_seconds_and_a_final_one() -> None:
    clock = Clock()
    con, out = console(False)
    progress = Progress(4, con, already={"a"}, states=lambda: (1, 1), clock=clock)
    assert not progress.terminal
    progress.tick()
    progress.update("a", ok())
    clock.now += 9
    progress.update("b", failed("provider_error"))
    progress.tick()
    assert out.getvalue() == ""  # not yet 10 s
    clock.now += 1
    progress.tick()
    clock.now += 5
    progress.tick()
    progress.update("c", ok())
    progress.stop()  # the final line
    lines = out.getvalue().splitlines()
    assert lines == [
        "2/4  elapsed 0:00:10  ETA 0:00:20  0.10 sessions/s  queued 1  running 1  done 2 (ok 1)"
        "  failed: provider_error 1",
        "3/4  elapsed 0:00:15  ETA 0:00:07  0.13 sessions/s  queued 0  running 1  done 3 (ok 2)"
        "  failed: provider_error 1",
    ]
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()


def test_started_and_stopped_off_a_terminal_writes_lines_only() -> None:
    con, out = console(False)
    with Progress(2, con, states=lambda: (2, 0)) as progress:
        progress.update("a", ok())
        progress.update("b", ok())
    text = out.getvalue()
    assert text.startswith("2/2  elapsed 0:00:0") and text.endswith("done 2 (ok 2)\n")
    assert "\x1b" not in text and "\r" not in text


def test_started_and_stopped_on_a_terminal_leaves_the_last_frame_and_the_cursor_shown() -> None:
    """A Ctrl-C (or a timeout) in the wait stops the display through the context manager."""
    con, out = console(True)
    try:
        with Progress(3, con, states=lambda: (1, 1)) as progress:
            progress.update("a", failed("timeout"))
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass
    text = out.getvalue()
    assert "1/3" in text and "failed: timeout 1" in text
    assert text.endswith("\x1b[?25h")  # the cursor shown again, on a line of its own
    assert progress._ticker is not None and not progress._ticker.is_alive()


class FakeLookups(SessionLookups):
    def __init__(self) -> None:
        self.looked: list[list[str]] = []

    def state_counts(self, sks: Any) -> tuple[int, int]:
        self.looked.append(list(sks))
        return len(sks), 0


def test_batch_states_reads_the_pending_sessions_or_an_even_spread_of_them() -> None:
    client = FakeLookups()
    few = Submission(batch="b", namespace="default", order=["s1", "s2", "s3"], ids={})
    assert batch_states(client, few, {"s2"})() == (2, 0)
    assert client.looked[-1] == ["s1", "s3"]
    many = Submission(
        batch="b", namespace="default", order=[f"s{n}" for n in range(25_000)], ids={}
    )
    finished = {f"s{n}" for n in range(1000)}
    batch_states(client, many, finished)()
    looked = client.looked[-1]
    assert len(looked) <= STATE_SAMPLE
    assert looked[0] == "s1000" and int(looked[-1][1:]) > 24_000  # across the whole batch


class FakePipeline:
    def __init__(self, states: dict[str, bytes]) -> None:
        self.states = states
        self.asked: list[str] = []

    def hget(self, key: str, field: str) -> None:
        assert field == "state"
        self.asked.append(key)

    def execute(self) -> list[bytes | None]:
        return [self.states.get(key) for key in self.asked]


def test_state_counts_queued_versus_any_other_state_in_one_pipeline() -> None:
    from schemas import keys

    states = {keys.meta("a"): b"queued", keys.meta("b"): b"round 2", keys.meta("c"): b"queued"}
    lookups = SessionLookups()
    pipelines: list[FakePipeline] = []

    class Redis:
        def pipeline(self, transaction: bool) -> FakePipeline:
            pipelines.append(FakePipeline(states))
            return pipelines[-1]

    lookups.redis = Redis()
    assert lookups.state_counts(["a", "b", "c", "gone"]) == (2, 2)
    assert len(pipelines) == 1


def test_the_summary_table_stays() -> None:
    table = summary([ok(), failed("provider_error"), failed("provider_error")], 2.0)
    assert "errors" in table and "provider_error 2" in table
    assert "1.5 sessions/s" in table
