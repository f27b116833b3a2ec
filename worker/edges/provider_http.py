"""LLM providers over HTTP: the worker's only HTTP client. A codec (worker/codecs/protocol.py)
makes the wire body and reads the reply, JSON or SSE stream; this module sends it, retries
transient failures (429, 5xx, timeouts; Retry-After honoured) and translates every transport
exception and status into the ProviderError tree.

urllib3 directly, not requests on top of it: requests' per-call preparation (hooks, cookies,
redirect bookkeeping, header merging) cost about half of each model call's CPU in the llm worker
(0.93 -> 0.48 ms a call measured on the replay server) and buys nothing an API client needs.

Logs carry backend names, statuses, attempt numbers, request ids and lengths, never the
request body, prompts, replies or the API key.
"""

from __future__ import annotations

import json
import logging
import os
import random
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode, urlsplit

import certifi
import urllib3
from urllib3.exceptions import (
    DecodeError,
    HTTPError,
    NewConnectionError,
    ProtocolError,
    ProxyError,
    ReadTimeoutError,
    SSLError,
)
from urllib3.exceptions import TimeoutError as Urllib3Timeout

from schemas import json_codec
from schemas.protocols import declared
from worker.codecs.error_text import json_or_none, upstream_message
from worker.codecs.openai_chat import add_usage, is_empty_reply, with_spent
from worker.codecs.protocol import ChatRequest, Codec, Delta, WireRequest
from worker.codecs.rate_headers import RateSignal, precise_retry_s, read_rate_signal
from worker.codecs.retry import RetryPolicy, backoff_s, parse_retry_after_s, should_retry_status
from worker.codecs.sse import SseParser, looks_like_sse
from worker.config import BackendConfig
from worker.errors import (
    ProviderProtocolError,
    ProviderRateLimitedError,
    ProviderRequestError,
    ProviderRetryableError,
    ProviderTimeoutError,
)

log = logging.getLogger(__name__)

_MIN_READ_TIMEOUT_S = 0.1
_USER_AGENT = "cchatq/0.1"

DeltaSink = Callable[[Delta], None]


@dataclass(frozen=True)
class CompletionResult:
    completion: dict[str, Any]  # canonical chat.completion
    attempts: int
    latency_ms: int  # the whole call: every attempt and every backoff sleep
    rate: RateSignal | None = None  # what the answering response said of the account's limits


