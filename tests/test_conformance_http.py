"""The HTTP errors and retries of docs/provider-conformance.md (Retry-After, x-should-retry,
retried statuses, timeouts and truncated streams, retry safety), plus the usage of retried
attempts, which the run's totals count.

Every case goes through the real HttpProvider (requests, codec, retry policy) against a
loopback server: tests/test_provider_http.py's ScriptedServer for JSON replies, and a small
SSE server here for streams. Backoff sleeps are recorded, never slept.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from email.utils import formatdate
from typing import Any

import pytest

from schemas import keys
from schemas.spec_types import spec_from_json
from tests.test_engine import (
    USER,
    call,
    make_spec,
    ok,
    session,
)
from tests.test_engine import completion as canonical_completion
from tests.test_provider_http import REQUEST, Reply, ScriptedServer, completion
from worker.codecs.anthropic import AnthropicCodec
from worker.codecs.gemini import GeminiCodec
from worker.codecs.openai_codec import OpenAICodec
from worker.codecs.protocol import ChatRequest, Codec
from worker.codecs.reply import Reply as ModelReply
from worker.config import BackendConfig, FleetConfig, Settings
from worker.edges.provider_http import CompletionResult, HttpProvider
from worker.errors import ProviderRequestError, ProviderRetryableError
from worker.session.ending import metrics
from worker.session.engine import CallModel, RunTools, plan
from worker.session.outcomes import ToolOutcome
from worker.session.state import Round
from worker.session.steps import StepRunner
from worker.session.twins.models import OpenRateControl, OpenRateLimiter
from worker.session.twins.queue import Published, StepQueue
from worker.session.twins.store import MemoryStore
from worker.session.twins.tools import NoTools

# Fixtures ---------------------------------------------------------------------------------------


@pytest.fixture
def server() -> Iterator[ScriptedServer]:
    srv = ScriptedServer()
    yield srv
    srv.close()


class Client:
    """HttpProvider with any codec against a server; backoff sleeps recorded, not slept. Not
    adaptive unless asked: a 429 is then retried in the call, as these cases check."""

    def __init__(self, base_url: str, codec: Codec, **cfg: Any) -> None:
        self.sleeps: list[float] = []
        backend = BackendConfig(name="test", base_url=base_url, **{"adaptive": False, **cfg})
        self.provider = HttpProvider(backend, codec, sleep=self.sleeps.append, environ={})

    def complete(self, request: ChatRequest = REQUEST) -> CompletionResult:
        return self.provider.complete(request)


@pytest.fixture
def client(server: ScriptedServer) -> Iterator[Callable[..., Client]]:
    made: list[Client] = []

    def factory(*script: Reply, codec: Codec | None = None, **cfg: Any) -> Client:
        server.script.extend(script)
        made.append(Client(server.base_url, codec or OpenAICodec(), **cfg))
        return made[-1]

    yield factory
    for c in made:
        c.provider.close()


def error_body(message: str) -> dict[str, Any]:
    return {"error": {"message": message}}


# A 429 waits its Retry-After (or retry-after-ms, or RetryInfo), else backoff --------------------


def _in_10_s() -> dict[str, str]:
    return {"Retry-After": formatdate(time.time() + 10, usegmt=True)}


@pytest.mark.parametrize(
    ("headers", "cfg", "low", "high"),
    [
        pytest.param(lambda: {"Retry-After": "7"}, {}, 7.0, 7.0, id="seconds"),
        pytest.param(_in_10_s, {}, 8.0, 10.0, id="http-date"),
        pytest.param(lambda: {"retry-after-ms": "750"}, {}, 0.75, 0.75, id="ms"),
        pytest.param(
            lambda: {"retry-after-ms": "750", "Retry-After": "7"}, {}, 0.75, 0.75, id="ms-wins"
        ),
        pytest.param(lambda: {"Retry-After": "600"}, {}, 60.0, 60.0, id="capped-default-60"),
        pytest.param(
            lambda: {"Retry-After": "7"}, {"max_retry_after_s": 5.0}, 5.0, 5.0, id="capped-5"
        ),
    ],
)
def test_retry_after_seconds_date_and_ms(
    client: Callable[..., Client],
    server: ScriptedServer,
    headers: Callable[[], dict[str, str]],
    cfg: dict[str, Any],
    low: float,
    high: float,
) -> None:
    c = client(Reply(429, error_body("slow down"), headers()), Reply(), **cfg)
    result = c.complete()
    assert result.attempts == 2
    assert len(server.seen) == 2
    assert result.completion["choices"][0]["message"]["content"] == "hello"
    (slept,) = c.sleeps
    assert low <= slept <= high


def test_without_a_header_exponential_backoff_with_jitter(
    client: Callable[..., Client], server: ScriptedServer
) -> None:
    c = client(*[Reply(429, error_body("slow down"))] * 3, Reply(), max_attempts=4)
    result = c.complete()
    assert result.attempts == 4
    assert len(c.sleeps) == 3
    for slept, base in zip(c.sleeps, [0.5, 1.0, 2.0], strict=True):
        assert base <= slept < base + 0.25  # 0.5, 1, 2 s plus up to 0.25 s of jitter


GEMINI_OK = {
    "candidates": [
        {"content": {"role": "model", "parts": [{"text": "hi"}]}, "finishReason": "STOP"}
    ],
    "usageMetadata": {"promptTokenCount": 3, "candidatesTokenCount": 1, "totalTokenCount": 4},
    "modelVersion": "gemini-2.5-flash",
    "responseId": "resp-1",
}
GEMINI_429 = {
    "error": {
        "code": 429,
        "message": "You exceeded your current quota.",
        "status": "RESOURCE_EXHAUSTED",
        "details": [
            {
                "@type": "type.googleapis.com/google.rpc.QuotaFailure",
                "violations": [{"quotaId": "GenerateRequestsPerMinutePerProjectPerModel"}],
            },
            {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "3s"},
        ],
    }
}


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        pytest.param({}, 3.0, id="retry-info"),
        pytest.param({"Retry-After": "1"}, 1.0, id="header-wins"),
    ],
)
def test_gemini_resource_exhausted_retry_info(
    client: Callable[..., Client],
    server: ScriptedServer,
    headers: dict[str, str],
    expected: float,
) -> None:
    c = client(Reply(429, GEMINI_429, headers), Reply(body=GEMINI_OK), codec=GeminiCodec())
    result = c.complete(ChatRequest(model="gemini-2.5-flash", messages=[USER]))
    assert c.sleeps == [expected]
    assert result.attempts == 2
    assert [s.path for s in server.seen] == ["/v1/models/gemini-2.5-flash:generateContent"] * 2
    assert result.completion["choices"][0]["message"]["content"] == "hi"


# x-should-retry wins over the status ------------------------------------------------------------


def test_x_should_retry_false_on_503_is_not_retried(
    client: Callable[..., Client], server: ScriptedServer
) -> None:
    c = client(Reply(503, error_body("overloaded"), {"x-should-retry": "false"}), Reply())
    with pytest.raises(ProviderRequestError) as info:
        c.complete()
    assert not isinstance(info.value, ProviderRetryableError)
    assert info.value.status == 503
    assert len(server.seen) == 1
    assert c.sleeps == []


def test_x_should_retry_true_on_400_is_retried(
    client: Callable[..., Client], server: ScriptedServer
) -> None:
    c = client(Reply(400, error_body("try again"), {"x-should-retry": "true"}), Reply())
    result = c.complete()
    assert result.attempts == 2
    assert len(server.seen) == 2
    assert len(c.sleeps) == 1


# 5xx and 529 are retried, 4xx other than 408/409/429 never --------------------------------------


@pytest.mark.parametrize("status", [500, 502, 503, 504, 529, 408, 409])
def test_transient_statuses_are_retried(
    client: Callable[..., Client], server: ScriptedServer, status: int
) -> None:
    c = client(Reply(status, error_body("transient")), Reply())
    result = c.complete()
    assert result.attempts == 2
    assert len(server.seen) == 2
    assert len(c.sleeps) == 1
    assert 0.5 <= c.sleeps[0] < 0.75


@pytest.mark.parametrize("status", [400, 401, 403, 404, 422])
def test_request_faults_are_never_retried(
    client: Callable[..., Client], server: ScriptedServer, status: int
) -> None:
    c = client(Reply(status, error_body("fix the request")), Reply())
    with pytest.raises(ProviderRequestError) as info:
        c.complete()
    assert not isinstance(info.value, ProviderRetryableError)
    assert info.value.status == status
    assert len(server.seen) == 1
    assert c.sleeps == []


ANTHROPIC_OK = {
    "id": "msg_01",
    "type": "message",
    "role": "assistant",
    "model": "claude-sonnet-4-5",
    "content": [{"type": "text", "text": "hi"}],
    "stop_reason": "end_turn",
    "stop_sequence": None,
    "usage": {"input_tokens": 3, "output_tokens": 1},
}


def test_anthropic_529_overloaded_error_is_retried(
    client: Callable[..., Client], server: ScriptedServer
) -> None:
    overloaded = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
    c = client(Reply(529, overloaded), Reply(body=ANTHROPIC_OK), codec=AnthropicCodec())
    result = c.complete(ChatRequest(model="claude-sonnet-4-5", messages=[USER]))
    assert result.attempts == 2
    assert [s.path for s in server.seen] == ["/v1/messages"] * 2
    assert result.completion["choices"][0]["message"]["content"] == "hi"


# Timeouts, the total deadline, truncated streams restarted whole --------------------------------


def test_read_timeout_is_retried(client: Callable[..., Client], server: ScriptedServer) -> None:
    c = client(Reply(delay_s=1.0), Reply(), read_timeout_s=0.2)
    result = c.complete()
    assert result.attempts == 2
    assert len(server.seen) == 2
    assert len(c.sleeps) == 1


def test_total_deadline_stops_a_long_retry_after(
    client: Callable[..., Client], server: ScriptedServer
) -> None:
    c = client(
        Reply(429, error_body("slow down"), {"Retry-After": "30"}), Reply(), total_timeout_s=5
    )
    with pytest.raises(ProviderRetryableError) as info:
        c.complete()
    assert info.value.status == 429
    assert c.sleeps == []  # 30 s would end past the 5 s deadline: no wait, no retry
    assert len(server.seen) == 1


def test_total_deadline_stops_repeated_timeouts(
    client: Callable[..., Client], server: ScriptedServer
) -> None:
    c = client(
        *[Reply(delay_s=1.0)] * 20,
        read_timeout_s=0.2,
        total_timeout_s=0.7,
        max_attempts=20,
        backoff_base_s=0.01,
        backoff_max_s=0.01,
    )
    start = time.monotonic()
    with pytest.raises(ProviderRetryableError, match="read timeout"):
        c.complete()
    elapsed = time.monotonic() - start
    assert elapsed < 1.5  # bounded by the deadline, not by 20 attempts of 0.2 s
    assert 2 <= len(server.seen) <= 5


def sse(*events: Any, done: bool = True) -> bytes:
    lines = [f"data: {json.dumps(e)}\n\n" for e in events]
    return "".join([*lines, "data: [DONE]\n\n" if done else ""]).encode()


def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-s",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


def test_truncated_stream_is_retried_whole_and_partial_output_discarded() -> None:
    truncated = sse(
        chunk({"role": "assistant", "content": "Hel"}),
        chunk({"tool_calls": [{"index": 0, "id": "call_1", "function": {"name": "f"}}]}),
        done=False,
    )
    whole = sse(
        chunk({"role": "assistant", "content": "Hello"}),
        chunk({"content": " world"}),
        chunk({}, finish="stop"),
    )
    srv = ScriptedServer()
    srv.script = [Reply(body=body, content_type="text/event-stream") for body in (truncated, whole)]
    sleeps: list[float] = []
    provider = HttpProvider(
        BackendConfig(name="sse", base_url=srv.base_url), OpenAICodec(), sleeps.append, {}
    )
    try:
        result = provider.complete(replace(REQUEST, stream=True))
    finally:
        provider.close()
        srv.close()
    assert result.attempts == 2
    assert len(sleeps) == 1
    bodies = [seen.body for seen in srv.seen]
    assert len(bodies) == 2 and bodies[0] == bodies[1]  # the same call, again
    assert json.loads(bodies[0])["stream"] is True
    message = result.completion["choices"][0]["message"]
    assert message["content"] == "Hello world"  # nothing of the cut-off attempt
    assert "tool_calls" not in message  # the half-built call is gone


# Never a model call again once a tool of that turn ran ------------------------------------------


def test_retry_budget_is_per_model_call(
    client: Callable[..., Client], server: ScriptedServer
) -> None:
    c = client(max_attempts=2)
    for _ in range(3):  # each call may spend the whole budget again
        server.script.extend([Reply(500, error_body("boom")), Reply()])
        assert c.complete().attempts == 2
    server.script.extend([Reply(500, error_body("boom"))] * 2 + [Reply()])
    with pytest.raises(ProviderRetryableError):
        c.complete()  # but never more than the budget within one call
    assert len(server.seen) == 8


TWO_CALLS = canonical_completion(
    call("call_a", "get_weather", '{"city":"Paris"}'),
    call("call_b", "get_time", "{}"),
    completion_id="c0",
)


@pytest.mark.parametrize(
    "stored",
    [
        pytest.param({}, id="no-tool-ran"),
        pytest.param({0: ok("sunny")}, id="one-tool-ran"),
        pytest.param({1: ok("12:00")}, id="other-tool-ran"),
        pytest.param({0: ok("sunny"), 1: ok("12:00")}, id="all-tools-ran"),
    ],
)
def test_a_stored_round_reply_is_never_requested_again(
    stored: dict[int, ToolOutcome],
) -> None:
    s = session(make_spec(), Round(reply=ModelReply.parse(TWO_CALLS), outcomes=stored))
    step = plan(s)
    if len(stored) < 2:
        assert isinstance(step, RunTools)
        assert step.round_no == 0
        assert sorted(r.index for r in step.runs) == sorted({0, 1} - set(stored))
    else:
        assert isinstance(step, CallModel)
        assert step.round_no == 1  # a new model call, with every tool result in it
        assert [m["role"] for m in step.messages[-2:]] == ["tool", "tool"]


class ScriptedProvider:
    def __init__(self, *replies: dict[str, Any]) -> None:
        self.replies = list(replies)
        self.requests: list[ChatRequest] = []

    def complete(self, request: ChatRequest, on_delta: Any = None) -> CompletionResult:
        self.requests.append(request)
        return CompletionResult(self.replies.pop(0), attempts=1, latency_ms=1)


def redeliver(store: MemoryStore, sk: str, round_no: int) -> None:
    """As if the step's last delivery died after its work, before marking it published."""
    store.published.discard(keys.round_step(sk, round_no))


