"""OpenTelemetry spans from a real fleet: workers export over OTLP/HTTP to a receiver in this
process (fixtures/otlp.py), and every model call and tool call of a batch arrives as a span
under its session's invoke_agent span, in one trace per session across its tasks; content
only when asked for; a step redelivered after its worker was SIGKILLed shows as attempt 2 in
the same trace. Redis database 10."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fixtures.demo_scenarios import failing_tool, program_chat, provider_error, two_rounds
from fixtures.otlp import OtlpReceiver, SpanSeen
from producer.fleet import Fleet
from schemas import keys
from tests.conftest import Running, _workers
from tests.test_pipeline import submit_specs
from tests.test_recovery import diagnose
from worker.session.spans import agent_span_id, trace_id

pytestmark = pytest.mark.fleet

REDIS_DB = 10
CONTENT = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"
CONTENT_KEYS = {
    "gen_ai.input.messages",
    "gen_ai.output.messages",
    "gen_ai.tool.call.arguments",
    "gen_ai.tool.call.result",
}
INTERNAL, CLIENT, STATUS_ERROR = 1, 3, 2  # OTLP's numbers


@pytest.fixture()
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as received:
        yield received


def otel_env(receiver: OtlpReceiver, **extra: str) -> dict[str, str]:
    return {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.url,
        "OTEL_BSP_SCHEDULE_DELAY": "100",  # ms: spans leave a worker soon after their step
        "CCHATQ_CONSUMER_DEAD_AFTER_S": "5",  # a killed worker's message comes back soon
        **extra,
    }


def exporting(base: Fleet, receiver: OtlpReceiver, **extra: str) -> Iterator[Running]:
    yield from _workers(base, db=REDIS_DB, extra_env=otel_env(receiver, **extra))


@pytest.fixture()
def traced(base_fleet: Fleet, receiver: OtlpReceiver) -> Iterator[Running]:
    yield from exporting(base_fleet, receiver)


@pytest.fixture()
def traced_with_content(base_fleet: Fleet, receiver: OtlpReceiver) -> Iterator[Running]:
    yield from exporting(base_fleet, receiver, **{CONTENT: "true"})


def hexed(value: int, size: int) -> str:
    return value.to_bytes(size, "big").hex()


def of_session(spans: list[SpanSeen], spec_id: str) -> list[SpanSeen]:
    return [s for s in spans if s.attributes.get("cchatq.session.id") == spec_id]


def kinds_of(spans: list[SpanSeen]) -> tuple[int, int, int]:
    """How many chat, execute_tool and invoke_agent spans."""
    ops = [s.attributes.get("gen_ai.operation.name") for s in spans]
    return ops.count("chat"), ops.count("execute_tool"), ops.count("invoke_agent")


def arrived(expected: dict[str, tuple[int, int, int]]) -> Any:
    """Whether every session's spans came, as many of each as expected."""

    def done(spans: list[SpanSeen]) -> bool:
        by_id: dict[str, list[SpanSeen]] = {}
        for span in spans:
            by_id.setdefault(str(span.attributes.get("cchatq.session.id")), []).append(span)
        return all(kinds_of(by_id.get(i, [])) == counts for i, counts in expected.items())

    return done


def batch(fresh: str) -> tuple[list[dict[str, Any]], dict[str, tuple[int, int, int]]]:
    """100 sessions: two_rounds (3 model calls, 2 tool calls), a tool that traps, a model that
    answers 400, and two program runs; with the chat, tool and agent spans each makes."""
    specs: list[dict[str, Any]] = []
    expected: dict[str, tuple[int, int, int]] = {}
    kinds = [(two_rounds, 68, (3, 2, 1)), (failing_tool, 15, (2, 1, 1))]
    kinds += [(provider_error, 15, (1, 0, 1))]
    for make, count, spans in kinds:
        for k in range(count):
            spec = {"id": f"{fresh}/{make.__name__}/{k}", **make(k)[0]}
            specs.append(spec)
            expected[spec["id"]] = spans
    for k in range(2):  # its chat is a session of its own: `<run id>#send0`
        run = f"{fresh}/program/{k}"
        specs.append({"id": run, **program_chat(k)[0]})
        expected[run] = (0, 0, 1)
        expected[f"{run}#send0"] = (1, 0, 1)
    return specs, expected


