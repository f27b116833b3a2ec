"""The viewer's read model: typed values built from records, trace events and batch members,
which the templates render and the JSON twins (`/api/...`) serialise. No I/O here."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from schemas.partial import PartialCall

# a session's status as the viewer shows it
QUEUED, RUNNING, OK, ERROR, GONE = "queued", "running", "ok", "error", "gone"
STATUSES = (OK, ERROR, RUNNING, QUEUED)  # what the batch page filters on
SORTS = ("latency", "tokens")  # the batch page's sorts, each largest first
PAGE_ROWS = 500  # sessions on one batch page
PROGRAM_ROWS = 20  # program runs listed under their batch on the runs page (its page has all)


def to_json(value: Any) -> dict[str, Any]:
    """A read-model value as its JSON twin shows it (dataclasses as objects, tuples as lists)."""
    out: dict[str, Any] = asdict(value)
    return out


@dataclass(frozen=True)
class RunRow:
    """One row of the runs page: a batch, or a program run of a batch (its chats counted)."""

    kind: str  # "batch" | "program"
    key: str  # the batch id, or the program run's spec id
    batch: str  # the batch (a program run's own batch)
    submitted_ms: int
    sessions: int  # a batch's sessions; a program run's chats
    queued: int
    running: int
    done: int
    gone: int  # runs expired (or lost with Redis's data)
    ok: int
    failures: dict[str, int]  # error code -> how many
    rate: float | None  # sessions (chats) finished per second
    eta_s: float | None  # None: no rate to tell yet
    elapsed_s: float
    finished: bool  # a batch: nothing queued or running; a program run: its record is in
    source: str = ""  # offline: the results file it was read from

    @property
    def failed(self) -> int:
        return sum(self.failures.values())

    @property
    def status(self) -> str:
        return "done" if self.finished else "running"

    def json(self) -> dict[str, Any]:
        return {**to_json(self), "failed": self.failed, "status": self.status}


@dataclass(frozen=True)
class SessionRow:
    """One session (or program run) of a batch page."""

    spec_id: str
    kind: str  # "session" | "program"
    status: str  # queued | running | ok | error | gone
    code: str | None = None  # the error code when it failed
    latency_ms: int | None = None
    tokens: int | None = None  # prompt + completion
    rounds: int | None = None  # model rounds (a program run: its chats)
    tools: tuple[str, ...] = ()  # the tools it called, each once, in first-call order
    tool_calls: int = 0
    tool_failures: int = 0
    attempt: int = 1
    state: str = ""  # while it runs: its meta's state ("round 2")
    preview: str = ""  # the start of its answer (or of its error message)


@dataclass(frozen=True)
class BatchQuery:
    """The batch page's filter and sort (its GET form: a filtered view has its own URL)."""

    status: str = ""
    code: str = ""
    tool: str = ""
    q: str = ""
    sort: str = ""
    page: int = 1

    def params(self, **changes: Any) -> dict[str, str]:
        """The non-empty query parameters of this query with `changes` (a next-page link)."""
        values = {**asdict(self), **changes}
        return {k: str(v) for k, v in values.items() if v and not (k == "page" and v == 1)}


@dataclass(frozen=True)
class BatchRows:
    """Every session of a batch, as a source reads them (the read model filters them)."""

    batch: str
    run: RunRow
    rows: tuple[SessionRow, ...]


@dataclass(frozen=True)
class BatchPage:
    batch: str
    run: RunRow
    outcomes: dict[str, int]  # ok and each error code: how many
    states: dict[str, int]  # queued, running, gone: how many
    codes: tuple[str, ...]  # every error code in the batch (the filter's choices)
    tools: tuple[str, ...]  # every tool called in the batch
    query: BatchQuery
    matched: int  # sessions the filter keeps
    rows: tuple[SessionRow, ...]  # this page of them
    pages: int

    @property
    def next_page(self) -> int | None:
        return self.query.page + 1 if self.query.page < self.pages else None

    @property
    def previous_page(self) -> int | None:
        return self.query.page - 1 if self.query.page > 1 else None

    def json(self) -> dict[str, Any]:
        out = to_json(self)
        out["run"] = self.run.json()
        out["next_page"], out["previous_page"] = self.next_page, self.previous_page
        return out


# one session --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolLog:
    """A line a tool call wrote (its `log` calls, stdout or stderr)."""

    level: str
    stream: str
    message: str


