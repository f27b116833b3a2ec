"""What a program run needs from the outside world besides the session ports: its chats'
state, its fd mirror, its memory snapshots and its user streams.
`edges.store_programs.RedisProgramStore` implements it on Redis,
`worker.session.twins.store.MemoryStore` in memory."""

from __future__ import annotations

from typing import Any, Protocol

from schemas.spec_types import SessionSpec
from schemas.user_stream import StreamEvent


class ProgramStore(Protocol):
    def submit_chat(self, sk: str, spec: SessionSpec, batch: str) -> bool:
        """Store a chat's spec, watched from the run's batch; False if it already exists."""
        ...

    def ready(self, sks: list[str]) -> list[bool]: ...
    def response_and_record(self, sk: str) -> tuple[bytes | None, dict[str, Any] | None]: ...
    def wait_done(self, batch: str, timeout_s: float) -> list[str]:
        """Block until a chat of the batch finishes, or the run's user sends (an entry
        keys.USER_WAKE), or the timeout: what was announced."""
        ...

    def is_cancelled(self, sk: str) -> bool: ...
    def put_fork(self, blob: bytes) -> str: ...
    def fork_blob(self, sha: str) -> bytes: ...
    def save_fd(self, run_sk: str, fd: int, entry: dict[str, Any]) -> None: ...

    def user_events(self, run_sk: str, after: str) -> list[tuple[str, StreamEvent | None]]:
        """What the run's user sent after entry `after` ("0-0": from the start), oldest
        first, as (entry id, event); at most a batch of them per call. None: an entry this
        version does not know (skipped)."""
        ...

    def emit_user_event(self, run_sk: str, seq: int, event: StreamEvent) -> bool:
        """The run's `seq`-th event to its user (seq from 1); False if it is there already
        (a replayed run writing again what it wrote before)."""
        ...
