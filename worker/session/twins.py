"""In-memory twins of the session ports (as dramatiq ships its StubBroker and httpx its
MockTransport): the steps run on them exactly as on Redis and Celery, in one process.

`MemoryStore` keeps the same rules as the Redis store (first writer wins, leases, published
markers, try counters, the fan-in count); `tests/test_store_contract.py` runs one contract
over both. Keys never expire here. `StepQueue` is the dispatcher: it records what was
published and runs it (`drain`), turning `RetryLater` into a requeue, as Celery's retry does.
`MemoryStore` also serves the guest's ProgramStore port, so program runs use the same twin.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from typing import Any

from schemas import keys
from schemas.bodies import dump_body
from schemas.keys import ChunkMember
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
from worker.codecs.protocol import ChatRequest, Delta
from worker.config import BackendConfig
from worker.errors import (
    ProviderRequestError,
    RetryLater,
    SpecMissingError,
    StepDeadLettered,
    StoreError,
    ToolRuntimeError,
)
from worker.session.engine import Round, Session
from worker.session.outcomes import ToolOutcome
from worker.session.ports import (
    NextStep,
    Permit,
    RoundReads,
    StepPublisher,
    StepStart,
    ToolCall,
    ToolReads,
    TraceWrite,
)
from worker.session.trace import TraceEvent
from worker.session.twin_streams import UserStreamTwin


@dataclass
class MemoryStore(UserStreamTwin):
    """SessionStore (and the guest's ProgramStore, its user streams from UserStreamTwin) in
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
    partials: dict[str, str] = field(default_factory=dict)
    deadletters: list[tuple[str, str]] = field(default_factory=list)
    forks: dict[str, bytes] = field(default_factory=dict)
    fd_mirror: dict[str, dict[int, bytes]] = field(default_factory=dict)
    mcp_listed: dict[str, bytes] = field(default_factory=dict)  # sk -> its MCP tools' JSON
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
            self.meta_of.setdefault(sk, {})["submitted_ms"] = str(int(time.time() * 1000))
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
                reply = json.loads(raw)
                calls = ((reply.get("choices") or [{}])[0].get("message") or {}).get(
                    "tool_calls"
                ) or []
                outcomes = {
                    i: ToolOutcome.from_json(json.loads(self.outcomes[(sk, r, i)]))
                    for i in range(len(calls))
                    if (sk, r, i) in self.outcomes
                }
                rounds.append(Round(reply=reply, outcomes=outcomes))
        return Session(spec=spec, backend=spec.provider or backend, rounds=tuple(rounds))

    def tool_inputs(
        self, sk: str, round_no: int, index: int
    ) -> tuple[dict[str, Any] | None, ToolOutcome | None]:
        reply = self.replies.get((sk, round_no))
        outcome = self.outcomes.get((sk, round_no, index))
        return (
            None if reply is None else dict(json.loads(reply)),
            None if outcome is None else ToolOutcome.from_json(json.loads(outcome)),
        )

    def store_model_reply(self, sk: str, round_no: int, reply: dict[str, Any]) -> dict[str, Any]:
        with self._cond:
            winner = self.replies.setdefault((sk, round_no), dump_body(reply))
        return dict(json.loads(winner))

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
    ) -> StepStart:
        with self._cond:
            now = time.monotonic()
            published = step in self.published
            leased = self.leases.get(step, 0.0) <= now
            if leased and not published:
                self.leases[step] = now + lease_ms / 1000
            if (leased and not published) or step not in self.tries:  # it runs the step
                self.tries[step] = self.tries.get(step, 0) + 1
            if sk and meta:
                self.meta_of.setdefault(sk, {}).update({k: str(v) for k, v in meta.items()})
            cancelled = bool(sk) and sk in self.cancelled
        start = StepStart(published, leased, self.tries[step], cancelled)
        if isinstance(reads, RoundReads):
            session = self.load_session(sk, reads.backend, upto_round=reads.round_no)
            return replace(start, session=session)
        if isinstance(reads, ToolReads):
            return replace(start, tool_inputs=self.tool_inputs(sk, reads.round_no, reads.index))
        return start

    def hold(self, step: str, token: str) -> AbstractContextManager[None]:
        return contextlib.nullcontext()  # twin leases last as long as begin_step asked

    def uncount_try(self, step: str) -> None:
        with self._cond:
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
            for made in write.events:  # a fleet event (no session): the fleet's, under ""
                self.traces.setdefault(write.sk if made.session else "", []).append(made)

    def set_partial(self, sk: str, text: str | None) -> None:
        with self._cond:
            if text is None:
                self.partials.pop(sk, None)
            else:
                self.partials[sk] = text

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

    def ending_inputs(self, sk: str) -> tuple[dict[str, Any] | None, bool, int]:
        submitted = self.meta_of.get(sk, {}).get("submitted_ms", "0")
        return self.failure(sk), self.is_cancelled(sk), int(submitted or 0)

    def dead_letter(self, step: str, sk: str, body: dict[str, Any], reason: str) -> None:
        with self._cond:
            self.failures.setdefault(sk, dump_body(body))
            self.deadletters.append((step, reason[:500]))

    def meta(self, sk: str) -> dict[str, str]:
        return dict(self.meta_of.get(sk, {}))

    def has_result(self, sk: str) -> bool:
        return sk in self.responses

    def write_result(self, sk: str, body: bytes, record: dict[str, Any]) -> bool:
        with self._cond:
            wrote = sk not in self.responses
            self.responses.setdefault(sk, bytes(body))
            self.records.setdefault(sk, dump_body(record))
            self.meta_of.setdefault(sk, {}).update(
                state="done", finished_ms=str(int(time.time() * 1000))
            )
            batches = list(self.watchers.get(sk, ()))
        self.notify(sk, batches)
        return wrote

    def watcher_batches(self, sk: str) -> list[str]:
        return sorted(self.watchers.get(sk, ()))

    def notify(self, sk: str, batches: Iterable[str]) -> None:
        with self._cond:
            for batch in batches:
                self.done.setdefault(batch, deque()).append(sk)
            self._cond.notify_all()

    def chunk_members(self, batch: str, chunk_no: int) -> list[ChunkMember]:
        return list(self.chunks.get((batch, chunk_no), []))

    # the guest's ProgramStore --------------------------------------------------------------

    def submit_chat(self, sk: str, spec: SessionSpec, batch: str) -> bool:
        return self.submit(sk, spec, batch)

    def ready(self, sks: list[str]) -> list[bool]:
        return [sk in self.responses for sk in sks]

    def response_and_record(self, sk: str) -> tuple[bytes | None, dict[str, Any] | None]:
        return self.responses.get(sk), self.record(sk)

    def wait_done(self, batch: str, timeout_s: float) -> list[str]:
        if self.pump is not None and not self.done.get(batch):
            self.pump()
        with self._cond:
            queue = self.done.setdefault(batch, deque())
            if not queue:
                self._cond.wait(timeout=max(timeout_s, 0.0) if self.pump is None else 0)
            out = list(queue)
            queue.clear()
            return out

    def put_fork(self, blob: bytes) -> str:
        sha = hashlib.sha256(blob).hexdigest()
        self.forks.setdefault(sha, bytes(blob))
        return sha

    def fork_blob(self, sha: str) -> bytes:
        blob = self.forks.get(sha)
        if blob is None:
            raise StoreError(f"fork {sha[:12]} not stored (expired)")
        return blob

    def save_fd(self, run_sk: str, fd: int, entry: dict[str, Any]) -> None:
        self.fd_mirror.setdefault(run_sk, {})[fd] = dump_body(entry)


