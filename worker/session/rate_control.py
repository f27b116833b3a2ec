"""The adaptive rate control a model call goes through (docs/architecture.md section 6): one
controller per backend, account and model, shared by every worker of the fleet, with a window
of calls in flight and a pace in requests and tokens per second, both learned from what the
provider says. This module holds the port and its values; worker.edges.rate_control keeps the
controllers in Redis.
"""

from __future__ import annotations

import functools
import hashlib
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Literal, Protocol

from worker.codecs.rate_headers import RateSignal
from worker.config import BackendConfig


@dataclass(frozen=True)
class ControlKey:
    """Whose limits a call counts against: the provider limits an account's key per model."""

    backend: str
    account: str  # a digest of the API key ("-" without one): never the key itself
    model: str

    @property
    def id(self) -> str:
        return f"{self.backend}/{self.account}/{self.model}"


@functools.lru_cache(maxsize=64)  # a call's controller is found on every model call
def account_of(api_key: str | None) -> str:
    """The account an API key names, as a short digest (ids only reach Redis and logs)."""
    if not api_key:
        return "-"
    return hashlib.sha256(api_key.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class Slot:
    """Room for one call: a place in its controller's window, leased while the call runs."""

    key: ControlKey
    member: str
    estimated_tokens: int
    kept: bool = False  # of a block its process keeps (far from the limit): given back to it


@dataclass(frozen=True)
class Wait:
    """No room yet: come back in `wait_s` (the round gives its worker thread back meanwhile)."""

    wait_s: float
    reason: str  # "window", "pace", "tokens" or "queued": what there was no room in


CallKind = Literal["ok", "rate_limited", "failed"]


@dataclass(frozen=True)
class CallReport:
    """How a call went, for its controller to learn from."""

    kind: CallKind
    latency_ms: int
    used_tokens: int = 0  # as the provider counted them (the reply's usage)
    signal: RateSignal | None = None  # what the response's headers said of the limits


@dataclass(frozen=True)
class Change:
    """A change of a controller's window or pace, and why (logged once, by its maker)."""

    reason: str  # "slow start", "grow", "429 cut" or "header"
    window: float
    pace_rps: float  # 0: no pace


class RateControl(Protocol):
    def acquire(
        self, key: ControlKey, waiter: str, estimated_tokens: int, backend: BackendConfig
    ) -> Slot | Wait:
        """A slot, or how long to wait. `waiter` names the asking round across its retries
        (its place in the waiting room); `backend` holds the configured ceilings."""
        ...

    def held(self, slot: Slot) -> AbstractContextManager[None]:
        """Keeps the slot's lease alive while its call runs (a dead worker's slots expire)."""
        ...

    def report(self, slot: Slot, report: CallReport, backend: BackendConfig) -> Change | None:
        """Frees the slot and learns from the call; the change it made, if any."""
        ...

    def paces_tokens(self, key: ControlKey, backend: BackendConfig) -> bool:
        """Whether calls of this controller need a token estimate before they start."""
        ...


def backend_ceilings(backend: BackendConfig) -> tuple[float, float]:
    """The configured limits as ceilings of the learned pace: (requests/s, tokens/s); 0 none."""
    window_s = backend.rate_window_s or 60.0
    rps = (backend.requests_per_minute or 0) / window_s
    tps = (backend.tokens_per_minute or 0) / window_s
    return rps, tps
