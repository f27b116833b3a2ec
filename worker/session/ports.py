"""What a step needs from the outside world besides its store (worker.session.store_ports), as
Protocols: the dispatcher, the rate limiter, the model provider, the tool runtime, MCP servers
and where spans go. The edges (Celery, HTTP, wasmtime) implement them; `worker.session.twins`
implements them in memory, so the steps run and are tested with no Redis and no workers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from schemas.fleet import ToolDefaults
from schemas.limits import Limits
from schemas.mcp import McpToolInfo
from schemas.spec_types import McpToolRef
from worker.codecs.protocol import ChatRequest, Delta
from worker.codecs.rate_headers import RateSignal
from worker.config import BackendConfig
from worker.session.outcomes import ToolOutcome
from worker.session.spans import SpanValue
from worker.session.store_ports import Commit, NextStep, PendingReply
from worker.session.tool_logs import ToolLogs
from worker.session.trace import TraceEvent


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

    def __init__(self, step: str = "", reply: PendingReply | None = None) -> None:
        self.step = step  # the step whose outbox this is: the ender of a session it ends
        self.steps: list[NextStep] = []
        self.events: list[TraceEvent] = []  # written with the step's published marker
        self.spec_ids: dict[str, str] = {}  # sk -> spec id, shown with the steps it publishes
        self.outcome: str | None = None  # the code a session this step ended ended with
        # tool outcomes stored with the step's commit, before the steps it publishes
        self.outcomes: dict[tuple[int, int], ToolOutcome] = {}
        self.notify: list[str] = []  # batches told the session finished, with the commit
        # the round's reply, stored with the commit; kept across its body's runs in a delivery
        self.reply = reply

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
