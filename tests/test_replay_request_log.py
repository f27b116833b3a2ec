"""The replay server's request log (GET /log), driven over real HTTP: one entry per model
request with its conversation's digest, round, status, injected fault and billed usage, no
prompt text, read from a cursor, bounded, and the usage each wire bills as its reply says."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import requests

from fixtures.replay.conversation import Usage
from fixtures.replay.rate_limit import RateLimits
from fixtures.replay.request_log import RATE_LIMIT_GATE, LoggedRequest, RequestLog, conversation_id
from fixtures.replay.scenarios import Outcome
from fixtures.replay.server import ReplayServer
from fixtures.replay.wire_common import Reply

SCHEMA: dict[str, Any] = {"type": "object", "properties": {}}
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}


@pytest.fixture()
def server() -> Iterator[ReplayServer]:
    srv = ReplayServer(port=0).start()
    yield srv
    srv.stop()


def log_since(server: ReplayServer, since: int) -> list[LoggedRequest]:
    page = requests.get(f"{server.root}/log", params={"since": since}, timeout=5)
    assert page.status_code == 200, page.text
    return [LoggedRequest.from_json(e) for e in page.json()["entries"]]


def cursor(server: ReplayServer) -> int:
    return int(requests.get(f"{server.root}/log?limit=0", timeout=5).json()["next"])


def chat(server: ReplayServer, model: str, messages: list[dict[str, Any]]) -> requests.Response:
    body = {"model": model, "messages": messages, "tools": [WEATHER_TOOL]}
    return requests.post(f"{server.url}/chat/completions", json=body, timeout=10)


def test_each_request_is_logged_with_its_round_status_fault_and_usage(
    server: ReplayServer,
) -> None:
    since = cursor(server)
    first = [{"role": "user", "content": "Weather in Oslo?"}]
    round0 = chat(server, "replay/weather", first).json()
    call = round0["choices"][0]["message"]
    answer = {"role": "tool", "tool_call_id": call["tool_calls"][0]["id"], "content": "cold"}
    round1 = chat(server, "replay/weather", [*first, call, answer]).json()
    flaky = [{"role": "user", "content": "hello there"}]
    assert chat(server, "replay/flaky", flaky).status_code == 500  # its one fault
    retried = chat(server, "replay/flaky", flaky).json()

    logged = log_since(server, since)
    weather = conversation_id("openai", "weather", "Weather in Oslo?")
    flaky_id = conversation_id("openai", "flaky", "hello there")
    assert [(q.conversation, q.round, q.status, q.fault) for q in logged] == [
        (weather, 0, 200, None),
        (weather, 1, 200, None),
        (flaky_id, 0, 500, "server_error"),
        (flaky_id, 0, 200, None),
    ]
    assert [q.seq for q in logged] == list(range(since, since + 4))
    billed = [
        Usage(r["usage"]["prompt_tokens"], r["usage"]["completion_tokens"])
        for r in (round0, round1, retried)
    ]
    assert [q.usage for q in logged] == [billed[0], billed[1], Usage(), billed[2]]
    assert {(q.protocol, q.scenario) for q in logged} == {
        ("openai", "weather"),
        ("openai", "flaky"),
    }
    raw = requests.get(f"{server.root}/log", params={"since": since}, timeout=5).text
    assert "Oslo" not in raw and "hello" not in raw  # no prompt text leaves the server


def test_a_request_the_scenario_did_not_expect_is_logged_without_a_conversation(
    server: ReplayServer,
) -> None:
    since = cursor(server)
    assert chat(server, "replay/nonesuch", [{"role": "user", "content": "x"}]).status_code == 422
    (entry,) = log_since(server, since)
    assert (entry.conversation, entry.round, entry.status, entry.fault) == ("", -1, 422, None)


def test_the_log_reads_from_a_cursor_in_pages_and_answers_a_bad_query_with_400(
    server: ReplayServer,
) -> None:
    since = cursor(server)
    for n in range(3):
        chat(server, "replay/plain", [{"role": "user", "content": f"page {n}"}])
    page = requests.get(f"{server.root}/log", params={"since": since + 1, "limit": 1}, timeout=5)
    body = page.json()
    assert [e["seq"] for e in body["entries"]] == [since + 1]
    assert body["next"] == since + 3 and body["first"] <= since
    assert server.log(since + 2)["entries"][0]["seq"] == since + 2
    bad = requests.get(f"{server.root}/log", params={"since": "soon"}, timeout=5)
    assert bad.status_code == 400
    assert bad.json()["error"]["message"] == "/log: since must be a whole number >= 0, got 'soon'"


def test_the_log_keeps_the_newest_entries_and_a_reset_goes_on_numbering() -> None:
    log = RequestLog(capacity=3)
    outcome = Outcome(Reply(200, b"{}"), "ok", "plain", conversation="ab" * 32, turn=0)
    for _ in range(5):
        log.add(outcome)
    page = log.page(0)
    assert (page["first"], page["next"]) == (2, 5)  # entries 0 and 1 were dropped
    assert [e["seq"] for e in page["entries"]] == [2, 3, 4]
    assert page["entries"][0]["conversation"] == "ab" * 8
    log.reset()
    log.add(outcome)
    page = log.page(0)
    assert (page["first"], page["next"], [e["seq"] for e in page["entries"]]) == (5, 6, [5])


def test_a_request_the_rate_limits_refuse_is_logged_as_their_fault() -> None:
    srv = ReplayServer(port=0, rate_limits=RateLimits(rps=0.01, burst_s=100)).start()
    try:
        since = cursor(srv)
        first = [{"role": "user", "content": "Weather in Rome?"}]
        assert chat(srv, "replay/weather", first).status_code == 200  # the bucket's one request
        assert chat(srv, "replay/weather", first).status_code == 429
        logged = log_since(srv, since)
    finally:
        srv.stop()
    key = conversation_id("openai", "weather", "Weather in Rome?")
    assert [(q.conversation, q.round, q.status, q.fault) for q in logged] == [
        (key, 0, 200, None),
        (key, 0, 429, RATE_LIMIT_GATE),
    ]
    assert logged[1].usage == Usage()


def anthropic(server: ReplayServer) -> tuple[str, Usage]:
    body = {
        "model": "replay/plain",
        "max_tokens": 2048,
        "messages": [{"role": "user", "content": "think anthropic"}],
        "thinking": {"type": "enabled", "budget_tokens": 1024},
    }
    headers = {"anthropic-version": "2023-06-01", "x-api-key": "x"}
    reply = requests.post(f"{server.root}/v1/messages", json=body, headers=headers, timeout=10)
    usage = reply.json()["usage"]
    return "think anthropic", Usage(usage["input_tokens"], usage["output_tokens"])


def gemini(server: ReplayServer) -> tuple[str, Usage]:
    body = {
        "contents": [{"role": "user", "parts": [{"text": "think gemini"}]}],
        "generationConfig": {"thinkingConfig": {"thinkingBudget": 1024}},
    }
    url = f"{server.root}/v1beta/models/replay-plain:generateContent"
    meta = requests.post(url, json=body, headers={"x-goog-api-key": "x"}, timeout=10).json()
    meta = meta["usageMetadata"]
    assert meta["thoughtsTokenCount"] > 0
    out = meta["candidatesTokenCount"] + meta["thoughtsTokenCount"]
    return "think gemini", Usage(meta["promptTokenCount"], out)


def tags(server: ReplayServer) -> tuple[str, Usage]:
    body = {"model": "replay-tags/plain", "messages": [{"role": "user", "content": "tags"}]}
    usage = requests.post(f"{server.url}/chat/completions", json=body, timeout=10).json()["usage"]
    return "tags", Usage(usage["prompt_tokens"], usage["completion_tokens"])


@pytest.mark.parametrize(
    ("wire", "ask"), [("anthropic", anthropic), ("gemini", gemini), ("tags", tags)]
)
def test_the_logged_usage_is_what_each_wire_billed_thinking_included(
    server: ReplayServer, wire: str, ask: Any
) -> None:
    since = cursor(server)
    text, billed = ask(server)
    (entry,) = log_since(server, since)
    assert (entry.protocol, entry.conversation) == (wire, conversation_id(wire, "plain", text))
    assert entry.usage == billed
