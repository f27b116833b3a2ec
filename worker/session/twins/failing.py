"""A store that fails on cue: a Redis blip, or an outage, for the steps' failure paths; or a
Redis that refuses writes for now (full, failing to persist, a replica), which steps wait out
without spending a try; or a Redis that does not answer."""

from __future__ import annotations

from typing import Any

from worker.errors import StoreError, StoreUnavailableError, StoreUnreachableError
from worker.session.twins.store import MemoryStore


class FailingStore:
    """A store whose named methods raise StoreError on their first N calls each (a Redis
    blip, or an outage), then behave like the store they wrap."""

    _refusing = ""  # RefusingStore's reason
    _unanswered = False  # UnreachableStore's

    def __init__(self, store: MemoryStore, **failures: int) -> None:
        self._store = store
        self._left = dict(failures)
        self.raised: list[str] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if name not in self._left:
            return attr

        def failing(*args: Any, **kwargs: Any) -> Any:
            if self._left[name] > 0:
                self._left[name] -= 1
                self.raised.append(name)
                if self._refusing:
                    raise StoreUnavailableError(self._refusing, f"twin: {name} refused")
                if self._unanswered:
                    raise StoreUnreachableError(f"twin: {name}: TimeoutError")
                raise StoreError(f"twin: {name} failed")
            return attr(*args, **kwargs)

        return failing


class RefusingStore(FailingStore):
    """The same, but what its methods raise is a Redis refusing writes for now
    (StoreUnavailableError with `reason`: OOM, MISCONF, READONLY, LOADING)."""

    def __init__(self, store: MemoryStore, reason: str, /, **refusals: int) -> None:
        super().__init__(store, **refusals)
        self._refusing = reason


class UnreachableStore(FailingStore):
    """The same, but its methods time out (StoreUnreachableError): a Redis cut off, paused or
    failing over."""

    _unanswered = True
