"""HttpProvider with the OpenAI codec against a real loopback HTTP server with scripted
responses (retries, timeouts, errors; the codecs' own cases are in tests/test_codec_*)."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import urllib3

from worker.codecs.openai_codec import OpenAICodec
from worker.codecs.protocol import ChatRequest
from worker.config import BackendConfig
from worker.edges.provider_http import CompletionResult, HttpProvider, _pool_for
from worker.errors import (
    ProviderProtocolError,
    ProviderRequestError,
    ProviderRetryableError,
    ProviderTimeoutError,
)

REQUEST = ChatRequest(model="m", messages=[{"role": "user", "content": "TOPSECRETPROMPT"}])


def completion(content: str | None = "hello") -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    }


@dataclass
class Reply:
    status: int = 200
    body: Any = field(default_factory=completion)  # dict/list -> JSON, bytes as is
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0
    content_type: str = "application/json"  # text/event-stream for a scripted SSE body


@dataclass
class Seen:
    path: str
    headers: dict[str, str]
    body: bytes


class ScriptedServer:
    """Answers POSTs from a script in order; an unscripted request gets a loud 599."""

    def __init__(self) -> None:
        self.script: list[Reply] = []
        self.seen: list[Seen] = []
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, like real providers
            disable_nagle_algorithm = True  # see docs/architecture.md section 6

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                with server.lock:
                    server.seen.append(Seen(self.path, dict(self.headers.items()), body))
                    reply = server.script.pop(0) if server.script else Reply(599, b"unscripted")
                time.sleep(reply.delay_s)
                raw = reply.body if isinstance(reply.body, bytes) else json.dumps(reply.body)
                raw = raw.encode() if isinstance(raw, str) else raw
                try:
                    self.send_response(reply.status)
                    for name, value in reply.headers.items():
                        self.send_header(name, value)
                    self.send_header("Content-Type", reply.content_type)
                    self.send_header("Content-Length", str(len(raw)))
                    self.end_headers()
                    self.wfile.write(raw)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (read timeout test)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        # A short poll keeps shutdown() (and so each test's teardown) fast.
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True
        )
        self.thread.start()
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1/"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


@pytest.fixture
def server() -> Iterator[ScriptedServer]:
    srv = ScriptedServer()
    yield srv
    srv.close()


class Harness:
    def __init__(self, base_url: str, environ: dict[str, str] | None = None, **cfg: Any) -> None:
        self.sleeps: list[float] = []
        # not adaptive unless asked: a 429 is then retried in the call
        self.backend = BackendConfig(name="test", base_url=base_url, **{"adaptive": False, **cfg})
        self.provider = HttpProvider(
            self.backend, OpenAICodec(), sleep=self.sleeps.append, environ=environ or {}
        )

    def complete(self, request: ChatRequest = REQUEST) -> CompletionResult:
        return self.provider.complete(request)


@pytest.fixture
def make(server: ScriptedServer) -> Iterator[Any]:
    made: list[Harness] = []

    def factory(*script: Reply, environ: dict[str, str] | None = None, **cfg: Any) -> Harness:
        server.script.extend(script)
        harness = Harness(server.base_url, environ, **cfg)
        made.append(harness)
        return harness

    yield factory
    for harness in made:
        harness.provider.close()


def test_success_posts_json_body(make: Any, server: ScriptedServer) -> None:
    result = make(Reply()).complete()
    assert result.completion == completion()
    assert result.attempts == 1
    assert result.latency_ms >= 0
    (seen,) = server.seen
    assert seen.path == "/v1/chat/completions"  # trailing slash of base_url dropped
    assert json.loads(seen.body) == {"model": "m", "messages": REQUEST.messages, "stream": False}
    assert seen.headers["Content-Type"] == "application/json"
    assert "Authorization" not in seen.headers


def test_429_retry_after_then_200(make: Any) -> None:
    h = make(Reply(429, {"error": {"message": "slow down"}}, {"Retry-After": "1"}), Reply())
    result = h.complete()
    assert h.sleeps == [1.0]
    assert result.attempts == 2
    assert result.completion["choices"][0]["message"]["content"] == "hello"


def test_500_every_attempt_raises_retryable(make: Any, server: ScriptedServer) -> None:
    h = make(*[Reply(500, {"error": {"message": "boom"}})] * 3, max_attempts=3)
    with pytest.raises(ProviderRetryableError) as info:
        h.complete()
    assert info.value.status == 500
    assert info.value.message == "HTTP 500: boom"
    assert info.value.retry_after_s is None
    assert len(server.seen) == 3
    assert len(h.sleeps) == 2
    assert 0.5 <= h.sleeps[0] < 0.75
    assert 1.0 <= h.sleeps[1] < 1.25


def test_400_raises_request_error_without_retry(make: Any, server: ScriptedServer) -> None:
    h = make(Reply(400, {"error": {"message": "Unsupported parameter: 'foo'", "type": "x"}}))
    with pytest.raises(ProviderRequestError) as info:
        h.complete()
    assert not isinstance(info.value, ProviderRetryableError)
    assert info.value.status == 400
    assert info.value.message == "HTTP 400: Unsupported parameter: 'foo'"
    assert info.value.code == "provider_error"
    assert len(server.seen) == 1
    assert h.sleeps == []


def test_upstream_error_message_capped(make: Any) -> None:
    h = make(Reply(422, {"detail": [{"msg": "x" * 1000}]}))
    with pytest.raises(ProviderRequestError) as info:
        h.complete()
    assert info.value.message == "HTTP 422: " + "x" * 300


def test_x_should_retry_false_stops(make: Any, server: ScriptedServer) -> None:
    h = make(Reply(503, b"overloaded", {"x-should-retry": "false"}))
    with pytest.raises(ProviderRequestError) as info:
        h.complete()
    assert info.value.status == 503
    assert info.value.message == "HTTP 503: overloaded"
    assert len(server.seen) == 1


@pytest.mark.parametrize("body", [b"<html>oops</html>", b'{"choices": []}', b"[1]"])
def test_malformed_200_is_protocol_error(make: Any, server: ScriptedServer, body: bytes) -> None:
    h = make(Reply(200, body))
    with pytest.raises(ProviderProtocolError):
        h.complete()
    assert len(server.seen) == 1


def test_empty_reply_retried_once_then_error(make: Any, server: ScriptedServer) -> None:
    h = make(Reply(body=completion(None)), Reply(body=completion("")))
    with pytest.raises(ProviderProtocolError, match=r"^empty response$"):
        h.complete()
    assert len(server.seen) == 2
    assert h.sleeps == []


def test_empty_reply_then_answer(make: Any) -> None:
    result = make(Reply(body=completion(None)), Reply()).complete()
    assert result.attempts == 2
    assert result.completion["choices"][0]["message"]["content"] == "hello"


def test_api_key_from_configured_env_var(make: Any, server: ScriptedServer) -> None:
    h = make(Reply(), environ={"TEST_LLM_KEY": "sk-test-123"}, api_key_env="TEST_LLM_KEY")
    h.complete()
    assert server.seen[0].headers["Authorization"] == "Bearer sk-test-123"


def test_api_key_env_unset_sends_no_header(make: Any, server: ScriptedServer) -> None:
    make(Reply(), environ={}, api_key_env="TEST_LLM_KEY").complete()
    assert "Authorization" not in server.seen[0].headers


def test_read_timeout_is_retried(make: Any, server: ScriptedServer) -> None:
    h = make(Reply(delay_s=1.0), Reply(), read_timeout_s=0.2)
    result = h.complete()
    assert result.attempts == 2
    assert len(h.sleeps) == 1
    assert len(server.seen) == 2


def test_read_timeout_every_attempt(make: Any) -> None:
    h = make(*[Reply(delay_s=0.6)] * 2, read_timeout_s=0.15, max_attempts=2)
    with pytest.raises(ProviderRetryableError, match="read timeout") as info:
        h.complete()
    assert info.value.status is None


def test_connection_refused_is_retryable() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    sleeps: list[float] = []
    backend = BackendConfig(name="down", base_url=f"http://127.0.0.1:{port}/v1", max_attempts=2)
    provider = HttpProvider(backend, OpenAICodec(), sleep=sleeps.append, environ={})
    try:
        with pytest.raises(ProviderRetryableError, match="connection failed") as info:
            provider.complete(REQUEST)
    finally:
        provider.close()
    assert info.value.status is None
    assert len(sleeps) == 1


def test_total_timeout_stops_before_a_long_sleep(make: Any, server: ScriptedServer) -> None:
    h = make(Reply(429, {}, {"Retry-After": "30"}), Reply(), total_timeout_s=5.0)
    with pytest.raises(ProviderRetryableError) as info:
        h.complete()
    assert info.value.status == 429
    assert info.value.retry_after_s == 30.0
    assert h.sleeps == []
    assert len(server.seen) == 1


def test_request_timeout_bounds_the_call_and_is_not_retried(
    make: Any, server: ScriptedServer
) -> None:
    # the request's own bound (a program chat's timeout_ms): a read timeout past it ends the
    # call with provider_timeout at once, though the backend would retry and wait longer
    h = make(Reply(delay_s=1.0), Reply(), read_timeout_s=30.0, max_attempts=3)
    with pytest.raises(ProviderTimeoutError) as info:
        h.complete(replace(REQUEST, timeout_s=0.2))
    assert info.value.code == "provider_timeout"
    assert info.value.message == (
        "the model request passed its timeout of 200 ms (backend test, attempt 1)"
    )
    assert (len(server.seen), h.sleeps) == (1, [])


def test_request_timeout_longer_than_the_reply_changes_nothing(make: Any) -> None:
    result = make(Reply(delay_s=0.05)).complete(replace(REQUEST, timeout_s=5.0))
    assert (result.attempts, result.completion["choices"][0]["message"]["content"]) == (1, "hello")


def test_no_secrets_in_logs_or_errors(make: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    h = make(
        Reply(500, {}),
        Reply(),
        Reply(400, {"error": {"message": "nope"}}),
        environ={"K": "sk-live-SECRET"},
        api_key_env="K",
    )
    h.complete()
    with pytest.raises(ProviderRequestError) as info:
        h.complete()
    for text in (caplog.text, info.value.message):
        assert "TOPSECRETPROMPT" not in text
        assert "SECRET" not in text
    assert "HTTP 500" in caplog.text


def test_threads_share_one_pool_that_keeps_their_connections(
    make: Any, server: ScriptedServer
) -> None:
    h = make(*[Reply() for _ in range(4)])
    results: list[int] = []
    threads = [
        threading.Thread(target=lambda: results.append(h.complete().attempts)) for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert results == [1, 1, 1, 1]
    pool = h.provider._connections().connection_from_url(server.base_url)
    opened = pool.num_connections
    assert 1 <= opened <= 4
    server.script.extend(Reply() for _ in range(3))
    for _ in range(3):
        assert h.complete().attempts == 1
    assert pool.num_connections == opened  # kept alive, reused
    h.provider.close()
    server.script.append(Reply())
    assert h.complete().attempts == 1  # usable again after close


def test_pool_goes_through_the_environments_proxy_unless_the_host_is_exempt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    monkeypatch.setenv("NO_PROXY", "internal.example")
    proxied = _pool_for("https://api.example/v1", 8)
    assert isinstance(proxied, urllib3.ProxyManager)
    assert proxied.proxy is not None and proxied.proxy.host == "proxy.example"
    assert not isinstance(_pool_for("https://internal.example/v1", 8), urllib3.ProxyManager)
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", "/etc/ssl/custom.pem")
    assert _pool_for("https://api.example/v1", 8).connection_pool_kw["ca_certs"] == (
        "/etc/ssl/custom.pem"
    )
