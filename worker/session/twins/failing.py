"""A store that fails on cue: a Redis blip, or an outage, for the steps' failure paths."""

from __future__ import annotations

from typing import Any

from worker.errors import StoreError
from worker.session.twins.store import MemoryStore


class FailingStore:
    """A store whose named methods raise StoreError on their first N calls each (a Redis
    blip, or an outage), then behave like the store they wrap."""

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
                raise StoreError(f"twin: {name} failed")
            return attr(*args, **kwargs)

        return failing
