"""The fleet a program run talks to, in this process, on the twins of worker/session/twins/:
a MemoryStore (session store and the guest's ProgramStore), a StepQueue (the dispatcher), a
real StepRunner, the replay server's scenarios answering in process, and a real
WasmToolRuntime running the programs' tools in their forks. No Redis, no Celery, no sockets.

    pipe = pipeline(blobs, cache_dir)        # store.pump runs the queued steps
    host = ProgramHost(defaults, pipe.store, pipe.queue)
    ...                                      # a blocking hostcall runs the chats it waits for
    pipe.close()

A program waiting on its chats calls `MemoryStore.wait_done`, which finds nothing done and
calls the pump: the queued steps run right there, in the program's thread.

A reply with latency (`[[latency_ms:N]]`, the `slow` scenario) does not block that thread:
its request is in flight for N ms from the round step's first call, and until it lands the
round step gives its slot back as a rate-limited step does (`RateLimited`: no try spent, the
step retried after the wait). Retried steps are parked with their countdown, as Celery's
`retry(countdown=...)` parks them, and the pump puts them back on the queue once due; while
nothing can run, the pump waits in slices of PUMP_SLICE_S, so a blocking wait that ends
earlier (a timeout, the run's deadline) is overshot by at most one slice.
"""

from __future__ import annotations

import heapq
import itertools
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fixtures.replay.scenarios import Outcome, handle
from worker.codecs.openai_chat import is_empty_reply
from worker.codecs.openai_codec import OpenAICodec
from worker.codecs.protocol import ChatRequest, Delta
from worker.codecs.retry import should_retry_status
from worker.config import BackendConfig, FleetConfig, Settings
from worker.edges.wasm_runtime import WasmToolRuntime
from worker.errors import (
    ProviderError,
    ProviderProtocolError,
    ProviderRequestError,
    ProviderRetryableError,
    ProviderTimeoutError,
    RateLimited,
    RetryLater,
)
from worker.session.steps import StepRunner
from worker.session.twins.models import Completed, OpenRateControl, OpenRateLimiter
from worker.session.twins.queue import Published, StepQueue
from worker.session.twins.store import MemoryStore

PUMP_SLICE_S = 0.005
REPLAY_BACKEND = BackendConfig(name="replay", base_url="http://replay.twin/v1")


# the replay server, in process -----------------------------------------------------------


@dataclass
class ReplayTwin:
    """`provider_for` of a fleet whose backends are the replay server (OpenAI wire, JSON
    replies): the scenarios of fixtures/replay answer each encoded request body, as the
    server's `POST /v1/chat/completions` does, with the server's fault memory and counters."""

    default_latency_ms: int = 0
    requests: int = 0
    unexpected: list[str] = field(default_factory=list)  # what the server prints loudly
    rejected: list[str] = field(default_factory=list)
    _seen: set[str] = field(default_factory=set, init=False)
    # body -> (when it lands, its outcome, when it was sent)
    _in_flight: dict[bytes, tuple[float, Outcome, float]] = field(default_factory=dict, init=False)
    _lock: threading.RLock = field(default_factory=threading.RLock, init=False)

    def __call__(self, backend: BackendConfig) -> ReplayProvider:
        return ReplayProvider(self, backend)

    def first_seen(self, key: str) -> bool:
        with self._lock:
            new = key not in self._seen
            self._seen.add(key)
            return new

    def exchange(self, body: bytes, timeout_s: float | None = None) -> Outcome:
        """The server's answer to one request body, once its latency has passed: until then
        RateLimited with the time left (the request stays in flight, answered once). A
        request whose `timeout_s` passes first is dropped: ProviderTimeoutError, as the HTTP
        provider raises it."""
        with self._lock:
            flying = self._in_flight.get(body)
            if flying is None:
                outcome = handle(
                    body, default_latency_ms=self.default_latency_ms, first_seen=self.first_seen
                )
                self._count(outcome)
                if outcome.latency_ms <= 0:
                    return outcome
                now = time.monotonic()
                flying = (now + outcome.latency_ms / 1000, outcome, now)
                self._in_flight[body] = flying
            landed, outcome, sent = flying
            now = time.monotonic()
            left = landed - now
            if left > 0:
                if timeout_s is not None:
                    over = sent + timeout_s - now
                    if over <= 0:
                        del self._in_flight[body]
                        ms = round(timeout_s * 1000)
                        raise ProviderTimeoutError(
                            f"the model request passed its timeout of {ms} ms"
                        )
                    left = min(left, over)
                raise RateLimited(left)
            del self._in_flight[body]
            return outcome

    def _count(self, outcome: Outcome) -> None:
        self.requests += 1
        if outcome.kind == "unexpected":
            self.unexpected.append(outcome.message)
        elif outcome.kind == "rejected":
            self.rejected.append(outcome.message)


