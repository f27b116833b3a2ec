"""The viewer's read model, with no server and no Redis: the timeline from trace events, the
thread from a transcript, a batch page's filters, sorts and pages, a run's progress, and
results files read offline."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from producer.viewer.app import environment
from producer.viewer.file_source import FileSource, ResultsFileError
from producer.viewer.model import PAGE_ROWS, BatchRows, SessionRow
from producer.viewer.progress import Member, run_row
from producer.viewer.rows import batch_page, parse_query, record_row
from producer.viewer.source import SessionFacts
from producer.viewer.thread import thread
from producer.viewer.timeline import timeline
from producer.viewer.views import NO_TRACE_FILE, session_view
from schemas.partial import PartialCall
from tests.viewer_data import (
    envelope,
    program_line,
    session_line,
    two_round_events,
    write_lines,
)

# the timeline ------------------------------------------------------------------------------


def test_timeline_has_every_step_and_wait_in_time_order() -> None:
    steps = timeline(two_round_events(), submitted_ms=1_000_000)
    assert [(s.kind, s.label) for s in steps] == [
        ("queue_wait", "queued: round 0"),
        ("round", "round 0: model call"),
        ("queue_wait", "queued: calculate call_0_0"),
        ("tool", "tool calculate call_0_0"),
        ("queue_wait", "queued: round"),
        ("rate_wait", "rate-limit wait (round)"),
        ("queue_wait", "queued: round 1"),
        ("round", "round 1: model call"),
        ("finish", "finished"),
    ]
    assert [s.at_ms for s in steps] == sorted(s.at_ms for s in steps)
    assert steps[0].at_ms == 0 and steps[0].ms == 100  # from the submit to round 0's call


def test_timeline_computes_queue_waits_from_consecutive_events() -> None:
    by_label = {s.label: s for s in timeline(two_round_events(), submitted_ms=1_000_000)}
    # the tool waited from its round's model call ending (130) until it started (150)
    assert by_label["queued: calculate call_0_0"].ms == 20
    # the rate-limited round was picked up 10 ms after the tool ended
    assert by_label["queued: round"].ms == 10
    rate = by_label["rate-limit wait (round)"]
    assert rate.ms == 300 and rate.detail == "replay 429"


def test_timeline_uses_queue_ms_worker_and_delivery_when_present() -> None:
    by_label = {s.label: s for s in timeline(two_round_events(), submitted_ms=1_000_000)}
    assert by_label["queued: round 1"].ms == 7  # the event's queue_ms, not 520 - 500
    first = by_label["round 0: model call"]
    assert (first.ms, first.worker, first.attempt) == (30, "llm@host", 1)
    assert "tokens 10 in / 5 out" in first.detail and "replay" in first.detail
    assert "replay/two_rounds" in by_label["round 1: model call"].detail
    tool = by_label["tool calculate call_0_0"]
    assert (tool.ms, tool.worker, tool.attempt) == (40, "tools@host", 2)  # one retry: 2nd try
    assert "1 retry" in tool.detail


def test_timeline_bars_span_the_session() -> None:
    steps = timeline(two_round_events(), submitted_ms=1_000_000)
    assert min(s.offset_pct for s in steps) == 0
    assert max(s.offset_pct + s.width_pct for s in steps) == pytest.approx(100, abs=0.1)


def test_timeline_of_a_call_answered_without_running() -> None:
    events = [
        {"event": "model.call.started", "session": "s", "ts_ms": 10, "round": 0},
        {"event": "model.call.finished", "session": "s", "ts_ms": 20, "round": 0, "latency_ms": 10},
        {
            "event": "tool.call.failed",
            "session": "s",
            "ts_ms": 21,
            "round": 0,
            "call_id": "call_0_0",
            "tool": "nope",
            "error": "TOOL_NOT_FOUND",
        },
    ]
    tool = timeline(events)[-1]
    assert (tool.kind, tool.ms, tool.attempt, tool.error) == ("tool", None, None, "TOOL_NOT_FOUND")
    assert "not run" in tool.detail


def test_no_events_no_timeline() -> None:
    assert timeline([]) == ()


# the thread --------------------------------------------------------------------------------


def test_thread_pairs_each_tool_call_with_its_answer_and_log_lines() -> None:
    line = session_line("s1")
    line["transcript"][3]["content"] = envelope({"result": 4}, retries=2, fallback="calculate_slow")
    logs = [
        {"call_id": "call_0_0", "round": 0, "tool": "calculate", "source": "tool",
         "level": "info", "stream": "stderr", "message": "adding"},
    ]  # fmt: skip
    messages = thread(line["transcript"], logs)
    assert [m.role for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
    turn = messages[2]
    assert turn.thinking == "I should call the calculator."
    (tool_call,) = turn.tool_calls
    assert tool_call.name == "calculate" and tool_call.call_id == "call_0_0"
    assert json.loads(tool_call.arguments) == {"a": 1, "b": 3, "op": "add"}
    assert "\n" in tool_call.arguments  # pretty-printed
    assert tool_call.ok is True and json.loads(tool_call.result or "") == {"result": 4}
    assert (tool_call.retries, tool_call.fallback) == (2, "calculate_slow")
    assert [(log.stream, log.message) for log in tool_call.logs] == [("stderr", "adding")]
    assert messages[3].tool_name == "calculate"


def test_thread_shows_a_failed_call_by_its_error_class() -> None:
    line = session_line("s1")
    failure = {"code": "RUNTIME_ERROR", "message": "trapped"}
    line["transcript"][3]["content"] = envelope(None, failure)
    (tool_call,) = thread(line["transcript"])[2].tool_calls
    assert (tool_call.ok, tool_call.error_code, tool_call.error_message) == (
        False,
        "RUNTIME_ERROR",
        "trapped",
    )
    raw = [{"role": "tool", "tool_call_id": "c", "content": json.dumps({"error": failure})}]
    bare = thread([{"role": "assistant", "tool_calls": [{"id": "c", "function": {}}]}, *raw])
    assert bare[0].tool_calls[0].error_code == "RUNTIME_ERROR"


def test_thread_of_an_unanswered_call_and_of_content_parts() -> None:
    parts = [{"type": "text", "text": "look"}, {"type": "image_url"}]
    unanswered = {"id": "x", "function": {"name": "f", "arguments": "not json"}}
    messages = thread(
        [
            {"role": "user", "content": parts},
            {"role": "assistant", "content": "", "tool_calls": [unanswered]},
        ]
    )
    assert messages[0].content.startswith("look\n") and "image_url" in messages[0].content
    call = messages[1].tool_calls[0]
    assert call.answered is False and call.arguments == "not json"


# a batch page ------------------------------------------------------------------------------


def _rows() -> BatchRows:
    rows = [
        record_row(f"b/{n}", session_line(f"b/{n}", latency_ms=100 * n, tokens=1000 - n))
        for n in range(1, 6)
    ]
    rows.append(record_row("b/fail", session_line("b/fail", code="provider_error", tools=False)))
    rows.append(SessionRow("b/q", "session", "queued"))
    rows.append(SessionRow("b/r", "session", "running", state="round 1"))
    run = run_row("batch", "b", "b", 0, [Member(r.status, r.code) for r in rows], 10_000)
    return BatchRows("b", run, tuple(rows))


def test_batch_page_counts_by_outcome_and_state() -> None:
    page = batch_page(_rows(), parse_query({}))
    assert page.outcomes == {"ok": 5, "provider_error": 1}
    assert page.states == {"queued": 1, "running": 1}
    assert page.codes == ("provider_error",) and page.tools == ("calculate",)
    assert page.matched == 8 and page.pages == 1


@pytest.mark.parametrize(
    ("params", "ids"),
    [
        ({"status": "error"}, ["b/fail"]),
        ({"status": "running"}, ["b/r"]),
        ({"code": "provider_error"}, ["b/fail"]),
        ({"tool": "calculate", "q": "3"}, ["b/3"]),
        ({"q": "FAIL"}, ["b/fail"]),
        ({"sort": "latency", "status": "ok"}, ["b/5", "b/4", "b/3", "b/2", "b/1"]),
        ({"sort": "tokens", "tool": "calculate"}, ["b/1", "b/2", "b/3", "b/4", "b/5"]),
    ],
)
def test_batch_page_filters_and_sorts(params: dict[str, str], ids: list[str]) -> None:
    assert [r.spec_id for r in batch_page(_rows(), parse_query(params)).rows] == ids


def test_batch_page_drops_unknown_values_and_pages() -> None:
    query = parse_query({"status": "weird", "sort": "name", "page": "x"})
    assert (query.status, query.sort, query.page) == ("", "", 1)
    rows = tuple(SessionRow(f"id{n}", "session", "ok") for n in range(PAGE_ROWS + 3))
    found = BatchRows("b", _rows().run, rows)
    second = batch_page(found, parse_query({"page": "2"}))
    assert [r.spec_id for r in second.rows] == [f"id{n}" for n in range(PAGE_ROWS, PAGE_ROWS + 3)]
    assert second.next_page is None and second.previous_page == 1
    first = batch_page(found, parse_query({}))
    assert len(first.rows) == PAGE_ROWS and first.next_page == 2
    assert first.query.params(page=2) == {"page": "2"}
    assert batch_page(found, parse_query({"page": "99"})).query.page == 2


# progress ----------------------------------------------------------------------------------


def test_progress_rate_and_eta_of_a_running_batch() -> None:
    members = [Member("ok", finished_ms=5_000 + n) for n in range(10)] + [
        Member("error", "provider_error", 6_000),
        Member("running"),
        Member("queued"),
        Member("queued"),
    ]
    row = run_row("batch", "b", "b", submitted_ms=0, members=members, now_ms=11_000)
    assert (row.queued, row.running, row.done, row.failed, row.status) == (2, 1, 11, 1, "running")
    assert row.failures == {"provider_error": 1}
    assert row.rate == 1.0  # 11 finished in the last 11 s
    assert row.eta_s == 3.0


def test_progress_of_a_finished_batch() -> None:
    members = [Member("ok", finished_ms=2_000), Member("ok", finished_ms=4_000)]
    row = run_row("batch", "b", "b", 0, members, now_ms=100_000)
    assert (row.status, row.elapsed_s, row.rate, row.eta_s) == ("done", 4.0, 0.5, 0.0)


# results files, offline --------------------------------------------------------------------


def test_a_malformed_line_is_named_by_file_and_line(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "r.jsonl", [session_line("a")])
    path.write_text(path.read_text() + "\n{not json\n")
    with pytest.raises(ResultsFileError, match=r"r\.jsonl:3: not a JSON line"):
        FileSource([path])
    path.write_text('{"id": "a"}\n')
    with pytest.raises(ResultsFileError, match=r"r\.jsonl:1: not a result line"):
        FileSource([path])
    with pytest.raises(ResultsFileError, match="cannot be read"):
        FileSource([tmp_path / "missing.jsonl"])


def test_file_source_batches_sessions_and_program_chats(tmp_path: Path) -> None:
    first = write_lines(
        tmp_path / "one.jsonl",
        [session_line("s1"), session_line("s2", code="provider_error"), program_line("p1")],
    )
    no_batch = {k: v for k, v in session_line("s3").items() if k != "batch"}
    second = write_lines(tmp_path / "two.jsonl", [no_batch])
    source = FileSource([first, second])
    kinds = [(r.kind, r.key) for r in source.runs()]
    assert (
        ("batch", "b1") in kinds and ("batch", "two.jsonl") in kinds and ("program", "p1") in kinds
    )
    found = source.batch_rows("b1")
    assert found is not None
    assert [(r.spec_id, r.status, r.code) for r in found.rows] == [
        ("s1", "ok", None),
        ("s2", "error", "provider_error"),
        ("p1", "ok", None),
    ]
    assert found.run.failures == {"provider_error": 1} and found.run.finished
    assert source.batch_rows("nope") is None and source.session("nope") is None
    assert source.trace("s1") is None

    view = session_view(source_session(source, "s1"))
    assert view.timeline == () and view.timeline_note == NO_TRACE_FILE
    assert (view.status, view.tokens_in, view.tokens_out, view.backend) == ("ok", 90, 10, "replay")

    program = session_view(source_session(source, "p1"))
    assert program.program is not None
    assert [c.spec_id for c in program.program.chats] == ["p1#send0"]
    assert [(f.call_id, f.tool, f.log_lines) for f in program.program.forks] == [
        ("call_0_0", "sum", 1)
    ]
    assert program.program.logs[1].origin == "sum call_0_0"
    chat = session_view(source_session(source, "p1#send0"))
    assert [m.content for m in chat.messages] == ["Echo: hi"]


def test_file_source_reads_a_file_again_when_it_changes(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "r.jsonl", [session_line("s1")])
    source = FileSource([path])
    write_lines(path, [session_line("s1"), session_line("s2")])
    os.utime(path, (1, 1))  # a new mtime, whatever the clock's resolution
    found = source.batch_rows("b1")
    assert found is not None and [r.spec_id for r in found.rows] == ["s1", "s2"]


def source_session(source: FileSource, spec_id: str) -> SessionFacts:
    facts = source.session(spec_id)
    assert facts is not None
    return facts


def test_a_running_session_shows_its_spec_state_and_streamed_text() -> None:
    facts = SessionFacts(
        spec_id="s1",
        state="running",
        state_text="round 1",
        events=two_round_events()[:4],
        partial_text="Resu",
        spec={"model": "replay/two_rounds", "messages": [{"role": "user", "content": "Add"}]},
        flower=("kwargs:session=s1", "http://flower/api/tasks?search=x"),
    )
    view = session_view(facts)
    assert (view.status, view.state, view.live, view.partial_text) == (
        "running",
        "round 1",
        True,
        "Resu",
    )
    assert [m.content for m in view.messages] == ["Add"] and view.model == "replay/two_rounds"
    assert [s.label for s in view.timeline] == [
        "round 0: model call",
        "queued: calculate call_0_0",
        "tool calculate call_0_0 (no end yet)",
    ]
    assert view.has_trace and view.flower_search == "kwargs:session=s1"


def test_a_running_session_shows_its_rounds_thinking_and_tool_calls_so_far() -> None:
    calls = (PartialCall("get_weather", '{"city": "Pa'),)
    facts = SessionFacts(
        spec_id="s1", state="running", state_text="round 0", events=two_round_events()[:1],
        partial_text="", partial_thinking="Weighing <b>", partial_tool_calls=calls,
    )  # fmt: skip
    view = session_view(facts)
    assert (view.partial_thinking, view.partial_tool_calls) == ("Weighing <b>", calls)
    assert json.loads(json.dumps(view.json()))["partial_tool_calls"] == [
        {"name": "get_weather", "arguments": '{"city": "Pa'}
    ]
    html = environment().get_template("_session.html").render(view=view, live=True)
    assert '<pre class="partial thinking" id="partial-thinking">Weighing &lt;b&gt;</pre>' in html
    assert "<code>get_weather</code>" in html
    assert '<pre class="partial" data-partial-call="0">{&#34;city&#34;: &#34;Pa</pre>' in html
    ended = session_view(replace(facts, record=session_line("s1")))
    assert (ended.partial_thinking, ended.partial_tool_calls) == (None, ())


def test_the_round_that_ended_a_session_has_the_worker_its_last_event_names() -> None:
    """A step's worker and delivery ride its last event: for the round that ends the session,
    that is session.finished, and the round's row says so."""
    t0 = 1_000_000
    events = [
        {"event": "model.call.started", "session": "s", "ts_ms": t0 + 5, "round": 0},
        {"event": "model.call.finished", "session": "s", "ts_ms": t0 + 20, "round": 0,
         "latency_ms": 15},
        {"event": "session.finished", "session": "s", "ts_ms": t0 + 22, "latency_ms": 22,
         "kind": "round", "step_ms": 17, "worker": "llm-2@host", "delivery": 2},
    ]  # fmt: skip
    by_label = {s.label: s for s in timeline(events, submitted_ms=t0)}
    last = by_label["round 0: model call"]
    assert (last.worker, last.attempt) == ("llm-2@host", 2)
    assert "step 17 ms" in last.detail
