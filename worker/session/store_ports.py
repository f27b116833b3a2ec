"""The store's ports, one a role, with the typed values they take and return: a step's data
(StepData), its guards (StepGuards), a session's end (SessionLifecycle), the batches it is in
(BatchLinks) and the fleet's upkeep (FleetUpkeep: DeadLetters, Reconciling); their key families
and slot rules differ (docs/architecture.md section 5). SessionStore is all of them. The Redis
store (worker.edges.store) implements each, `worker.session.twins` in memory, and
`tests/store_contract/` holds both to one contract a role.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from schemas.keys import ChunkMember
from schemas.partial import PartialRound
from schemas.spec_types import ProgramSpec, SessionSpec, Spec, ToolSpec
from worker.codecs.reply import Reply
from worker.errors import InternalError
from worker.session.engine import ToolRun
from worker.session.outcomes import ToolOutcome
from worker.session.round_record import StoredRound
from worker.session.state import Session
from worker.session.trace import TraceEvent

# A step's lease: a delivery holds it while it runs, and its worker renews it (SessionStore.hold)
# every third of it, so a worker that dies frees its step within this, whatever the step does.
STEP_LEASE_MS = 15_000


@dataclass(frozen=True)
class RoundReads:
    """What a round step reads: its session's rounds up to `round_no`."""

    round_no: int
    backend: str  # the session's backend when its spec names none


@dataclass(frozen=True)
class ToolReads:
    """What a tool step reads: its round as stored (its reply and planned runs) and its own
    stored outcome."""

    round_no: int
    index: int


ToolInputs = tuple[StoredRound | None, ToolOutcome | None]


@dataclass(frozen=True)
class NextStep:
    """A step to publish: its kind (`round`, `tool`, `finish`, `program`) and its ids, and
    the spec id of its session when known: shown with its task (Flower's search finds a
    session by it), never one of its arguments."""

    kind: str
    args: tuple[str | int, ...]
    shown_id: str = ""


@dataclass(frozen=True)
class StepStart:
    """What one delivery of a step learns before it works, with what it asked to read in the
    same round trip (speculatively: a delivery that does not hold the lease ignores it)."""

    published: bool  # its continuation was already sent: nothing to do
    leased: bool  # this delivery holds the lease
    tries: int  # deliveries so far, this one included
    cancelled: bool
    session: Session | None = None  # asked with RoundReads
    tool_inputs: ToolInputs | None = None  # asked with ToolReads
    lease: str = ""  # this delivery's lease token, when it holds the lease
    tries_stored: bool = True  # False: a first delivery, counted without a write
    ended: bool = False  # its session's response is written: it ended
    # published, with the broker apart: the steps it published, which a delivery that finds
    # it so sends again (its worker may have died between its commit and its messages)
    unsent: tuple[NextStep, ...] = ()


class StepData(Protocol):
    """A step's reads and writes of its own session's keys: the spec, stored rounds and tool
    outcomes (first writer wins), calls waiting under max_parallel, background tasks, the
    partial round, the trace. One slot: the session's hash tag."""

    def load_spec(self, sk: str) -> Spec: ...
    def batch_of(self, sk: str) -> str:
        """The batch a session was submitted in, as its stored spec says ("" when it says
        none); a program run's chats are in `keys.run_batch` of their run."""
        ...

    def load_session(self, sk: str, backend: str, upto_round: int | None = None) -> Session: ...
    def tool_inputs(self, sk: str, round_no: int, index: int) -> ToolInputs: ...
    def store_round(self, sk: str, round_no: int, reply: Reply, runs: Sequence[ToolRun]) -> Reply:
        """Store a round's reply with the runs its plan made, unless one is stored (first
        writer wins): the stored reply, `reply` itself when this call stored it."""
        ...

    def store_tool_outcomes(
        self, sk: str, round_no: int, outcomes: dict[int, ToolOutcome], calls: int
    ) -> int:
        """Store what is not stored yet; how many of the round's first `calls` calls have an
        outcome (0 when `calls` is 0)."""
        ...

    def unstarted_calls(self, sk: str, round_no: int, calls: int) -> tuple[list[int], int]:
        """Of a round's first `calls` calls, under max_parallel: those waiting for room (no
        outcome, never queued, no step leased), and how many hold a place (queued or
        running, no outcome yet)."""
        ...

    def queue_calls(self, sk: str, round_no: int, indexes: list[int], claim: bool) -> list[int]:
        """Mark calls queued; with `claim`, only those no one marked before (returned)."""
        ...

    def set_partial(self, sk: str, partial: PartialRound | None) -> None: ...
    def store_mcp_tools(self, sk: str, tools: tuple[ToolSpec, ...]) -> None:
        """Store the MCP tools a session offers, as its first round listed them (first writer
        wins); `load_spec` then returns the spec with them (spec_types.with_mcp_tools)."""
        ...

    def trace(self, write: TraceWrite) -> None: ...
    def task_state(self, sk: str, task_id: str) -> dict[str, str] | None:
        """An async background task's state (status, percent, message, outcome), if any."""
        ...

    def update_task(self, sk: str, task_id: str, fields: dict[str, str]) -> None: ...
    def is_cancelled(self, sk: str) -> bool: ...


