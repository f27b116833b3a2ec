"""The replay LLM server, driven over real HTTP the way a chat client drives it."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

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
        "unexpected": 0,
        "faults": 0,
        "last_unexpected": "",
        "max_in_flight": 0,
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


def test_stream_and_unknown_route_are_loud(client: Client) -> None:
    loud(client.post("replay/plain", user("hi"), stream=True), "stream=true")
    response = client.session.get(client.root("/v1/models"), timeout=5)
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "replay_unexpected_request"
    assert client.server.stats()["unexpected"] == 2


# --- transport ----------------------------------------------------------------------------


def test_keep_alive_without_nagle() -> None:
    """Each kept-alive request would wait ~40 ms for a delayed ACK with Nagle on
    (architecture.md section 5); speed itself is measured in bench/, not asserted here."""
    from fixtures.replay import server as replay_server

    handlers = [
        v for v in vars(replay_server).values()
        if isinstance(v, type) and issubclass(v, replay_server.BaseHTTPRequestHandler)
        and v is not replay_server.BaseHTTPRequestHandler
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
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "fixtures.replay", "--port", "0"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        assert line.startswith("READY http://127.0.0.1:"), line
        url = line.removeprefix("READY ")
        health = requests.get(url.removesuffix("/v1") + "/healthz", timeout=5)
        assert (health.status_code, health.text) == (200, "ok")
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
