"""What a step needs from the outside world, as Protocols. The edges (Redis, Celery, HTTP,
wasmtime) implement them; `worker.session.twins` implements them in memory, so the steps run
and are tested with no Redis and no workers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeVar

from schemas.fleet import ToolDefaults
from schemas.keys import ChunkMember
from schemas.limits import Limits
from schemas.mcp import McpToolInfo
from schemas.partial import PartialRound
from schemas.spec_types import McpToolRef, ProgramSpec, SessionSpec, Spec, ToolSpec
from worker.codecs.protocol import ChatRequest, Delta
from worker.codecs.rate_headers import RateSignal
from worker.codecs.reply import Reply
from worker.config import BackendConfig
from worker.errors import InternalError
from worker.session.engine import ToolRun
from worker.session.outcomes import ToolOutcome
from worker.session.round_record import StoredRound
from worker.session.spans import SpanValue
from worker.session.state import Session
from worker.session.tool_logs import ToolLogs
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


@dataclass(frozen=True)
class Permit:
    """Room for one model call under a backend's rate limit."""

    backend: str
    member: str


class CallWatcher(Protocol):
    """Watches a running tool call: hears its `cchatq_progress` reports and is asked, at each
    report and while the tool sleeps, whether it may go on (raises a ToolError to stop it)."""

    def progress(self, percent: int, message: str) -> None: ...
    def check(self) -> None: ...


@dataclass(frozen=True)
class ToolCall:
    """One tool call as the tool runtime runs it: what to run and its bounds."""

    module_sha256: str
    export: str | None  # by export name ...
    table_index: int | None  # ... or by index into the function table
    fork_sha256: str | None  # a program's tool: run in the fork (snapshot) with this sha256
    arguments: bytes  # canonical JSON, already validated
    # by default, a session's limits when nothing sets them (schemas.limits)
    timeout_ms: int = ToolDefaults.timeout_ms
    memory_bytes: int = Limits.tool_memory_bytes
    max_output_bytes: int = Limits.max_tool_output_bytes
    attempt: int = 0  # 0 on the first try, then the retry number (the tool can ask for it)
    # a background call's watcher: hears its progress, and may stop it (cancel)
    watcher: CallWatcher | None = field(default=None, compare=False)
    # where the tool's `log` lines and stdout/stderr go, as it writes them (all its attempts)
    logs: ToolLogs | None = field(default=None, compare=False)
    mcp: McpToolRef | None = None  # an MCP server's tool: called there, not in WASM


class SessionStore(Protocol):
    """Session state: specs, stored outputs (first writer wins), step guards, results."""

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

    def unstarted_calls(self, sk: str, round_no: int, calls: int) -> tuple[list[int], int]:
        """Of a round's first `calls` calls, under max_parallel: those waiting for room (no
        outcome, never queued, no step leased), and how many hold a place (queued or
        running, no outcome yet)."""
        ...

    def queue_calls(self, sk: str, round_no: int, indexes: list[int], claim: bool) -> list[int]:
        """Mark calls queued; with `claim`, only those no one marked before (returned)."""
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
    def lease_left_ms(self, step: str) -> int: ...
    def end_step(self, step: str) -> None: ...
    def release_lease(self, step: str) -> None: ...
    def is_cancelled(self, sk: str) -> bool: ...
    def failure(self, sk: str) -> dict[str, Any] | None: ...
    def ending_inputs(self, sk: str) -> EndingInputs:
        """What an ending reads, in one round trip."""
        ...

    def dead_letter(self, step: str, sk: str, body: dict[str, Any], reason: str) -> None: ...
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

    def watcher_batches(self, sk: str) -> list[str]: ...
    def notify(self, sk: str, batches: Iterable[str]) -> None: ...
    def chunk_members(self, batch: str, chunk_no: int) -> list[ChunkMember]: ...


SpecT = TypeVar("SpecT", SessionSpec, ProgramSpec)


def spec_of(store: SessionStore, sk: str, kind: type[SpecT]) -> SpecT:
    """A session's spec, of the kind its step expects (a chat or a program run)."""
    spec = store.load_spec(sk)
    if not isinstance(spec, kind):
        raise InternalError(f"session {sk} is not a {kind.__name__}")
    return spec


@dataclass(frozen=True)
class TraceWrite:
    """Trace events of one session, to append to its stream and the fleet's; `expire`: the
    first or last write of a session, which makes its stream with its TTL (others only add)."""

    sk: str
    events: tuple[TraceEvent, ...]
    expire: bool = False


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


@dataclass(frozen=True)
class NextStep:
    """A step to publish: its kind (`round`, `tool`, `finish`, `program`) and its ids, and
    the spec id of its session when known: shown with its task (Flower's search finds a
    session by it), never one of its arguments."""

    kind: str
    args: tuple[str | int, ...]
    shown_id: str = ""