class FailingStore:
    """A store whose named methods raise StoreError on their first N calls each (a Redis
    blip, or an outage), then behave like the store they wrap."""

    def __init__(self, store: MemoryStore, **failures: int) -> None:
        self._store = store
        self._left = dict(failures)
        self.raised: list[str] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if name not in self._left:
            return attr

        def failing(*args: Any, **kwargs: Any) -> Any:
            if self._left[name] > 0:
                self._left[name] -= 1
                self.raised.append(name)
                raise StoreError(f"twin: {name} failed")
            return attr(*args, **kwargs)

        return failing


Published = tuple[Any, ...]  # ("round", sk, r) | ("tool", sk, r, i) | ("finish", sk) | ...


@dataclass
class StepQueue(StepPublisher):
    """The Dispatcher port: published steps wait here until `drain` runs them."""

    pending: deque[Published] = field(default_factory=deque)
    sent: list[Published] = field(default_factory=list)
    retries: int = 0
    failed: list[Published] = field(default_factory=list)  # tasks that ended as FAILURE

    def start(self, batch: str, chunk_no: int) -> None:
        self._put(("start", batch, chunk_no))

    def publish(
        self,
        steps: Sequence[NextStep],
        published: str | None = None,
        trace: TraceWrite | None = None,
    ) -> bool:
        for step in steps:
            self._put((step.kind, *step.args))
        return False  # the published marker is the store's (MemoryStore.end_step)

    def _put(self, step: Published) -> None:
        self.sent.append(step)
        self.pending.append(step)

    def drain(self, run: Callable[[Published], None], max_steps: int = 10_000) -> int:
        """Run published steps until none is left; a step that asks to be retried (its
        task's `retry`) goes to the back of the queue. Returns how many ran."""
        ran = 0
        while self.pending:
            if ran >= max_steps:
                raise RuntimeError(f"more than {max_steps} steps: a loop?")
            self.run_next(run)
            ran += 1
        return ran

    def run_next(self, run: Callable[[Published], None]) -> Published:
        """Run the oldest published step once (a retry requeues it)."""
        step = self.pending.popleft()
        try:
            run(step)
        except RetryLater:
            self.retries += 1
            self.pending.append(step)
        except StepDeadLettered:  # a Celery FAILURE: the task is done, its sessions ended
            self.failed.append(step)
        return step


