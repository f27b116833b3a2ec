"""The store's ports in memory: `MemoryStore` keeps the Redis store's rules (first writer wins,
leases, published markers, try counters, the fan-in count, one end a session), a module a role:
StepData here, StepGuards in `store_guards`, SessionLifecycle, BatchLinks and FleetUpkeep in
`store_endings`; `tests/store_contract/` runs one contract a role over both. Keys never expire
here. It also serves the guest's ProgramStore port (`programs`, `streams`), so program runs use
the same twin."""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from schemas import keys
from schemas.bodies import dump_body
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
    NextStep,
    ToolInputs,
    TraceWrite,
)
from worker.session.trace import TraceEvent
from worker.session.twins.programs import ProgramTwin
from worker.session.twins.store_endings import TwinBatches, TwinLifecycle, TwinUpkeep
from worker.session.twins.store_guards import TwinGuards


@dataclass
class MemoryStore(TwinBatches, TwinLifecycle, TwinGuards, TwinUpkeep, ProgramTwin):
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
    # unfinished sessions by their last sign of progress (ms): the reconciler's index
    progress_ms: dict[str, int] = field(default_factory=dict)
    # the steps a published marker lists: none here (the twin queue publishes with its
    # commit), as a test leaves them for a worker that died before its messages
    unsent: dict[str, tuple[NextStep, ...]] = field(default_factory=dict)
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
            self.progress_ms[sk] = self.clock()
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

    # StepData --------------------------------------------------------------------------

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

    def is_cancelled(self, sk: str) -> bool:
        return sk in self.cancelled
