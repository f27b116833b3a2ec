"""OpenAI-compatible chat-completions over HTTP: the only module that imports `requests`.

Every requests exception and HTTP status is translated here into the ProviderError tree.
Logs carry backend names, statuses, attempt numbers, request ids and lengths, never the
request body, prompts, replies or the API key.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import requests

from worker.codecs.openai_chat import is_empty_reply, normalize_completion
from worker.codecs.retry import RetryPolicy, backoff_s, parse_retry_after_s, should_retry_status
from worker.config import BackendConfig
from worker.errors import (
    ProviderProtocolError,
    ProviderRequestError,
    ProviderRetryableError,
)

log = logging.getLogger(__name__)

_MAX_ERROR_CHARS = 300
_MIN_READ_TIMEOUT_S = 0.1
_USER_AGENT = "cchatq/0.1"


@dataclass(frozen=True)
class CompletionResult:
    completion: dict[str, Any]  # normalised (normalize_completion)
    attempts: int
    latency_ms: int  # the whole call: every attempt and every backoff sleep


class OpenAIChatProvider:
    """One backend. Thread-safe: each thread gets its own requests.Session (Celery llm pool)."""

    def __init__(
        self,
        backend: BackendConfig,
        sleep: Callable[[float], None] = time.sleep,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self._backend = backend
        self._policy = RetryPolicy.from_backend(backend)
        self._sleep = sleep
        self._environ = environ
        self._url = backend.base_url.rstrip("/") + "/chat/completions"
        self._local = threading.local()
        self._sessions: list[requests.Session] = []
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            sessions, self._sessions = self._sessions, []
            self._local = threading.local()  # threads build fresh sessions if used again
        for session in sessions:
            session.close()

    def _session(self) -> requests.Session:
        session: requests.Session | None = getattr(self._local, "session", None)
        if session is None:
            session = requests.Session()
            with self._lock:
                self._sessions.append(session)
                self._local.session = session
        return session

    def _headers(self) -> dict[str, str]:
        headers = {
            "Content-Type": "application/json",
            "Accept": "application/json",
            "User-Agent": _USER_AGENT,
        }
        # Read at call time so a rotated key is picked up without a restart.
        key = self._backend.api_key(self._environ)
        if key:
            headers["Authorization"] = f"Bearer {key}"
        return headers

    def complete(self, request: dict[str, Any]) -> CompletionResult:
        """POST one chat-completions body; retry transient failures per RetryPolicy (B9)."""
        try:
            body = json.dumps(
                request, separators=(",", ":"), ensure_ascii=False, allow_nan=False
            ).encode()  # NaN is not JSON; servers would answer 400
        except (TypeError, ValueError) as exc:
            raise ProviderRequestError(f"request is not JSON-serialisable: {exc}") from None
        policy, backend = self._policy, self._backend
        start = time.monotonic()
        attempts = 0
        empty_retried = False
        while True:
            attempts += 1
            outcome = self._attempt(body, attempts, start)
            if isinstance(outcome, dict):
                if not is_empty_reply(outcome):
                    latency_ms = int((time.monotonic() - start) * 1000)
                    return CompletionResult(outcome, attempts, latency_ms)
                # B1.12: one retry for an empty reply, with no backoff (it is not a load signal).
                if (
                    empty_retried
                    or attempts >= policy.max_attempts
                    or self._past_deadline(start, 0.0)
                ):
                    raise ProviderProtocolError("empty response")
                empty_retried = True
                log.warning(
                    "backend %s: empty reply (attempt %d), retrying", backend.name, attempts
                )
                continue
            if attempts >= policy.max_attempts:
                raise outcome
            delay = backoff_s(attempts, policy, outcome.retry_after_s, random.random())
            if self._past_deadline(start, delay):
                raise outcome
            # outcome.message holds at most the upstream error text, never our request.
            log.warning(
                "backend %s: %s (attempt %d/%d), retrying in %.2fs",
                backend.name,
                outcome.message,
                attempts,
                policy.max_attempts,
                delay,
            )
            self._sleep(delay)

    def _past_deadline(self, start: float, delay: float) -> bool:
        return time.monotonic() - start + delay >= self._backend.total_timeout_s

    def _attempt(
        self, body: bytes, attempt: int, start: float
    ) -> dict[str, Any] | ProviderRetryableError:
        """One HTTP exchange: the completion, a retryable failure, or a raised final error."""
        backend = self._backend
        remaining = backend.total_timeout_s - (time.monotonic() - start)
        # The total deadline also bounds each read (B9.77), never below a usable minimum.
        read_s = max(min(backend.read_timeout_s, remaining), _MIN_READ_TIMEOUT_S)
        try:
            resp = self._session().post(
                self._url,
                data=body,
                headers=self._headers(),
                timeout=(backend.connect_timeout_s, read_s),
            )
        except requests.Timeout as exc:
            kind = "connect" if isinstance(exc, requests.ConnectTimeout) else "read"
            return ProviderRetryableError(f"{kind} timeout calling backend {backend.name}")
        except (
            requests.ConnectionError,
            requests.exceptions.ChunkedEncodingError,
            requests.exceptions.ContentDecodingError,
        ) as exc:
            return ProviderRetryableError(
                f"connection failed calling backend {backend.name} ({type(exc).__name__})"
            )
        except requests.RequestException as exc:
            # Bad URL, redirect loop, invalid header: retrying cannot help.
            raise ProviderRequestError(
                f"request to backend {backend.name} failed: {type(exc).__name__}"
            ) from None

        status = resp.status_code
        request_id = resp.headers.get("x-request-id", "-")
        log.log(
            logging.DEBUG if 200 <= status < 300 else logging.WARNING,
            "backend %s: HTTP %d attempt %d request_id %s sent %d bytes got %d bytes",
            backend.name,
            status,
            attempt,
            request_id,
            len(body),
            len(resp.content),
        )
        if 200 <= status < 300:
            return self._completion(resp)
        message = f"HTTP {status}: {_upstream_message(resp)}"
        if not should_retry_status(status, resp.headers):
            raise ProviderRequestError(message, status)
        retry_after = parse_retry_after_s(resp.headers, time.time())
        return ProviderRetryableError(message, status, retry_after)

    def _completion(self, resp: requests.Response) -> dict[str, Any]:
        try:
            payload = json.loads(resp.content)
        except (ValueError, UnicodeDecodeError):
            raise ProviderProtocolError(
                f"HTTP {resp.status_code} body is not JSON ({len(resp.content)} bytes)"
            ) from None
        return normalize_completion(payload)


def _upstream_message(resp: requests.Response) -> str:
    """The provider's own error text, as OpenAI/Anthropic/vLLM/FastAPI shape it, capped."""
    text = ""
    try:
        payload = json.loads(resp.content)
    except (ValueError, UnicodeDecodeError):
        text = resp.content.decode("utf-8", errors="replace")
    else:
        text = _message_in(payload)
    text = " ".join(text.split()) or (resp.reason or "no error message")
    return text[:_MAX_ERROR_CHARS]


def _message_in(payload: Any) -> str:
    if isinstance(payload, str):
        return payload
    if isinstance(payload, dict):
        for key in ("error", "message", "detail", "msg"):
            if key in payload:
                found = _message_in(payload[key])
                if found:
                    return found
    if isinstance(payload, list) and payload:
        return _message_in(payload[0])  # FastAPI 422 detail lists, Gemini error arrays
    return json.dumps(payload)[:_MAX_ERROR_CHARS] if payload not in (None, "", {}, []) else ""
