"""A model call, as the steps make it: the backend named by the session (or the fleet's
default; a model alias of the configuration routes a session that names none:
schemas/model_routes.py), the account's rate control (worker.session.rate_control; the static
limit of a backend with `adaptive: false`), the call through the CompletionProvider port, and
the partial state of a streamed round for `cchatq status`. The round step and the summaries of
long tool outputs call models only through here."""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from schemas.model_routes import ModelAlias, ModelRoute, route_model
from schemas.partial import PartialCall, PartialRound
from worker.codecs.protocol import ChatRequest, Delta
from worker.codecs.rate_headers import RateSignal
from worker.config import BackendConfig
from worker.errors import (
    ProviderError,
    ProviderRateLimitedError,
    RateLimited,
    StoreError,
    StoreUnavailableError,
)
from worker.session.engine import CallModel
from worker.session.ports import Completion, CompletionProvider, Permit, RateLimiter
from worker.session.rate_control import (
    CallKind,
    CallReport,
    ControlKey,
    RateControl,
    Slot,
    Wait,
    account_of,
)
from worker.session.refusals import STEPS
from worker.session.state import Session
from worker.session.store_ports import StepData

log = logging.getLogger(__name__)

PARTIAL_EVERY_S = 0.25
RETRY_AFTER_MIN_S = 0.01  # a 429 that names no wait: its round comes back at once, in line


class PartialState:
    """A streamed round so far (text, thinking, each tool call's name and argument text),
    published at most every PARTIAL_EVERY_S for `cchatq status` and the session viewer."""

    def __init__(self, store: StepData, sk: str) -> None:
        self.store, self.sk = store, sk
        self.text: list[str] = []
        self.thinking: list[str] = []
        self.calls: list[tuple[list[str], list[str]]] = []  # (name pieces, argument pieces)
        self.last = 0.0

    def __call__(self, delta: Delta) -> None:
        if delta.kind == "restart":
            self.text.clear()
            self.thinking.clear()
            self.calls.clear()
            return
        if delta.kind == "content":
            self.text.append(delta.text)
        elif delta.kind == "reasoning":
            self.thinking.append(delta.text)
        elif delta.kind == "tool_call":
            while len(self.calls) <= delta.call:
                self.calls.append(([], []))
            name, arguments = self.calls[delta.call]
            name.append(delta.name)
            arguments.append(delta.text)
        else:
            return
        if time.monotonic() - self.last >= PARTIAL_EVERY_S:
            self.last = time.monotonic()
            self.store.set_partial(self.sk, self.state())

    def state(self) -> PartialRound:
        calls = tuple(PartialCall("".join(n), "".join(a)) for n, a in self.calls)
        return PartialRound("".join(self.text), "".join(self.thinking), calls)

    def close(self) -> None:
        with contextlib.suppress(StoreError):
            self.store.set_partial(self.sk, None)


def estimate_tokens(chat: ChatRequest) -> int:
    """A prompt's size in tokens, roughly (4 characters a token), before the call."""
    return len(json.dumps(chat.messages, ensure_ascii=False)) // 4 + 1


