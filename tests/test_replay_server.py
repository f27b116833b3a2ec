"""The replay LLM server, driven over real HTTP the way a chat client drives it."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest
import requests

from fixtures.replay.faults import FaultDice, FaultRates
from fixtures.replay.scenarios import SLOW_DEFAULT_LATENCY_MS, handle
from fixtures.replay.server import ReplayServer

ROOT = Path(__file__).resolve().parents[1]
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
CALC_TOOL = {"type": "function", "function": {"name": "calculate", "parameters": {}}}


class Client:
    """A minimal OpenAI-style chat client on one kept-alive session."""

    def __init__(self, server: ReplayServer) -> None:
        self.server = server
        self.session = requests.Session()

    def post(self, model: str, messages: list[dict[str, Any]], **extra: Any) -> requests.Response:
        body = {"model": model, "messages": messages, **extra}
        return self.session.post(f"{self.server.url}/chat/completions", json=body, timeout=10)

    def ok(self, model: str, messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        response = self.post(model, messages, **extra)
        assert response.status_code == 200, response.text
        result: dict[str, Any] = response.json()
        return result

    def root(self, path: str) -> str:
        return self.server.url.removesuffix("/v1") + path


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]


def message(reply: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = reply["choices"][0]["message"]
    return result


def follow_up(
    messages: list[dict[str, Any]], reply: dict[str, Any], contents: list[str]
) -> list[dict[str, Any]]:
    """What a client sends next: the assistant message, then one tool message per call."""
    assistant = message(reply)
    calls = assistant["tool_calls"]
    assert len(calls) == len(contents)
    tools = [
        {"role": "tool", "tool_call_id": call["id"], "content": content}
        for call, content in zip(calls, contents, strict=True)
    ]
    return [*messages, assistant, *tools]


def calls_of(reply: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [
        (c["id"], c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in message(reply)["tool_calls"]
    ]


def loud(response: requests.Response, *fragments: str) -> str:
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["type"] == "replay_unexpected_request"
    for fragment in fragments:
        assert fragment in error["message"]
    text: str = error["message"]
    return text


@pytest.fixture(scope="module")
def server() -> Iterator[ReplayServer]:
    srv = ReplayServer(port=0).start()
    yield srv
    srv.stop()


@pytest.fixture()
def client(server: ReplayServer) -> Iterator[Client]:
    server.reset()
    c = Client(server)
    yield c
    c.session.close()


# --- endpoints and reply format -----------------------------------------------------------


def test_health_and_empty_stats(client: Client) -> None:
    health = client.session.get(client.root("/healthz"), timeout=5)
    assert (health.status_code, health.text) == (200, "ok")
    stats = client.session.get(client.root("/stats"), timeout=5).json()
    assert stats == {
        "requests": 0,
        "by_scenario": {},
        "by_protocol": {},
        "unexpected": 0,
        "rejected": 0,
        "faults": 0,
        "last_unexpected": "",
        "last_rejected": "",
        "max_in_flight": 0,
        "arrivals": [],
    }


def test_plain_full_reply_format(client: Client) -> None:
    text = "  Hello there [[latency_ms:0]] "
    reply = client.ok("replay/plain", user(text))
    digest = hashlib.sha256(f"{text}0".encode()).hexdigest()[:12]
    content = "Echo: Hello there"
    assert reply == {
        "id": f"chatcmpl-replay-{digest}",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "replay/plain",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content},
                "finish_reason": "stop",
            }
        ],
        "usage": {
            "prompt_tokens": 20,
            "completion_tokens": len(content) // 4 + 1,
            "total_tokens": 20 + len(content) // 4 + 1,
        },
    }
    assert client.server.stats()["by_scenario"] == {"plain": 1}


def test_scenario_marker_when_model_has_no_prefix(client: Client) -> None:
    parts = [{"type": "text", "text": "hi [[scenario:plain]] you"}]
    reply = client.ok("gpt-4o", [{"role": "user", "content": parts}])
    assert message(reply)["content"] == "Echo: hi  you"
    assert reply["model"] == "gpt-4o"


def test_same_request_same_bytes(client: Client) -> None:
    first = client.post("replay/weather", user("Weather in Oslo"), tools=[WEATHER_TOOL])
    second = client.post("replay/weather", user("Weather in Oslo"), tools=[WEATHER_TOOL])
    assert first.content == second.content


def test_chunked_request_body(client: Client) -> None:
    body = json.dumps({"model": "replay/plain", "messages": user("chunks")}).encode()
    pieces = iter([body[:10], body[10:]])  # a generator makes requests send it chunked
    response = client.session.post(f"{client.server.url}/chat/completions", data=pieces, timeout=5)
    assert response.status_code == 200
    assert message(response.json())["content"] == "Echo: chunks"


# --- scripted conversations ---------------------------------------------------------------


def test_weather_conversation(client: Client) -> None:
    messages = user("What is the weather in Paris?")
    first = client.ok("replay/weather", messages, tools=[WEATHER_TOOL])
    call = message(first)["tool_calls"][0]
    assert message(first)["content"] is None
    assert first["choices"][0]["finish_reason"] == "tool_calls"
    assert call == {
        "id": "call_0_0",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
    }
    assert first["usage"] == {"prompt_tokens": 20, "completion_tokens": 5, "total_tokens": 25}
    second = client.ok(
        "replay/weather", follow_up(messages, first, ["18C, sunny"]), tools=[WEATHER_TOOL]
    )
    assert message(second) == {"role": "assistant", "content": "Weather report: 18C, sunny"}
    assert second["usage"]["prompt_tokens"] == 40
    assert second["id"] != first["id"]


def test_parallel_conversation_in_call_order(client: Client) -> None:
    messages = user("Weather in Paris, Tokyo , Lima?")
    first = client.ok("replay/parallel", messages, tools=[WEATHER_TOOL])
    assert calls_of(first) == [
        ("call_0_0", "get_weather", {"city": "Paris"}),
        ("call_0_1", "get_weather", {"city": "Tokyo"}),
        ("call_0_2", "get_weather", {"city": "Lima"}),
    ]
    history = follow_up(messages, first, ["sun", "rain", "fog"])
    second = client.ok("replay/parallel", history, tools=[WEATHER_TOOL])
    assert message(second)["content"] == "sun | rain | fog"

    swapped = [*history[:-3], history[-2], history[-3], history[-1]]
    loud(
        client.post("replay/parallel", swapped, tools=[WEATHER_TOOL]),
        "replay scenario parallel:",
        "'call_0_1' but 'call_0_0' was expected",
    )


def test_two_rounds_integers(client: Client) -> None:
    messages = user("Add 2 and 3, then multiply by 10")
    tools = [CALC_TOOL]
    first = client.ok("replay/two_rounds", messages, tools=tools)
    assert calls_of(first) == [("call_0_0", "calculate", {"a": 2, "b": 3, "op": "add"})]
    assert message(first)["tool_calls"][0]["function"]["arguments"] == '{"a":2,"b":3,"op":"add"}'
    messages = follow_up(messages, first, ['{"result": 5}'])
    second = client.ok("replay/two_rounds", messages, tools=tools)
    assert calls_of(second) == [("call_1_0", "calculate", {"a": 5, "b": 10, "op": "mul"})]
    messages = follow_up(messages, second, ['{"result":50}'])
    third = client.ok("replay/two_rounds", messages, tools=tools)
    assert message(third)["content"] == "Result: 50"


def test_two_rounds_floats_keep_their_text(client: Client) -> None:
    messages = user("Add 1.5 and 2.0, then multiply by 4")
    first = client.ok("replay/two_rounds", messages, tools=[CALC_TOOL])
    assert calls_of(first)[0][2] == {"a": 1.5, "b": 2, "op": "add"}
    messages = follow_up(messages, first, ['{"result":3.5}'])
    second = client.ok("replay/two_rounds", messages, tools=[CALC_TOOL])
    assert calls_of(second)[0][2] == {"a": 3.5, "b": 4, "op": "mul"}
    messages = follow_up(messages, second, ['{"result":14.0}'])
    assert message(client.ok("replay/two_rounds", messages, tools=[CALC_TOOL]))["content"] == (
        "Result: 14.0"
    )


@pytest.mark.parametrize("failing_round", [1, 2])
def test_two_rounds_tool_failure(client: Client, failing_round: int) -> None:
    error = '{"error":{"code":"tool_exec_failed","message":"division by zero"}}'
    messages = user("Add 2 and 3, then multiply by 10")
    reply = client.ok("replay/two_rounds", messages, tools=[CALC_TOOL])
    if failing_round == 2:
        messages = follow_up(messages, reply, ['{"result":5}'])
        reply = client.ok("replay/two_rounds", messages, tools=[CALC_TOOL])
    messages = follow_up(messages, reply, [error])
    final = client.ok("replay/two_rounds", messages, tools=[CALC_TOOL])
    assert message(final)["content"] == f"Tool failed: {error}"


def test_two_rounds_rewritten_history_is_loud(client: Client) -> None:
    messages = user("Add 2 and 3, then multiply by 10")
    first = client.ok("replay/two_rounds", messages, tools=[CALC_TOOL])
    history = follow_up(messages, first, ['{"result":5}'])
    history[2]["tool_calls"][0]["function"]["arguments"] = '{"a":2,"b":4,"op":"add"}'
    loud(
        client.post("replay/two_rounds", history, tools=[CALC_TOOL]),
        "assistant message of turn 0 does not match",
    )


def test_call_scenario_with_unoffered_tools(client: Client) -> None:
    text = 'run [[call:no_such_tool {"m": [[1, 2]], "s": "]]"}]] and [[call:echo {"x":1}]]'
    messages = user(text)
    first = client.ok("replay/call", messages)  # no tools offered: allowed for `call`
    assert calls_of(first) == [
        ("call_0_0", "no_such_tool", {"m": [[1, 2]], "s": "]]"}),
        ("call_0_1", "echo", {"x": 1}),
    ]
    history = follow_up(messages, first, ['{"error":"unknown_tool"}', "hello"])
    second = client.ok("replay/call", history)
    assert message(second)["content"] == 'Tool said: {"error":"unknown_tool"} | hello'


def test_call_scenario_without_marker_is_loud(client: Client) -> None:
    loud(client.post("replay/call", user("nothing to call")), "no [[call:NAME ARGS]] marker")


def test_loop_never_finishes(client: Client) -> None:
    messages = user("loop forever")
    for t in range(6):
        reply = client.ok("replay/loop", messages, tools=[WEATHER_TOOL])
        assert calls_of(reply) == [(f"call_{t}_0", "get_weather", {"city": "Paris"})]
        messages = follow_up(messages, reply, [f"result {t}"])
    assert client.server.stats()["by_scenario"] == {"loop": 6}


def test_empty_reply(client: Client) -> None:
    reply = client.ok("replay/empty", user("say nothing"))
    assert message(reply) == {"role": "assistant", "content": ""}
    assert reply["choices"][0]["finish_reason"] == "stop"
    assert reply["usage"]["completion_tokens"] == 1


# --- faults -------------------------------------------------------------------------------


def test_rate_limited_once_per_conversation(client: Client) -> None:
    first = client.post("replay/rate_limited", user("hi"))
    assert first.status_code == 429
    assert first.headers["Retry-After"] == "1"
    assert first.json() == {"error": {"type": "rate_limit_error", "message": "slow down"}}
    again = client.ok("replay/rate_limited", user("hi"))
    assert message(again)["content"] == "Echo: hi"

    custom = client.post("replay/rate_limited", user("other [[retry_after:7]]"))
    assert (custom.status_code, custom.headers["Retry-After"]) == (429, "7")
    stats = client.server.stats()
    assert (stats["faults"], stats["requests"], stats["unexpected"]) == (2, 3, 0)

    client.session.post(client.root("/reset"), timeout=5).raise_for_status()
    assert client.post("replay/rate_limited", user("hi")).status_code == 429
    assert client.server.stats()["requests"] == 1


def test_flaky_fails_first_then_answers(client: Client) -> None:
    first = client.post("replay/flaky", user("hi"))
    assert first.status_code == 500
    assert first.json() == {"error": {"message": "upstream exploded"}}
    assert message(client.ok("replay/flaky", user("hi")))["content"] == "Echo: hi"
    # Same prompt, other fault scenario: its own first request still faults.
    assert client.post("replay/rate_limited", user("hi")).status_code == 429
    assert client.server.stats()["faults"] == 2


def test_fault_dice_is_seeded_and_draws_its_shares() -> None:
    rates = FaultRates(rate_429=0.1, rate_500=0.05, retry_after_s=2, seed=3)
    first, second = FaultDice(rates), FaultDice(rates)
    draws = [first.draw() for _ in range(4000)]
    assert draws == [second.draw() for _ in range(4000)]  # the same seed, the same faults
    kinds = [d.kind if d else None for d in draws]
    assert 300 < kinds.count("rate_limited") < 500 and 120 < kinds.count("server_error") < 280
    assert {d.retry_after_s for d in draws if d and d.kind == "rate_limited"} == {2}
    assert FaultDice(FaultRates()).draw() is None
    with pytest.raises(ValueError):
        FaultRates(rate_429=0.7, rate_500=0.5)


def test_random_429s_and_the_wait_before_each_retry_are_logged() -> None:
    """Every scripted answer a 429 (Retry-After 1): a retry at once is early, one a second
    later is not; GET /faults counts them and the smallest gap."""
    rates = FaultRates(rate_429=1.0, retry_after_s=1)
    with ReplayServer(port=0, faults=rates) as srv:
        c = Client(srv)
        first = c.post("replay/plain", user("hi"))
        assert (first.status_code, first.headers["Retry-After"]) == (429, "1")
        assert c.post("replay/plain", user("hi")).status_code == 429  # at once: too early
        time.sleep(1.05)
        assert c.post("replay/plain", user("hi")).status_code == 429
        assert c.post("replay/plain", user("another conversation")).status_code == 429
        faults = requests.get(c.root("/faults"), timeout=5).json()
        c.session.close()
    assert faults["injected"] == {"429": 4, "500": 0}
    assert (faults["retries_after_429"], faults["early_retries"]) == (2, 1)
    assert faults["unretried_429"] == 2  # the last of each conversation
    assert faults["min_gap_after_429_s"] < 0.5 and faults["min_margin_s"] < 0


@contextlib.contextmanager
def replay_process(*args: str) -> Iterator[str]:
    """`python -m fixtures.replay --port 0 ARGS` as a process of its own: its base URL, from
    its READY line; it must stop cleanly on SIGTERM."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "fixtures.replay", "--port", "0", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        assert line.startswith("READY http://127.0.0.1:"), line
        yield line.removeprefix("READY ")
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def test_random_500s_from_the_command_line() -> None:
    with replay_process("--fault-500-rate", "1") as url:
        body = {"model": "replay/plain", "messages": user("hi")}
        reply = requests.post(f"{url}/chat/completions", json=body, timeout=5)
        assert reply.status_code == 500
        faults = requests.get(url.removesuffix("/v1") + "/faults", timeout=5).json()
        assert faults["injected"] == {"429": 0, "500": 1}