class HttpProvider:
    """One backend. Thread-safe: the worker's threads share one connection pool, sized to them
    (`max_connections`) so that each keeps its connection alive between calls."""

    def __init__(
        self,
        backend: BackendConfig,
        codec: Codec,
        sleep: Callable[[float], None] = time.sleep,
        environ: Mapping[str, str] | None = None,
        max_connections: int = 10,
    ) -> None:
        self._backend = backend
        self._codec = codec
        self._key_header = declared(codec.protocol).key_header
        self._policy = RetryPolicy.from_backend(backend)
        self._sleep = sleep
        self._environ = environ
        self._base = backend.base_url.rstrip("/")
        self._max_connections = max_connections
        self._pool: urllib3.PoolManager | None = None
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None  # a later call builds a fresh one
        if pool is not None:
            pool.clear()

    def _connections(self) -> urllib3.PoolManager:
        pool = self._pool
        if pool is None:
            with self._lock:
                if self._pool is None:
                    self._pool = _pool_for(self._backend.base_url, self._max_connections)
                pool = self._pool
        return pool

    def _headers(self, wire: WireRequest, stream: bool) -> dict[str, str]:
        headers = {
            "Content-Type": "application/json",
            "Accept": "text/event-stream" if stream else "application/json",
            "User-Agent": _USER_AGENT,
            **wire.headers,
        }
        # Read at call time so a rotated key is picked up without a restart.
        key = self._backend.api_key(self._environ)
        if key:
            headers[self._key_header.name] = self._key_header.value(key)
        return headers

    def complete(self, request: ChatRequest, on_delta: DeltaSink | None = None) -> CompletionResult:
        """One model call; transient failures retried per RetryPolicy. A retried stream
        restarts the whole call and discards its partial output."""
        wire = self._codec.encode(request)
        try:
            body = json.dumps(
                wire.body, separators=(",", ":"), ensure_ascii=False, allow_nan=False
            ).encode()  # NaN is not JSON; servers would answer 400
        except (TypeError, ValueError) as exc:
            raise ProviderRequestError(f"request is not JSON-serialisable: {exc}") from None
        policy, backend = self._policy, self._backend
        start = time.monotonic()
        attempts = 0
        empty_retried = False
        # usage of attempts whose reply was discarded: the run's totals count them too
        spent: dict[str, int] = {}
        while True:
            attempts += 1
            if attempts > 1 and on_delta is not None:
                on_delta(Delta("restart", ""))  # what a failed stream showed is void
            outcome, signal = self._attempt(wire, body, request, attempts, start, on_delta)
            if isinstance(outcome, dict):
                if not is_empty_reply(outcome):
                    latency_ms = int((time.monotonic() - start) * 1000)
                    completion = with_spent(outcome, spent)
                    return CompletionResult(completion, attempts, latency_ms, signal)
                add_usage(spent, outcome.get("usage"))
                # One retry for an empty reply, with no backoff (it is not a load signal).
                if (
                    empty_retried
                    or attempts >= policy.max_attempts
                    or self._past_deadline(request, start, 0.0)
                ):
                    raise ProviderProtocolError("empty response")
                empty_retried = True
                log.warning(
                    "backend %s: empty reply (attempt %d), retrying", backend.name, attempts
                )
                continue
            if request.timeout_s is not None and time.monotonic() - start >= request.timeout_s:
                # the request's own bound ran out (SPEAR's per-request timeout_ms)
                raise ProviderTimeoutError(
                    f"the model request passed its timeout of {round(request.timeout_s * 1000)}"
                    f" ms (backend {backend.name}, attempt {attempts})"
                )
            if attempts >= policy.max_attempts:
                raise outcome
            delay = backoff_s(attempts, policy, outcome.retry_after_s, random.random())
            if self._past_deadline(request, start, delay):
                raise outcome
            # outcome.message holds at most the upstream error text, never our request.
            log.warning(
                "backend %s: %s (attempt %d/%d), retrying in %.2fs",
                backend.name, outcome.message, attempts, policy.max_attempts, delay,
            )  # fmt: skip
            self._sleep(delay)

    def _total_s(self, request: ChatRequest) -> float:
        """The whole call's deadline: the backend's, or the request's own when shorter."""
        total = self._backend.total_timeout_s
        return total if request.timeout_s is None else min(total, request.timeout_s)

    def _past_deadline(self, request: ChatRequest, start: float, delay: float) -> bool:
        return time.monotonic() - start + delay >= self._total_s(request)

    def _attempt(
        self,
        wire: WireRequest,
        body: bytes,
        request: ChatRequest,
        attempt: int,
        start: float,
        on_delta: DeltaSink | None,
    ) -> tuple[dict[str, Any] | ProviderRetryableError, RateSignal | None]:
        """One HTTP exchange: the completion, a retryable failure, or a raised final error; with
        what the response said of the account's rate limits."""
        backend = self._backend
        remaining = self._total_s(request) - (time.monotonic() - start)
        # read_s is the idle timeout between reads of a stream; the total deadline bounds it too
        read_s = max(min(backend.read_timeout_s, remaining), _MIN_READ_TIMEOUT_S)
        connect_s = max(min(backend.connect_timeout_s, remaining), _MIN_READ_TIMEOUT_S)
        url = self._base + wire.path
        if wire.query:
            url += "?" + urlencode(wire.query)
        try:
            resp = self._connections().request(
                "POST",
                url,
                body=body,
                headers=self._headers(wire, request.stream),
                timeout=urllib3.Timeout(connect=connect_s, read=read_s),
                preload_content=not request.stream,
                redirect=False,
            )
            # only an adaptive backend's rate controller reads what the headers say
            signal = read_rate_signal(resp.headers, time.time()) if backend.adaptive else None
            try:
                reply = self._reply(resp, request, body, attempt, start, read_s, on_delta, signal)
                return reply, signal
            finally:
                if request.stream:  # a stream left unread must not go back to the pool
                    resp.close()
                    resp.release_conn()
        except (NewConnectionError, ProtocolError, SSLError, ProxyError, DecodeError) as exc:
            # refused, reset, cut mid-body or mid-chunk, TLS or proxy failure, bad gzip
            failed = f"connection failed calling backend {backend.name} ({type(exc).__name__})"
            return ProviderRetryableError(failed), None
        except Urllib3Timeout as exc:
            kind = "read" if isinstance(exc, ReadTimeoutError) else "connect"
            return ProviderRetryableError(f"{kind} timeout calling backend {backend.name}"), None
        except (HTTPError, ValueError) as exc:
            # Bad URL, invalid header: retrying cannot help.
            raise ProviderRequestError(
                f"request to backend {backend.name} failed: {type(exc).__name__}"
            ) from None

    def _reply(
        self,
        resp: urllib3.BaseHTTPResponse,
        request: ChatRequest,
        body: bytes,
        attempt: int,
        start: float,
        read_s: float,
        on_delta: DeltaSink | None,
        signal: RateSignal | None,
    ) -> dict[str, Any] | ProviderRetryableError:
        backend, status = self._backend, resp.status
        content_type = resp.headers.get("content-type", "")
        # a JSON or HTML reply to a stream request is an error body, not an empty stream
        streaming = request.stream and 200 <= status < 300 and looks_like_sse(content_type)
        log.log(
            logging.DEBUG if 200 <= status < 300 else logging.WARNING,
            "backend %s: HTTP %d attempt %d request_id %s sent %d bytes%s",
            backend.name, status, attempt, resp.headers.get("x-request-id", "-"), len(body),
            " (stream)" if streaming else f" got {len(resp.data)} bytes",
        )  # fmt: skip
        if streaming:
            return self._stream(resp, request, start, read_s, on_delta)
        if 200 <= status < 300:
            try:
                return self._codec.decode(_json_body(resp), request)
            except ProviderRetryableError as exc:  # e.g. Gemini MALFORMED_FUNCTION_CALL
                return exc
        message = f"HTTP {status}: {upstream_message(resp.data, resp.reason)}"
        if not should_retry_status(status, resp.headers):
            raise ProviderRequestError(message, status)
        now, payload = time.time(), json_or_none(resp.data)
        retry_after = parse_retry_after_s(resp.headers, now)
        # a whole-second Retry-After is rounded up: the reset headers or the body say it exactly
        precise = precise_retry_s(resp.headers, payload, now, retry_after)
        if precise is not None:
            retry_after = precise
        elif retry_after is None:
            retry_after = self._codec.retry_after_s(status, payload)
        if status == 429 and backend.adaptive:
            # the round waits for room without its thread: no attempt is spent on a 429
            raise ProviderRateLimitedError(message, retry_after, signal)
        return ProviderRetryableError(message, status, retry_after)

    def _stream(
        self,
        resp: urllib3.BaseHTTPResponse,
        request: ChatRequest,
        start: float,
        read_s: float,
        on_delta: DeltaSink | None,
    ) -> dict[str, Any] | ProviderRetryableError:
        """The reply of an SSE stream. One that gives no content for stream_idle_timeout_s is
        abandoned as retryable: keepalives (comments, `ping` events, empty deltas) can keep
        its socket reading forever, so the idle time is checked on every chunk."""
        parser, assembler = SseParser(), self._codec.assembler(request)
        name, idle_s = self._backend.name, self._backend.stream_idle_timeout_s
        idle = _IdleWatch(idle_s, read_s, resp)
        stalled = f"stream from backend {name} sent no content for {idle_s:g} s"
        try:
            for chunk in _arrivals(resp):
                for event in parser.feed(chunk):
                    deltas = assembler.feed(event)
                    if on_delta is not None:
                        for delta in deltas:
                            on_delta(delta)
                if idle.stalled(assembler.progress):
                    if assembler.finished:
                        break  # the whole reply came, then only keepalives: it is the reply
                    return ProviderRetryableError(stalled)
                if time.monotonic() - start > self._total_s(request):
                    return ProviderRetryableError(f"stream from backend {name} passed its deadline")
            for event in parser.close():
                assembler.feed(event)
        except ReadTimeoutError:
            if not assembler.finished:
                if idle.waiting_for_content:
                    return ProviderRetryableError(stalled)
                raise  # silent for read_timeout_s: a read timeout
        except ProviderRetryableError as exc:
            return exc  # other ProviderErrors (a request fault in the stream) end the call
        if not assembler.finished:
            # a stream that ends early is truncated; its calls never run
            return ProviderRetryableError(f"stream from backend {name} ended early")
        try:
            return assembler.result()
        except ProviderRetryableError as exc:
            return exc