class StepGuards(Protocol):
    """Each step's lease, published marker and try count (the step's slot: its session's)."""

    def begin_step(
        self,
        step: str,
        lease_ms: int,
        meta: dict[str, str | int] | None = None,
        sk: str = "",
        reads: RoundReads | ToolReads | None = None,
        first: bool | None = None,
    ) -> StepStart:
        """One delivery of `step` begins (`first`: the first delivery of its message, when
        the broker knows; None: not known)."""
        ...

    def defer_step(self, step: str, sk: str, stored: bool, wait_ms: int) -> None:
        """This delivery waits `wait_ms` for room under a rate limit: its lease released, its
        try uncounted, its session (`sk`, when a session's step) not taken for stalled."""
        ...

    def hold(self, step: str, token: str) -> AbstractContextManager[None]:
        """Keep this delivery's lease of `step` alive while the step runs."""
        ...

    def active_steps(self, steps: list[str]) -> set[str]:
        """Which of these steps are leased (a delivery works on them) or published."""
        ...

    def published_steps(self, steps: list[str]) -> set[str]:
        """Which of these steps are published (their continuation was sent)."""
        ...

    def leased_steps(self, steps: list[str]) -> dict[str, int]:
        """Which of these steps a delivery works on now (leased, not published), each with
        the ms its lease has left."""
        ...

    def lease_left_ms(self, step: str) -> int: ...
    def end_step(self, step: str) -> None: ...
    def release_lease(self, step: str) -> None: ...


class SessionLifecycle(Protocol):
    """A session's end: what the ending rules read, and its response fd, record and end in its
    meta, written once."""

    def failure(self, sk: str) -> dict[str, Any] | None: ...
    def ending_inputs(self, sk: str) -> EndingInputs:
        """What an ending reads, in one round trip."""
        ...

    def meta(self, sk: str) -> dict[str, str]: ...
    def now_ms(self) -> int:
        """Now on the clock submits are stamped on (Redis's, in the Redis store)."""
        ...

    def has_result(self, sk: str) -> bool: ...
    def write_result(
        self,
        sk: str,
        body: bytes,
        record: dict[str, Any],
        notify_later: list[str] | None = None,
        ender: str = "",
    ) -> str | None:
        """Write the response fd and the record once, with the session's end in its meta
        (state, outcome, `ended_by`: the step `ender`). When this call wrote them, or step
        `ender` had (its redelivery, whose commit may never have been written), the caller
        ends the session: it gets the outcome code of the ending written, and only it tells
        the batches waiting for the session, or adds them to `notify_later` for the caller to
        tell (with its step's commit). None when another step ended it."""
        ...


class BatchLinks(Protocol):
    """The batches a session is in (its batch's slot, not the session's): who waits for it,
    telling them it ended, and a batch's chunks of members."""

    def watcher_batches(self, sk: str) -> list[str]: ...
    def notify(self, sk: str, batches: Iterable[str], outcome: str = "") -> None:
        """Tell `batches` that session `sk` ended (as `outcome`): their done lists and ended
        indexes."""
        ...

    def chunk_members(self, batch: str, chunk_no: int) -> list[ChunkMember]: ...


