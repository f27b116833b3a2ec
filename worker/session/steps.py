"""The steps of a session: start, round, tool, finish. Each runs at least once, so each is
idempotent: a step id, a lease while it runs, first-writer-wins outputs, and a `published`
marker set after its continuation is sent. A redelivered step that finds its work done
re-publishes its continuation; duplicates of a step are absorbed by these guards.

Each body runs under the StepGuard (worker.session.guard). Celery is not imported here: tasks
call these methods and turn `RetryLater` into a retry.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from schemas import keys
from schemas.bodies import OK, dump_body, outcome_code
from schemas.spec_types import ProgramSpec, SessionSpec
from worker.codecs.protocol import ChatRequest, Delta
from worker.config import BackendConfig, Settings
from worker.errors import (
    CancelledError,
    DeadlineExceededError,
    InternalError,
    ProviderError,
    RateLimited,
    SpecMissingError,
    StoreError,
)
from worker.session.decisions import Decision, Ending, decide
from worker.session.engine import (
    CallModel,
    Round,
    Session,
    next_call,
)
from worker.session.guard import StepGuard
from worker.session.mcp_offer import offer_mcp_tools
from worker.session.ports import (
    CompletionProvider,
    Dispatcher,
    McpClient,
    Outbox,
    Permit,
    RateLimiter,
    RoundReads,
    SessionStore,
    StepStart,
    ToolRuntime,
)
from worker.session.records import ending, failed_program_record
from worker.session.tool_step import ToolStep
from worker.session.trace import (
    event,
    model_call_ended,
    unrun_calls,
)

log = logging.getLogger(__name__)
SpecT = TypeVar("SpecT", SessionSpec, ProgramSpec)

PARTIAL_EVERY_S = 0.25


class PartialText:
    """The text of a streamed round, published every PARTIAL_EVERY_S for `cchatq status`."""

    def __init__(self, store: SessionStore, sk: str) -> None:
        self.store, self.sk = store, sk
        self.text: list[str] = []
        self.last = 0.0

    def __call__(self, delta: Delta) -> None:
        if delta.kind == "restart":
            self.text.clear()
            return
        if delta.kind != "content":
            return
        self.text.append(delta.text)
        if time.monotonic() - self.last >= PARTIAL_EVERY_S:
            self.last = time.monotonic()
            self.store.set_partial(self.sk, "".join(self.text))

    def close(self) -> None:
        with contextlib.suppress(StoreError):
            self.store.set_partial(self.sk, None)


def estimate_tokens(chat: ChatRequest) -> int:
    """A prompt's size in tokens, roughly (4 characters a token), before the call."""
    return len(json.dumps(chat.messages, ensure_ascii=False)) // 4 + 1