class _IdleWatch:
    """The time since a stream last gave content. The socket never waits past the idle time
    left, so a stream that goes quiet or sends only pings ends at its idle timeout, not at
    the next ping after it."""

    def __init__(self, idle_s: float, read_s: float, resp: urllib3.BaseHTTPResponse) -> None:
        self._idle_s, self._read_s = idle_s, read_s
        self._sock = getattr(resp.connection, "sock", None)  # None: checked per chunk only
        self._progress, self._since = 0, time.monotonic()  # the headers began the stream
        self.waiting_for_content = False  # the socket's wait is the idle time left
        self._wait_s = -1.0  # the socket's timeout as last set (a syscall: only on a change)
        self._bound_wait(self._since)

    def stalled(self, progress: int) -> bool:
        now = time.monotonic()
        if progress != self._progress:
            self._progress, self._since = progress, now
        elif now - self._since >= self._idle_s:
            return True
        self._bound_wait(now)
        return False

    def _bound_wait(self, now: float) -> None:
        left = self._idle_s - (now - self._since)
        self.waiting_for_content = left < self._read_s
        wait_s = max(min(left, self._read_s), _MIN_READ_TIMEOUT_S)
        if self._sock is not None and wait_s != self._wait_s:
            self._sock.settimeout(wait_s)
            self._wait_s = wait_s