@dataclass(frozen=True)
class Completed:
    completion: dict[str, Any]


@dataclass
class ScriptedProvider:
    """The CompletionProvider port answering from a script: each entry a canonical
    chat.completion, a ProviderError to raise, or a function of the request."""

    script: list[dict[str, Any] | Exception | Callable[[ChatRequest], dict[str, Any]]]
    requests: list[ChatRequest] = field(default_factory=list)

    def __call__(self, backend: BackendConfig) -> ScriptedProvider:  # as `provider_for`
        return self

    def complete(
        self, request: ChatRequest, on_delta: Callable[[Delta], None] | None = None
    ) -> Completed:
        self.requests.append(request)
        if not self.script:
            raise ProviderRequestError("the scripted provider has no more replies")
        entry = self.script.pop(0)
        if isinstance(entry, Exception):
            raise entry
        return Completed(entry(request) if callable(entry) else entry)


def NoProvider(backend: BackendConfig) -> ScriptedProvider:
    """`provider_for` of a process that calls no model."""
    return ScriptedProvider([])


class NoTools:
    """The ToolRuntime port of a process that runs no tools."""

    def run(self, call: ToolCall) -> str:
        raise ToolRuntimeError("this twin runs no tools")


@dataclass
class PythonTools:
    """The ToolRuntime port running Python functions by export name: text in, text out."""

    functions: dict[str, Callable[[str], str]]
    calls: list[ToolCall] = field(default_factory=list)

    def run(self, call: ToolCall) -> str:
        self.calls.append(call)
        function = self.functions.get(call.export or "")
        if function is None:
            raise ToolRuntimeError(f"no function {call.export!r} in this twin")
        return function(call.arguments.decode())


@dataclass
class OpenRateLimiter:
    """The RateLimiter port with room for every call (or a fixed wait, to test waiting)."""

    wait_s: list[float] = field(default_factory=list)  # waits to answer first, in order
    settled: list[tuple[Permit, int]] = field(default_factory=list)

    def acquire(self, backend: BackendConfig, estimated_tokens: int) -> Permit | float:
        if self.wait_s:
            return self.wait_s.pop(0)
        return Permit(backend.name, "")

    def settle(self, permit: Permit, used_tokens: int) -> None:
        self.settled.append((permit, used_tokens))
