"""OpenTelemetry GenAI spans built from trace events (worker/session/spans.py), on hand-made
events and through the twins: names, kinds, parents, deterministic ids, attributes, error
types, and content only when it is asked for. The SDK edge's conversion and the switch that
turns spans on are here too; the fleet half is tests/test_otel_fleet.py."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from typing import Any

import pytest

from schemas import keys
from schemas.spec_types import McpToolRef, ProgramDef, ProgramSpec, spec_from_json
from tests.test_steps import SK, pipeline, reply, submit
from tests.test_steps import spec as pipeline_spec
from tests.test_trace import CANARY, flaky_weather, mixed_model
from worker.config import (
    SPAN_SCHEDULE_DELAY_MS,
    BackendConfig,
    Settings,
    load_settings,
    span_exporters,
)
from worker.session.ports import NoSpans
from worker.session.spans import (
    SpanSession,
    SpanValue,
    agent_span_id,
    genai_messages,
    span_id,
    step_spans,
    trace_id,
)
from worker.session.trace import TraceEvent
from worker.session.twins.failing import FailingStore

BACKENDS = {
    "replay": BackendConfig("replay", "openai", "http://127.0.0.1:8011/v1"),
    "claude": BackendConfig("claude", "anthropic", "https://api.anthropic.com/v1"),
    "gemini": BackendConfig("gemini", "gemini", "https://generativelanguage.googleapis.com/v1beta"),
    "tags": BackendConfig("tags", "openai-text-tags", "http://10.1.2.3:9000/v1"),
}
CONTENT_VARIABLE = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"
STEP_FIELDS: dict[str, Any] = {"worker": "llm@host", "delivery": 1, "queue_ms": 7, "kind": "round"}
WEATHER_TOOL = {
    "module_sha256": "0" * 64,
    "export": "get_weather",
    "table_index": None,
    "function": {"name": "get_weather", "parameters": {"type": "object"}},
}


def chat_session(batch: str = "b1", **extra: Any) -> SpanSession:
    raw = pipeline_spec(**extra)
    raw["tools"] = [WEATHER_TOOL]
    return SpanSession("sk1", spec_from_json(raw), batch)


def model_finished(**over: Any) -> TraceEvent:
    fields: dict[str, Any] = {
        "event": "model.call.finished", "session": "t/1", "ts_ms": 10_000, "round": 0,
        "latency_ms": 400, "request_id": "chatcmpl-1", "backend": "replay", "tokens_in": 12,
        "tokens_out": 5, "model": "replay/two_rounds", "response_model": "replay-1",
        "finish_reason": "tool_calls", "step_ms": 450, **STEP_FIELDS,
    }  # fmt: skip
    fields.update(over)
    return TraceEvent(**fields)


def by_name(spans: list[SpanValue]) -> dict[str, SpanValue]:
    return {s.name: s for s in spans}


def test_a_model_call_is_a_client_chat_span_under_its_sessions_agent_span() -> None:
    started = TraceEvent("model.call.started", "t/1", 9_550, round=0)
    (chat,) = step_spans(chat_session(), "sk1.r0", [started, model_finished()], BACKENDS)
    assert chat.name == "chat replay/two_rounds"
    assert chat.kind == "client"
    assert (chat.trace_id, chat.parent_id) == (trace_id("sk1"), agent_span_id("sk1"))
    assert chat.span_id == span_id("sk1", "chat r0", 1)
    assert (chat.start_ms, chat.end_ms) == (9_600, 10_000)  # ts - latency .. ts
    assert chat.error is None
    assert dict(chat.attributes) == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "openai",
        "server.address": "127.0.0.1",
        "server.port": 8011,
        "gen_ai.request.model": "replay/two_rounds",
        "gen_ai.response.model": "replay-1",
        "gen_ai.response.id": "chatcmpl-1",
        "gen_ai.usage.input_tokens": 12,
        "gen_ai.usage.output_tokens": 5,
        "gen_ai.response.finish_reasons": ("tool_calls",),
        "cchatq.backend": "replay",
        "cchatq.session.id": "t/1",
        "cchatq.batch.id": "b1",
        "cchatq.step": "sk1.r0",
        "cchatq.attempt": 1,
        "cchatq.worker": "llm@host",
    }
    # the message waited 7 ms before the step's body began (450 ms before its last event)
    (waited,) = chat.events
    assert (waited.name, dict(waited.attributes), waited.ts_ms) == (
        "cchatq.queue_wait",
        {"wait_ms": 7},
        9_550,
    )


def test_ids_are_derived_so_a_redelivery_lands_beside_the_first_delivery() -> None:
    events = [model_finished()]
    first = step_spans(chat_session(), "sk1.r0", events, BACKENDS)
    assert step_spans(chat_session(), "sk1.r0", events, BACKENDS) == first  # deterministic
    (again,) = step_spans(chat_session(), "sk1.r0", [model_finished(delivery=2)], BACKENDS)
    assert again.trace_id == first[0].trace_id
    assert again.parent_id == first[0].parent_id
    assert again.span_id != first[0].span_id
    assert again.attributes["cchatq.attempt"] == 2
    other = SpanSession("sk2", None)
    (elsewhere,) = step_spans(other, "sk2.r0", events, BACKENDS)
    assert elsewhere.trace_id != first[0].trace_id
    assert all(0 < s.span_id < 2**64 and 0 < s.trace_id < 2**128 for s in (*first, elsewhere))


@pytest.mark.parametrize(
    ("backend", "provider", "address", "port"),
    [
        ("claude", "anthropic", "api.anthropic.com", 443),
        ("gemini", "gcp.gemini", "generativelanguage.googleapis.com", 443),
        ("tags", "openai", "10.1.2.3", 9000),  # a text-tags backend: its protocol's provider
    ],
)
def test_the_provider_and_server_come_from_the_backend(
    backend: str, provider: str, address: str, port: int
) -> None:
    (chat,) = step_spans(chat_session(), "sk1.r0", [model_finished(backend=backend)], BACKENDS)
    attrs = chat.attributes
    assert (attrs["gen_ai.provider.name"], attrs["server.address"], attrs["server.port"]) == (
        provider,
        address,
        port,
    )


def test_a_failed_model_call_has_its_error_type_and_status() -> None:
    failed = TraceEvent(
        "model.call.failed", "t/1", 5_000, round=1, latency_ms=20, error="provider_error",
        backend="replay", model="replay/bad_request", **STEP_FIELDS,
    )  # fmt: skip
    (chat,) = step_spans(chat_session(), "sk1.r1", [failed], BACKENDS)
    assert chat.error == "provider_error"
    assert chat.attributes["error.type"] == "provider_error"
    assert "gen_ai.response.model" not in chat.attributes
    assert chat.span_id == span_id("sk1", "chat r1", 1)


def test_tool_calls_are_execute_tool_spans_with_their_retries_and_errors() -> None:
    step: dict[str, Any] = {**STEP_FIELDS, "kind": "tool", "worker": "tools@host"}
    call: dict[str, Any] = {"round": 0, "call_id": "c1", "tool": "get_weather"}
    events = [
        TraceEvent("tool.call.started", "t/1", 1_000, **call),
        TraceEvent("tool.call.retried", "t/1", 1_100, attempt=1, error="RUNTIME_ERROR", **call),
        TraceEvent("tool.call.failed", "t/1", 1_300, latency_ms=300, error="TIMEOUT", **call,
                   attempt=1, **step),
    ]  # fmt: skip
    (tool,) = step_spans(chat_session(), "sk1.r0.t0", events, BACKENDS)
    assert (tool.name, tool.kind) == ("execute_tool get_weather", "internal")
    assert (tool.start_ms, tool.end_ms, tool.error) == (1_000, 1_300, "TIMEOUT")
    assert tool.parent_id == agent_span_id("sk1")
    assert tool.span_id == span_id("sk1", "execute_tool r0 c1", 1)
    assert {k: v for k, v in tool.attributes.items() if not k.startswith("cchatq.")} == {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": "get_weather",
        "gen_ai.tool.type": "function",
        "gen_ai.tool.call.id": "c1",
        "error.type": "TIMEOUT",
    }
    assert tool.attributes["cchatq.step"] == "sk1.r0.t0"
    assert tool.attributes["cchatq.worker"] == "tools@host"
    assert tool.attributes["cchatq.tool.retries"] == 1
    names = [e.name for e in tool.events]
    assert names == ["cchatq.queue_wait", "cchatq.tool.retried"]
    assert dict(tool.events[1].attributes) == {"attempt": 1, "error.type": "RUNTIME_ERROR"}


def test_an_mcp_servers_tool_is_an_extension() -> None:
    session = chat_session()
    assert session.spec is not None and not isinstance(session.spec, ProgramSpec)
    mcp_tool = replace(session.spec.tools[0], mcp=McpToolRef("files", "get_weather"))
    session = replace(session, spec=replace(session.spec, tools=(mcp_tool,)))
    ended = TraceEvent(
        "tool.call.finished", "t/1", 1_000, round=0, call_id="c1", tool="get_weather"
    )
    (tool,) = step_spans(session, "sk1.r0.t0", [ended], BACKENDS)
    assert tool.attributes["gen_ai.tool.type"] == "extension"


def test_the_session_end_is_the_agent_span_from_its_submit_exported_last() -> None:
    events = [
        model_finished(kind=None, worker=None, delivery=None, queue_ms=None),
        TraceEvent("session.finished", "t/1", 10_010, latency_ms=3_010, error="tool_call_limit",
                   **STEP_FIELDS),
    ]  # fmt: skip
    chat, agent = step_spans(chat_session(), "sk1.r2", events, BACKENDS)
    assert chat.name.startswith("chat ")
    assert (agent.name, agent.kind) == ("invoke_agent cchatq", "internal")
    assert (agent.span_id, agent.parent_id) == (agent_span_id("sk1"), None)
    assert agent.trace_id == chat.trace_id
    assert (agent.start_ms, agent.end_ms) == (7_000, 10_010)
    assert agent.error == "tool_call_limit"
    assert dict(agent.attributes) == {
        "gen_ai.operation.name": "invoke_agent",
        "gen_ai.agent.name": "cchatq",
        "cchatq.session.id": "t/1",
        "cchatq.batch.id": "b1",
        "cchatq.outcome": "tool_call_limit",
        "error.type": "tool_call_limit",
    }
    ok = TraceEvent("session.finished", "t/1", 10_010, latency_ms=10)
    (agent,) = step_spans(chat_session(), "sk1.fin", [ok], BACKENDS)
    assert agent.attributes["cchatq.outcome"] == "ok" and agent.error is None
    assert "error.type" not in agent.attributes


def test_a_programs_chats_sit_in_the_programs_trace_under_its_agent_span() -> None:
    run_sk = "run0000000000000000000"
    chat_sk = keys.chat_session_key(run_sk, 0)
    chat = SpanSession(chat_sk, chat_session().spec, keys.run_batch(run_sk))
    ended = TraceEvent("session.finished", "p/1#send0", 2_000, latency_ms=100)
    call, agent = step_spans(chat, f"{chat_sk}.r0", [model_finished(), ended], BACKENDS)
    assert call.trace_id == agent.trace_id == trace_id(run_sk)
    assert call.parent_id == agent.span_id == agent_span_id(chat_sk)
    assert agent.parent_id == agent_span_id(run_sk)
    program = ProgramSpec("p/1", ProgramDef("prog_chat.wasm"))
    run = SpanSession(run_sk, program, "b9")
    (run_agent,) = step_spans(run, f"{run_sk}.prog", [replace(ended, session="p/1")], BACKENDS)
    assert run_agent.name == "invoke_agent prog_chat"
    assert (run_agent.span_id, run_agent.parent_id) == (agent_span_id(run_sk), None)
    assert run_agent.trace_id == trace_id(run_sk)


def test_a_rate_limit_wait_is_a_span_as_long_as_the_wait() -> None:
    waited = TraceEvent(
        "rate_limit.waited", "t/1", 4_000, kind="round", backend="replay", wait_ms=750,
        reason="429", delivery=1, worker="llm@host",
    )  # fmt: skip
    (wait,) = step_spans(chat_session(), "sk1.r0", [waited], BACKENDS)
    assert (wait.name, wait.kind, wait.start_ms, wait.end_ms) == (
        "rate_limit wait",
        "internal",
        4_000,
        4_750,
    )
    assert wait.parent_id == agent_span_id("sk1")
    assert wait.attributes["cchatq.rate_limit.wait_ms"] == 750
    assert wait.attributes["cchatq.rate_limit.reason"] == "429"
    again = step_spans(chat_session(), "sk1.r0", [replace(waited, ts_ms=5_000)], BACKENDS)
    assert again[0].span_id != wait.span_id  # each wait of a step is a span of its own


CONTENT_KEYS = {
    "gen_ai.input.messages",
    "gen_ai.output.messages",
    "gen_ai.tool.call.arguments",
    "gen_ai.tool.call.result",
}


def test_content_is_shown_only_when_asked_for() -> None:
    asked = [{"role": "user", "content": "Weather in Paris?"}]
    answer = reply(None, ("c1", "get_weather", '{"city":"Paris"}'))["choices"][0]["message"]
    model = model_finished(content={"input": asked, "output": answer})
    tool = TraceEvent(
        "tool.call.finished", "t/1", 1_000, round=0, call_id="c1", tool="get_weather",
        content={"arguments": '{"city":"Paris"}', "result": "sunny"},
    )  # fmt: skip
    hidden = step_spans(chat_session(), "sk1.r0", [model, tool], BACKENDS)
    assert not any(CONTENT_KEYS & set(s.attributes) for s in hidden)
    chat, run = step_spans(chat_session(), "sk1.r0", [model, tool], BACKENDS, content=True)
    assert json.loads(str(chat.attributes["gen_ai.input.messages"])) == [
        {"role": "user", "parts": [{"type": "text", "content": "Weather in Paris?"}]}
    ]
    assert json.loads(str(chat.attributes["gen_ai.output.messages"])) == [
        {
            "role": "assistant",
            "parts": [
                {"type": "tool_call", "id": "c1", "name": "get_weather",
                 "arguments": '{"city":"Paris"}'}
            ],
            "finish_reason": "tool_calls",
        }
    ]  # fmt: skip
    assert run.attributes["gen_ai.tool.call.arguments"] == '{"city":"Paris"}'
    assert run.attributes["gen_ai.tool.call.result"] == "sunny"
    # an event that carries none shows none, asked or not
    (bare,) = step_spans(chat_session(), "sk1.r0", [model_finished()], BACKENDS, content=True)
    assert not CONTENT_KEYS & set(bare.attributes)


def test_genai_messages_shape_tool_answers_and_text_parts() -> None:
    shaped = genai_messages([
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ])  # fmt: skip
    assert shaped == [
        {"role": "system", "parts": [{"type": "text", "content": "Be brief."}]},
        {"role": "tool", "parts": [{"type": "tool_call_response", "response": "sunny",
                                    "id": "c1"}]},
    ]  # fmt: skip


# through the twins --------------------------------------------------------------------------


class Recorded:
    """A SpanSink that keeps what it is handed."""

    on = True

    def __init__(self) -> None:
        self.spans: list[SpanValue] = []

    def export(self, spans: Any) -> None:
        self.spans.extend(spans)

    def flush(self) -> None:
        return None


def run_with_spans(content: bool) -> tuple[Recorded, Any]:
    p = pipeline([mixed_model, mixed_model], tools={"get_weather": flaky_weather()})
    sink = Recorded()
    settings = replace(p.runner.settings, span_content=content)
    p.runner = replace(p.runner, spans=sink, settings=settings)
    session_spec = pipeline_spec({"name": "get_weather", "parameters": {"type": "object"}})
    session_spec["tools"][0]["policy"] = {"max_retries": 1, "retry_backoff_ms": 0}
    session_spec["messages"] = [{"role": "user", "content": f"Weather? {CANARY}"}]
    submit(p, session_spec)
    p.drain()
    return sink, p


def test_a_sessions_steps_make_its_spans_as_they_commit() -> None:
    sink, _ = run_with_spans(content=False)
    names = [s.name for s in sink.spans]
    assert names == [
        "chat m", "execute_tool nope",  # round 0: the unknown tool answered in the round step
        "execute_tool get_weather",  # its tool step (one retry inside)
        "chat m", "invoke_agent cchatq",  # round 1 ends the session
    ]  # fmt: skip
    spans = by_name(sink.spans)
    agent = spans["invoke_agent cchatq"]
    assert {s.trace_id for s in sink.spans} == {trace_id(SK)}
    assert {s.parent_id for s in sink.spans if s is not agent} == {agent.span_id}
    assert spans["execute_tool nope"].error == "TOOL_NOT_FOUND"
    assert spans["execute_tool get_weather"].attributes["cchatq.step"] == keys.tool_step(SK, 0, 0)
    assert spans["execute_tool get_weather"].attributes["cchatq.batch.id"] == "b"
    assert not any(CONTENT_KEYS & set(s.attributes) for s in sink.spans)
    assert CANARY not in repr(sink.spans)


def test_a_session_ended_by_a_dead_lettered_finish_step_spans_from_its_submit() -> None:
    """The finish step fails every try (here: what the ending reads), so its poison writes the
    end bare: its invoke_agent span still runs from the session's submit, not from its end."""
    p = pipeline([reply("hello")], store=lambda m: FailingStore(m, ending_inputs=99))
    sink = Recorded()
    p.runner = replace(p.runner, spans=sink)
    submit(p, pipeline_spec())
    submitted_ms = int(time.time() * 1000) - 5_000  # five seconds ago
    p.store.meta_of[SK]["submitted_ms"] = str(submitted_ms)
    p.drain()
    assert p.body()["error"]["code"] == "step_failed"
    (agent,) = [s for s in sink.spans if s.name == "invoke_agent cchatq"]
    assert agent.error == "step_failed"
    assert submitted_ms <= agent.start_ms <= submitted_ms + 1_000  # the ms the clock moved
    assert agent.end_ms - agent.start_ms >= 5_000


