"""The SessionLifecycle, BatchLinks and FleetUpkeep ports in memory, parts of MemoryStore: a
session's end written once, the batches told, dead letters, and the reconciler's turn and its
index of unfinished sessions by last progress (the Redis store's `cq:active`)."""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from schemas.bodies import dump_body, outcome_code
from schemas.keys import ChunkMember
from worker.session.store_ports import EndingInputs


class TwinLifecycle:
    # MemoryStore's fields
    meta_of: dict[str, dict[str, str]]
    failures: dict[str, bytes]
    cancelled: set[str]
    responses: dict[str, bytes]
    records: dict[str, bytes]
    watchers: dict[str, set[str]]
    progress_ms: dict[str, int]
    clock: Callable[[], int]
    _cond: threading.Condition

    def notify(self, sk: str, batches: Iterable[str], outcome: str = "") -> None:
        raise NotImplementedError  # TwinBatches', before this in MemoryStore's bases

    def failure(self, sk: str) -> dict[str, Any] | None:
        raw = self.failures.get(sk)
        return None if raw is None else dict(json.loads(raw))

    def ending_inputs(self, sk: str) -> EndingInputs:
        submitted = self.meta_of.get(sk, {}).get("submitted_ms", "0")
        ended = (self.failure(sk), sk in self.cancelled)
        return EndingInputs(*ended, int(submitted or 0), self.clock())

    def meta(self, sk: str) -> dict[str, str]:
        return dict(self.meta_of.get(sk, {}))

    def now_ms(self) -> int:
        return self.clock()

    def has_result(self, sk: str) -> bool:
        return sk in self.responses

    def write_result(
        self,
        sk: str,
        body: bytes,
        record: dict[str, Any],
        notify_later: list[str] | None = None,
        ender: str = "",
    ) -> str | None:
        with self._cond:
            meta = self.meta_of.setdefault(sk, {})
            if sk in self.responses:
                if not ender or meta.get("ended_by") != ender:
                    return None
            else:
                self.responses[sk] = bytes(body)
                self.records.setdefault(sk, dump_body(record))
                outcome = outcome_code(record.get("body"))
                meta.update(state="done", finished_ms=str(self.clock()))
                meta.update(outcome=outcome, ended_by=ender)
                self.progress_ms.pop(sk, None)  # ended: nothing for the reconciler
            batches = list(self.watchers.get(sk, ()))
        if notify_later is not None:
            notify_later.extend(batches)
        else:
            self.notify(sk, batches)
        return meta["outcome"]


class TwinBatches:
    # MemoryStore's fields
    watchers: dict[str, set[str]]
    done: dict[str, deque[str]]
    chunks: dict[tuple[str, int], list[ChunkMember]]
    _cond: threading.Condition

    def watcher_batches(self, sk: str) -> list[str]:
        return sorted(self.watchers.get(sk, ()))

    def notify(self, sk: str, batches: Iterable[str], outcome: str = "") -> None:
        with self._cond:
            for batch in batches:
                self.done.setdefault(batch, deque()).append(sk)
            self._cond.notify_all()

    def chunk_members(self, batch: str, chunk_no: int) -> list[ChunkMember]:
        return list(self.chunks.get((batch, chunk_no), []))


class TwinUpkeep:
    # MemoryStore's fields
    meta_of: dict[str, dict[str, str]]
    failures: dict[str, bytes]
    deadletters: list[tuple[str, str]]
    progress_ms: dict[str, int]
    clock: Callable[[], int]
    _cond: threading.Condition
    _turn_until_s: float = 0.0  # the reconciler's turn, held until (monotonic)

    def dead_letter(self, step: str, sk: str, body: dict[str, Any], reason: str) -> None:
        with self._cond:
            self.failures.setdefault(sk, dump_body(body))
            self.deadletters.append((step, reason[:500]))

    def take_reconciler_turn(self, hold_ms: int) -> bool:
        with self._cond:
            now = time.monotonic()
            if now < self._turn_until_s:
                return False
            self._turn_until_s = now + hold_ms / 1000
            return True

    def stalled(self, quiet_ms: int, most: int) -> list[str]:
        with self._cond:
            now = self.clock()
            quiet = sorted((ms, sk) for sk, ms in self.progress_ms.items() if ms <= now - quiet_ms)
            found = [sk for _, sk in quiet[:most]]
            self.progress_ms.update(dict.fromkeys(found, now))
            return found

    def forget_session(self, sk: str) -> None:
        with self._cond:
            self.progress_ms.pop(sk, None)

    def submitted_ms(self, sks: list[str]) -> list[int | None]:
        found = [self.meta_of.get(sk, {}).get("submitted_ms") for sk in sks]
        return [None if ms is None else int(ms) for ms in found]

    def trim_results(self, keep: int) -> int:
        """The twin keeps every result (it retires nothing)."""
        return 0
