"""The history checker (bench/history.py) on synthetic histories: a clean run is valid with
its exact counts, and each check fails on the history made to break it."""

from __future__ import annotations

import dataclasses
from typing import Any

from bench.history import (
    History,
    Run,
    StoredRecord,
    Submitted,
    Verdict,
    judge,
    verdict_table,
)
from bench.history_read import first_user_text, submitted_of
from fixtures.replay.conversation import Usage
from fixtures.replay.request_log import LoggedRequest, conversation_id

SESSIONS = 3
ROUND_USAGE = (Usage(10, 5), Usage(30, 8))  # what the server bills each of the two rounds


def text(i: int) -> str:
    return f"[run {i}] Weather in Oslo?"


def request(i: int, round_no: int, seq: int, fault: str | None = None) -> LoggedRequest:
    status = {None: 200, "rate_limited": 429, "server_error": 500}[fault]
    usage = Usage() if fault else ROUND_USAGE[round_no]
    key = conversation_id("openai", "weather", text(i))
    return LoggedRequest(seq, key, round_no, status, fault, usage, "openai", "weather")


def record(i: int, **changes: Any) -> StoredRecord:
    clean = StoredRecord(f"run/{i}", (f"call_{i}",), (f"call_{i}",), Usage(40, 13))
    return dataclasses.replace(clean, **changes)


def clean() -> History:
    """Three weather sessions (a tool call round, then the answer), each ended once."""
    return History(
        submitted=tuple(Submitted(f"run/{i}", text(i)) for i in range(SESSIONS)),
        runs=tuple(Run(f"run/{i}", f"sk{i}", record(i), 1) for i in range(SESSIONS)),
        delivered=tuple(f"run/{i}" for i in range(SESSIONS)),
        requests=tuple(request(i, r, 2 * i + r) for i in range(SESSIONS) for r in (0, 1)),
    )


def with_run(history: History, i: int, **changes: Any) -> History:
    runs = list(history.runs)
    runs[i] = dataclasses.replace(runs[i], **changes)
    return dataclasses.replace(history, runs=tuple(runs))


def test_a_clean_run_is_valid_with_exact_counts() -> None:
    verdict = judge("clean", clean())
    assert verdict == Verdict(
        "clean", submitted=3, ended=3, lost=0, unexpected=0, double_endings=0, tool_calls=3,
        tool_answered_twice=0, tool_unanswered=0, log_judged=True, conversations=3,
        model_calls=6, rounds=6, extra_explained=0, extra_unexplained=0, usage_checked=3,
        usage_mismatches=0, examples={},
    )  # fmt: skip
    assert verdict.valid
    assert verdict.line() == (
        "clean: history valid: 3/3 ended, lost 0, unexpected 0, double endings 0; tool call "
        "ids 3: answered twice 0, unanswered 0; model calls 6 for 6 rounds of 3 sessions: "
        "extra 0 after a fault, 0 unexplained; usage 0 of 3 mismatched"
    )


def test_a_session_with_no_record_and_no_result_handed_out_is_lost() -> None:
    history = with_run(clean(), 1, record=None, finished_events=0)
    history = dataclasses.replace(history, delivered=("run/0", "run/2"))
    verdict = judge("lost", history)
    assert (verdict.lost, verdict.ended, verdict.valid) == (1, 2, False)
    assert verdict.examples["lost"] == ("run/1",)


def test_a_result_the_producer_handed_out_is_an_ending_when_redis_lost_the_record() -> None:
    verdict = judge("kept", with_run(clean(), 1, record=None))
    assert (verdict.lost, verdict.ended, verdict.valid) == (0, 3, True)


def test_an_ending_nobody_submitted_is_unexpected() -> None:
    stranger = Run("run/9", "sk9", record(9, spec_id="run/9"), 1)
    history = dataclasses.replace(clean(), runs=(*clean().runs, stranger))
    verdict = judge("unexpected", history)
    assert (verdict.unexpected, verdict.valid) == (1, False)
    assert verdict.examples["unexpected"] == ("run/9",)
    handed = dataclasses.replace(clean(), delivered=(*(clean().delivered or ()), "other/1"))
    assert judge("handed", handed).unexpected == 1


def test_a_record_naming_another_id_than_its_run_is_unexpected_and_its_id_lost() -> None:
    history = with_run(clean(), 2, record=record(2, spec_id="run/0"))
    history = dataclasses.replace(history, delivered=("run/0", "run/1"))
    verdict = judge("swapped", history)
    assert (verdict.unexpected, verdict.lost, verdict.valid) == (1, 1, False)


def test_a_session_ended_twice_is_a_double_ending() -> None:
    two_events = judge("events", with_run(clean(), 0, finished_events=2))
    assert (two_events.double_endings, two_events.valid) == (1, False)
    assert two_events.examples["double endings"] == ("run/0",)
    handed_twice = dataclasses.replace(clean(), delivered=("run/0", "run/1", "run/2", "run/1"))
    assert judge("twice", handed_twice).double_endings == 1
    second_run = Run("run/2", "sk2b", record(2), 1)
    two_runs = dataclasses.replace(clean(), runs=(*clean().runs, second_run))
    assert judge("runs", two_runs).double_endings == 1


def test_a_tool_call_id_answered_twice_makes_the_run_invalid() -> None:
    history = with_run(clean(), 1, record=record(1, answer_ids=("call_1", "call_1")))
    verdict = judge("dup", history)
    assert (verdict.tool_answered_twice, verdict.tool_unanswered, verdict.valid) == (1, 0, False)
    assert verdict.examples["tool answered twice"] == ("run/1",)


