"""Redis operations of program runs: their chats, fd tables, memory snapshots and user streams.
Same rules as store.py: every key has a TTL; redis errors become StoreError."""

from __future__ import annotations

import hashlib
from typing import Any

import redis

from schemas import keys, redis_links
from schemas.bodies import dump_body
from schemas.session_record import read_record
from schemas.spec_types import SessionSpec, spec_to_json
from schemas.user_stream import StreamEvent
from worker.edges.step_leases import translated
from worker.edges.store import RedisStore
from worker.errors import StoreError

USER_EVENTS_BATCH = 256  # user events read at once


class RedisProgramStore:
    """The guest's ProgramStore port (worker.guest.ports) on Redis."""

    def __init__(self, store: RedisStore) -> None:
        self.store = store
        self.client = store.client
        self.ttl_s = store.ttl_s
        self._forks: dict[str, bytes] = {}

    @translated
    def submit_chat(self, sk: str, spec: SessionSpec, batch: str) -> bool:
        """Store a chat's spec, in the run's batch. False if it already exists
        (a redelivered program replaying its chats): then it is not started again. Its id
        names this chat (`cchatq status '<run id>#send<n>'`, found through its run's claim)."""
        now_ms = self.store.clock.now_ms()  # Redis's clock, as a producer's submit
        body = keys.with_submitted(dump_body(spec_to_json(spec)), now_ms, batch)
        pipe = self.store.on(sk).pipeline(transaction=True)
        pipe.set(keys.spec(sk), body, nx=True, ex=self.ttl_s)
        pipe.hsetnx(keys.meta(sk), "submitted_ms", now_ms)
        pipe.hset(keys.meta(sk), mapping={"id": spec.id, "batch": batch})
        pipe.expire(keys.meta(sk), self.ttl_s)  # its meta's batch is told when it ends
        return bool(pipe.execute()[0])

    @translated
    def ready(self, sks: list[str]) -> list[bool]:
        pipe = self.client.pipeline(transaction=False)
        for sk in sks:
            pipe.exists(keys.response(sk))
        return [bool(x) for x in pipe.execute()]

    @translated
    def response_and_record(self, sk: str) -> tuple[bytes | None, dict[str, Any] | None]:
        body, record = self.client.mget([keys.response(sk), keys.record(sk)])
        return (None if body is None else bytes(body)), (
            None if record is None else read_record(record).record  # a chat retires as it ends
        )

    @translated
    def wait_done(self, batch: str, timeout_s: float) -> list[str]:
        """Block until a chat of the batch finishes (or the timeout, capped below the socket
        timeout: the caller loops): the keys announced."""
        wait_s = redis_links.block_s(max(timeout_s, 0.01))
        item = self.client.blpop([keys.done_list(batch)], timeout=wait_s)
        if item is None:
            return []
        more = self.client.lpop(keys.done_list(batch), 1000) or []
        return [item[1].decode(), *(m.decode() for m in more)]

    def is_cancelled(self, sk: str) -> bool:
        return self.store.is_cancelled(sk)

    @translated
    def put_fork(self, blob: bytes) -> str:
        """Content-addressed, so unchanged memory between sends is stored once."""
        sha = hashlib.sha256(blob).hexdigest()
        self.client.set(keys.fork(sha), blob, nx=True, ex=self.ttl_s)
        self.client.expire(keys.fork(sha), self.ttl_s)
        return sha

    @translated
    def fork_blob(self, sha: str) -> bytes:
        """A snapshot; each tools process keeps the recent ones (a program's tool calls share
        one snapshot per send)."""
        blob = self._forks.get(sha)
        if blob is None:
            raw = self.client.get(keys.fork(sha))
            if raw is None:
                raise StoreError(f"fork {sha[:12]} not in Redis (expired)")
            if len(self._forks) >= 64:
                self._forks.pop(next(iter(self._forks)))
            blob = self._forks[sha] = bytes(raw)
        return blob

    @translated
    def save_fd(self, run_sk: str, fd: int, entry: dict[str, Any]) -> None:
        pipe = self.client.pipeline(transaction=False)
        pipe.hset(keys.fds(run_sk), str(fd), dump_body(entry))
        pipe.expire(keys.fds(run_sk), self.ttl_s)
        pipe.execute()

    @translated
    def user_events(self, run_sk: str, after: str) -> list[tuple[str, StreamEvent | None]]:
        read = self.client.xread({keys.user_in(run_sk): after}, count=USER_EVENTS_BATCH)
        entries = read[0][1] if read else []
        return [
            (entry_id.decode(), StreamEvent.from_fields(fields)) for entry_id, fields in entries
        ]

    @translated
    def emit_user_event(self, run_sk: str, seq: int, event: StreamEvent) -> bool:
        key = keys.user_out(run_sk)
        try:
            self.client.xadd(key, event.fields(), id=f"0-{seq}")
        except redis.ResponseError as exc:
            if "equal or smaller" not in str(exc):
                raise
            return False  # written by this run before its task was delivered again
        self.client.expire(key, self.ttl_s)
        return True
