"""A model call, as the steps make it: the backend named by the session (or the fleet's
default), the backend's rate limit, the call through the CompletionProvider port, and the
partial text of a streamed round for `cchatq status`. The round step and the summaries of
long tool outputs call models only through here."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from worker.codecs.protocol import ChatRequest, Delta
from worker.config import BackendConfig
from worker.errors import ProviderError, RateLimited, StoreError
from worker.session.engine import CallModel
from worker.session.ports import CompletionProvider, Permit, RateLimiter, SessionStore
from worker.session.state import Session

PARTIAL_EVERY_S = 0.25


class PartialText:
    """The text of a streamed round, published every PARTIAL_EVERY_S for `cchatq status`."""

    def __init__(self, store: SessionStore, sk: str) -> None:
        self.store, self.sk = store, sk
        self.text: list[str] = []
        self.last = 0.0

    def __call__(self, delta: Delta) -> None:
        if delta.kind == "restart":
            self.text.clear()
            return
        if delta.kind != "content":
            return
        self.text.append(delta.text)
        if time.monotonic() - self.last >= PARTIAL_EVERY_S:
            self.last = time.monotonic()
            self.store.set_partial(self.sk, "".join(self.text))

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
    rate_limiter: RateLimiter
    store: SessionStore  # where a streamed round's partial text goes

    def backend(self, provider: str | None) -> BackendConfig | None:
        """The backend of this name (the fleet's default for None); None when there is none."""
        try:
            return self.backends[provider or self.default_backend]
        except (KeyError, TypeError):  # unknown, or not a name at all: the round ends it
            return None

    def call_round(self, sk: str, session: Session, step: CallModel) -> dict[str, Any]:
        """A round's model call: the reply, or the error body the round ends in. RateLimited
        when its backend has no room yet (the step is put off, no try spent)."""
        backend = self.backend(session.spec.provider)
        if backend is None:
            name = session.spec.provider
            return ProviderError(
                f"unknown backend {name!r}; configured: {sorted(self.backends)}"
            ).body()
        chat = ChatRequest(
            model=step.model,
            messages=step.messages,
            tools=step.tools,
            params=step.params,
            tool_choice=step.tool_choice,
            parallel_tool_calls=step.parallel_tool_calls,
            stream=backend.stream,
            thinking_budget_tokens=backend.thinking_budget_tokens,
            timeout_s=_seconds(session.spec.limits.request_timeout_ms),
        )
        try:
            return self.complete(backend, chat, partial_of=sk)
        except ProviderError as exc:
            return exc.body()

    def complete(
        self, backend: BackendConfig, chat: ChatRequest, partial_of: str | None = None
    ) -> dict[str, Any]:
        """One model call under the backend's rate limit (a round's, or a summary's): the
        reply; RateLimited when there is no room yet; a ProviderError as the call raised it.
        A streamed call of `partial_of` shows its text in `cchatq status` as it comes."""
        # the prompt's size matters only to a token limit: no JSON of it for other calls
        estimated = estimate_tokens(chat) if backend.tokens_per_minute else 0
        permit = self.rate_limiter.acquire(backend, estimated)
        if not isinstance(permit, Permit):
            raise RateLimited(permit, backend.name)
        partial = PartialText(self.store, partial_of) if partial_of and backend.stream else None
        try:
            reply = dict(self.provider_for(backend).complete(chat, partial).completion)
        finally:
            if partial is not None:
                partial.close()
        self.rate_limiter.settle(permit, int((reply.get("usage") or {}).get("total_tokens", 0)))
        return reply


def _seconds(ms: int | None) -> float | None:
    return None if ms is None else ms / 1000
