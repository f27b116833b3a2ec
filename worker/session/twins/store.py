"""The SessionStore port in memory: `MemoryStore` keeps the Redis store's rules (first writer
wins, leases, published markers, try counters, the fan-in count); `tests/test_store_contract.py`
runs one contract over both. Keys never expire here. It also serves the guest's ProgramStore
port (`programs`, `streams`), so program runs use the same twin."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from typing import Any

from schemas import keys
from schemas.bodies import dump_body, outcome_code
from schemas.keys import ChunkMember
from schemas.partial import PartialRound
from schemas.spec_types import (
    SessionSpec,
    Spec,
    ToolSpec,
    spec_from_json,
    spec_to_json,
    tool_from_json,
    tool_to_json,
    with_builtins,
    with_mcp_tools,
)
from worker.codecs.reply import Reply
from worker.errors import SpecMissingError, StoreError
from worker.session.engine import ToolRun
from worker.session.outcomes import ToolOutcome
from worker.session.round_record import decode_round, encode_round
from worker.session.state import Round, Session
from worker.session.store_ports import (
    EndingInputs,
    RoundReads,
    StepStart,
    ToolInputs,
    ToolReads,
    TraceWrite,
)
from worker.session.trace import TraceEvent
from worker.session.twins.programs import ProgramTwin


@dataclass
class MemoryStore(ProgramTwin):
    """SessionStore (and the guest's ProgramStore: ProgramTwin and its user streams) in
    memory."""

    specs: dict[str, dict[str, Any]] = field(default_factory=dict)  # the stored JSON form
    meta_of: dict[str, dict[str, str]] = field(default_factory=dict)
    replies: dict[tuple[str, int], bytes] = field(default_factory=dict)
    outcomes: dict[tuple[str, int, int], bytes] = field(default_factory=dict)
    queued: set[tuple[str, int, int]] = field(default_factory=set)  # calls under max_parallel
    traces: dict[str, list[TraceEvent]] = field(default_factory=dict)
    tasks: dict[tuple[str, str], dict[str, str]] = field(default_factory=dict)
    leases: dict[str, float] = field(default_factory=dict)  # step -> monotonic expiry
    published: set[str] = field(default_factory=set)
    tries: dict[str, int] = field(default_factory=dict)
    failures: dict[str, bytes] = field(default_factory=dict)
    cancelled: set[str] = field(default_factory=set)
    responses: dict[str, bytes] = field(default_factory=dict)
    records: dict[str, bytes] = field(default_factory=dict)
    watchers: dict[str, set[str]] = field(default_factory=dict)
    done: dict[str, deque[str]] = field(default_factory=dict)
    chunks: dict[tuple[str, int], list[ChunkMember]] = field(default_factory=dict)
    partials: dict[str, PartialRound] = field(default_factory=dict)
    deadletters: list[tuple[str, str]] = field(default_factory=list)
    forks: dict[str, bytes] = field(default_factory=dict)
    fd_mirror: dict[str, dict[int, bytes]] = field(default_factory=dict)
    mcp_listed: dict[str, bytes] = field(default_factory=dict)  # sk -> its MCP tools' JSON
    # the store's clock (ms): Redis's TIME in the Redis store, which every process stamps by
    clock: Callable[[], int] = field(default=lambda: time.time_ns() // 1_000_000)
    # Called by a blocking wait that finds nothing (a program waiting on its chats): runs the
    # queued steps in the same thread, so one-threaded tests need no workers.
    pump: Callable[[], None] | None = None
    _cond: threading.Condition = field(default_factory=threading.Condition)

    # seeding (what a producer does) --------------------------------------------------------

    def submit(self, sk: str, spec: Spec, batch: str = "") -> bool:
        with self._cond:
            if sk in self.specs:
                return False
            self.specs[sk] = json.loads(dump_body(spec_to_json(spec)))
            self.meta_of.setdefault(sk, {})["submitted_ms"] = str(self.clock())
            self.meta_of[sk].update(id=spec.id, batch=batch)
            if batch:
                self.watchers.setdefault(sk, set()).add(batch)
            return True

    def cancel(self, sk: str) -> None:
        with self._cond:
            self.cancelled.add(sk)

    def result(self, sk: str) -> dict[str, Any] | None:
        raw = self.responses.get(sk)
        return None if raw is None else dict(json.loads(raw))

    def record(self, sk: str) -> dict[str, Any] | None:
        raw = self.records.get(sk)
        return None if raw is None else dict(json.loads(raw))

    # SessionStore --------------------------------------------------------------------------

    def load_spec(self, sk: str) -> Spec:
        raw = self.specs.get(sk)
        if raw is None:
            raise SpecMissingError(f"session {sk}: spec not found (expired or never submitted)")
        spec = with_builtins(spec_from_json(raw))
        listed = self.mcp_listed.get(sk)
        if isinstance(spec, SessionSpec) and spec.mcp_servers and listed is not None:
            spec = with_mcp_tools(spec, tuple(tool_from_json(t) for t in json.loads(listed)))
        return spec

    def batch_of(self, sk: str) -> str:
        return self.meta_of.get(sk, {}).get("batch", "")

    def store_mcp_tools(self, sk: str, tools: tuple[ToolSpec, ...]) -> None:
        with self._cond:
            self.mcp_listed.setdefault(sk, dump_body([tool_to_json(t) for t in tools]))

    def load_session(self, sk: str, backend: str, upto_round: int | None = None) -> Session:
        spec = self.load_spec(sk)
        if not isinstance(spec, SessionSpec):
            raise StoreError(f"session {sk} is a program run, not a chat")
        last = spec.limits.max_iterations - 1 if upto_round is None else upto_round
        rounds: list[Round] = []
        with self._cond:
            for r in range(last + 1):
                raw = self.replies.get((sk, r))
                if raw is None:
                    break
                reply = Reply.parse(decode_round(raw).completion)
                outcomes = {
                    i: ToolOutcome.from_json(json.loads(self.outcomes[(sk, r, i)]))
                    for i in range(reply.call_count)
                    if (sk, r, i) in self.outcomes
                }
                rounds.append(Round(reply=reply, outcomes=outcomes))
        return Session(spec=spec, backend=spec.provider or backend, rounds=tuple(rounds))

    def tool_inputs(self, sk: str, round_no: int, index: int) -> ToolInputs:
        stored = self.replies.get((sk, round_no))
        outcome = self.outcomes.get((sk, round_no, index))
        return (
            None if stored is None else decode_round(stored),
            None if outcome is None else ToolOutcome.from_json(json.loads(outcome)),
        )

    def store_round(self, sk: str, round_no: int, reply: Reply, runs: Sequence[ToolRun]) -> Reply:
        with self._cond:
            earlier = self.replies.get((sk, round_no))
            if earlier is None:
                self.replies[(sk, round_no)] = encode_round(reply, runs)
                return reply
        return Reply.parse(decode_round(earlier).completion)

    def store_tool_outcomes(
        self, sk: str, round_no: int, outcomes: dict[int, ToolOutcome], calls: int
    ) -> int:
        with self._cond:
            for index, outcome in outcomes.items():
                self.outcomes.setdefault((sk, round_no, index), dump_body(outcome.to_json()))
            return sum((sk, round_no, i) in self.outcomes for i in range(calls))

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
            cancelled = bool(sk) and sk in self.cancelled
            ended = bool(sk) and sk in self.responses
        start = StepStart(published, leased, self.tries[step], cancelled, ended=ended)
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

    def task_state(self, sk: str, task_id: str) -> dict[str, str] | None:
        with self._cond:
            state = self.tasks.get((sk, task_id))
            return dict(state) if state else None

    def update_task(self, sk: str, task_id: str, fields: dict[str, str]) -> None:
        with self._cond:
            self.tasks.setdefault((sk, task_id), {}).update(fields)

    def trace(self, write: TraceWrite) -> None:
        with self._cond:
            meta = self.meta_of.get(write.sk, {})
            lost_ending = bool(write.ended_by) and (
                meta.get("ended_by") != write.ended_by or "finished_said" in meta
            )
            if write.ended_by and not lost_ending:
                meta["finished_said"] = "1"
            for made in write.events:  # a fleet event (no session): the fleet's, under ""
                stream = write.sk if made.session else ""
                if lost_ending and stream and made.event == "session.finished":
                    continue  # as on Redis: said by whoever writes the ending again
                if stream and stream not in self.traces and not write.expire:
                    continue  # as on Redis: only a write that sets its TTL makes the stream
                self.traces.setdefault(stream, []).append(made)

    def set_partial(self, sk: str, partial: PartialRound | None) -> None:
        with self._cond:
            if partial is None:
                self.partials.pop(sk, None)
            else:
                self.partials[sk] = partial

    def lease_left_ms(self, step: str) -> int:
        return max(int((self.leases.get(step, 0.0) - time.monotonic()) * 1000), 0)

    def unstarted_calls(self, sk: str, round_no: int, calls: int) -> tuple[list[int], int]:
        with self._cond:
            unanswered = [i for i in range(calls) if (sk, round_no, i) not in self.outcomes]
        steps = {keys.tool_step(sk, round_no, i): i for i in unanswered}
        active = self.active_steps(list(steps))
        waiting = [
            i for s, i in steps.items() if s not in active and (sk, round_no, i) not in self.queued
        ]
        return waiting, len(unanswered) - len(waiting)

    def queue_calls(self, sk: str, round_no: int, indexes: list[int], claim: bool) -> list[int]:
        with self._cond:
            won = [i for i in indexes if not claim or (sk, round_no, i) not in self.queued]
            self.queued.update((sk, round_no, i) for i in won)
            return won

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

    def is_cancelled(self, sk: str) -> bool:
        return sk in self.cancelled

    def failure(self, sk: str) -> dict[str, Any] | None:
        raw = self.failures.get(sk)
        return None if raw is None else dict(json.loads(raw))

    def ending_inputs(self, sk: str) -> EndingInputs:
        submitted = self.meta_of.get(sk, {}).get("submitted_ms", "0")
        ended = (self.failure(sk), self.is_cancelled(sk))
        return EndingInputs(*ended, int(submitted or 0), self.clock())

    def dead_letter(self, step: str, sk: str, body: dict[str, Any], reason: str) -> None:
        with self._cond:
            self.failures.setdefault(sk, dump_body(body))
            self.deadletters.append((step, reason[:500]))

    def meta(self, sk: str) -> dict[str, str]:
        return dict(self.meta_of.get(sk, {}))

    def trim_results(self, keep: int) -> int:
        """The twin keeps every result (it retires nothing)."""
        return 0

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
            batches = list(self.watchers.get(sk, ()))
        if notify_later is not None:
            notify_later.extend(batches)
        else:
            self.notify(sk, batches)
        return meta["outcome"]

    def watcher_batches(self, sk: str) -> list[str]:
        return sorted(self.watchers.get(sk, ()))

    def notify(self, sk: str, batches: Iterable[str], outcome: str = "") -> None:
        with self._cond:
            for batch in batches:
                self.done.setdefault(batch, deque()).append(sk)
            self._cond.notify_all()

    def chunk_members(self, batch: str, chunk_no: int) -> list[ChunkMember]:
        return list(self.chunks.get((batch, chunk_no), []))