@dataclass
class StepRunner:
    store: SessionStore
    dispatch: Dispatcher
    provider_for: Callable[[BackendConfig], CompletionProvider]
    tools: Callable[[], ToolRuntime]  # lazy: a prefork child builds its own wasmtime engine
    settings: Settings
    rate_limiter: RateLimiter
    mcp: McpClient | None = None  # MCP servers' tool lists (their calls go through `tools`)

    def __post_init__(self) -> None:
        self.guard = StepGuard(self.store, self.dispatch, self.settings)

    def _default_backend(self) -> str:
        return self.settings.default_backend

    # applying a decision -------------------------------------------------------------------

    def apply(
        self,
        sk: str,
        decision: Decision,
        session: Session | None = None,
        dispatch: Dispatcher | None = None,
    ) -> None:
        """Carry out what the engine decided: store tool messages, publish the next steps
        (through `dispatch`: a step passes its Outbox), write the ending. The one place a
        decision becomes Redis writes and messages. Given the session (a round step), a
        finish is done here rather than published as a task of its own: one hop less per
        session, under the same ending rules."""
        send = dispatch or self.dispatch
        done = (
            self.store.store_tool_outcomes(
                sk, decision.round_no, decision.store, decision.fan_in or 0
            )
            if decision.store
            else 0
        )
        tools = list(decision.tools)
        if decision.refill is not None and tools:  # a window opens: its calls hold places
            self.store.queue_calls(sk, decision.round_no, tools, claim=False)
        for index in tools:
            send.tool(sk, decision.round_no, index)
        if decision.fan_in is not None and done >= decision.fan_in:
            send.round(sk, decision.round_no + 1)
        elif decision.refill is not None and not tools and decision.fan_in is not None:
            self._refill(sk, decision.round_no, decision.fan_in, decision.refill, send)
        if decision.next_round is not None:
            send.round(sk, decision.next_round)
        if decision.finish and session is not None:
            self._end(sk, session, send if isinstance(send, Outbox) else None)
        elif decision.finish:
            send.finish(sk)
        if decision.ending is not None:
            body, record = decision.ending.body, decision.ending.record
            self.store.write_result(sk, dump_body(body), record)
            if isinstance(send, Outbox):  # the step's task result: a code, never content
                send.outcome = outcome_code(body)

    def _refill(self, sk: str, round_no: int, calls: int, window: int, send: Dispatcher) -> None:
        """A call of a max_parallel window finished: start the next waiting ones. Each is
        claimed first, so two calls finishing at once never start the same one twice."""
        waiting, placed = self.store.unstarted_calls(sk, round_no, calls)
        for index in self.store.queue_calls(
            sk, round_no, waiting[: max(0, window - placed)], claim=True
        ):
            send.tool(sk, round_no, index)

    # start ---------------------------------------------------------------------------------

    def start(self, batch: str, chunk_no: int) -> str | None:
        def members() -> list[keys.ChunkMember]:
            return self.store.chunk_members(batch, chunk_no)

        def body(_: StepStart, outbox: Outbox) -> None:
            for member in members():
                outbox.spec_ids[member.sk] = member.spec_id
                if member.program:
                    outbox.program(member.sk)
                else:
                    outbox.round(member.sk, 0)

        def sessions() -> list[str]:
            return [m.sk for m in members()]

        # sk "": a chunk is no session (no cancel flag, no meta); its poison ends them all
        step = keys.start_step(batch, chunk_no)
        return self.guard.run(step, "", body, targets=sessions)

    # round ---------------------------------------------------------------------------------

    def round(self, sk: str, round_no: int) -> str | None:
        def body(start: StepStart, outbox: Outbox) -> None:
            session = self._session(sk, start.session, upto_round=round_no)
            outbox.spec_ids[sk] = session.spec.id
            if len(session.rounds) < round_no:
                return  # out of order: published before its round could be (never by us)
            if len(session.rounds) == round_no:
                if self.settings.trace:  # written with the step's end, as its other events
                    spec_id = session.spec.id
                    if round_no == 0:
                        outbox.events.append(event("session.started", spec_id))
                    outbox.events.append(event("model.call.started", spec_id, round=round_no))
                started = time.monotonic()
                failed = None
                if session.spec.mcp_servers:  # listed once, by the first round, and stored
                    fleet = self.settings.tool_defaults
                    session, failed = offer_mcp_tools(self.store, self.mcp, fleet, sk, session)
                reply = failed or self._call_model(sk, session, next_call(session))
                winner = self.store.store_model_reply(sk, round_no, reply)
                session = replace(session, rounds=(*session.rounds, Round(reply=winner)))
                if self.settings.trace:
                    took_ms = round((time.monotonic() - started) * 1000)
                    outbox.events.append(
                        model_call_ended(
                            session.spec.id, round_no, winner, took_ms, session.backend
                        )
                    )
            # the plan runs once per round, here, on the stored reply (a redelivery too)
            decision = decide(session)
            if self.settings.trace and decision.store:
                reply = session.rounds[decision.round_no].reply
                outbox.events.extend(
                    unrun_calls(session.spec.id, decision.round_no, reply, decision.store)
                )
            self.apply(sk, decision, session, outbox)

        step = keys.round_step(sk, round_no)
        reads = RoundReads(round_no, self._default_backend())
        return self.guard.run(step, sk, body, reads=reads, state=f"round {round_no}")

    def _session(
        self, sk: str, read: Session | None = None, upto_round: int | None = None
    ) -> Session:
        """The session as the engine sees it: what the step read (or reads now), with the
        fleet's tool defaults."""
        if read is None:
            read = self.store.load_session(sk, self._default_backend(), upto_round=upto_round)
        return replace(read, fleet=self.settings.tool_defaults)

    def backend(self, provider: str | None) -> BackendConfig | None:
        try:
            return self.settings.backend(provider)
        except (KeyError, TypeError):  # unknown, or not a name at all: the round ends it
            return None

    def _call_model(self, sk: str, session: Session, step: CallModel) -> dict[str, Any]:
        backend = self.backend(session.spec.provider)
        if backend is None:
            name = session.spec.provider
            return ProviderError(
                f"unknown backend {name!r}; configured: {sorted(self.settings.backends)}"
            ).body()
        chat = ChatRequest(
            model=step.model,
            messages=step.messages,
            tools=step.tools,
            params=step.params,
            tool_choice=step.tool_choice,
            parallel_tool_calls=step.parallel_tool_calls,
            stream=backend.stream,
            thinking_budget_tokens=backend.thinking_budget_tokens,
            timeout_s=_seconds(session.spec.limits.request_timeout_ms),
        )
        try:
            return self.complete(backend, chat, partial_of=sk)
        except ProviderError as exc:
            return exc.body()

    def complete(
        self, backend: BackendConfig, chat: ChatRequest, partial_of: str | None = None
    ) -> dict[str, Any]:
        """One model call under the backend's rate limit (a round's, or a summary's): the
        reply; RateLimited when there is no room yet; a ProviderError as the call raised it.
        A streamed call of `partial_of` shows its text in `cchatq status` as it comes."""
        permit = self.rate_limiter.acquire(backend, estimate_tokens(chat))
        if not isinstance(permit, Permit):
            raise RateLimited(permit, backend.name)
        partial = PartialText(self.store, partial_of) if partial_of and backend.stream else None
        try:
            reply = dict(self.provider_for(backend).complete(chat, partial).completion)
        finally:
            if partial is not None:
                partial.close()
        self.rate_limiter.settle(permit, int((reply.get("usage") or {}).get("total_tokens", 0)))
        return reply

    # tool ----------------------------------------------------------------------------------

    def tool(self, sk: str, round_no: int, index: int, background: bool = False) -> str | None:
        """A tool call's step (worker.session.tool_step); `background`: the call of a
        background tool, run on the background queue after its tool step handed it over."""
        return ToolStep(self, sk, round_no, index, background).run()

    def spec_of(self, sk: str, kind: type[SpecT]) -> SpecT:
        """A session's spec, of the kind its step expects (a chat or a program run)."""
        spec = self.store.load_spec(sk)
        if not isinstance(spec, kind):
            raise InternalError(f"session {sk} is not a {kind.__name__}")
        return spec

    # nudge ------------------------------------------------------------------------------

    def nudge(self, sk: str) -> bool:
        """Re-publish what a stalled session does next, as the engine plans it from the stored
        state. A broker can lose a message (a worker killed between taking it and recording it
        as unacknowledged); every step being idempotent, publishing it again is always safe.
        A step that is leased or published is left alone: a session waiting on a slow model
        call is not stalled, and a copy of its step would only queue behind it. False: the
        session is gone (its spec expired, or was lost with Redis's data)."""
        if self.store.has_result(sk):
            self.store.notify(sk, self.store.watcher_batches(sk))
            return True
        try:
            spec = self.store.load_spec(sk)
        except SpecMissingError:  # expired, or lost with Redis's data: nothing to recover
            log.warning("nudge %s: no spec, nothing to recover", sk)
            return False
        if isinstance(spec, ProgramSpec):
            if not self.store.active_steps([keys.program_step(sk)]):  # not running, not done
                self.dispatch.program(sk)
            return True
        try:
            decision = decide(self._session(sk))
        except StoreError:
            raise
        except Exception:  # a plan that cannot be made: the finish step ends the session
            log.warning("nudge %s: no plan, finishing", sk)
            decision = Decision(finish=True)
        self.apply(sk, self._not_running(sk, decision))
        return True

    def end_overdue(self, sk: str, deadline_ms: int) -> None:
        """A session past the fleet's deadline with no progress ends deadline_exceeded: its
        failure is recorded (first failure wins) and its finish step writes the body."""
        body = DeadlineExceededError(
            f"session showed no progress and passed the fleet's deadline of {deadline_ms // 1000} s"
        ).body()
        self.store.dead_letter(f"{sk}.deadline", sk, body, "deadline")
        self.dispatch.finish(sk)

    def _not_running(self, sk: str, decision: Decision) -> Decision:
        """The decision without the steps it publishes that are already leased or published.
        A call whose tool step is published but has no outcome was handed over to the
        background queue: its background step is published again unless it is active."""
        tools = {keys.tool_step(sk, decision.round_no, i): i for i in decision.tools}
        rounds = [] if decision.next_round is None else [keys.round_step(sk, decision.next_round)]
        active = self.store.active_steps([*tools, *rounds])
        handed = self.store.published_steps([step for step in tools if step in active])
        calls = {keys.background_step(sk, decision.round_no, tools[s]): tools[s] for s in handed}
        for step in sorted(set(calls) - self.store.active_steps(list(calls))):
            self.dispatch.background(sk, decision.round_no, calls[step])
        return replace(
            decision,
            tools=tuple(i for step, i in tools.items() if step not in active),
            next_round=None if rounds and rounds[0] in active else decision.next_round,
        )

    # finish --------------------------------------------------------------------------------

    def finish(self, sk: str) -> str | None:
        def body(_: StepStart, outbox: Outbox) -> None:
            spec = self.store.load_spec(sk)
            failure = self.store.failure(sk)
            if isinstance(spec, ProgramSpec):  # only a failed run is finished here
                result = failure or CancelledError("program run cancelled").body()
                record = failed_program_record(spec, result)
                self.apply(sk, Decision(ending=Ending(result, record)), dispatch=outbox)
                return
            self._end(sk, self._session(sk), outbox)

        step = keys.finish_step(sk)
        return self.guard.run(step, sk, body, stop_if_cancelled=False)

    def _end(self, sk: str, session: Session, outbox: Outbox | None = None) -> None:
        """Write a chat session's ending (the ending rules read its failure, cancel, meta).
        Its session.finished event joins the step's `outbox` (after the round's own events),
        or is written at once."""
        failure, cancelled, submitted_ms = self.store.ending_inputs(sk)
        latency_ms = int(time.time() * 1000) - submitted_ms
        decision = ending(session, failure, cancelled, latency_ms)
        self.apply(sk, decision, dispatch=outbox)
        if self.settings.trace and decision.ending is not None:
            code = outcome_code(decision.ending.body)
            error = None if code == OK else code
            finished = event(
                "session.finished", session.spec.id, latency_ms=latency_ms, error=error
            )
            if outbox is not None:
                outbox.events.append(finished)
            else:
                self.guard.trace_now(sk, finished, expire=True)


def _seconds(ms: int | None) -> float | None:
    return None if ms is None else ms / 1000