class DeadLetters(Protocol):
    def dead_letter(self, step: str, sk: str, body: dict[str, Any], reason: str) -> None:
        """A step past its attempts: its session's failure (the first one kept) and the
        fleet's dead-letter list."""
        ...


class Reconciling(Protocol):
    """The reconciler's turn, its index of unfinished sessions by last progress, and the
    finished sessions kept by count."""

    def take_reconciler_turn(self, hold_ms: int) -> bool:
        """Whether this process reconciles now: one in the fleet at a time, for `hold_ms`."""
        ...

    def stalled(self, quiet_ms: int, most: int) -> list[str]:
        """Unfinished sessions with no sign of progress for `quiet_ms`, oldest first; each is
        marked as just seen, so the next turns look at others first."""
        ...

    def forget_session(self, sk: str) -> None:
        """Not to be watched any more (nothing left to recover)."""
        ...

    def submitted_ms(self, sks: list[str]) -> list[int | None]:
        """When each session was submitted (None: unknown)."""
        ...

    def now_ms(self) -> int:
        """Now on the clock marks and submits are stamped on (Redis's)."""
        ...

    def trim_results(self, keep: int) -> int:
        """The results of finished sessions beyond the latest `keep` deleted: how many."""
        ...


class FleetUpkeep(DeadLetters, Reconciling, Protocol):
    """Fleet-wide structures, each a slot of its own: dead letters and the reconciler's."""


class SessionWork(StepData, SessionLifecycle, Protocol):
    """A step's data with its session's end: what a tool step and the Applier use."""


class SessionStore(StepData, StepGuards, SessionLifecycle, BatchLinks, FleetUpkeep, Protocol):
    """The whole store a StepRunner works with: every role above."""


SpecT = TypeVar("SpecT", SessionSpec, ProgramSpec)


def spec_of(store: StepData, sk: str, kind: type[SpecT]) -> SpecT:
    """A session's spec, of the kind its step expects (a chat or a program run)."""
    spec = store.load_spec(sk)
    if not isinstance(spec, kind):
        raise InternalError(f"session {sk} is not a {kind.__name__}")
    return spec


@dataclass(frozen=True)
class TraceWrite:
    """Trace events of one session, to append to its stream and the fleet's; `expire`: the
    first or last write of a session, which makes its stream with its TTL (others only add).
    `ended_by`: the step whose events hold the session's session.finished, which its stream
    takes only while the stored ending is that step's (an ending a failover lost is written
    again, and said again, by whoever ends it next: never two)."""

    sk: str
    events: tuple[TraceEvent, ...]
    expire: bool = False
    ended_by: str = ""


@dataclass(frozen=True)
class PendingReply:
    """A round's reply, paid for and not yet stored: written with its step's commit, first
    writer wins (a commit that finds another delivery's reply writes nothing: ReplyTaken)."""

    round_no: int
    reply: Reply
    runs: tuple[ToolRun, ...] = ()


@dataclass(frozen=True)
class Commit:
    """What a step writes as it ends, with the steps it publishes: its published marker, its
    trace events, the tool outcomes it stores (first writer wins, by round and call) and the
    batches it tells that its session finished."""

    sk: str
    published: str | None = None
    trace: TraceWrite | None = None
    outcomes: Mapping[tuple[int, int], ToolOutcome] = field(default_factory=dict)
    notify: tuple[str, ...] = ()
    ended_as: str = ""  # the outcome code of the session it ended (the batches told keep it)
    reply: PendingReply | None = None  # its round's reply, when the commit stores it


@dataclass(frozen=True)
class EndingInputs:
    """What the ending rules read: the failure a dead-lettered step recorded, the cancel flag,
    and when the session was submitted, with now: both on the store's clock (Redis's), so a
    session's latency does not depend on the hosts' clocks of its producer and its last step."""

    failure: dict[str, Any] | None
    cancelled: bool
    submitted_ms: int
    now_ms: int

    @property
    def latency_ms(self) -> int:
        return self.now_ms - self.submitted_ms