def test_every_call_of_a_batch_arrives_as_a_span_under_its_session(
    traced: Running, receiver: OtlpReceiver, tmp_path: Path, fresh_id: str
) -> None:
    specs, expected = batch(fresh_id)
    assert len(specs) == 100
    sub = submit_specs(traced.client, specs, tmp_path)
    records = {r["id"]: r for _, r in traced.client.wait(sub, timeout_s=240)}
    assert len(records) == 100
    spans = receiver.wait_for(arrived(expected), timeout_s=60)
    replay_port = int(traced.fleet.replay_url.split(":")[-1].split("/")[0])

    assert {s.resource.get("service.name") for s in spans} == {"cchatq-worker"}
    assert {s.scope for s in spans} == {"cchatq"}
    assert len({s.span_id for s in spans}) == len(spans)  # derived ids never collide
    for spec_id in expected:
        mine = of_session(spans, spec_id)
        run_id = spec_id.split("#", 1)[0]
        sk = str(traced.client.session_key(spec_id if "#" not in spec_id else run_id))
        if "#" in spec_id:  # a program's chat: its own key, in its run's trace
            own_sk = keys.chat_session_key(sk, 0)
            assert {s.attributes["cchatq.batch.id"] for s in mine} == {keys.run_batch(sk)}
        else:
            own_sk = sk
            assert {s.attributes["cchatq.batch.id"] for s in mine} == {sub.batch}
        (agent,) = [s for s in mine if s.name.startswith("invoke_agent")]
        assert {s.trace_id for s in mine} == {hexed(trace_id(sk), 16)}  # one trace, all tasks
        assert agent.span_id == hexed(agent_span_id(own_sk), 8)
        assert agent.kind == INTERNAL
        assert agent.parent_id == ("" if own_sk == sk else hexed(agent_span_id(sk), 8))
        assert {s.parent_id for s in mine if s is not agent} <= {agent.span_id}
        # within the agent's span, give or take the ms by which two processes' readings of
        # Redis's clock may differ (a program's chat is submitted by one, called by another)
        skew_ns = 2_000_000
        assert all(
            agent.start_ns - skew_ns <= s.start_ns and s.end_ns <= agent.end_ns + skew_ns
            for s in mine
        )
        assert not any(CONTENT_KEYS & set(s.attributes) for s in mine)
        # a round the rate controller put off has a `rate_limit wait` span too (no operation)
        chats = sorted(
            (s for s in mine if s.attributes.get("gen_ai.operation.name") == "chat"),
            key=lambda s: s.start_ns,
        )
        assert [s.attributes["cchatq.step"] for s in chats] == [
            keys.round_step(own_sk, r) for r in range(len(chats))
        ]
        for chat in chats:
            attrs = chat.attributes
            assert chat.kind == CLIENT and chat.name == f"chat {attrs['gen_ai.request.model']}"
            assert attrs["gen_ai.provider.name"] == "openai"
            assert (attrs["server.address"], attrs["server.port"]) == ("127.0.0.1", replay_port)
            assert attrs["cchatq.attempt"] == 1
            assert str(attrs["cchatq.worker"]).startswith("llm")
            assert [e.name for e in chat.events][:1] == ["cchatq.queue_wait"]
            assert chat.events[0].attributes["wait_ms"] >= 0
        for tool in (
            s for s in mine if s.attributes.get("gen_ai.operation.name") == "execute_tool"
        ):
            attrs = tool.attributes
            assert tool.kind == INTERNAL
            assert tool.name == f"execute_tool {attrs['gen_ai.tool.name']}"
            assert attrs["gen_ai.tool.type"] == "function" and attrs["gen_ai.tool.call.id"]
            assert str(attrs["cchatq.worker"]).startswith("tools")
            assert str(attrs["cchatq.step"]).startswith(f"{own_sk}.r")
            assert [e.name for e in tool.events][:1] == ["cchatq.queue_wait"]

    def named(spec_id: str, name: str) -> SpanSeen:
        (span,) = [s for s in of_session(spans, spec_id) if s.name == name]
        return span

    for k in range(68):
        spec_id = f"{fresh_id}/two_rounds/{k}"
        assert records[spec_id]["status"] == "ok"
        agent = named(spec_id, "invoke_agent cchatq")
        assert agent.attributes["cchatq.outcome"] == "ok" and agent.status_code != STATUS_ERROR
        chats = [s for s in of_session(spans, spec_id) if s.name == "chat replay/two_rounds"]
        assert sorted(s.attributes["gen_ai.response.finish_reasons"] for s in chats) == [
            ("stop",),
            ("tool_calls",),
            ("tool_calls",),
        ]
        assert all(s.attributes["gen_ai.usage.output_tokens"] >= 0 for s in chats)
        assert all(s.attributes["gen_ai.response.id"] for s in chats)
    for k in range(15):
        trapped = named(f"{fresh_id}/failing_tool/{k}", "execute_tool boom")
        assert trapped.attributes["error.type"] == "RUNTIME_ERROR"
        assert trapped.status_code == STATUS_ERROR
        refused = f"{fresh_id}/provider_error/{k}"
        chat = named(refused, "chat replay/bad_request")
        assert chat.attributes["error.type"] == "provider_error"
        assert chat.status_code == STATUS_ERROR
        agent = named(refused, "invoke_agent cchatq")
        assert agent.attributes["error.type"] == agent.attributes["cchatq.outcome"]
        assert agent.attributes["cchatq.outcome"] == "provider_error"
        assert agent.status_code == STATUS_ERROR
    for k in range(2):
        run = named(f"{fresh_id}/program/{k}", "invoke_agent prog_chat")
        assert run.attributes["gen_ai.agent.name"] == "prog_chat"
    # the start steps, of no session, say where they ran and how long the producer's message
    # waited, in the fleet's trace stream
    fleet = [e for _, f in traced.client.redis.xrange(keys.TRACE) for e in keys.trace_events(f)]
    starts = [e for e in fleet if e.get("kind") == "start"]
    assert starts and all(e["queue_ms"] >= 0 and e["delivery"] == 1 for e in starts)
    assert all(str(e["worker"]).startswith("control") for e in starts)