def test_an_unanswered_tool_call_id_is_counted() -> None:
    verdict = judge("short", with_run(clean(), 1, record=record(1, answer_ids=())))
    assert (verdict.tool_unanswered, verdict.tool_answered_twice) == (1, 0)
    assert verdict.valid  # counted, not a loss
    assert verdict.examples["tool unanswered"] == ("run/1",)


def test_a_second_model_call_in_a_round_is_unexplained_without_a_fault_before_it() -> None:
    again = dataclasses.replace(
        clean(), requests=(*(clean().requests or ()), request(1, 0, seq=10))
    )
    verdict = judge("again", again)
    assert (verdict.model_calls, verdict.rounds) == (7, 6)
    assert (verdict.extra_explained, verdict.extra_unexplained) == (0, 1)
    assert verdict.examples["extra model calls"] == ("run/1",)
    # the round billed twice while the record counts one answer: its usage does not match
    assert (verdict.usage_mismatches, verdict.examples["usage mismatch"]) == (1, ("run/1",))


def test_model_calls_after_an_injected_fault_are_explained() -> None:
    faults = (request(0, 0, 20, "rate_limited"), request(0, 1, 21, "server_error"))
    logged = (*(clean().requests or ()), *faults)
    verdict = judge("faults", dataclasses.replace(clean(), requests=logged))
    assert (verdict.model_calls, verdict.extra_explained, verdict.extra_unexplained) == (8, 2, 0)
    assert verdict.usage_mismatches == 0  # a fault bills nothing
    assert "extra model calls" not in verdict.examples


def test_a_round_whose_every_call_failed_has_only_explained_extra_calls() -> None:
    failed = tuple(request(0, 0, 30 + n, "server_error") for n in range(3))
    others = tuple(q for q in clean().requests or () if q.seq >= 2)
    verdict = judge("failed", dataclasses.replace(clean(), requests=failed + others))
    assert (verdict.rounds, verdict.extra_explained, verdict.extra_unexplained) == (5, 2, 0)


def test_usage_that_differs_from_what_the_server_billed_is_a_mismatch() -> None:
    verdict = judge("usage", with_run(clean(), 2, record=record(2, usage=Usage(40, 12))))
    assert (verdict.usage_checked, verdict.usage_mismatches) == (3, 1)
    assert verdict.valid
    no_usage = judge("none", with_run(clean(), 2, record=record(2, usage=None)))
    assert (no_usage.usage_checked, no_usage.usage_mismatches) == (2, 0)


def test_model_calls_are_not_judged_without_the_whole_replay_log() -> None:
    for history in (
        dataclasses.replace(clean(), log_complete=False),
        dataclasses.replace(clean(), requests=None),
    ):
        verdict = judge("partial", history)
        assert not verdict.log_judged and verdict.model_calls == 0 and verdict.valid
        assert verdict.line().endswith("model calls not judged (no complete replay log)")


def test_a_stored_record_is_read_for_its_calls_answers_and_usage() -> None:
    stored = StoredRecord.from_record(
        {
            "id": "run/0",
            "status": "ok",
            "transcript": [
                {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "tool_calls": [{"id": "a"}, {"id": "b"}]},
                {"role": "tool", "tool_call_id": "b", "content": "{}"},
                {"role": "tool", "tool_call_id": "a", "content": "{}"},
                {"role": "assistant", "content": "cold"},
            ],
            "metrics": {"usage": {"prompt_tokens": 40, "completion_tokens": 13}},
        }
    )
    assert stored == StoredRecord("run/0", ("a", "b"), ("b", "a"), Usage(40, 13))
    bare = StoredRecord.from_record({"id": "x", "transcript": [], "metrics": {}})
    assert bare == StoredRecord("x", (), (), None)


def test_the_first_user_message_is_read_as_the_replay_server_reads_it() -> None:
    parts = [{"type": "text", "text": "Weather "}, {"type": "image"}, {"type": "text", "text": "?"}]
    system = {"role": "system", "content": "s"}
    objects: list[dict[str, Any]] = [
        {"id": "a", "messages": [system, {"role": "user", "content": "hi"}]},
        {"id": "b", "messages": [{"role": "user", "content": parts}]},
        {"id": "c", "program": {}},
    ]
    assert submitted_of(objects) == (
        Submitted("a", "hi"), Submitted("b", "Weather ?"), Submitted("c", ""),
    )  # fmt: skip
    assert first_user_text(None) == ""


def test_the_table_names_each_run_and_the_ids_that_failed() -> None:
    good = judge("good", clean())
    bad = judge("bad", with_run(clean(), 1, record=record(1, answer_ids=("call_1", "call_1"))))
    lines = verdict_table([good, bad])
    assert lines[0].split() == [
        "run", "history", "ended", "lost", "unexpected", "2", "endings", "tool", "2x", "tool",
        "0x", "model", "calls/rounds", "extra", "fault/other", "usage", "bad",
    ]  # fmt: skip
    assert lines[1].split() == [
        "good", "valid", "3/3", "0", "0", "0", "0", "0", "6/6", "0/0", "0/3",
    ]  # fmt: skip
    assert lines[2].split()[:2] == ["bad", "INVALID"]
    assert lines[3:] == ["  bad: tool answered twice: run/1"]