def test_malformed_body(client: Client) -> None:
    response = client.post("replay/malformed", user("hi"))
    assert response.status_code == 200
    assert response.headers["Content-Type"] == "application/json"
    assert response.content == b'{"choices": ['
    with pytest.raises(requests.JSONDecodeError):
        response.json()


def test_bad_request(client: Client) -> None:
    response = client.post("replay/bad_request", user("hi"))
    assert response.status_code == 400
    assert response.json() == {
        "error": {"type": "invalid_request_error", "message": "model not supported"}
    }
    assert client.server.stats()["faults"] == 0


def test_slow_waits_for_marker_latency(client: Client) -> None:
    started = time.monotonic()
    reply = client.ok("replay/slow", user("take your time [[latency_ms:300]]"))
    assert time.monotonic() - started >= 0.3
    assert message(reply)["content"] == "Echo: take your time"


def test_slow_defaults_to_two_seconds_pure() -> None:
    body = json.dumps({"model": "replay/slow", "messages": user("x")}).encode()
    outcome = handle(body, default_latency_ms=0, first_seen=lambda key: True)
    assert (outcome.kind, outcome.latency_ms) == ("ok", SLOW_DEFAULT_LATENCY_MS)


def test_server_default_latency_and_marker_override() -> None:
    with ReplayServer(latency_ms=250) as srv, requests.Session() as session:
        url = f"{srv.url}/chat/completions"
        started = time.monotonic()
        session.post(url, json={"model": "replay/plain", "messages": user("a")}, timeout=5)
        assert time.monotonic() - started >= 0.25
        started = time.monotonic()
        body = {"model": "replay/weather", "messages": user("Weather in Rome [[latency_ms:0]]")}
        response = session.post(url, json={**body, "tools": [WEATHER_TOOL]}, timeout=5)
        assert response.status_code == 200


