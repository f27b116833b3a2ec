"""The guest's ProgramStore port in memory, a part of MemoryStore: a program's chats are sessions
of the same twin store, its forks and fd table kept beside them, its user streams from
UserStreamTwin."""

from __future__ import annotations

import hashlib
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from schemas.bodies import dump_body
from schemas.spec_types import SessionSpec, Spec
from worker.errors import StoreError
from worker.session.twins.streams import UserStreamTwin


class ProgramTwin(UserStreamTwin):
    # MemoryStore's fields
    responses: dict[str, bytes]
    done: dict[str, deque[str]]
    forks: dict[str, bytes]
    fd_mirror: dict[str, dict[int, bytes]]
    pump: Callable[[], None] | None
    _cond: threading.Condition

    def submit(self, sk: str, spec: Spec, batch: str = "") -> bool:
        raise NotImplementedError  # MemoryStore's

    def record(self, sk: str) -> dict[str, Any] | None:
        raise NotImplementedError  # MemoryStore's

    def submit_chat(self, sk: str, spec: SessionSpec, batch: str) -> bool:
        return self.submit(sk, spec, batch)

    def ready(self, sks: list[str]) -> list[bool]:
        return [sk in self.responses for sk in sks]

    def response_and_record(self, sk: str) -> tuple[bytes | None, dict[str, Any] | None]:
        return self.responses.get(sk), self.record(sk)

    def wait_done(self, batch: str, timeout_s: float) -> list[str]:
        if self.pump is not None and not self.done.get(batch):
            self.pump()
        with self._cond:
            queue = self.done.setdefault(batch, deque())
            if not queue:
                self._cond.wait(timeout=max(timeout_s, 0.0) if self.pump is None else 0)
            out = list(queue)
            queue.clear()
            return out

    def put_fork(self, blob: bytes) -> str:
        sha = hashlib.sha256(blob).hexdigest()
        self.forks.setdefault(sha, bytes(blob))
        return sha

    def fork_blob(self, sha: str) -> bytes:
        blob = self.forks.get(sha)
        if blob is None:
            raise StoreError(f"fork {sha[:12]} not stored (expired)")
        return blob

    def save_fd(self, run_sk: str, fd: int, entry: dict[str, Any]) -> None:
        self.fd_mirror.setdefault(run_sk, {})[fd] = dump_body(entry)