@dataclass(frozen=True)
class ToolCallView:
    """One tool call of an assistant turn, with the answer its tool message gave."""

    call_id: str
    name: str
    arguments: str  # pretty JSON (or the text as the model wrote it, when not JSON)
    answered: bool  # a tool message answers it
    ok: bool | None = None  # None: not answered, or a raw answer that does not say
    result: str | None = None  # the output (pretty JSON when it is JSON)
    error_code: str | None = None  # the tool error class when it failed
    error_message: str | None = None
    retries: int | None = None
    fallback: str | None = None  # the tool that answered instead
    latency_ms: int | None = None
    note: str = ""  # an excerpt or a summary: what the model read is not the whole output
    logs: tuple[ToolLog, ...] = ()


@dataclass(frozen=True)
class MessageView:
    """One message of the thread, in transcript order."""

    role: str  # system | user | assistant | tool (or what the transcript says)
    content: str  # its text (non-text parts as JSON)
    thinking: str | None = None  # an assistant's reasoning
    tool_calls: tuple[ToolCallView, ...] = ()
    tool_call_id: str | None = None  # a tool message: the call it answers
    tool_name: str | None = None


@dataclass(frozen=True)
class TimelineStep:
    """One step or wait of a session, from its trace events."""

    kind: str  # round | tool | finish | rate_wait | queue_wait
    label: str
    at_ms: int  # from the session's first event (or its submit)
    ms: int | None  # how long (None: not known)
    round: int | None = None
    call_id: str | None = None
    tool: str | None = None
    worker: str | None = None
    attempt: int | None = None  # a round: its delivery; a tool: its try (retries + 1)
    error: str | None = None
    detail: str = ""  # tokens, backend, model, the reason of a wait...
    offset_pct: float = 0.0  # where its bar starts, in % of the session's span
    width_pct: float = 0.0


@dataclass(frozen=True)
class ProgramLog:
    level: str
    origin: str  # "" for the program's own line, else the tool call that wrote it
    message: str


@dataclass(frozen=True)
class ChatLink:
    """A program run's chat (`<run id>#send<n>`), linked to its own session page."""

    spec_id: str
    status: str
    code: str | None = None
    preview: str = ""


@dataclass(frozen=True)
class Fork:
    """A tool call a program's chat ran in a forked instance of the program."""

    chat: str
    call_id: str
    tool: str
    status: str  # ok | error | running
    code: str | None = None
    log_lines: int = 0


@dataclass(frozen=True)
class FrameView:
    """One user-stream event of a program run (an SSF frame's data, or an open/close)."""

    direction: str  # "in" (user -> program) | "out" (program -> user)
    stream_id: int
    kind: str  # open | data | close
    seq: int | None = None
    text: str = ""


@dataclass(frozen=True)
class ProgramParts:
    exit_code: int | None
    stdout: str
    stderr: str
    logs: tuple[ProgramLog, ...]
    chats: tuple[ChatLink, ...]
    forks: tuple[Fork, ...]
    frames: tuple[FrameView, ...]
    frames_note: str = ""  # why there are none to show (a results file keeps none)


@dataclass(frozen=True)
class SessionView:
    """A session's page: its summary, thread, timeline (or a program run's parts)."""

    spec_id: str
    kind: str  # "session" | "program"
    status: str  # queued | running | ok | error | gone
    state: str  # the meta's state while it runs ("round 1"), else the status
    batch: str
    attempt: int
    code: str | None = None
    error_message: str | None = None
    latency_ms: int | None = None
    tokens_in: int | None = None
    tokens_out: int | None = None
    rounds: int | None = None
    tool_calls: int | None = None
    tool_failures: int | None = None
    backend: str | None = None
    model: str | None = None
    submitted_ms: int | None = None
    finished_ms: int | None = None
    messages: tuple[MessageView, ...] = ()
    timeline: tuple[TimelineStep, ...] = ()
    timeline_note: str = ""  # why the timeline is empty (no trace in a results file)
    partial_text: str | None = None  # the round being streamed, while it runs
    partial_thinking: str | None = None
    partial_tool_calls: tuple[PartialCall, ...] = ()
    flower_search: str | None = None
    flower_url: str | None = None
    has_trace: bool = False
    program: ProgramParts | None = None
    source: str = ""  # offline: the results file

    @property
    def live(self) -> bool:
        return self.status in (QUEUED, RUNNING)

    def json(self) -> dict[str, Any]:
        return {**to_json(self), "live": self.live}