# --- loud failures ------------------------------------------------------------------------


def test_bad_json_is_loud(client: Client, capfd: pytest.CaptureFixture[str]) -> None:
    response = client.session.post(
        f"{client.server.url}/chat/completions", data=b"{not json", timeout=5
    )
    text = loud(response, "replay scenario ?:", "not valid JSON")
    stats = client.server.stats()
    assert (stats["unexpected"], stats["last_unexpected"]) == (1, text)
    assert text in capfd.readouterr().err


@pytest.mark.parametrize(
    ("model", "text", "fragment"),
    [
        ("replay/nope", "hi", "replay scenario nope: unknown scenario"),
        ("gpt-4o", "no marker here", "no scenario"),
        ("gpt-4o", "[[scenario:bogus]] hi", "replay scenario bogus: unknown scenario"),
    ],
)
def test_unknown_or_missing_scenario_is_loud(
    client: Client, model: str, text: str, fragment: str
) -> None:
    loud(client.post(model, user(text)), fragment)


def test_wrong_turn_count_is_loud(client: Client) -> None:
    history = [*user("hi"), {"role": "assistant", "content": "Echo: hi"}]
    loud(client.post("replay/plain", history), "replay scenario plain:", "finished with a text")

    messages = user("Weather in Paris")
    first = client.ok("replay/weather", messages, tools=[WEATHER_TOOL])
    history = follow_up(messages, first, ["sunny"])
    second = client.ok("replay/weather", history, tools=[WEATHER_TOOL])
    history = [*history, message(second), {"role": "user", "content": "and tomorrow?"}]
    loud(client.post("replay/weather", history, tools=[WEATHER_TOOL]), "'user' message")
    assert client.server.stats()["unexpected"] == 2


def test_tool_message_protocol_violations_are_loud(client: Client) -> None:
    tools = [WEATHER_TOOL]
    messages = user("Weather in Paris, Rome")
    first = client.ok("replay/parallel", messages, tools=tools)
    full = follow_up(messages, first, ["sun", "rain"])
    assistant, tool_a, tool_b = full[2], full[3], full[4]

    loud(client.post("replay/parallel", full[:-1], tools=tools), "missing tool message")
    extra = {**tool_b, "tool_call_id": "call_9_9"}
    loud(client.post("replay/parallel", [*full, extra], tools=tools), "extra tool message")
    interleaved = [*messages, assistant, {"role": "user", "content": "hurry"}, tool_a, tool_b]
    loud(client.post("replay/parallel", interleaved, tools=tools), "missing tool message")
    stray = [*messages, tool_a, assistant, tool_b]
    loud(client.post("replay/parallel", stray, tools=tools), "extra tool message at index 2")


def test_tool_not_offered_is_loud(client: Client) -> None:
    loud(
        client.post("replay/weather", user("Weather in Paris"), tools=[CALC_TOOL]),
        "calls ['get_weather'] but the request offers tools ['calculate']",
    )
    loud(client.post("replay/two_rounds", user("Add 1 and 2, then multiply by 3")), "calculate")


def test_unknown_route_is_loud_and_stream_is_served(client: Client) -> None:
    streamed = client.post("replay/plain", user("hi"), stream=True)
    assert streamed.status_code == 200
    assert streamed.headers["Content-Type"].startswith("text/event-stream")
    response = client.session.get(client.root("/v1/models"), timeout=5)
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "replay_unexpected_request"
    assert client.server.stats()["unexpected"] == 1


# --- transport ----------------------------------------------------------------------------


def test_keep_alive_without_nagle() -> None:
    """Each kept-alive request would wait ~40 ms for a delayed ACK with Nagle on
    (docs/architecture.md section 6); speed itself is measured in bench/, not asserted here."""
    from fixtures.replay import server as replay_server

    handlers = [
        v for v in vars(replay_server).values()
        if isinstance(v, type) and issubclass(v, BaseHTTPRequestHandler)
        and v is not BaseHTTPRequestHandler
    ]  # fmt: skip
    assert handlers and all(h.disable_nagle_algorithm for h in handlers)
    assert all(h.protocol_version == "HTTP/1.1" for h in handlers)


def test_stop_cuts_kept_alive_connections() -> None:
    srv = ReplayServer().start()
    with requests.Session() as session:
        body = {"model": "replay/plain", "messages": user("x")}
        url = f"{srv.url}/chat/completions"
        assert session.post(url, json=body, timeout=5).status_code == 200
        srv.stop()
        with pytest.raises(requests.ConnectionError):
            session.post(url, json=body, timeout=5)


def test_module_entry_point_subprocess() -> None:
    with replay_process() as url:
        health = requests.get(url.removesuffix("/v1") + "/healthz", timeout=5)
        assert (health.status_code, health.text) == (200, "ok")


# === the four wire protocols ================================================================
#
# One small raw-HTTP driver per protocol (request building, JSON and SSE assembly, the
# follow-up turn), so the same scripted conversations run on every wire, JSON and stream.

Assembled = tuple[str | None, list[tuple[str | None, str, dict[str, Any]]]]
ANTHROPIC_HEADERS = {"anthropic-version": "2023-06-01", "x-api-key": "x"}
SCHEMA: dict[str, Any] = {"type": "object", "properties": {}}
TOOL_NAMES = {
    "weather": ["get_weather"],
    "parallel": ["get_weather"],
    "two_rounds": ["calculate"],
    "bad_args": ["get_weather"],
}


def sse_events(response: requests.Response) -> list[tuple[str | None, str]]:
    """(event, data) of an SSE body, for LF or CRLF line endings."""
    assert response.headers["Content-Type"].startswith("text/event-stream"), response.text
    events: list[tuple[str | None, str]] = []
    for block in response.text.replace("\r\n", "\n").split("\n\n"):
        if not block.strip():
            continue
        name, data = None, []
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].removeprefix(" "))
        events.append((name, "\n".join(data)))
    return events


class Driver:
    protocol = ""

    def __init__(self, session: requests.Session, server: ReplayServer) -> None:
        self.session, self.server = session, server

    def start(self, text: str) -> list[dict[str, Any]]:
        raise NotImplementedError

    def post(
        self, scenario: str, history: list[dict[str, Any]], stream: bool, **extra: Any
    ) -> requests.Response:
        raise NotImplementedError

    def assemble(self, response: requests.Response, stream: bool) -> tuple[Assembled, Any]:
        """(text, calls) of a reply, and the raw assistant turn to echo back."""
        raise NotImplementedError

    def follow(
        self, history: list[dict[str, Any]], raw: Any, calls: list[Any], results: list[Any]
    ) -> list[dict[str, Any]]:
        raise NotImplementedError

    def turn(
        self, scenario: str, history: list[dict[str, Any]], stream: bool, **extra: Any
    ) -> tuple[Assembled, Any]:
        response = self.post(scenario, history, stream, **extra)
        assert response.status_code == 200, response.text
        return self.assemble(response, stream)