def last_sent(dispatch: StepQueue) -> Published:
    """The step published last, read afresh (each step run may publish more)."""
    return dispatch.sent[-1]


def test_round_step_calls_the_model_only_before_its_tools_run() -> None:
    store = MemoryStore()
    store.submit("s1", spec_from_json(make_spec()))
    dispatch = StepQueue()
    provider = ScriptedProvider(TWO_CALLS, canonical_completion(content="done"))
    backend = BackendConfig(name="replay")
    runner = StepRunner(
        store=store,
        dispatch=dispatch,
        provider_for=lambda _: provider,
        tools=NoTools,
        settings=Settings(fleet=FleetConfig(backends={"replay": backend})),
        rate_limiter=OpenRateLimiter(),
        rate_control=OpenRateControl(),
    )
    runner.round("s1", 0)  # the round's model call, before any tool is planned
    assert len(provider.requests) == 1
    assert dispatch.sent == [("tool", "s1", 0, 0), ("tool", "s1", 0, 1)]

    store.store_tool_outcomes("s1", 0, {0: ok("sunny")}, 2)  # one tool ran
    redeliver(store, "s1", 0)
    runner.round("s1", 0)  # a redelivered round step: plans the rest, no second model call
    assert len(provider.requests) == 1
    assert last_sent(dispatch) == ("tool", "s1", 0, 1)

    store.store_tool_outcomes("s1", 0, {1: ok("12:00")}, 2)  # every tool ran
    redeliver(store, "s1", 0)
    runner.round("s1", 0)
    assert len(provider.requests) == 1
    assert last_sent(dispatch) == ("round", "s1", 1)

    runner.round("s1", 1)  # the next model call is a new call, carrying the tool results
    assert len(provider.requests) == 2
    assert [m["role"] for m in provider.requests[1].messages[-2:]] == ["tool", "tool"]
    assert last_sent(dispatch) == ("round", "s1", 1)  # the last round ends the session itself
    body = store.result("s1")
    assert body is not None and body["choices"][0]["message"]["content"] == "done"


# Retried attempts that returned usage count in the run's totals ---------------------------------


def test_retried_attempt_usage_reaches_run_totals(
    client: Callable[..., Client], server: ScriptedServer
) -> None:
    c = client(Reply(body=completion(None)), Reply())  # each reply bills 4 tokens
    result = c.complete()
    assert result.attempts == 2
    s = session(make_spec(), Round(reply=ModelReply.parse(result.completion)))
    assert metrics(s, 0)["usage"]["total_tokens"] == 8