def test_content_is_exported_only_when_asked_for_and_never_traced_in_redis(
    traced_with_content: Running, receiver: OtlpReceiver, tmp_path: Path, fresh_id: str
) -> None:
    specs = [{"id": f"{fresh_id}/tr/{k}", **two_rounds(k)[0]} for k in range(3)]
    specs.append({"id": f"{fresh_id}/boom", **failing_tool(0)[0]})
    sub = submit_specs(traced_with_content.client, specs, tmp_path)
    records = {r["id"]: r for _, r in traced_with_content.client.wait(sub, timeout_s=120)}
    assert len(records) == 4
    expected = {s["id"]: (3, 2, 1) for s in specs[:3]} | {specs[3]["id"]: (2, 1, 1)}
    spans = receiver.wait_for(arrived(expected), timeout_s=60)
    for k in range(3):
        mine = of_session(spans, f"{fresh_id}/tr/{k}")
        first = min((s for s in mine if s.name.startswith("chat")), key=lambda s: s.start_ns)
        asked = json.loads(first.attributes["gen_ai.input.messages"])
        text = two_rounds(k)[0]["messages"][0]["content"]
        assert asked == [{"role": "user", "parts": [{"type": "text", "content": text}]}]
        answered = json.loads(first.attributes["gen_ai.output.messages"])
        assert answered[0]["finish_reason"] == "tool_calls"
        assert answered[0]["parts"][0]["name"] == "calculate"
        tools = sorted(
            (s for s in mine if s.name == "execute_tool calculate"), key=lambda s: s.start_ns
        )
        assert json.loads(tools[0].attributes["gen_ai.tool.call.arguments"]) == {
            "a": k,
            "b": 3,
            "op": "add",
        }
        assert json.loads(tools[0].attributes["gen_ai.tool.call.result"]) == {"result": k + 3}
    boom = next(s for s in spans if s.name == "execute_tool boom")
    assert "unreachable" in boom.attributes["gen_ai.tool.call.result"]
    # the trace events in Redis (cchatq trace) carry none of it
    for spec in specs:
        sk = str(traced_with_content.client.session_key(spec["id"]))
        stored = json.dumps(list(traced_with_content.client.run_trace(sk)))
        assert "multiply" not in stored and "content" not in stored, stored


def test_a_step_redelivered_after_its_worker_was_killed_is_attempt_2_in_the_same_trace(
    traced: Running, receiver: OtlpReceiver, tmp_path: Path, fresh_id: str
) -> None:
    spec: dict[str, Any] = {
        "id": f"{fresh_id}/killed",
        "model": "replay/plain",
        "messages": [{"role": "user", "content": f"Hello {fresh_id} [[latency_ms:3000]]"}],
    }
    sub = submit_specs(traced.client, [spec], tmp_path)
    sk = sub.order[0]
    step = keys.round_step(sk, 0)

    def leased() -> bool:
        state = traced.client.redis.get(keys.step_state(step))
        return state is not None and state.startswith(b"lease")

    deadline = time.monotonic() + 30
    while not leased():  # the model call is in flight
        assert time.monotonic() < deadline, "the round never started"
        time.sleep(0.02)
    name, llm = next((n, p) for n, p in traced.fleet.workers.items() if n.startswith("llm"))
    traced.fleet.kill(llm)
    traced.fleet.start_worker("llm", extra_env=otel_env(receiver))
    try:
        (record,) = dict(traced.client.wait(sub, timeout_s=45)).values()
    except TimeoutError:
        pytest.fail(diagnose(traced, [sk]))
    assert record["status"] == "ok"
    expected = {spec["id"]: (1, 0, 1)}
    spans = of_session(receiver.wait_for(arrived(expected), timeout_s=30), spec["id"])
    chat = next(s for s in spans if s.name == "chat replay/plain")
    agent = next(s for s in spans if s.name == "invoke_agent cchatq")
    assert chat.attributes["cchatq.attempt"] == 2
    assert chat.attributes["cchatq.step"] == step
    assert not str(chat.attributes["cchatq.worker"]).startswith(f"{name}@")  # the new worker
    assert chat.trace_id == agent.trace_id == hexed(trace_id(sk), 16)
    assert chat.parent_id == agent.span_id
    # its message waited through the killed delivery and its return to the queue
    (waited,) = [e for e in chat.events if e.name == "cchatq.queue_wait"]
    assert waited.attributes["wait_ms"] > 0