def as_text(result: Any) -> str:
    return result if isinstance(result, str) else json.dumps(result)


class OpenAIDriver(Driver):
    protocol = "openai"

    def start(self, text: str) -> list[dict[str, Any]]:
        return user(text)

    def post(
        self, scenario: str, history: list[dict[str, Any]], stream: bool, **extra: Any
    ) -> requests.Response:
        tools = [
            {"type": "function", "function": {"name": n, "parameters": SCHEMA}}
            for n in TOOL_NAMES.get(scenario, [])
        ]
        body: dict[str, Any] = {"model": f"replay/{scenario}", "messages": history, **extra}
        if tools:
            body["tools"] = tools
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        return self.session.post(f"{self.server.url}/chat/completions", json=body, timeout=10)

    def assemble(self, response: requests.Response, stream: bool) -> tuple[Assembled, Any]:
        if not stream:
            msg = message(response.json())
        else:
            events = sse_events(response)
            assert events[-1] == (None, "[DONE]")
            chunks = [json.loads(data) for _, data in events[:-1]]
            assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] > 0
            assert chunks[-2]["choices"][0]["finish_reason"] in ("stop", "tool_calls")
            msg = {"role": "assistant", "content": None}
            slots: dict[int, dict[str, Any]] = {}
            for chunk in chunks[1:-2]:
                delta = chunk["choices"][0]["delta"]
                if "content" in delta:
                    msg["content"] = (msg["content"] or "") + delta["content"]
                for frag in delta.get("tool_calls", []):
                    slot = slots.setdefault(frag["index"], {"function": {"arguments": ""}})
                    slot.update({k: frag[k] for k in ("id", "type") if k in frag})
                    slot["function"]["name"] = frag["function"].get(
                        "name", slot["function"].get("name")
                    )
                    slot["function"]["arguments"] += frag["function"]["arguments"]
            if slots:
                msg["tool_calls"] = [slots[i] for i in sorted(slots)]
        calls = [
            (c["id"], c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in msg.get("tool_calls", [])
        ]
        return (msg["content"], calls), msg

    def follow(
        self, history: list[dict[str, Any]], raw: Any, calls: list[Any], results: list[Any]
    ) -> list[dict[str, Any]]:
        tools = [
            {"role": "tool", "tool_call_id": c[0], "content": as_text(r)}
            for c, r in zip(calls, results, strict=True)
        ]
        return [*history, raw, *tools]


class AnthropicDriver(Driver):
    protocol = "anthropic"

    def start(self, text: str) -> list[dict[str, Any]]:
        return [{"role": "user", "content": text}]

    def post(
        self, scenario: str, history: list[dict[str, Any]], stream: bool, **extra: Any
    ) -> requests.Response:
        body: dict[str, Any] = {
            "model": f"replay/{scenario}",
            "max_tokens": 2048,
            "messages": history,
            "stream": stream,
            **extra,
        }
        if TOOL_NAMES.get(scenario):
            body["tools"] = [{"name": n, "input_schema": SCHEMA} for n in TOOL_NAMES[scenario]]
        url = f"{self.server.root}/v1/messages"
        return self.session.post(url, json=body, headers=ANTHROPIC_HEADERS, timeout=10)

    def assemble(self, response: requests.Response, stream: bool) -> tuple[Assembled, Any]:
        if not stream:
            reply = response.json()
        else:
            events = sse_events(response)
            for name, data in events:
                assert json.loads(data)["type"] == name
            names = [name for name, _ in events]
            assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
            assert "ping" in names
            reply = json.loads(events[0][1])["message"]
            buffers: dict[int, str] = {}
            for name, data in events[1:]:
                event = json.loads(data)
                if name == "content_block_start":
                    reply["content"].append(event["content_block"])
                elif name == "content_block_delta":
                    block, delta = reply["content"][event["index"]], event["delta"]
                    if delta["type"] == "text_delta":
                        block["text"] += delta["text"]
                    elif delta["type"] == "thinking_delta":
                        block["thinking"] += delta["thinking"]
                    elif delta["type"] == "signature_delta":
                        block["signature"] = delta["signature"]
                    else:
                        buffers[event["index"]] = (
                            buffers.get(event["index"], "") + delta["partial_json"]
                        )
                elif name == "content_block_stop" and event["index"] in buffers:
                    reply["content"][event["index"]]["input"] = json.loads(buffers[event["index"]])
                elif name == "message_delta":
                    reply["stop_reason"] = event["delta"]["stop_reason"]
                    reply["usage"]["output_tokens"] = event["usage"]["output_tokens"]
        blocks = reply["content"]
        text = "".join(b["text"] for b in blocks if b["type"] == "text") or None
        calls = [(b["id"], b["name"], b["input"]) for b in blocks if b["type"] == "tool_use"]
        assert reply["stop_reason"] == ("tool_use" if calls else "end_turn")
        return (text, calls), {"role": "assistant", "content": blocks}

    def follow(
        self, history: list[dict[str, Any]], raw: Any, calls: list[Any], results: list[Any]
    ) -> list[dict[str, Any]]:
        blocks = [
            {"type": "tool_result", "tool_use_id": c[0], "content": as_text(r)}
            for c, r in zip(calls, results, strict=True)
        ]
        return [*history, raw, {"role": "user", "content": blocks}]


class GeminiDriver(Driver):
    protocol = "gemini"

    def start(self, text: str) -> list[dict[str, Any]]:
        return [{"role": "user", "parts": [{"text": text}]}]

    def post(
        self, scenario: str, history: list[dict[str, Any]], stream: bool, **extra: Any
    ) -> requests.Response:
        method = "streamGenerateContent?alt=sse" if stream else "generateContent"
        url = f"{self.server.root}/v1beta/models/replay-{scenario}:{method}"
        body: dict[str, Any] = {"contents": history, **extra}
        if TOOL_NAMES.get(scenario):
            body["tools"] = [{"functionDeclarations": [{"name": n} for n in TOOL_NAMES[scenario]]}]
        return self.session.post(url, json=body, headers={"x-goog-api-key": "x"}, timeout=10)

    def assemble(self, response: requests.Response, stream: bool) -> tuple[Assembled, Any]:
        chunks = [json.loads(d) for _, d in sse_events(response)] if stream else [response.json()]
        assert "\r\n\r\n" in response.text if stream else True
        parts: list[dict[str, Any]] = []
        for chunk in chunks:
            parts += chunk["candidates"][0]["content"].get("parts", [])
        assert chunks[-1]["candidates"][0]["finishReason"] == "STOP"
        assert all("finishReason" not in c["candidates"][0] for c in chunks[:-1])
        usage = chunks[-1]["usageMetadata"]
        assert usage["totalTokenCount"] == (
            usage["promptTokenCount"]
            + usage["candidatesTokenCount"]
            + usage.get("thoughtsTokenCount", 0)
        )
        text = "".join(p["text"] for p in parts if "text" in p and not p.get("thought")) or None
        calls = [
            (p["functionCall"].get("id"), p["functionCall"]["name"], p["functionCall"]["args"])
            for p in parts
            if "functionCall" in p
        ]
        return (text, calls), {"role": "model", "parts": parts}

    def follow(
        self, history: list[dict[str, Any]], raw: Any, calls: list[Any], results: list[Any]
    ) -> list[dict[str, Any]]:
        parts = [
            {
                "functionResponse": {
                    "id": c[0],
                    "name": c[1],
                    "response": r if isinstance(r, dict) else {"result": r},
                }
            }
            for c, r in zip(calls, results, strict=True)
        ]
        return [*history, raw, {"role": "user", "parts": parts}]


class TagsDriver(OpenAIDriver):
    protocol = "tags"

    def post(
        self, scenario: str, history: list[dict[str, Any]], stream: bool, **extra: Any
    ) -> requests.Response:
        body: dict[str, Any] = {"model": f"replay-tags/{scenario}", "messages": history, **extra}
        if stream:
            body["stream"] = True
        return self.session.post(f"{self.server.url}/chat/completions", json=body, timeout=10)

    def assemble(self, response: requests.Response, stream: bool) -> tuple[Assembled, Any]:
        if stream:
            chunks = [json.loads(d) for _, d in sse_events(response)[:-1]]
            pieces = [c["choices"][0]["delta"].get("content", "") for c in chunks]
            content = "".join(pieces)
            if "<tool_call>" in content:  # every tag is cut across two chunks
                assert "<tool" in pieces and all("<tool_call>" not in p for p in pieces)
            finish = chunks[-1]["choices"][0]["finish_reason"]
        else:
            reply = response.json()
            content, finish = message(reply)["content"], reply["choices"][0]["finish_reason"]
            assert "tool_calls" not in message(reply)
        assert finish == "stop"
        blocks = re.findall(r"<tool_call>(.*?)</tool_call>", content, re.S)
        calls: list[tuple[str | None, str, dict[str, Any]]] = [
            (None, json.loads(b)["name"], json.loads(b)["arguments"]) for b in blocks
        ]
        return (None if blocks else content, calls), {"role": "assistant", "content": content}

    def follow(
        self, history: list[dict[str, Any]], raw: Any, calls: list[Any], results: list[Any]
    ) -> list[dict[str, Any]]:
        text = "\n".join(
            "<tool_response>\n" + json.dumps({"name": c[1], "content": r}) + "\n</tool_response>"
            for c, r in zip(calls, results, strict=True)
        )
        return [*history, raw, {"role": "user", "content": text}]


DRIVERS: dict[str, type[Driver]] = {
    d.protocol: d for d in (OpenAIDriver, AnthropicDriver, GeminiDriver, TagsDriver)
}
WIRE_MODES = [(p, s) for p in DRIVERS for s in (False, True)]
WIRE_IDS = [f"{p}-{'stream' if s else 'json'}" for p, s in WIRE_MODES]


@pytest.fixture()
def drivers(server: ReplayServer) -> Iterator[dict[str, Driver]]:
    server.reset()
    with requests.Session() as session:
        yield {name: cls(session, server) for name, cls in DRIVERS.items()}


def ids_of(calls: list[Any]) -> list[str | None]:
    return [c[0] for c in calls]


def strip_ids(calls: list[Any]) -> list[tuple[str, Any]]:
    return [(c[1], c[2]) for c in calls]


@pytest.mark.parametrize(("protocol", "stream"), WIRE_MODES, ids=WIRE_IDS)
def test_weather_on_every_wire(drivers: dict[str, Driver], protocol: str, stream: bool) -> None:
    d = drivers[protocol]
    history = d.start("What is the weather in Paris?")
    (text, calls), raw = d.turn("weather", history, stream)
    assert (text, strip_ids(calls)) == (None, [("get_weather", {"city": "Paris"})])
    history = d.follow(history, raw, calls, ["18C, sunny"])
    (text, calls), _ = d.turn("weather", history, stream)
    assert (text, calls) == ("Weather report: 18C, sunny", [])
    assert d.server.stats()["by_protocol"] == {protocol: 2}


@pytest.mark.parametrize(("protocol", "stream"), WIRE_MODES, ids=WIRE_IDS)
def test_parallel_on_every_wire(drivers: dict[str, Driver], protocol: str, stream: bool) -> None:
    d = drivers[protocol]
    history = d.start("Weather in Paris, Tokyo, Lima?")
    (_, calls), raw = d.turn("parallel", history, stream)
    cities = [args["city"] for _, args in strip_ids(calls)]
    assert cities == ["Paris", "Tokyo", "Lima"]
    assert len(set(ids_of(calls))) == (1 if protocol == "tags" else 3)  # tags: no ids
    history = d.follow(history, raw, calls, ["sun", "rain", "fog"])
    assert d.turn("parallel", history, stream)[0] == ("sun | rain | fog", [])


@pytest.mark.parametrize(("protocol", "stream"), WIRE_MODES, ids=WIRE_IDS)
def test_two_rounds_on_every_wire(drivers: dict[str, Driver], protocol: str, stream: bool) -> None:
    d = drivers[protocol]
    history = d.start("Add 2 and 3, then multiply by 10")
    (_, calls), raw = d.turn("two_rounds", history, stream)
    assert strip_ids(calls) == [("calculate", {"a": 2, "b": 3, "op": "add"})]
    history = d.follow(history, raw, calls, [{"result": 5}])
    (_, calls), raw = d.turn("two_rounds", history, stream)
    assert strip_ids(calls) == [("calculate", {"a": 5, "b": 10, "op": "mul"})]
    history = d.follow(history, raw, calls, [{"result": 50}])
    assert d.turn("two_rounds", history, stream)[0] == ("Result: 50", [])


# where the API takes objects only: what refuses the turn as it came, and what the client sends
OBJECT_ONLY = {
    "gemini": ("parts", "functionCall", "args", "Invalid value at 'contents[1].parts[0]"
               ".function_call.args' (type.googleapis.com/google.protobuf.Struct)"),
    "anthropic": ("content", None, "input", "messages.1.content.0.tool_use.input: "
                  "Input should be a valid dictionary"),
}  # fmt: skip


def _with_arguments(raw: dict[str, Any], protocol: str, value: Any) -> dict[str, Any]:
    """The echoed assistant turn with its one call's arguments set to `value`."""
    items, wrapper, key, _ = OBJECT_ONLY[protocol]
    out = json.loads(json.dumps(raw))
    item = out[items][0]
    (item[wrapper] if wrapper else item)[key] = value
    return out


@pytest.mark.parametrize(("protocol", "stream"), WIRE_MODES, ids=WIRE_IDS)
def test_bad_args_on_every_wire(drivers: dict[str, Driver], protocol: str, stream: bool) -> None:
    """`bad_args` calls with arguments that are no object. Echoed as they came they are fine
    where arguments are text (OpenAI, tags) and refused as the real API refuses them where
    they must be an object (Gemini, Anthropic); there the object holding their text is taken."""
    d = drivers[protocol]
    history = d.start("Weather in Paris?")
    (text, calls), raw = d.turn("bad_args", history, stream)
    assert (text, strip_ids(calls)) == (None, [("get_weather", ["Paris"])])
    error = {"error": {"code": "VALIDATION_ERROR", "message": "must be an object"}}
    follow = d.follow(history, raw, calls, [error])
    if protocol in OBJECT_ONLY:
        response = d.post("bad_args", follow, stream)
        assert response.status_code == 400, response.text
        assert OBJECT_ONLY[protocol][3] in response.json()["error"]["message"]
        kind = "INVALID_ARGUMENT" if protocol == "gemini" else "invalid_request_error"
        assert kind in response.text
        other = _with_arguments(raw, protocol, {"_raw_arguments": '["Paris","Rome"]'})
        response = d.post("bad_args", d.follow(history, other, calls, [error]), stream)
        assert response.status_code == 422, response.text  # not what it sent: loud
        raw = _with_arguments(raw, protocol, {"_raw_arguments": '["Paris"]'})
        follow = d.follow(history, raw, calls, [error])
    (text, calls), _ = d.turn("bad_args", follow, stream)
    assert calls == [] and str(text).startswith("Tool said: {")
    assert json.loads(str(text).removeprefix("Tool said: ")) == error


@pytest.mark.parametrize("protocol", list(DRIVERS))
def test_stream_assembles_to_the_json_reply(drivers: dict[str, Driver], protocol: str) -> None:
    d = drivers[protocol]
    for scenario, text in [("parallel", "Weather in Oslo, Rome"), ("plain", "a longer hello")]:
        history = d.start(text)
        assert d.turn(scenario, history, False)[0] == d.turn(scenario, history, True)[0]


@pytest.mark.parametrize("protocol", list(DRIVERS))
def test_rewritten_history_is_loud_on_every_wire(drivers: dict[str, Driver], protocol: str) -> None:
    d = drivers[protocol]
    history = d.start("Weather in Paris")
    (_, calls), raw = d.turn("weather", history, False)
    bad = [(c[0], c[1], {"city": "Rome"}) for c in calls]
    history = d.follow(history, raw, bad, ["sunny"])
    if protocol == "openai":
        raw["tool_calls"][0]["function"]["arguments"] = '{"city":"Rome"}'
    elif protocol == "anthropic":
        raw["content"][0]["input"] = {"city": "Rome"}
    elif protocol == "gemini":
        raw["parts"][0]["functionCall"]["args"] = {"city": "Rome"}
    else:
        raw["content"] = raw["content"].replace("Paris", "Rome")
    response = d.post("weather", history, False)
    assert response.status_code == 422, response.text
    assert "assistant message of turn 0 does not match" in response.text
    assert d.server.stats()["unexpected"] == 1


# --- wire format details ------------------------------------------------------------------


def test_openai_stream_chunk_sequence(drivers: dict[str, Driver]) -> None:
    d = drivers["openai"]
    response = d.post("parallel", d.start("Weather in Paris, Rome"), True)
    chunks = [json.loads(data) for _, data in sse_events(response)[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1
    fragments = [c["choices"][0]["delta"]["tool_calls"][0] for c in chunks[1:-2]]
    assert [f["index"] for f in fragments] == [0, 1] * (len(fragments) // 2)  # interleaved
    assert fragments[0] == {
        "index": 0,
        "id": "call_0_0",
        "type": "function",
        "function": {"name": "get_weather", "arguments": ""},
    }
    assert all("id" not in f and "name" not in f["function"] for f in fragments[2:])
    assert len(fragments) >= 6  # the arguments arrive in several pieces per call
    assert chunks[-2]["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "tool_calls",
    }
    assert chunks[-1]["choices"] == []
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["usage"] == {"prompt_tokens": 20, "completion_tokens": 5, "total_tokens": 25}

    plain = d.session.post(
        f"{d.server.url}/chat/completions",
        timeout=5,
        json={"model": "replay/plain", "messages": user("hi"), "stream": True},
    )
    chunks = [json.loads(data) for _, data in sse_events(plain)[:-1]]
    assert all(c["choices"] and "usage" not in c for c in chunks)  # no include_usage
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "Echo: hi"


def test_openai_stream_options_without_stream_is_rejected(client: Client) -> None:
    response = client.post("replay/plain", user("hi"), stream_options={"include_usage": True})
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert "only allowed when 'stream' is enabled" in response.json()["error"]["message"]
    stats = client.server.stats()
    assert (stats["rejected"], stats["unexpected"]) == (1, 0)
    assert "stream_options" in stats["last_rejected"]


def test_anthropic_json_and_stream_format(drivers: dict[str, Driver]) -> None:
    d = drivers["anthropic"]
    history = d.start("Weather in Paris")
    reply = d.post("weather", history, False).json()
    assert reply == {
        "id": reply["id"],
        "type": "message",
        "role": "assistant",
        "model": "replay/weather",
        "content": [
            {
                "type": "tool_use",
                "id": "toolu_replay_0_0",
                "name": "get_weather",
                "input": {"city": "Paris"},
            }
        ],
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": {
            "input_tokens": 10,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
            "output_tokens": 5,
        },
    }
    assert reply["id"].startswith("msg_")
    events = sse_events(d.post("weather", history, True))
    starts = [json.loads(data) for name, data in events if name == "content_block_start"]
    assert starts == [
        {
            "type": "content_block_start",
            "index": 0,
            "content_block": {
                "type": "tool_use",
                "id": "toolu_replay_0_0",
                "name": "get_weather",
                "input": {},
            },
        }
    ]
    partials = [
        json.loads(data)["delta"]["partial_json"]
        for name, data in events
        if name == "content_block_delta"
    ]
    assert partials[0] == "" and len(partials) >= 3 and "".join(partials) == '{"city":"Paris"}'
    final = json.loads(events[-2][1])
    assert final == {
        "type": "message_delta",
        "usage": {"output_tokens": 5},
        "delta": {"stop_reason": "tool_use", "stop_sequence": None},
    }


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_anthropic_thinking_round_trip(drivers: dict[str, Driver], stream: bool) -> None:
    d = drivers["anthropic"]
    thinking = {"thinking": {"type": "enabled", "budget_tokens": 1024}}
    history = d.start("Add 2 and 3, then multiply by 10")
    (_, calls), raw = d.turn("two_rounds", history, stream, **thinking)
    head = raw["content"][0]
    assert head["type"] == "thinking" and head["thinking"] and head["signature"]
    if stream:
        deltas = [
            json.loads(data)["delta"]["type"]
            for name, data in sse_events(d.post("two_rounds", history, True, **thinking))
            if name == "content_block_delta"
        ]
        assert deltas[:3] == ["thinking_delta"] * 3 and deltas[3] == "signature_delta"
    history = d.follow(history, raw, calls, [{"result": 5}])
    (_, calls), raw = d.turn("two_rounds", history, stream, **thinking)
    assert raw["content"][0]["signature"] != head["signature"]  # one signature per turn
    history = d.follow(history, raw, calls, [{"result": 50}])
    (text, _), raw = d.turn("two_rounds", history, stream, **thinking)
    assert text == "Result: 50" and raw["content"][0]["type"] == "thinking"

    dropped = json.loads(json.dumps(history))
    del dropped[1]["content"][0]  # the client forgot the thinking block of turn 0
    rejected = d.post("two_rounds", dropped, stream, **thinking)
    assert rejected.status_code == 400
    assert rejected.json()["error"]["type"] == "invalid_request_error"
    assert (
        "messages.1.content.0.type: Expected `thinking` or `redacted_thinking`, but found "
        "`tool_use`"
    ) in rejected.json()["error"]["message"]
    forged = json.loads(json.dumps(history))
    forged[3]["content"][0]["signature"] = forged[1]["content"][0]["signature"]
    rejected = d.post("two_rounds", forged, stream, **thinking)
    assert rejected.status_code == 400 and "Invalid `signature`" in rejected.text
    # Without thinking, earlier thinking blocks are simply accepted.
    assert d.turn("two_rounds", dropped, stream)[0] == ("Result: 50", [])


ANTHROPIC_REJECTIONS = [
    ("no max_tokens", {"max_tokens": None}, "max_tokens: Field required"),
    (
        "assistant first",
        {"messages": [{"role": "assistant", "content": "hi"}]},
        'first message must use the "user" role',
    ),
    (
        "system role",
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "hi"},
            ]
        },
        "messages.0.role: Input should be 'user' or 'assistant'",
    ),
    (
        "empty text",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]},
        "text content blocks must be non-empty",
    ),
    (
        "budget",
        {"thinking": {"type": "enabled", "budget_tokens": 4096}},
        "`max_tokens` must be greater than `thinking.budget_tokens`",
    ),
    (
        "forced tool",
        {"thinking": {"type": "enabled", "budget_tokens": 1024}, "tool_choice": {"type": "any"}},
        "tool_choice forces tool use",
    ),
]