class Dispatcher(Protocol):
    """Publishes the next step of a session (at least once; steps absorb duplicates)."""

    def round(self, sk: str, round_no: int) -> None: ...
    def tool(self, sk: str, round_no: int, index: int) -> None: ...
    def background(self, sk: str, round_no: int, index: int) -> None: ...
    def finish(self, sk: str) -> None: ...
    def program(self, sk: str) -> None: ...

    # True: `publish` writes a commit with the steps, in the same write (the dispatcher
    # shares the store's Redis); False: the caller writes commits through the store
    writes_commits: bool

    def publish(self, steps: Sequence[NextStep], commit: Commit | None = None) -> None:
        """Publish `steps` in order; with `commit` (only where `writes_commits`), what the
        step writes as it ends, in the same write: its tool outcomes before the steps, then
        its notifications, its published marker and its trace."""
        ...


class StepPublisher:
    """A Dispatcher's ways to publish one step, each the `publish` of one NextStep: the shape
    the broker's dispatcher, the Outbox and the twin's queue share."""

    writes_commits = False

    def publish(self, steps: Sequence[NextStep], commit: Commit | None = None) -> None:
        raise NotImplementedError

    def round(self, sk: str, round_no: int) -> None:
        self.publish([NextStep("round", (sk, round_no))])

    def tool(self, sk: str, round_no: int, index: int) -> None:
        self.publish([NextStep("tool", (sk, round_no, index))])

    def background(self, sk: str, round_no: int, index: int) -> None:
        """A background tool's call, handed over by its tool step to the background queue."""
        self.publish([NextStep("background", (sk, round_no, index))])

    def finish(self, sk: str) -> None:
        self.publish([NextStep("finish", (sk,))])

    def program(self, sk: str) -> None:
        self.publish([NextStep("program", (sk,))])


class Outbox(StepPublisher):
    """A Dispatcher that keeps what one step publishes, so that the step can send it all
    with its published marker (`Dispatcher.publish`)."""

    def __init__(self, step: str = "") -> None:
        self.step = step  # the step whose outbox this is: the ender of a session it ends
        self.steps: list[NextStep] = []
        self.events: list[TraceEvent] = []  # written with the step's published marker
        self.spec_ids: dict[str, str] = {}  # sk -> spec id, shown with the steps it publishes
        self.outcome: str | None = None  # the code a session this step ended ended with
        # tool outcomes stored with the step's commit, before the steps it publishes
        self.outcomes: dict[tuple[int, int], ToolOutcome] = {}
        self.notify: list[str] = []  # batches told the session finished, with the commit

    def shown(self) -> list[NextStep]:
        """The steps, each with its session's spec id where this step knows it."""
        return [
            replace(s, shown_id=self.spec_ids.get(str(s.args[0]), s.shown_id)) for s in self.steps
        ]

    def publish(self, steps: Sequence[NextStep], commit: Commit | None = None) -> None:
        self.steps.extend(steps)


class SpanSink(Protocol):
    """Where a session's spans go (OpenTelemetry, worker.edges.otel_spans) as its steps commit
    their trace events; `on` False: nowhere, and no span is built."""

    on: bool

    def export(self, spans: Sequence[SpanValue]) -> None:
        """Hand finished spans over (batched and sent in the background; never raises)."""
        ...

    def flush(self) -> None:
        """Send what is held: the worker is stopping."""
        ...


class NoSpans:
    """The SpanSink of a worker whose spans are off."""

    on = False

    def export(self, spans: Sequence[SpanValue]) -> None:
        return None

    def flush(self) -> None:
        return None


class RateLimiter(Protocol):
    def acquire(self, backend: BackendConfig, estimated_tokens: int) -> Permit | float:
        """A permit, or the seconds to wait before there may be room."""
        ...

    def settle(self, permit: Permit, used_tokens: int) -> None: ...


class Completion(Protocol):
    @property
    def completion(self) -> dict[str, Any]: ...

    @property
    def rate(self) -> RateSignal | None:
        """What the answering response said of the account's rate limits (None: nothing)."""
        ...


class CompletionProvider(Protocol):
    """One model call: a canonical chat.completion, or a raised ProviderError."""

    def complete(
        self, request: ChatRequest, on_delta: Callable[[Delta], None] | None = None
    ) -> Completion: ...


class ToolRuntime(Protocol):
    """Runs one tool call: its output text, or a raised ToolError / GuestError."""

    def run(self, call: ToolCall) -> str: ...


class McpClient(Protocol):
    """MCP servers (the configuration's `mcp_servers`): lists a server's tools (a raised
    McpError when it cannot), and runs a call of one (a ToolRuntime for calls with `mcp`)."""

    def list_tools(self, server: str, budget_ms: int | None = None) -> tuple[McpToolInfo, ...]:
        """Its tools, within the server's timeout (and `budget_ms`, when less)."""
        ...

    def run(self, call: ToolCall) -> str: ...