def test_captured_content_reaches_spans_and_never_the_trace_stream() -> None:
    sink, p = run_with_spans(content=True)
    spans = by_name(sink.spans)
    assert CANARY in str(spans["execute_tool get_weather"].attributes["gen_ai.tool.call.arguments"])
    chats = [s for s in sink.spans if s.name == "chat m"]
    assert all(CANARY in str(s.attributes["gen_ai.input.messages"]) for s in chats)
    unknown = spans["execute_tool nope"].attributes  # answered without running
    assert unknown["gen_ai.tool.call.arguments"] == "{}"
    assert "nope" in str(unknown["gen_ai.tool.call.result"])
    events = [e.to_json() for e in p.store.traces[SK]]
    assert CANARY not in json.dumps(events)
    assert all("content" not in e for e in events)


def test_content_is_not_carried_while_spans_are_off() -> None:
    p = pipeline([reply("hi")])
    p.runner = replace(p.runner, settings=replace(p.runner.settings, span_content=True))
    assert isinstance(p.runner.spans, NoSpans) and not p.runner.content
    submit(p, pipeline_spec())
    p.drain()
    assert all(e.content is None for e in p.store.traces[SK])


# switching spans on -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "exporters"),
    [
        ({}, ()),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, ("otlp",)),
        ({"OTEL_TRACES_EXPORTER": "console,otlp"}, ("console", "otlp")),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, ()),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, ("otlp",)),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, ("otlp",)),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}, ()),
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, ()),
    ],
)
def test_spans_are_on_only_when_the_otel_variables_ask(
    env: dict[str, str], exporters: tuple[str, ...]
) -> None:
    assert span_exporters(env) == exporters