@pytest.mark.parametrize(
    ("change", "fragment"),
    [r[1:] for r in ANTHROPIC_REJECTIONS],
    ids=[r[0] for r in ANTHROPIC_REJECTIONS],
)
def test_anthropic_request_rejections(
    drivers: dict[str, Driver], change: dict[str, Any], fragment: str
) -> None:
    d = drivers["anthropic"]
    body = {"model": "replay/plain", "max_tokens": 2048, "messages": d.start("hi"), **change}
    body = {k: v for k, v in body.items() if v is not None}
    response = d.session.post(
        f"{d.server.root}/v1/messages", json=body, headers=ANTHROPIC_HEADERS, timeout=5
    )
    assert response.status_code == 400, response.text
    assert response.json()["type"] == "error"
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert fragment in response.json()["error"]["message"]


def test_anthropic_version_header_required(drivers: dict[str, Driver]) -> None:
    d = drivers["anthropic"]
    body = {"model": "replay/plain", "max_tokens": 16, "messages": d.start("hi")}
    response = d.session.post(f"{d.server.root}/v1/messages", json=body, timeout=5)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "anthropic-version: header is required"
    ok = d.session.post(
        f"{d.server.root}/v1/messages",
        json=body,
        timeout=5,
        headers={"anthropic-version": "2023-06-01"},
    )
    assert ok.json()["content"] == [{"type": "text", "text": "Echo: hi"}]
    assert d.server.stats()["rejected"] == 1