@dataclass
class ModelCaller:
    backends: Mapping[str, BackendConfig]
    default_backend: str
    provider_for: Callable[[BackendConfig], CompletionProvider]
    rate_limiter: RateLimiter  # a backend's static limit, when it is not adaptive
    store: StepData  # where a streamed round's partial text goes
    control: RateControl  # the adaptive rate control of every other backend
    models: Mapping[str, ModelAlias] = field(default_factory=dict)  # the model aliases

    def route(
        self, provider: str | None, model: str, params: Mapping[str, Any] | None = None
    ) -> ModelRoute:
        """Where a call naming `provider` and `model` goes (an alias applies without one)."""
        return route_model(self.models, provider, model, params)

    def backend(self, provider: str | None) -> BackendConfig | None:
        """The backend of this name (the fleet's default for None); None when there is none."""
        try:
            return self.backends[provider or self.default_backend]
        except (KeyError, TypeError):  # unknown, or not a name at all: the round ends it
            return None

    def call_round(
        self, sk: str, session: Session, step: CallModel, waiter: str = ""
    ) -> dict[str, Any]:
        """A round's model call: the reply, or the error body the round ends in. RateLimited
        when its backend has no room yet (the step is put off, no try spent)."""
        route = self.route(session.spec.provider, step.model, step.params)
        backend = self.backend(route.backend)
        if backend is None:
            name = route.backend
            return ProviderError(
                f"unknown backend {name!r}; configured: {sorted(self.backends)}"
            ).body()
        chat = ChatRequest(
            model=route.model,
            messages=step.messages,
            tools=step.tools,
            params=route.params,
            tool_choice=step.tool_choice,
            parallel_tool_calls=step.parallel_tool_calls,
            stream=backend.stream,
            thinking_budget_tokens=backend.thinking_budget_tokens,
            timeout_s=_seconds(session.spec.limits.request_timeout_ms),
        )
        try:
            return self.complete(backend, chat, partial_of=sk, waiter=waiter)
        except ProviderError as exc:
            return exc.body()

    def complete(
        self,
        backend: BackendConfig,
        chat: ChatRequest,
        partial_of: str | None = None,
        waiter: str = "",
    ) -> dict[str, Any]:
        """One model call under its account's rate control (a round's, or a summary's): the
        reply; RateLimited when there is no room yet, or the provider answered 429 (no attempt
        is spent on either); a ProviderError as the call raised it. `waiter` names the round
        across its retries, for its place in line. A streamed call of `partial_of` shows its
        text in `cchatq status` as it comes."""
        if not backend.adaptive:
            return self._complete_limited(backend, chat, partial_of)
        key = ControlKey(backend.name, account_of(backend.api_key()), chat.model)
        # the prompt's size matters only to a token pace: no JSON of it for other calls
        estimated = estimate_tokens(chat) if self.control.paces_tokens(key, backend) else 0
        slot = self.control.acquire(key, waiter or uuid.uuid4().hex, estimated, backend)
        if isinstance(slot, Wait):
            raise RateLimited(slot.wait_s, backend.name, slot.reason)
        started = time.monotonic()
        kind: CallKind = "failed"
        result: Completion | None = None
        signal: RateSignal | None = None
        try:
            with self.control.held(slot):
                result = self._call(backend, chat, partial_of)
            kind, signal = "ok", result.rate
        except ProviderRateLimitedError as exc:
            kind = "rate_limited"
            signal = exc.signal if isinstance(exc.signal, RateSignal) else None
            wait_s = max(exc.retry_after_s or 0.0, RETRY_AFTER_MIN_S)
            raise RateLimited(wait_s, backend.name, "429") from None
        finally:
            completion = result.completion if result is not None else {}
            used = int((completion.get("usage") or {}).get("total_tokens", 0) or 0)
            self._report(slot, CallReport(kind, _ms_since(started), used, signal), backend)
        return dict(completion)

    def _report(self, slot: Slot, report: CallReport, backend: BackendConfig) -> None:
        """Tell the controller; a report Redis failed to take is lost, never the call's reply
        (its slot's lease runs out on its own)."""
        try:
            self.control.report(slot, report, backend)
        except StoreUnavailableError as exc:  # said once for the process, not once a call
            STEPS.refused(exc.reason)
        except StoreError as exc:
            log.warning("rate control %s: report lost: %s", slot.key.id, exc.code)

    def _complete_limited(
        self, backend: BackendConfig, chat: ChatRequest, partial_of: str | None
    ) -> dict[str, Any]:
        """A call under the backend's static limit (`adaptive: false`)."""
        # the prompt's size matters only to a token limit: no JSON of it for other calls
        estimated = estimate_tokens(chat) if backend.tokens_per_minute else 0
        permit = self.rate_limiter.acquire(backend, estimated)
        if not isinstance(permit, Permit):
            raise RateLimited(permit, backend.name)
        reply = dict(self._call(backend, chat, partial_of).completion)
        used = int((reply.get("usage") or {}).get("total_tokens", 0))
        try:  # a settle Redis refused keeps the estimate until the window passes, never
            self.rate_limiter.settle(permit, used)  # costs the call's reply (a call again)
        except StoreUnavailableError as exc:
            STEPS.refused(exc.reason)
        except StoreError as exc:
            log.warning("rate limit %s: usage not settled: %s", backend.name, exc.code)
        return reply

    def _call(
        self, backend: BackendConfig, chat: ChatRequest, partial_of: str | None
    ) -> Completion:
        partial = PartialState(self.store, partial_of) if partial_of and backend.stream else None
        try:
            return self.provider_for(backend).complete(chat, partial)
        finally:
            if partial is not None:
                partial.close()


def _ms_since(started: float) -> int:
    return int((time.monotonic() - started) * 1000)


def _seconds(ms: int | None) -> float | None:
    return None if ms is None else ms / 1000