def test_the_service_name_and_content_come_from_the_standard_variables() -> None:
    assert load_settings({}).span_service == "cchatq-worker"
    on = {"OTEL_SERVICE_NAME": "evals", CONTENT_VARIABLE: "1"}
    assert not load_settings(on).span_content  # only "true" says yes, as the SDKs read it
    on[CONTENT_VARIABLE] = "True"
    settings = load_settings(on)
    assert (settings.span_service, settings.span_content) == ("evals", True)
    assert not load_settings({}).span_content


def test_a_workers_spans_wait_a_second_unless_otel_bsp_schedule_delay_says() -> None:
    """What the batch processor holds is lost with a SIGKILLed worker: a worker holds spans
    for SPAN_SCHEDULE_DELAY_MS (1 s), not the SDK's 5 s, unless the standard variable says."""
    assert load_settings({}).span_delay_ms == SPAN_SCHEDULE_DELAY_MS == 1_000
    assert load_settings({"OTEL_BSP_SCHEDULE_DELAY": "200"}).span_delay_ms is None  # the SDK's


def test_the_sdk_edge_sends_spans_after_its_delay_without_a_flush(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from worker.edges.otel_spans import OtelSpans

    sink = OtelSpans(("console",), "svc", delay_ms=100)
    (chat,) = step_spans(chat_session(), "sk1.r0", [model_finished()], BACKENDS)
    sink.export([chat])
    seen = ""
    deadline = time.monotonic() + 4  # under the SDK's own 5 s: the delay given is the one used
    while chat.name not in seen and time.monotonic() < deadline:
        time.sleep(0.05)
        seen += capsys.readouterr().out
    sink.flush()
    assert chat.name in seen


def test_with_spans_off_the_sdk_edge_is_never_imported() -> None:
    from worker.wiring import span_sink

    sys.modules.pop("worker.edges.otel_spans", None)
    assert isinstance(span_sink(Settings()), NoSpans)
    assert "worker.edges.otel_spans" not in sys.modules


def test_spans_asked_for_without_the_extra_are_off_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from worker import wiring

    monkeypatch.setitem(sys.modules, "worker.edges.otel_spans", None)  # the extra missing
    settings = Settings(span_exporters=("otlp",))
    assert isinstance(wiring.span_sink(settings), NoSpans)
    with caplog.at_level("WARNING", logger="worker.wiring"):
        wiring.check_spans(settings)
    assert [r.getMessage() for r in caplog.records] == [wiring.SPANS_MISSING]


def test_the_sdk_edge_makes_finished_spans_with_their_own_ids_parents_and_times() -> None:
    from opentelemetry.trace import SpanKind, StatusCode

    from worker.edges.otel_spans import OtelSpans

    sink = OtelSpans((), "svc")
    failed = model_finished(error="provider_error")
    (chat,) = step_spans(chat_session(), "sk1.r0", [failed], BACKENDS)
    span = sink.readable(chat)
    assert span.context is not None and span.parent is not None
    assert (span.context.trace_id, span.context.span_id) == (chat.trace_id, chat.span_id)
    assert (span.parent.trace_id, span.parent.span_id) == (chat.trace_id, agent_span_id("sk1"))
    assert span.context.trace_flags.sampled
    assert (span.start_time, span.end_time) == (9_600 * 10**6, 10_000 * 10**6)
    assert span.kind == SpanKind.CLIENT
    assert span.status.status_code == StatusCode.ERROR
    assert span.attributes is not None and span.attributes["gen_ai.response.finish_reasons"] == (
        "tool_calls",
    )
    assert span.resource.attributes["service.name"] == "svc"
    assert [e.name for e in span.events] == ["cchatq.queue_wait"]
    assert span.instrumentation_scope is not None
    assert span.instrumentation_scope.name == "cchatq"