def test_anthropic_tool_pairing_rejections(drivers: dict[str, Driver]) -> None:
    d = drivers["anthropic"]
    history = d.start("Weather in Paris, Rome")
    (_, calls), raw = d.turn("parallel", history, False)
    full = d.follow(history, raw, calls, ["sun", "rain"])

    def rejected(messages: list[dict[str, Any]], fragment: str, **extra: Any) -> None:
        response = d.post("parallel", messages, False, **extra)
        assert response.status_code == 400, response.text
        assert fragment in response.json()["error"]["message"]

    one_result = [*full[:2], {"role": "user", "content": full[2]["content"][:1]}]
    rejected(
        one_result,
        "messages.1: `tool_use` ids were found without `tool_result` blocks "
        "immediately after: toolu_replay_0_1",
    )
    rejected(full[:2], "`tool_use` ids were found without `tool_result` blocks")
    stray = {"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}
    extra = [*full[:2], {"role": "user", "content": [*full[2]["content"], stray]}]
    rejected(extra, "unexpected `tool_use_id` found in `tool_result` blocks: toolu_nope")
    early = [{"role": "user", "content": [stray]}]
    rejected(early, "unexpected `tool_use_id`")
    no_tools = {"model": "replay/parallel", "max_tokens": 64, "messages": full}
    response = d.session.post(
        f"{d.server.root}/v1/messages", json=no_tools, headers=ANTHROPIC_HEADERS, timeout=5
    )
    assert response.status_code == 400
    assert "`tool_use` or `tool_result` blocks must define tools" in response.text
    assert d.turn("parallel", full, False)[0] == ("sun | rain", [])
    # Valid for the API but not what the script produced: loud 422, not 400.
    reordered = [*full[:2], {"role": "user", "content": full[2]["content"][::-1]}]
    assert d.turn("parallel", reordered, False)[0] == ("sun | rain", [])  # paired by id
    chatty = [
        *full[:2],
        {"role": "user", "content": [*full[2]["content"], {"type": "text", "text": "hurry"}]},
    ]
    assert d.post("parallel", chatty, False).status_code == 422
    assert d.server.stats()["rejected"] == 5


def gemini_thinking(include: bool = True) -> dict[str, Any]:
    return {
        "generationConfig": {"thinkingConfig": {"includeThoughts": include, "thinkingBudget": 1024}}
    }


def test_gemini_json_format(drivers: dict[str, Driver]) -> None:
    d = drivers["gemini"]
    reply = d.post("parallel", d.start("Weather in Paris, Rome"), False).json()
    assert reply == {
        "candidates": [
            {
                "content": {
                    "role": "model",
                    "parts": [
                        {
                            "functionCall": {
                                "id": "replay-call-0-0",
                                "name": "get_weather",
                                "args": {"city": "Paris"},
                            }
                        },
                        {
                            "functionCall": {
                                "id": "replay-call-0-1",
                                "name": "get_weather",
                                "args": {"city": "Rome"},
                            }
                        },
                    ],
                },
                "index": 0,
                "finishReason": "STOP",
            }
        ],
        "usageMetadata": {"promptTokenCount": 10, "candidatesTokenCount": 5, "totalTokenCount": 15},
        "modelVersion": "replay-parallel",
        "responseId": reply["responseId"],
    }


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_gemini_thought_signature_round_trip(drivers: dict[str, Driver], stream: bool) -> None:
    d = drivers["gemini"]
    history = d.start("Weather in Paris, Rome")
    (_, calls), raw = d.turn("parallel", history, stream, **gemini_thinking())
    thought_part, *call_parts = raw["parts"]
    assert thought_part["thought"] is True and thought_part["text"]
    assert "thoughtSignature" in call_parts[0] and "thoughtSignature" not in call_parts[1]
    history = d.follow(history, raw, calls, ["sun", "rain"])
    (text, _), raw = d.turn("parallel", history, stream, **gemini_thinking())
    assert text == "sun | rain"

    signature = history[1]["parts"][1].pop("thoughtSignature")
    response = d.post("parallel", history, stream, **gemini_thinking())
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["code"], error["status"]) == (400, "INVALID_ARGUMENT")
    assert "Function call is missing a thought_signature in functionCall parts" in error["message"]
    # google-genai re-encodes bytes as URL-safe base64: the same bytes must be accepted.
    urlsafe = signature.replace("+", "-").replace("/", "_").rstrip("=")
    history[1]["parts"][1]["thoughtSignature"] = urlsafe
    assert d.turn("parallel", history, stream, **gemini_thinking())[0] == ("sun | rain", [])
    history[1]["parts"][1]["thoughtSignature"] = "AAAA" + signature[4:]
    response = d.post("parallel", history, stream, **gemini_thinking())
    assert response.status_code == 400 and "Corrupted thought signature" in response.text
    # Without thinkingConfig nothing is checked (and no thought part is sent).
    del history[1]["parts"][1]["thoughtSignature"]
    assert d.turn("parallel", history, stream)[0] == ("sun | rain", [])


