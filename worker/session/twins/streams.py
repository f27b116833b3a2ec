"""The user-stream part of the ProgramStore twin (MemoryStore inherits it): a run's
user events both ways, in memory, with the Redis store's rules (entry ids after a cursor; the
run's writes numbered, a replayed write refused), and the user's side a producer plays on Redis
(`producer/user_stream.py`), for tests."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from schemas import keys
from schemas.user_stream import StreamEvent

EVENTS_BATCH = 256


@dataclass
class UserStreamTwin:
    user_in: dict[str, list[StreamEvent]] = field(default_factory=dict)
    user_out: dict[str, dict[int, StreamEvent]] = field(default_factory=dict)

    def notify(self, sk: str, batches: Iterable[str]) -> None:
        raise NotImplementedError  # MemoryStore's: wakes the run's blocking waits

    # the user's side -----------------------------------------------------------------------

    def user_send(self, run_sk: str, event: StreamEvent) -> None:
        self.user_in.setdefault(run_sk, []).append(event)
        self.notify(keys.USER_WAKE, [keys.run_batch(run_sk)])

    def user_received(self, run_sk: str) -> list[StreamEvent]:
        out = self.user_out.get(run_sk, {})
        return [out[seq] for seq in sorted(out)]

    # the program's side (ProgramStore) -----------------------------------------------------

    def user_events(self, run_sk: str, after: str) -> list[tuple[str, StreamEvent | None]]:
        seen = int(after.partition("-")[0])
        events = self.user_in.get(run_sk, [])[seen : seen + EVENTS_BATCH]
        return [(f"{seen + n + 1}-0", event) for n, event in enumerate(events)]

    def emit_user_event(self, run_sk: str, seq: int, event: StreamEvent) -> bool:
        out = self.user_out.setdefault(run_sk, {})
        if seq <= max(out, default=0):
            return False
        out[seq] = event
        return True