def _arrivals(resp: urllib3.BaseHTTPResponse) -> Iterator[bytes]:
    """A stream's bytes as they arrive: each HTTP chunk, or each read of a body that is not
    chunked (`stream(None)` would read that one to its end before giving anything)."""
    if resp.chunked:
        yield from resp.stream(None)
        return
    while data := resp.read1():
        yield data


def _pool_for(base_url: str, max_connections: int) -> urllib3.PoolManager:
    """Connections to one backend, through the environment's proxy for it (HTTPS_PROXY,
    NO_PROXY...) and verified against REQUESTS_CA_BUNDLE / CURL_CA_BUNDLE or certifi's
    bundle, as requests would: read once, not on every call. No retries or redirects here:
    the retry policy above owns them."""
    bundle = os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE")
    options: dict[str, Any] = {
        "num_pools": 4,
        "maxsize": max(max_connections, 1),
        "block": False,  # past maxsize a call opens a connection of its own, never waits
        "retries": False,
        "ca_certs": bundle or certifi.where(),
    }
    parts = urlsplit(base_url)
    proxies = urllib.request.getproxies_environment()
    bypass = urllib.request.proxy_bypass_environment(  # type: ignore[attr-defined]
        parts.hostname or "", proxies
    )
    proxy = None if bypass else proxies.get(parts.scheme) or proxies.get("all")
    return urllib3.ProxyManager(proxy, **options) if proxy else urllib3.PoolManager(**options)


def _json_body(resp: urllib3.BaseHTTPResponse) -> Any:
    try:
        return json_codec.loads(resp.data)
    except (ValueError, UnicodeDecodeError):
        raise ProviderProtocolError(
            f"HTTP {resp.status} body is not JSON ({len(resp.data)} bytes)"
        ) from None