def test_gemini_request_rejections(drivers: dict[str, Driver]) -> None:
    d = drivers["gemini"]
    history = d.start("Weather in Paris, Rome")
    (_, calls), raw = d.turn("parallel", history, False)
    full = d.follow(history, raw, calls, ["sun", "rain"])

    def rejected(contents: list[dict[str, Any]], fragment: str) -> None:
        response = d.post("parallel", contents, False)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["status"] == "INVALID_ARGUMENT"
        assert fragment in response.json()["error"]["message"]

    rejected([*full[:1], {**full[1], "role": "assistant"}, full[2]], "valid role: user, model")
    as_string = json.loads(json.dumps(full))
    as_string[2]["parts"][0]["functionResponse"]["response"] = "18C"
    rejected(as_string, "function_response.response' (type.googleapis.com/google.protobuf.Struct)")
    rejected(
        [*full[:2], {"role": "user", "parts": full[2]["parts"][:1]}],
        "number of function response parts is equal to the number of function call parts",
    )
    rejected([*full[:1], full[2]], "function response turn comes immediately after")
    swapped = [*full[:2], {"role": "user", "parts": full[2]["parts"][::-1]}]
    response = d.post("parallel", swapped, False)  # valid for the API, not for the script
    assert response.status_code == 422
    assert response.json()["error"]["status"] == "REPLAY_UNEXPECTED_REQUEST"
    assert d.server.stats()["rejected"] == 4


def test_gemini_key_in_query_and_v1_path_and_alt(drivers: dict[str, Driver]) -> None:
    d = drivers["gemini"]
    body = {"contents": d.start("hi")}
    url = f"{d.server.root}/v1/models/replay-plain:generateContent?key=x"
    reply = d.session.post(url, json=body, timeout=5).json()
    assert reply["candidates"][0]["content"]["parts"] == [{"text": "Echo: hi"}]
    marker = {"contents": d.start("[[scenario:plain]] hey")}
    url = f"{d.server.root}/v1beta/models/gemini-2.5-flash:generateContent"
    reply = d.session.post(url, json=marker, timeout=5).json()
    assert reply["candidates"][0]["content"]["parts"] == [{"text": "Echo: hey"}]
    assert reply["modelVersion"] == "gemini-2.5-flash"
    url = f"{d.server.root}/v1beta/models/replay-plain:streamGenerateContent"
    assert d.session.post(url, json=body, timeout=5).status_code == 422  # no alt=sse


