"""A session's result in Redis, a part of RedisStore: the response fd and the record, written
once, and the batches waiting for the session told that it finished."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from schemas import keys
from schemas.bodies import dump_body, outcome_code
from worker.edges.step_leases import translated


class ResultWrites:
    """A part of RedisStore (which sets `client` and `ttl_s`)."""

    client: Any
    ttl_s: int

    @translated
    def has_result(self, sk: str) -> bool:
        return bool(self.client.exists(keys.response(sk)))

    @translated
    def write_result(
        self, sk: str, body: bytes, record: dict[str, Any], notify_later: list[str] | None = None
    ) -> bool:
        """Write the response fd once, then tell every waiting batch (or add them to
        `notify_later`). True if this call wrote it."""
        # No MULTI: the record is written before the response, so whoever sees the response
        # finds the record too; each SET NX keeps the first outcome. The watchers are read
        # after the response: a batch that starts watching later finds the response.
        pipe = self.client.pipeline(transaction=False)
        pipe.set(keys.record(sk), dump_body(record), nx=True, ex=self.ttl_s)
        pipe.set(keys.response(sk), body, nx=True, ex=self.ttl_s)
        done = {"state": "done", "finished_ms": int(time.time() * 1000)}
        pipe.hset(keys.meta(sk), mapping={**done, "outcome": outcome_code(record.get("body"))})
        pipe.zrem(keys.ACTIVE, sk)
        pipe.smembers(keys.watchers(sk))
        _, wrote, _, _, batches = pipe.execute()
        watchers = [b.decode() for b in batches]
        if notify_later is not None:
            notify_later.extend(watchers)
        else:
            self.notify(sk, watchers)
        return bool(wrote)

    @translated
    def watcher_batches(self, sk: str) -> list[str]:
        return [b.decode() for b in self.client.smembers(keys.watchers(sk))]

    @translated
    def notify(self, sk: str, batches: Iterable[str]) -> None:
        pipe = self.client.pipeline(transaction=False)
        self.add_notify(pipe, sk, batches)
        pipe.execute()

    def add_notify(self, client: Any, sk: str, batches: Iterable[str]) -> None:
        """Tell `batches` that session `sk` finished, by `client` (this store, or a pipeline)."""
        for batch in batches:
            client.rpush(keys.done_list(batch), sk)
            client.expire(keys.done_list(batch), self.ttl_s)
