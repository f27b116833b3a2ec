"""A model stream that stops giving content is abandoned at the backend's stream_idle_timeout_s
and retried, though keepalives keep arriving: HttpProvider against the replay server over real
HTTP (`[[stall_ms:N]]`), every protocol; the stream assemblers' notion of content; and a
stream that is not chunked."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from fixtures.replay.conversation import Usage
from fixtures.replay.request_log import STALLED, LoggedRequest, conversation_id
from fixtures.replay.scenarios import conversation_key
from fixtures.replay.server import ReplayServer
from schemas.config import ConfigError, parse_config
from schemas.protocols import PROTOCOLS, declared
from worker.codecs.anthropic_stream import AnthropicStreamAssembler
from worker.codecs.gemini_stream import GeminiStreamAssembler
from worker.codecs.openai_stream import OpenAIStreamAssembler
from worker.codecs.protocol import ChatRequest, Delta, SseEvent, StreamAssembler
from worker.codecs.registry import codec_for
from worker.codecs.text_tags_stream import TextTagAssembler
from worker.config import BackendConfig
from worker.edges.provider_http import CompletionResult, HttpProvider
from worker.errors import ProviderRetryableError

IDLE_S = 0.8
PING_MS = 100  # keepalives far more often than the idle timeout: they must not count
STALL_MS = 5000  # far past the idle timeout: only abandoning the stream ends it in time
WIRE_NAMES = {"openai": "openai", "anthropic": "anthropic", "gemini": "gemini",
              "openai-text-tags": "tags"}  # fmt: skip


@pytest.fixture(scope="module")
def replay() -> Iterator[ReplayServer]:
    with ReplayServer() as server:
        yield server


def provider(replay: ReplayServer, protocol: str, **cfg: Any) -> HttpProvider:
    url = replay.root + declared(protocol).replay_path
    backend = BackendConfig(
        name=f"idle-{protocol}", protocol=protocol, base_url=url, stream=True, adaptive=False,
        **{"stream_idle_timeout_s": IDLE_S, **cfg},
    )  # fmt: skip
    return HttpProvider(backend, codec_for(protocol))


def ask(
    http: HttpProvider, protocol: str, text: str, deltas: list[Delta] | None = None
) -> CompletionResult:
    model = declared(protocol).replay_model_for("plain")
    request = ChatRequest(model, [{"role": "user", "content": text}], stream=True, max_tokens=64)
    try:
        return http.complete(request, None if deltas is None else deltas.append)
    finally:
        http.close()


def content(result: CompletionResult) -> str:
    text: str = result.completion["choices"][0]["message"]["content"]
    return text


def stall_of(replay: ReplayServer, protocol: str, text: str) -> dict[str, Any]:
    """The replay server's record of this conversation's stalled first round, once the stalled
    handler has seen how its stream ended."""
    turn = conversation_key(WIRE_NAMES[protocol], "plain", text) + ":0"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        found = [s for s in replay.stalls()["stalls"] if s["turn"] == turn]
        if found and found[0]["ended"] != "stalling":
            return found[0]
        time.sleep(0.02)
    raise AssertionError(f"no ended stall for {turn}: {replay.stalls()}")


@pytest.mark.parametrize("protocol", list(PROTOCOLS))
def test_a_stream_that_stalls_after_some_content_is_abandoned_and_retried(
    replay: ReplayServer, protocol: str, caplog: pytest.LogCaptureFixture
) -> None:
    text = f"Stall {protocol} [[stall_ms:{STALL_MS}]] [[ping_ms:{PING_MS}]]"
    deltas: list[Delta] = []
    with caplog.at_level(logging.WARNING, logger="worker.edges.provider_http"):
        result = ask(provider(replay, protocol), protocol, text, deltas)
    assert (result.attempts, content(result)) == (2, f"Echo: Stall {protocol}")
    # what the stalled attempt showed was voided, then the retry showed the whole answer
    kinds = [d.kind for d in deltas]
    assert kinds.count("restart") == 1 and kinds[0] == "content", kinds
    shown = "".join(d.text for d in deltas[kinds.index("restart") + 1 :])
    assert shown == f"Echo: Stall {protocol}"
    assert f"stream from backend idle-{protocol} sent no content for {IDLE_S:g} s" in caplog.text
    stall = stall_of(replay, protocol, text)
    # the client closed the stalled connection (it was not kept for another call), the
    # round was asked twice, and keepalives kept coming until it gave up
    assert stall["ended"] == "client hung up" and stall["requests"] == 2, stall
    assert stall["content_events"] > 0 and stall["pings"] >= 3, stall
    assert stall["ended_after_s"] >= IDLE_S, stall  # not before the idle timeout


@pytest.mark.parametrize("protocol", ["openai", "anthropic"])
def test_a_stream_of_keepalives_with_no_content_at_all_is_abandoned_and_retried(
    replay: ReplayServer, protocol: str
) -> None:
    text = f"Only pings {protocol} [[stall_ms:{STALL_MS}]] [[ping_ms:{PING_MS}]] [[stall_after:0]]"
    result = ask(provider(replay, protocol), protocol, text)
    assert (result.attempts, content(result)) == (2, f"Echo: Only pings {protocol}")
    stall = stall_of(replay, protocol, text)
    assert (stall["content_events"], stall["requests"]) == (0, 2), stall
    assert stall["ended"] == "client hung up" and stall["pings"] >= 3, stall


def test_a_silent_stream_is_still_bounded_by_the_read_timeout(
    replay: ReplayServer, caplog: pytest.LogCaptureFixture
) -> None:
    """No byte at all (not even a keepalive) for read_timeout_s, shorter than the idle timeout:
    the read timeout ends the attempt."""
    text = f"Silent [[stall_ms:{STALL_MS}]] [[ping_ms:{STALL_MS}]] [[stall_after:0]]"
    http = provider(replay, "openai", stream_idle_timeout_s=30.0, read_timeout_s=0.5)
    with caplog.at_level(logging.WARNING, logger="worker.edges.provider_http"):
        result = ask(http, "openai", text)
    assert (result.attempts, content(result)) == (2, "Echo: Silent")
    assert "read timeout calling backend idle-openai" in caplog.text
    assert "sent no content" not in caplog.text


@pytest.mark.parametrize("protocol", ["openai", "anthropic"])
def test_a_slow_but_steady_stream_is_not_abandoned(replay: ReplayServer, protocol: str) -> None:
    """Content every 0.4 s: the whole stream takes longer than the idle timeout, no gap does."""
    text = f"Slow and steady {protocol} [[chunk_delay_ms:400]]"
    result = ask(provider(replay, protocol, stream_idle_timeout_s=1.5), protocol, text)
    assert (result.attempts, content(result)) == (1, f"Echo: Slow and steady {protocol}")


def test_the_idle_timeout_is_a_positive_number_of_seconds_sixty_by_default() -> None:
    assert BackendConfig(name="b").stream_idle_timeout_s == 60.0
    config = parse_config({"backends": {"b": {"base_url": "http://h", "stream_idle_timeout_s": 2}}})
    assert config.backends["b"].stream_idle_timeout_s == 2.0
    for bad in (0, -1, "60", True):
        backend = {"base_url": "http://h", "stream_idle_timeout_s": bad}
        with pytest.raises(ConfigError) as info:
            parse_config({"backends": {"b": backend}})
        [(path, message)] = info.value.problems
        assert path == "backends.b.stream_idle_timeout_s" and "number of seconds" in message


# --- what counts as content -------------------------------------------------------------------


def progress_after(assembler: StreamAssembler, *events: SseEvent) -> list[int]:
    out = []
    for event in events:
        assembler.feed(event)
        out.append(assembler.progress)
    return out


def test_openai_and_text_tag_streams_count_content_not_keepalives() -> None:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> SseEvent:
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        return SseEvent("message", json.dumps({"id": "c", "choices": [choice]}))

    events = [
        chunk({"role": "assistant", "content": ""}),  # a role, no text: nothing new
        chunk({"content": "Hel"}),
        chunk({}),  # an empty delta: a keepalive some servers send
        SseEvent("ping", "{}"),
        chunk({"content": "lo"}),
        chunk({}, "stop"),
        SseEvent("message", "[DONE]"),
    ]
    assert progress_after(OpenAIStreamAssembler(), *events) == [0, 1, 1, 1, 2, 3, 4]
    # text held back inside a tag is not shown, but it is content
    tags = [chunk({"content": "<tool_call>"}), chunk({}), chunk({"content": '{"name":'})]
    assert progress_after(TextTagAssembler(), *tags) == [1, 1, 2]


def test_anthropic_streams_count_content_not_pings() -> None:
    def event(kind: str, body: str) -> SseEvent:
        return SseEvent(kind, f'{{"type":"{kind}",{body}}}' if body else f'{{"type":"{kind}"}}')

    start = '"message":{"id":"m","role":"assistant","content":[],"usage":{}}'
    events = [
        event("message_start", start),
        event("ping", ""),
        event("content_block_start", '"index":0,"content_block":{"type":"text","text":""}'),
        event("ping", ""),
        event("content_block_delta", '"index":0,"delta":{"type":"text_delta","text":""}'),
        event("content_block_delta", '"index":0,"delta":{"type":"text_delta","text":"Hi"}'),
        event("ping", ""),
    ]
    assert progress_after(AnthropicStreamAssembler({}), *events) == [1, 1, 2, 2, 2, 3, 3]


def test_gemini_streams_count_content_not_empty_chunks() -> None:
    def chunk(parts: str, finish: str = "") -> SseEvent:
        end = f',"finishReason":"{finish}"' if finish else ""
        return SseEvent("message", f'{{"candidates":[{{"content":{{"parts":[{parts}]}}{end}}}]}}')

    request = ChatRequest("m", [{"role": "user", "content": "hi"}], stream=True)
    events = [chunk('{"text":"Hi"}'), chunk(""), chunk('{"text":""}'), chunk("", "STOP")]
    assert progress_after(GeminiStreamAssembler(request), *events) == [1, 1, 1, 2]


# --- a stream that is not chunked --------------------------------------------------------------


class _Unchunked:
    """An HTTP/1.0 server whose SSE body has neither a length nor chunks (it ends when the
    connection closes, as some proxies send streams): its events are `script`, written with
    PING_MS between the keepalives that follow them, until the client hangs up or `pings` ran."""

    def __init__(self, events: list[bytes], pings: int) -> None:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", "0")))
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                try:
                    for event in events:
                        self.wfile.write(event)
                    for _ in range(pings):
                        time.sleep(PING_MS / 1000)
                        self.wfile.write(b": ping\n\n")
                except OSError:
                    outer.hung_up.set()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.hung_up = threading.Event()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


def _openai_events(done: bool) -> list[bytes]:
    head = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"Hello"}}]}\n\n'
    tail = b'data: {"id":"c","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
    return [head, tail, b"data: [DONE]\n\n"] if done else [head]


def test_a_stream_that_is_not_chunked_is_read_as_it_arrives_and_abandoned_when_it_stalls() -> None:
    server = _Unchunked(_openai_events(done=False), pings=int(STALL_MS / PING_MS))
    backend = BackendConfig(name="unchunked", base_url=server.url, stream=True, adaptive=False,
                            stream_idle_timeout_s=IDLE_S, max_attempts=1)  # fmt: skip
    http = HttpProvider(backend, codec_for("openai"))
    deltas: list[Delta] = []
    request = ChatRequest("m", [{"role": "user", "content": "hi"}], stream=True)
    try:
        with pytest.raises(ProviderRetryableError, match=r"sent no content for 0\.8 s"):
            http.complete(request, deltas.append)
        assert [d.text for d in deltas] == ["Hello"]  # shown as it came, before the stall
        assert server.hung_up.wait(10)
    finally:
        http.close()
        server.close()


def test_a_whole_reply_followed_by_keepalives_is_the_reply() -> None:
    server = _Unchunked(_openai_events(done=True), pings=int(STALL_MS / PING_MS))
    backend = BackendConfig(name="unchunked", base_url=server.url, stream=True, adaptive=False,
                            stream_idle_timeout_s=IDLE_S, max_attempts=1)  # fmt: skip
    http = HttpProvider(backend, codec_for("openai"))
    request = ChatRequest("m", [{"role": "user", "content": "hi"}], stream=True)
    try:
        result = http.complete(request)
    finally:
        http.close()
        server.close()
    assert (result.attempts, content(result)) == (1, "Hello")


def test_the_unchunked_server_really_sends_no_length_and_no_chunks() -> None:
    """The two tests above read what they claim to: a body that ends with its connection."""
    server = _Unchunked(_openai_events(done=True), pings=0)
    host, port = server.httpd.server_address[:2]
    try:
        with socket.create_connection((str(host), int(port)), timeout=5) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 0\r\n\r\n")
            raw = b""
            while chunk := sock.recv(4096):
                raw += chunk
    finally:
        server.close()
    head = raw.split(b"\r\n\r\n", 1)[0].lower()
    assert b"content-length" not in head and b"transfer-encoding" not in head
    assert raw.endswith(b"data: [DONE]\n\n")


# --- the replay server's stall itself ------------------------------------------------------------


def raw_stream(replay: ReplayServer, text: str) -> tuple[bytes, bool]:
    """POST a streamed chat completion on a connection of its own; the body as far as it came,
    and whether it ended properly (its last chunk) rather than being cut off."""
    body = json.dumps({"model": "replay/plain", "stream": True,
                       "messages": [{"role": "user", "content": text}]}).encode()  # fmt: skip
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: replay\r\nContent-Type: "
            f"application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()  # fmt: skip
    with socket.create_connection(("127.0.0.1", replay.port), timeout=10) as sock:
        sock.sendall(head + body)
        raw = b""
        while not raw.endswith(b"\r\n0\r\n\r\n") and (chunk := sock.recv(65536)):
            raw += chunk
    return raw, raw.endswith(b"\r\n0\r\n\r\n")


def test_the_replay_server_stalls_a_rounds_first_stream_then_cuts_it_and_answers_the_retry(
    replay: ReplayServer,
) -> None:
    text = "Cut [[stall_ms:400]] [[ping_ms:100]] [[stall_after:2]]"
    since = replay.log()["next"]
    first, ended = raw_stream(replay, text)
    assert not ended  # closed with no last chunk: a stream cut off
    events = [e for e in first.split(b"\r\n") if e.startswith((b"data:", b":"))]
    assert [e.startswith(b"data:") for e in events[:2]] == [True, True]  # role, some content
    assert b'"content":"Ech"' in events[1] and set(events[2:]) == {b": ping\n\n"}
    again, ended = raw_stream(replay, text)
    assert ended and b"data: [DONE]" in again and b": ping" not in again
    turn = conversation_key("openai", "plain", text) + ":0"
    [stall] = [s for s in replay.stalls()["stalls"] if s["turn"] == turn]
    assert (stall["ended"], stall["pings"], stall["requests"]) == ("time up", len(events) - 2, 2)
    # the request log names the stall a fault that billed nothing, so the retry is explained
    logged = [LoggedRequest.from_json(e) for e in replay.log(since)["entries"]]
    mine = [q for q in logged if q.conversation == conversation_id("openai", "plain", text)]
    assert [(q.round, q.fault) for q in mine] == [(0, STALLED), (0, None)]
    assert mine[0].usage == Usage() and mine[1].usage != Usage()


def test_an_answer_that_is_not_streamed_never_stalls(replay: ReplayServer) -> None:
    before = replay.stalls()["stalls"]
    http = provider(replay, "openai")
    request = ChatRequest("replay/plain", [{"role": "user", "content": "JSON [[stall_ms:5000]]"}])
    try:
        result = http.complete(request)
    finally:
        http.close()
    assert (result.attempts, content(result)) == (1, "Echo: JSON")
    assert replay.stalls()["stalls"] == before
