"""`cchatq batch` and `submit` output without a fleet: a batch's status word and ISO times,
the few lines `batch status` prints, which failed sessions `batch retry` chooses, counts in
the singular, every rejected line with --all-issues, and a spec file that cannot be read."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from producer.batches import BatchSummary, FailedSession, iso_utc
from producer.cli import main, shown_status
from producer.cli_batch import shown_summary
from producer.cli_common import EXIT_REJECTED, plural
from producer.retry_choice import UnknownCodes, choose, fails_again, parse_codes
from producer.specfile import SpecFileError, load_spec_file

T0_MS = 1_735_732_800_000  # 2025-01-01T12:00:00Z


def summary(**fields: object) -> BatchSummary:
    base: dict[str, object] = {"batch": "b1", "submitted_ms": T0_MS, "sessions": 3}
    return BatchSummary(**{**base, **fields})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fields", "word"),
    [
        ({"sessions": 0}, "validating"),
        ({"states": {"queued": 2, "done": 1}, "outcomes": {"ok": 1}}, "in_progress"),
        ({"states": {"running": 1, "done": 2}, "cancelling": 1}, "cancelling"),
        ({"states": {"done": 3}, "outcomes": {"ok": 2, "provider_error": 1}}, "completed"),
        ({"states": {"done": 3}, "outcomes": {"provider_error": 3}}, "failed"),
        ({"states": {"done": 3}, "outcomes": {"ok": 2, "cancelled": 1}}, "cancelled"),
        ({"states": {"done": 2, "gone": 1}, "outcomes": {"ok": 2}}, "expired"),
        ({"states": {"running": 1, "gone": 2}}, "in_progress"),
    ],
)
def test_the_status_word(fields: dict[str, object], word: str) -> None:
    assert summary(**fields).status == word


def test_times_are_iso_utc_and_completed_only_once_all_ended() -> None:
    assert iso_utc(T0_MS) == "2025-01-01T12:00:00Z"
    running = summary(states={"running": 1, "done": 2}, last_finished_ms=T0_MS + 5000)
    assert running.completed_ms is None
    assert running.to_json()["completed_at"] is None
    done = summary(states={"done": 3}, outcomes={"ok": 3}, last_finished_ms=T0_MS + 61_000)
    assert done.to_json() == {
        "batch": "b1", "status": "completed", "sessions": 3, "states": {"done": 3},
        "outcomes": {"ok": 3}, "submitted_at": "2025-01-01T12:00:00Z",
        "completed_at": "2025-01-01T12:01:01Z",
    }  # fmt: skip


def test_batch_status_prints_a_few_lines() -> None:
    done = summary(
        states={"done": 3},
        outcomes={"ok": 2, "provider_error": 1},
        last_finished_ms=T0_MS + 1000,
    )
    assert shown_summary(done).splitlines() == [
        "batch b1: completed",
        "  sessions:     3 sessions (3 done)",
        "  outcomes:     2 ok, 1 provider_error",
        "  submitted_at: 2025-01-01T12:00:00Z",
        "  completed_at: 2025-01-01T12:00:01Z",
    ]
    one = summary(sessions=1, states={"queued": 1}, cancelling=1)
    assert shown_summary(one).splitlines()[:4] == [
        "batch b1: cancelling",
        "  sessions:     1 session (1 queued)",
        "  outcomes:     none yet",
        "  cancelling:   1 session",
    ]


def test_plurals() -> None:
    assert [plural(n, "session") for n in (0, 1, 2)] == ["0 sessions", "1 session", "2 sessions"]
    assert plural(1, "mismatch", "mismatches") == "1 mismatch"
    assert plural(3, "mismatch", "mismatches") == "3 mismatches"


def test_status_of_a_session_shows_iso_times() -> None:
    meta = {"state": "done", "submitted_ms": str(T0_MS), "finished_ms": str(T0_MS + 2500)}
    assert shown_status(meta) == {
        "state": "done",
        "submitted_at": "2025-01-01T12:00:00Z",
        "finished_at": "2025-01-01T12:00:02Z",
    }


# --- batch retry ----------------------------------------------------------------------------


def failed(n: int, code: str, message: str = "") -> FailedSession:
    return FailedSession(f"id{n}", f"sk{n}", code, message)


FAILED = [
    failed(1, "provider_error", "HTTP 400: bad request"),
    failed(2, "provider_error", "HTTP 404: no such model"),
    failed(3, "provider_unavailable", "HTTP 503 after 3 tries"),
    failed(4, "provider_timeout"),
    failed(5, "invalid_request", "no model"),
    failed(6, "tool_call_limit"),
    failed(7, "guest_error", "no _start"),
    failed(8, "cancelled"),
]


def ids(sessions: list[FailedSession]) -> list[str]:
    return [s.spec_id for s in sessions]


def test_retry_skips_what_fails_the_same_way_by_default() -> None:
    choice = choose(FAILED, None, include_4xx=False)
    assert ids(choice.chosen) == ["id3", "id4", "id6", "id8"]
    assert choice.skipped == {"provider_error": 2, "invalid_request": 1, "guest_error": 1}
    line = choice.skipped_line("b1")
    assert line.startswith("batch b1: 4 failed sessions skipped") and "\n" not in line
    assert "2 provider_error: the backend refused the request (HTTP 4xx" in line
    assert "--include-4xx" in line


def test_retry_runs_them_when_asked() -> None:
    assert ids(choose(FAILED, None, include_4xx=True).chosen) == [f"id{n}" for n in range(1, 9)]
    named = choose(FAILED, frozenset({"provider_error", "provider_timeout"}), include_4xx=False)
    assert ids(named.chosen) == ["id1", "id2", "id4"] and named.skipped == {}
    assert choose(FAILED, frozenset({"step_failed"}), include_4xx=False).chosen == []


@pytest.mark.parametrize(
    ("message", "again"),
    [
        ("HTTP 400: bad", True),
        ("HTTP 422: unprocessable", True),
        ("HTTP 408: timeout", False),
        ("HTTP 409: conflict", False),
        ("HTTP 429: slow down", False),
        ("HTTP 500: oops", False),
        ("request to backend x failed: ValueError", True),  # cannot be made
    ],
)
def test_which_provider_errors_fail_again(message: str, again: bool) -> None:
    assert fails_again(failed(1, "provider_error", message)) is again


def test_codes_are_checked() -> None:
    assert parse_codes("provider_error, tool_call_limit") == {"provider_error", "tool_call_limit"}
    with pytest.raises(UnknownCodes) as caught:
        parse_codes("provider_error,nope")
    shown = str(caught.value)
    assert shown.startswith("unknown code 'nope'; valid codes: cancelled, deadline_exceeded")
    assert "\n" not in shown and "ok" not in shown.split(": ", 1)[1].split(", ")


def test_unknown_codes_are_one_line_before_redis(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")  # never reached
    assert main(["batch", "retry", "b1", "--codes", "TIMEOUT"]) == EXIT_REJECTED
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("cchatq batch retry --codes: unknown code 'TIMEOUT'; valid codes: ")


# --- submit: every issue, files that cannot be read ------------------------------------------


@pytest.fixture()
def no_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    for name in [k for k in os.environ if k.startswith("CCHATQ_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")  # rejected before it is needed
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_all_issues_lists_every_rejected_line(
    no_config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = no_config / "bad.jsonl"
    path.write_text("{nope\n" * 25)  # one issue a line: not JSON
    assert main(["submit", str(path)]) == EXIT_REJECTED
    short = capsys.readouterr().err.splitlines()
    assert short[-1] == "... and 5 more (--all-issues lists them all)" and len(short) == 22
    assert main(["submit", str(path), "--all-issues"]) == EXIT_REJECTED
    listed = capsys.readouterr().err.splitlines()
    assert listed[0] == "rejected, nothing enqueued:"
    assert [line.split(":")[1] for line in listed[1:]] == [str(n) for n in range(1, 26)]
    with pytest.raises(SpecFileError) as caught:
        load_spec_file(path)
    assert len(caught.value.listing(None).splitlines()) == 25


@pytest.mark.parametrize(
    ("name", "said"),
    [("nope.jsonl", "no such file"), (".", "is a directory, not a file")],
)
def test_a_spec_file_that_cannot_be_read(
    no_config: Path, capsys: pytest.CaptureFixture[str], name: str, said: str
) -> None:
    assert main(["submit", name]) == EXIT_REJECTED
    assert capsys.readouterr().err == f"rejected, nothing enqueued:\n{name}: {said}\n"


def test_run_with_a_missing_stdin_file(no_config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "prog.wasm", "--stdin", "nope.txt"]) == EXIT_REJECTED
    assert capsys.readouterr().err == "rejected: --stdin nope.txt: no such file\n"
