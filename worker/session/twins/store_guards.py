"""The StepGuards port in memory, a part of MemoryStore: each step's lease (a monotonic
expiry), published marker and try count, under the Redis store's rules (step_leases.py)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import replace

from worker.session.state import Session
from worker.session.store_ports import NextStep, RoundReads, StepStart, ToolInputs, ToolReads


class TwinGuards:
    # MemoryStore's fields
    meta_of: dict[str, dict[str, str]]
    leases: dict[str, float]  # step -> monotonic expiry
    published: set[str]
    tries: dict[str, int]
    cancelled: set[str]
    responses: dict[str, bytes]
    progress_ms: dict[str, int]
    unsent: dict[str, tuple[NextStep, ...]]  # what a published marker lists (broker apart)
    clock: Callable[[], int]
    _cond: threading.Condition

    def load_session(self, sk: str, backend: str, upto_round: int | None = None) -> Session:
        raise NotImplementedError  # MemoryStore's

    def tool_inputs(self, sk: str, round_no: int, index: int) -> ToolInputs:
        raise NotImplementedError  # MemoryStore's

    def begin_step(
        self,
        step: str,
        lease_ms: int,
        meta: dict[str, str | int] | None = None,
        sk: str = "",
        reads: RoundReads | ToolReads | None = None,
        first: bool | None = None,
    ) -> StepStart:
        with self._cond:  # every delivery's try is counted here, whatever `first` says
            now = time.monotonic()
            published = step in self.published
            leased = self.leases.get(step, 0.0) <= now
            if leased and not published:
                self.leases[step] = now + lease_ms / 1000
            if (leased and not published) or step not in self.tries:  # it runs the step
                self.tries[step] = self.tries.get(step, 0) + 1
            if sk and meta and sk in self.meta_of:  # a lost session's meta is not made again
                self.meta_of[sk].update({k: str(v) for k, v in meta.items()})
                if sk in self.progress_ms:  # a sign of progress for the reconciler
                    self.progress_ms[sk] = self.clock()
            cancelled = bool(sk) and sk in self.cancelled
            ended = bool(sk) and sk in self.responses
        unsent = self.unsent.get(step, ()) if published else ()
        start = StepStart(
            published, leased, self.tries[step], cancelled, ended=ended, unsent=unsent
        )
        if isinstance(reads, RoundReads):
            session = self.load_session(sk, reads.backend, upto_round=reads.round_no)
            return replace(start, session=session)
        if isinstance(reads, ToolReads):
            return replace(start, tool_inputs=self.tool_inputs(sk, reads.round_no, reads.index))
        return start

    def hold(self, step: str, token: str) -> AbstractContextManager[None]:
        return contextlib.nullcontext()  # twin leases last as long as begin_step asked

    def defer_step(self, step: str, sk: str, stored: bool, wait_ms: int) -> None:
        with self._cond:
            self.leases.pop(step, None)
            self.tries[step] = self.tries.get(step, 0) - 1
            if sk in self.progress_ms:  # not taken for stalled while it waits
                self.progress_ms[sk] = self.clock() + wait_ms

    def lease_left_ms(self, step: str) -> int:
        return max(int((self.leases.get(step, 0.0) - time.monotonic()) * 1000), 0)

    def active_steps(self, steps: list[str]) -> set[str]:
        with self._cond:
            now = time.monotonic()
            return {s for s in steps if s in self.published or self.leases.get(s, 0.0) > now}

    def published_steps(self, steps: list[str]) -> set[str]:
        with self._cond:
            return {s for s in steps if s in self.published}

    def leased_steps(self, steps: list[str]) -> dict[str, int]:
        with self._cond:
            now = time.monotonic()
            return {
                s: int((self.leases[s] - now) * 1000)
                for s in steps
                if s not in self.published and self.leases.get(s, 0.0) > now
            }

    def end_step(self, step: str) -> None:
        with self._cond:
            self.published.add(step)
            self.leases.pop(step, None)

    def release_lease(self, step: str) -> None:
        with self._cond:
            self.leases.pop(step, None)