class ReplayProvider:
    """The CompletionProvider port over ReplayTwin: the OpenAI codec encodes the request and
    decodes the reply, and statuses become ProviderErrors as in HttpProvider (retryable
    ones retried at once, up to the backend's max_attempts; one retry of an empty reply)."""

    def __init__(self, twin: ReplayTwin, backend: BackendConfig) -> None:
        if backend.protocol != "openai" or backend.stream:
            raise ProviderRequestError(
                f"backend {backend.name}: the replay twin serves the OpenAI wire, JSON only"
            )
        self.twin = twin
        self.backend = backend
        self.codec = OpenAICodec()

    def complete(
        self, request: ChatRequest, on_delta: Callable[[Delta], None] | None = None
    ) -> Completed:
        wire = self.codec.encode(request)
        try:
            body = json.dumps(
                wire.body, separators=(",", ":"), ensure_ascii=False, allow_nan=False
            ).encode()
        except (TypeError, ValueError) as exc:
            raise ProviderRequestError(f"request is not JSON-serialisable: {exc}") from None
        empty_retried = False
        failure: ProviderError = ProviderRetryableError("no attempt made")
        for _ in range(max(self.backend.max_attempts, 1)):
            reply = self.twin.exchange(body, request.timeout_s).reply
            if 200 <= reply.status < 300:
                try:
                    payload = json.loads(reply.body)
                except (ValueError, UnicodeDecodeError):
                    raise ProviderProtocolError(
                        f"HTTP {reply.status} body is not JSON ({len(reply.body)} bytes)"
                    ) from None
                try:
                    completion = self.codec.decode(payload, request)
                except ProviderRetryableError as exc:
                    failure = exc
                    continue
                if not is_empty_reply(completion):
                    return Completed(completion)
                if empty_retried:
                    raise ProviderProtocolError("empty response")
                empty_retried = True
                failure = ProviderProtocolError("empty response")
                continue
            message = f"HTTP {reply.status}: {upstream_message(reply.body)}"
            if not should_retry_status(reply.status, dict(reply.headers)):
                raise ProviderRequestError(message, reply.status)
            failure = ProviderRetryableError(message, reply.status)
        raise failure


def upstream_message(body: bytes) -> str:
    """The error text of a replay error body (`{"error": {"message": ...}}`), capped."""
    try:
        payload: Any = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return body.decode("utf-8", errors="replace")[:300]
    while isinstance(payload, dict):
        inner = payload.get("error", payload.get("message"))
        if inner is None:
            break
        payload = inner
    text = payload if isinstance(payload, str) else json.dumps(payload)
    return " ".join(text.split())[:300] or "no error message"


# the pipeline ----------------------------------------------------------------------------


@dataclass
class Pipeline:
    store: MemoryStore
    queue: StepQueue
    runner: StepRunner
    replay: ReplayTwin
    runtime: WasmToolRuntime
    parked: list[tuple[float, int, Published]] = field(default_factory=list)  # a heap by due
    retried: list[tuple[Published, str]] = field(default_factory=list)
    _order: itertools.count[int] = field(default_factory=itertools.count, init=False)

    def park(self, step: Published, later: RetryLater) -> None:
        """A step asked to be retried: held until its countdown is due."""
        self.retried.append((step, str(later)))
        due = time.monotonic() + max(later.countdown_s, 0.0)
        heapq.heappush(self.parked, (due, next(self._order), step))

    @property
    def crashed(self) -> list[tuple[Published, Exception]]:
        return self.queue.crashed

    def pump(self) -> None:
        """Run every step that can run now; if none could, wait one slice for a parked one."""
        now = time.monotonic()
        while self.parked and self.parked[0][0] <= now:
            self.queue.pending.append(heapq.heappop(self.parked)[2])
        if self.queue.drain(self.runner):
            return
        wait = PUMP_SLICE_S
        if self.parked:
            wait = min(wait, max(self.parked[0][0] - now, 0.0))
        time.sleep(wait)

    def drain(self, timeout_s: float = 30.0) -> None:
        """Run steps until none is queued or parked (parked ones when due)."""
        until = time.monotonic() + timeout_s
        while self.queue.pending or self.parked:
            if time.monotonic() > until:
                raise TimeoutError(f"steps still parked after {timeout_s} s: {self.parked}")
            self.pump()

    def close(self) -> None:
        self.store.pump = None
        self.runtime.close()


def pipeline(
    blobs: dict[str, bytes],
    cache_dir: Path,
    *,
    replay: ReplayTwin | None = None,
    settings: Settings | None = None,
) -> Pipeline:
    """A fresh store and queue; modules are loaded from `blobs` (sha256 hex -> bytes) and
    compiled into `cache_dir`. The settings default to one backend, `replay`."""
    store = MemoryStore()
    queue = StepQueue()
    replay = ReplayTwin() if replay is None else replay
    runtime = WasmToolRuntime(
        cache_dir=cache_dir, load_module_bytes=blobs.__getitem__, load_fork_blob=store.fork_blob
    )
    runner = StepRunner(
        store=store,
        dispatch=queue,
        provider_for=replay,
        tools=lambda: runtime,
        settings=settings or Settings(fleet=FleetConfig(backends={"replay": REPLAY_BACKEND})),
        rate_limiter=OpenRateLimiter(),
        rate_control=OpenRateControl(),
    )
    pipe = Pipeline(store, queue, runner, replay, runtime)
    queue.park = pipe.park
    store.pump = pipe.pump
    return pipe
