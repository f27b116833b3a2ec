"""The model's ports in memory: a CompletionProvider answering from a script, a RateLimiter and
a RateControl with room for every call (or fixed waits)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from worker.codecs.protocol import ChatRequest, Delta
from worker.codecs.rate_headers import RateSignal
from worker.config import BackendConfig
from worker.errors import ProviderRequestError
from worker.session.ports import Permit
from worker.session.rate_control import CallReport, Change, ControlKey, Slot, Wait


@dataclass(frozen=True)
class Completed:
    completion: dict[str, Any]
    rate: RateSignal | None = None


@dataclass
class ScriptedProvider:
    """The CompletionProvider port answering from a script: each entry a canonical
    chat.completion, a ProviderError to raise, or a function of the request."""

    script: list[dict[str, Any] | Exception | Callable[[ChatRequest], dict[str, Any]]]
    requests: list[ChatRequest] = field(default_factory=list)

    def __call__(self, backend: BackendConfig) -> ScriptedProvider:  # as `provider_for`
        return self

    def complete(
        self, request: ChatRequest, on_delta: Callable[[Delta], None] | None = None
    ) -> Completed:
        self.requests.append(request)
        if not self.script:
            raise ProviderRequestError("the scripted provider has no more replies")
        entry = self.script.pop(0)
        if isinstance(entry, Exception):
            raise entry
        return Completed(entry(request) if callable(entry) else entry)


def NoProvider(backend: BackendConfig) -> ScriptedProvider:
    """`provider_for` of a process that calls no model."""
    return ScriptedProvider([])


@dataclass
class OpenRateLimiter:
    """The RateLimiter port with room for every call (or a fixed wait, to test waiting)."""

    wait_s: list[float] = field(default_factory=list)  # waits to answer first, in order
    settled: list[tuple[Permit, int]] = field(default_factory=list)

    def acquire(self, backend: BackendConfig, estimated_tokens: int) -> Permit | float:
        if self.wait_s:
            return self.wait_s.pop(0)
        return Permit(backend.name, "")

    def settle(self, permit: Permit, used_tokens: int) -> None:
        self.settled.append((permit, used_tokens))


@dataclass
class OpenRateControl:
    """The RateControl port with room for every call (or fixed waits, to test waiting); it
    keeps what it was asked and told."""

    wait_s: list[float] = field(default_factory=list)  # waits to answer first, in order
    asked: list[tuple[ControlKey, str, int]] = field(default_factory=list)
    reports: list[CallReport] = field(default_factory=list)
    held_now: int = 0

    def acquire(
        self, key: ControlKey, waiter: str, estimated_tokens: int, backend: BackendConfig
    ) -> Slot | Wait:
        self.asked.append((key, waiter, estimated_tokens))
        if self.wait_s:
            return Wait(self.wait_s.pop(0), "window")
        return Slot(key, f"slot-{len(self.asked)}", estimated_tokens)

    @contextmanager
    def held(self, slot: Slot) -> Iterator[None]:
        self.held_now += 1
        try:
            yield
        finally:
            self.held_now -= 1

    def report(self, slot: Slot, report: CallReport, backend: BackendConfig) -> Change | None:
        self.reports.append(report)
        return None

    def paces_tokens(self, key: ControlKey, backend: BackendConfig) -> bool:
        return bool(backend.tokens_per_minute)
