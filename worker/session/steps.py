"""The steps of a session: start, round, tool, finish. Each runs at least once, so each is
idempotent: a step id, a lease while it runs, first-writer-wins outputs, and a `published`
marker set after its continuation is sent. A redelivered step that finds its work done
re-publishes its continuation; duplicates of a step are absorbed by these guards.

Celery is not imported here: tasks call these methods and turn `RetryLater` into a retry.
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
from schemas.bodies import dump_body, is_error_body
from schemas.limits import max_parallel
from schemas.spec_types import ProgramSpec, SessionSpec
from worker.codecs.openai_chat import tool_calls_of
from worker.codecs.protocol import ChatRequest, Delta
from worker.config import BackendConfig, Settings
from worker.errors import (
    CancelledError,
    InternalError,
    ProviderError,
    RateLimited,
    RetryLater,
    StepFailedError,
    StoreError,
)
from worker.session.decisions import Decision, Ending, after_tool, decide
from worker.session.engine import (
    CallModel,
    Round,
    Session,
    next_call,
    tool_run,
)
from worker.session.ports import (
    CompletionProvider,
    Dispatcher,
    NextStep,
    Outbox,
    Permit,
    RateLimiter,
    RoundReads,
    SessionStore,
    StepStart,
    ToolReads,
    ToolRuntime,
)
from worker.session.records import bare_record, ending, failed_program_record
from worker.session.tool_policy import ToolCaller, step_lease_ms

log = logging.getLogger(__name__)
SpecT = TypeVar("SpecT", SessionSpec, ProgramSpec)

START_LEASE_MS = 60_000
DEFAULT_LEASE_MS = 130_000  # when a step's own lease cannot be read: the longest model call
GUARD_RETRY_S = 1.0
FINISH_LEASE_MS = 30_000
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

    # guards --------------------------------------------------------------------------------

    def guarded(
        self,
        step: str,
        sk: str,
        lease_ms: Callable[[], int],
        body: Callable[[StepStart, Outbox], None],
        stop_if_cancelled: bool = True,
        targets: Callable[[], list[str]] | None = None,
        reads: RoundReads | ToolReads | None = None,
        **meta: str | int,
    ) -> None:
        """Run one delivery of a step under its guards. A step that keeps failing ends the
        sessions `targets()` names (its own session by default). Nothing escapes but
        RetryLater: a failure of the guard's own Redis calls retries the delivery, so a
        message is never acknowledged with its work undone. What `reads` names is read with
        the lease, in the same round trip, and handed to `body` in its StepStart."""
        try:
            self._guarded(step, sk, lease_ms, body, stop_if_cancelled, targets, reads, dict(meta))
        except RetryLater:
            raise
        except Exception as exc:
            log.warning("step %s: guard failed: %s", step, type(exc).__name__)
            raise RetryLater(GUARD_RETRY_S, f"guard: {type(exc).__name__}") from exc

    def _guarded(
        self,
        step: str,
        sk: str,
        lease_ms: Callable[[], int],
        body: Callable[[StepStart, Outbox], None],
        stop_if_cancelled: bool,
        targets: Callable[[], list[str]] | None,
        reads: RoundReads | ToolReads | None,
        meta: dict[str, str | int],
    ) -> None:
        sessions = targets or (lambda: [sk])
        try:
            lease = lease_ms()
        except Exception:  # the lease is advisory: the body reads again, under the guard
            lease = DEFAULT_LEASE_MS
        start = self.store.begin_step(step, lease, meta, sk, reads)
        if start.published:
            return
        if not start.leased:
            raise RetryLater(self.store.lease_left_ms(step) / 1000 + 0.05, f"step {step} is leased")
        if start.cancelled and stop_if_cancelled:
            # cancellation is checked at every step boundary; finish writes the cancelled body
            self._commit(step, [NextStep("finish", (sk,))])
            return
        if start.tries > self.settings.max_step_attempts:
            self.poison(step, sessions(), f"delivered {start.tries} times")
            return
        outbox = Outbox()
        try:
            body(start, outbox)
        except RateLimited as exc:
            # waiting for the backend's rate limit is not a failure: no try is spent, and the
            # task gives its worker slot back until there may be room
            self._release_quietly(step)
            self.store.uncount_try(step)
            raise RetryLater(exc.wait_s, "rate limited") from None
        except Exception as exc:
            self._release_quietly(step)
            if start.tries >= self.settings.max_step_attempts:
                self.poison(step, sessions(), f"{type(exc).__name__}: {exc}")
                return
            log.warning("step %s failed (try %d): %s", step, start.tries, type(exc).__name__)
            raise RetryLater(
                min(0.2 * 2**start.tries, 10.0), f"{type(exc).__name__}: {exc}"
            ) from exc
        self._commit(step, outbox.steps)

    def _commit(self, step: str, steps: list[NextStep]) -> None:
        """Publish what the step decided, then mark it published: one write where the
        dispatcher shares the store's Redis. In that order, so a redelivery that finds the
        marker knows its continuation was sent."""
        if not self.dispatch.publish(steps, published=step):
            self.store.end_step(step)

    def _release_quietly(self, step: str) -> None:
        with contextlib.suppress(StoreError):
            self.store.release_lease(step)

    def poison(self, step: str, sks: list[str], reason: str) -> None:
        """A step that keeps failing ends its sessions: dead-letter it, finish with an error.
        A failing finish step is not run again: its body is written here, bare."""
        failed = StepFailedError(f"step {step} failed for good: {reason}"[:500])
        for sk in sks:
            self.store.dead_letter(step, sk, failed.body(), reason)
            if step == keys.finish_step(sk):
                record = bare_record(self._spec_id(sk), failed.body())
                self.store.write_result(sk, dump_body(failed.body()), record)
                continue
            self.dispatch.finish(sk)
        self.store.end_step(step)

    def _spec_id(self, sk: str) -> str:
        try:
            return self.store.load_spec(sk).id
        except Exception:  # what failed may be this very read: the key still names it
            return sk

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
            self._end(sk, session)
        elif decision.finish:
            send.finish(sk)
        if decision.ending is not None:
            body, record = decision.ending.body, decision.ending.record
            self.store.write_result(sk, dump_body(body), record)

    def _refill(self, sk: str, round_no: int, calls: int, window: int, send: Dispatcher) -> None:
        """A call of a max_parallel window finished: start the next waiting ones. Each is
        claimed first, so two calls finishing at once never start the same one twice."""
        waiting, placed = self.store.unstarted_calls(sk, round_no, calls)
        for index in self.store.queue_calls(
            sk, round_no, waiting[: max(0, window - placed)], claim=True
        ):
            send.tool(sk, round_no, index)

    # start ---------------------------------------------------------------------------------

    def start(self, batch: str, chunk_no: int) -> None:
        def members() -> list[keys.ChunkMember]:
            return self.store.chunk_members(batch, chunk_no)

        def body(_: StepStart, outbox: Outbox) -> None:
            for member in members():
                if member.program:
                    outbox.program(member.sk)
                else:
                    outbox.round(member.sk, 0)

        def sessions() -> list[str]:
            return [m.sk for m in members()]

        # sk "": a chunk is no session (no cancel flag, no meta); its poison ends them all
        step = keys.start_step(batch, chunk_no)
        self.guarded(step, "", lambda: START_LEASE_MS, body, targets=sessions)

    # round ---------------------------------------------------------------------------------

    def round(self, sk: str, round_no: int) -> None:
        def lease_ms() -> int:
            backend = self._backend(self.store.load_spec(sk).provider)
            return int((backend.total_timeout_s if backend else 60) * 1000) + 10_000

        def body(start: StepStart, outbox: Outbox) -> None:
            session = self._session(sk, start.session, upto_round=round_no)
            if len(session.rounds) < round_no:
                return  # out of order: published before its round could be (never by us)
            if len(session.rounds) == round_no:
                reply = self._call_model(sk, session, next_call(session))
                winner = self.store.store_model_reply(sk, round_no, reply)
                session = replace(session, rounds=(*session.rounds, Round(reply=winner)))
            # the plan runs once per round, here, on the stored reply (a redelivery too)
            self.apply(sk, decide(session), session, outbox)

        step = keys.round_step(sk, round_no)
        reads = RoundReads(round_no, self._default_backend())
        self.guarded(step, sk, lease_ms, body, reads=reads, state=f"round {round_no}")

    def _session(
        self, sk: str, read: Session | None = None, upto_round: int | None = None
    ) -> Session:
        """The session as the engine sees it: what the step read (or reads now), with the
        fleet's tool defaults."""
        if read is None:
            read = self.store.load_session(sk, self._default_backend(), upto_round=upto_round)
        return replace(read, fleet=self.settings.tool_defaults)

    def _backend(self, provider: str | None) -> BackendConfig | None:
        try:
            return self.settings.backend(provider)
        except (KeyError, TypeError):  # unknown, or not a name at all: the round ends it
            return None

    def _call_model(self, sk: str, session: Session, step: CallModel) -> dict[str, Any]:
        backend = self._backend(session.spec.provider)
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
        )
        permit = self.rate_limiter.acquire(backend, estimate_tokens(chat))
        if not isinstance(permit, Permit):
            raise RateLimited(permit)
        partial = PartialText(self.store, sk) if backend.stream else None
        try:
            reply = dict(self.provider_for(backend).complete(chat, partial).completion)
        except ProviderError as exc:
            return exc.body()
        finally:
            if partial is not None:
                partial.close()
        self.rate_limiter.settle(permit, int((reply.get("usage") or {}).get("total_tokens", 0)))
        return reply

    # tool ----------------------------------------------------------------------------------

    def tool(self, sk: str, round_no: int, index: int) -> None:
        def lease_ms() -> int:
            # read before the reply says which tool runs: the longest any tool may take
            spec = self.spec_of(sk, SessionSpec)
            fleet = self.settings.tool_defaults
            return max((step_lease_ms(spec, t, fleet) for t in spec.tools), default=0) or (
                step_lease_ms(spec, None, fleet)
            )

        def body(start: StepStart, outbox: Outbox) -> None:
            spec = self.spec_of(sk, SessionSpec)
            reply, outcome = start.tool_inputs or self.store.tool_inputs(sk, round_no, index)
            if reply is None or is_error_body(reply):
                raise StoreError(f"round {round_no} reply missing for tool step")
            if outcome is None:
                run = tool_run(spec, reply, index)
                if run is None:
                    raise InternalError(f"call {index} of round {round_no} is not a tool run")
                outcome = ToolCaller(self.tools(), self.settings.tool_defaults).run(spec, run)
            calls = len(tool_calls_of(reply))
            window = max_parallel(spec.limits, self.settings.tool_defaults)
            self.apply(sk, after_tool(round_no, index, outcome, calls, window), dispatch=outbox)

        step = keys.tool_step(sk, round_no, index)
        self.guarded(step, sk, lease_ms, body, reads=ToolReads(round_no, index))

    def spec_of(self, sk: str, kind: type[SpecT]) -> SpecT:
        """A session's spec, of the kind its step expects (a chat or a program run)."""
        spec = self.store.load_spec(sk)
        if not isinstance(spec, kind):
            raise InternalError(f"session {sk} is not a {kind.__name__}")
        return spec

    # nudge ------------------------------------------------------------------------------

    def nudge(self, sk: str) -> None:
        """Re-publish what a stalled session does next, as the engine plans it from the stored
        state. A broker can lose a message (a worker killed between taking it and recording it
        as unacknowledged); every step being idempotent, publishing it again is always safe.
        A step that is leased or published is left alone: a session waiting on a slow model
        call is not stalled, and a copy of its step would only queue behind it."""
        if self.store.has_result(sk):
            self.store.notify(sk, self.store.watcher_batches(sk))
            return
        if isinstance(self.store.load_spec(sk), ProgramSpec):
            self.dispatch.program(sk)
            return
        try:
            decision = decide(self._session(sk))
        except StoreError:
            raise
        except Exception:  # a plan that cannot be made: the finish step ends the session
            log.warning("nudge %s: no plan, finishing", sk)
            decision = Decision(finish=True)
        self.apply(sk, self._not_running(sk, decision))

    def _not_running(self, sk: str, decision: Decision) -> Decision:
        """The decision without the steps it publishes that are already leased or published."""
        tools = {keys.tool_step(sk, decision.round_no, i): i for i in decision.tools}
        rounds = [] if decision.next_round is None else [keys.round_step(sk, decision.next_round)]
        active = self.store.active_steps([*tools, *rounds])
        return replace(
            decision,
            tools=tuple(i for step, i in tools.items() if step not in active),
            next_round=None if rounds and rounds[0] in active else decision.next_round,
        )

    # finish --------------------------------------------------------------------------------

    def finish(self, sk: str) -> None:
        def body(_: StepStart, outbox: Outbox) -> None:
            spec = self.store.load_spec(sk)
            failure = self.store.failure(sk)
            if isinstance(spec, ProgramSpec):  # only a failed run is finished here
                result = failure or CancelledError("program run cancelled").body()
                record = failed_program_record(spec, result)
                self.apply(sk, Decision(ending=Ending(result, record)))
                return
            self._end(sk, self._session(sk))

        step = keys.finish_step(sk)
        self.guarded(step, sk, lambda: FINISH_LEASE_MS, body, stop_if_cancelled=False)

    def _end(self, sk: str, session: Session) -> None:
        """Write a chat session's ending (the ending rules read its failure, cancel, meta)."""
        failure, cancelled, submitted_ms = self.store.ending_inputs(sk)
        latency_ms = int(time.time() * 1000) - submitted_ms
        self.apply(sk, ending(session, failure, cancelled, latency_ms))