def test_tags_format_and_loud_failures(drivers: dict[str, Driver]) -> None:
    d = drivers["tags"]
    history = d.start("Weather in Paris, Rome")
    reply = d.post("parallel", history, False).json()
    assert message(reply) == {
        "role": "assistant",
        "content": '<tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>\n'
        '<tool_call>{"name":"get_weather","arguments":{"city":"Rome"}}</tool_call>',
    }
    assert reply["choices"][0]["finish_reason"] == "stop"
    (_, calls), raw = d.assemble(d.post("parallel", history, False), False)
    full = d.follow(history, raw, calls, ["sun", "rain"])
    assert full[-1]["content"].startswith('<tool_response>\n{"name": "get_weather"')

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]
    native = d.post("parallel", history, False, tools=tools)
    assert native.status_code == 422 and "must not send native tools" in native.text
    tool_role = [*full[:3], {"role": "tool", "tool_call_id": "x", "content": "sun"}]
    assert "no 'tool' role" in d.post("parallel", tool_role, False).text
    wrong = [*full[:3], {**full[3], "content": full[3]["content"].replace("get_weather", "f")}]
    assert "in call order" in d.post("parallel", wrong, False).text
    split = [
        *full[:3],
        {"role": "user", "content": full[3]["content"].split("\n<tool_resp")[0]},
        {"role": "user", "content": "<tool_resp" + full[3]["content"].split("\n<tool_resp")[1]},
    ]
    assert d.turn("parallel", split, False)[0] == ("sun | rain", [])  # one message per result
    assert d.server.stats()["unexpected"] == 3


# --- faults on every wire -----------------------------------------------------------------


FAULT_SHAPES: dict[str, dict[str, tuple[int, str | None]]] = {
    "openai": {
        "rate_limited": (429, "rate_limit_error"),
        "flaky": (500, None),
        "bad_request": (400, "invalid_request_error"),
    },
    "tags": {
        "rate_limited": (429, "rate_limit_error"),
        "flaky": (500, None),
        "bad_request": (400, "invalid_request_error"),
    },
    "anthropic": {
        "rate_limited": (429, "rate_limit_error"),
        "flaky": (529, "overloaded_error"),
        "bad_request": (400, "invalid_request_error"),
    },
    "gemini": {
        "rate_limited": (429, "RESOURCE_EXHAUSTED"),
        "flaky": (500, "INTERNAL"),
        "bad_request": (400, "INVALID_ARGUMENT"),
    },
}


def error_kind(protocol: str, response: requests.Response) -> str | None:
    error = response.json()["error"]
    kind: str | None = error.get("status") if protocol == "gemini" else error.get("type")
    return kind


@pytest.mark.parametrize(("protocol", "stream"), WIRE_MODES, ids=WIRE_IDS)
def test_faults_on_every_wire(drivers: dict[str, Driver], protocol: str, stream: bool) -> None:
    d, shapes = drivers[protocol], FAULT_SHAPES[protocol]
    for scenario in ("rate_limited", "flaky"):
        history = d.start(f"hi {scenario} [[retry_after:3]]")
        first = d.post(scenario, history, stream)
        assert (first.status_code, error_kind(protocol, first)) == shapes[scenario]
        assert first.headers["Content-Type"] == "application/json"  # errors are never SSE
        assert d.turn(scenario, history, stream)[0] == (f"Echo: hi {scenario}", [])
    limited = d.post("rate_limited", d.start("other"), stream)
    assert limited.headers["Retry-After"] == "1"
    if protocol == "gemini":
        details = limited.json()["error"]["details"]
        assert details == [
            {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "1s"}
        ]
    if protocol == "anthropic":
        assert limited.json()["type"] == "error"
    bad = d.post("bad_request", d.start("x"), stream)
    assert (bad.status_code, error_kind(protocol, bad)) == shapes["bad_request"]
    malformed = d.post("malformed", d.start("x"), stream)
    assert malformed.status_code == 200
    with pytest.raises(ValueError):
        json.loads(malformed.text) if not stream else [
            json.loads(v) for _, v in sse_events(malformed)
        ]
    assert d.turn("empty", d.start("x"), stream)[0][1] == []
    started = time.monotonic()
    assert d.turn("slow", d.start("zz [[latency_ms:200]]"), stream)[0] == ("Echo: zz", [])
    assert time.monotonic() - started >= 0.2
    stats = d.server.stats()
    assert (stats["faults"], stats["unexpected"], stats["rejected"]) == (3, 0, 0)
    assert stats["by_protocol"] == {protocol: 9}


def test_fault_memory_is_per_protocol(drivers: dict[str, Driver]) -> None:
    for protocol in DRIVERS:
        d = drivers[protocol]
        assert d.post("rate_limited", d.start("same prompt"), False).status_code == 429
    assert drivers["openai"].server.stats()["by_protocol"] == dict.fromkeys(DRIVERS, 1)


def test_conversation_turns_are_counted_per_wire_pure() -> None:
    """The adapters parse into the same neutral conversation (no server involved)."""
    from fixtures.replay import wire_anthropic, wire_gemini, wire_tags
    from fixtures.replay.wire_common import HttpRequest, Wire

    anthropic_body = {
        "model": "replay/weather",
        "max_tokens": 64,
        "tools": [{"name": "get_weather", "input_schema": SCHEMA}],
        "messages": [
            {"role": "user", "content": "Weather in Paris"},
            {
                "role": "assistant",
                "content": [
                    {
                        "type": "tool_use",
                        "id": "toolu_replay_0_0",
                        "name": "get_weather",
                        "input": {"city": "Paris"},
                    }
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_replay_0_0",
                        "content": [{"type": "text", "text": "sunny"}],
                    }
                ],
            },
        ],
    }
    gemini_body = {
        "contents": [
            {"role": "user", "parts": [{"text": "Weather in Paris"}]},
            {
                "role": "model",
                "parts": [{"functionCall": {"name": "get_weather", "args": {"city": "Paris"}}}],
            },
            {
                "role": "user",
                "parts": [
                    {"function_response": {"name": "get_weather", "response": {"result": "sunny"}}}
                ],
            },
        ]
    }
    tags_body = {
        "model": "replay-tags/weather",
        "messages": [
            {"role": "user", "content": "Weather in Paris"},
            {
                "role": "assistant",
                "content": wire_tags.render_calls((("get_weather", {"city": "Paris"}),)),
            },
            {
                "role": "user",
                "content": '<tool_response>\n{"name":"get_weather","content":"sunny"}'
                "\n</tool_response>",
            },
        ],
    }
    cases: list[tuple[Wire, HttpRequest]] = [
        (
            wire_anthropic.ANTHROPIC,
            HttpRequest(
                "/v1/messages",
                json.dumps(anthropic_body).encode(),
                {"anthropic-version": "2023-06-01"},
            ),
        ),
        (
            wire_gemini.GEMINI,
            HttpRequest(
                "/v1beta/models/replay-weather:generateContent", json.dumps(gemini_body).encode()
            ),
        ),
        (wire_tags.TAGS, HttpRequest("/v1/chat/completions", json.dumps(tags_body).encode())),
    ]
    for wire, request in cases:
        conv = wire.conversation(wire.envelope(request))
        assert (conv.turn, conv.first_user, conv.rounds[0].results) == (
            1,
            "Weather in Paris",
            ("sunny",),
        )
        assert [(c.name, c.arguments) for c in conv.rounds[0].calls] == [
            ("get_weather", {"city": "Paris"})
        ]


@pytest.mark.parametrize(
    ("response", "text"),
    [
        ({"result": "18C"}, "18C"),
        ({"content": "18C"}, "18C"),  # the LiteLLM / worker codec wrapper
        ({"result": 5}, '{"result":5}'),
        ({"error": {"code": "tool_exec_failed"}}, '{"error":{"code":"tool_exec_failed"}}'),
        ({"result": "a", "extra": 1}, '{"result":"a","extra":1}'),
    ],
)
def test_gemini_function_response_to_neutral_text(response: dict[str, Any], text: str) -> None:
    from fixtures.replay.wire_common import tool_result_text

    assert tool_result_text(response) == text
