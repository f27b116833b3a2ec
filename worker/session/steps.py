"""The steps of a session: start, round, tool, finish. Each runs at least once, so each is
idempotent: a step id, a lease while it runs, first-writer-wins outputs, and a `published`
marker set after its continuation is sent. A redelivered step that finds its work done
re-publishes its continuation; duplicates of a step are absorbed by these guards.

Each body runs under the StepGuard (worker.session.guard) and hands its decision to the
Applier (worker.session.apply); model calls go through the ModelCaller, tool calls through
the ToolStep. Celery is not imported here: tasks call these methods (saying whether their
message is delivered for the first time: `first`) and turn `RetryLater` into a retry.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from schemas import keys
from schemas.spec_types import ProgramSpec
from worker.codecs.reply import Reply
from worker.config import BackendConfig, Settings
from worker.errors import (
    CancelledError,
    DeadlineExceededError,
    SpecMissingError,
    StepsInFlight,
    StoreError,
)
from worker.session.apply import Applier
from worker.session.decisions import (
    CallNext,
    Decision,
    EndSession,
    FinishLater,
    StartTools,
    WriteEnding,
    decide,
)
from worker.session.ending import Ending, failed_program_record, running_steps
from worker.session.engine import RunTools, Step, ToolRun, next_call, plan
from worker.session.guard import StepGuard
from worker.session.mcp_offer import offer_mcp_tools
from worker.session.model_call import ModelCaller
from worker.session.ports import (
    CompletionProvider,
    Dispatcher,
    McpClient,
    NoSpans,
    Outbox,
    RateLimiter,
    SpanSink,
    ToolRuntime,
)
from worker.session.rate_control import RateControl
from worker.session.refusals import keep_writing
from worker.session.state import Round, Session
from worker.session.store_ports import (
    PendingReply,
    RoundReads,
    SessionStore,
    SpecT,
    StepStart,
    spec_of,
)
from worker.session.tool_step import ToolContext, ToolStep
from worker.session.trace import Arrival, event, model_call_ended, unrun_calls

log = logging.getLogger(__name__)
# how often an ending waiting for its session's running steps looks again (a lease's time
# left, when shorter): a cancel lands this soon after the call it waits for
FINISH_POLL_MS = 500


@dataclass
class StepRunner:
    store: SessionStore
    dispatch: Dispatcher
    provider_for: Callable[[BackendConfig], CompletionProvider]
    tools: Callable[[], ToolRuntime]  # lazy: a prefork child builds its own wasmtime engine
    settings: Settings
    rate_limiter: RateLimiter  # the static limits of backends with `adaptive: false`
    rate_control: RateControl
    mcp: McpClient | None = None  # MCP servers' tool lists (their calls go through `tools`)
    spans: SpanSink = field(default_factory=NoSpans)  # OpenTelemetry's, when on

    def __post_init__(self) -> None:
        fleet = self.settings.fleet
        self.guard = StepGuard(self.store, self.dispatch, self.settings, self.spans)
        # what spans may show of calls (messages, arguments, results) rides the trace events
        # only while spans are on and their content is asked for
        self.content = self.settings.trace and self.settings.span_content and self.spans.on
        self.applier = Applier(self.store, self.settings.trace)
        self.models = ModelCaller(
            fleet.backends,
            fleet.default_backend,
            self.provider_for,
            self.rate_limiter,
            self.store,
            self.rate_control,
            fleet.models,
        )
        self.tool_context = ToolContext(
            store=self.store,
            guard=self.guard,
            applier=self.applier,
            tools=lambda: self.tools(),  # the runner's, as it is when a call runs
            fleet=fleet.tool_defaults,
            models=self.models,
            trace=self.settings.trace,
            content=self.content,
        )

    def apply(self, sk: str, decision: Decision, dispatch: Dispatcher | None = None) -> None:
        """Carry out a decision (worker.session.apply), publishing through `dispatch` (a
        step's Outbox) or at once."""
        self.applier.apply(sk, decision, dispatch or self.dispatch)

    # start ---------------------------------------------------------------------------------

    def start(
        self, batch: str, chunk_no: int, first: bool | None = None, arrival: Arrival | None = None
    ) -> str | None:
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
        return self.guard.run(step, "", body, targets=sessions, first=first, arrival=arrival)

    # round ---------------------------------------------------------------------------------

    def round(
        self, sk: str, round_no: int, first: bool | None = None, arrival: Arrival | None = None
    ) -> str | None:
        def body(start: StepStart, outbox: Outbox) -> None:
            session = self._session(sk, start.session, upto_round=round_no)
            outbox.spec_ids[sk] = session.spec.id
            if len(session.rounds) < round_no:
                return  # out of order: published before its round could be (never by us)
            if len(session.rounds) == round_no:
                session, step = self._call_model(sk, session, round_no, outbox)
            else:  # a redelivery: the plan runs on the stored reply (none rides the commit)
                step, outbox.reply = plan(session), None
            if self.settings.trace and isinstance(step, RunTools) and step.presets:
                reply = session.rounds[step.round_no].reply
                outbox.events.extend(
                    unrun_calls(session.spec.id, step.round_no, reply, step.presets, self.content)
                )
            self.applier.apply(sk, decide(session, step), outbox)

        step = keys.round_step(sk, round_no)
        reads = RoundReads(round_no, self.settings.fleet.default_backend)
        return self.guard.run(
            step, sk, body, reads=reads, first=first, arrival=arrival, state=f"round {round_no}"
        )

    def _call_model(
        self, sk: str, session: Session, round_no: int, outbox: Outbox
    ) -> tuple[Session, Step]:
        """Round `round_no`'s model call (not made again for a reply this delivery paid for in
        an earlier run of its body: `outbox.reply`), its reply stored with the plan made from
        it (first writer wins): the session with the stored reply, and the plan made from it.
        A reply whose plan writes nothing before the step's commit is stored with that commit
        (`outbox.reply`: one round trip fewer); any other at once, as its plan's writes must
        follow the reply that won."""
        trace, spec_id = self.settings.trace, session.spec.id
        if trace:  # written with the step's end, as its other events
            if round_no == 0:
                outbox.events.append(event("session.started", spec_id))
            outbox.events.append(event("model.call.started", spec_id, round=round_no))
        started = time.monotonic()
        failed = None
        if session.spec.mcp_servers:  # listed once, by the first round, and stored
            fleet = self.settings.fleet.tool_defaults
            session, failed = offer_mcp_tools(self.store, self.mcp, fleet, sk, session)
        waiter = keys.round_step(sk, round_no)  # its place in line across its retries
        call = next_call(session)
        paid = outbox.reply if outbox.reply and outbox.reply.round_no == round_no else None
        if paid is not None:
            reply = paid.reply
        else:
            reply = Reply.parse(failed or self.models.call_round(sk, session, call, waiter))
        with_reply = replace(session, rounds=(*session.rounds, Round(reply)))
        step = plan(with_reply)
        runs = step.runs if isinstance(step, RunTools) else ()
        outbox.reply = None
        if _rides_commit(decide(with_reply, step)):
            outbox.reply = PendingReply(round_no, reply, tuple(runs))
            winner = reply
        else:
            winner = self._store_reply(sk, round_no, reply, runs)
            if winner is not reply:
                with_reply = replace(session, rounds=(*session.rounds, Round(winner)))
                step = plan(with_reply)
        if trace:
            took_ms = round((time.monotonic() - started) * 1000)
            backend = with_reply.backend
            ended = model_call_ended(
                spec_id, round_no, winner, took_ms, backend, call, self.content
            )
            outbox.events.append(ended)
        return with_reply, step

    def _store_reply(self, sk: str, round_no: int, reply: Reply, runs: Sequence[ToolRun]) -> Reply:
        """A reply stored now, first writer wins: the stored one. A reply is paid for: kept
        through a Redis that refuses or does not answer, not bought again by the step's next
        run. An error is not: its step fails and runs again once Redis answers, the call with
        another chance (a worker cut off from Redis most likely could not reach the provider
        either)."""

        def store() -> Reply:
            return self.store.store_round(sk, round_no, reply, runs)

        wait_s = self.settings.store_wait_s
        return store() if reply.is_error else keep_writing(store, wait_s, self.guard.sleep)

    def _session(
        self, sk: str, read: Session | None = None, upto_round: int | None = None
    ) -> Session:
        """The session as the engine sees it: what the step read (or reads now), with the
        fleet's tool defaults, and the backend its model alias routes it to (its reply's
        `_spear.backend`)."""
        if read is None:
            backend = self.settings.fleet.default_backend
            read = self.store.load_session(sk, backend, upto_round=upto_round)
        routed = self.models.route(read.spec.provider, read.spec.model).backend
        return replace(
            read, backend=routed or read.backend, fleet=self.settings.fleet.tool_defaults
        )

    # tool ----------------------------------------------------------------------------------

    def tool(
        self,
        sk: str,
        round_no: int,
        index: int,
        background: bool = False,
        first: bool | None = None,
        arrival: Arrival | None = None,
    ) -> str | None:
        """A tool call's step (worker.session.tool_step); `background`: the call of a
        background tool, run on the background queue after its tool step handed it over."""
        return ToolStep(self.tool_context, sk, round_no, index, background).run(first, arrival)

    def spec_of(self, sk: str, kind: type[SpecT]) -> SpecT:
        """A session's spec, of the kind its step expects (a chat or a program run)."""
        return spec_of(self.store, sk, kind)

    # nudge ---------------------------------------------------------------------------------

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
        decision: Decision
        try:
            session = self._session(sk)
            decision = decide(session, plan(session))
        except StoreError:
            raise
        except Exception:  # a plan that cannot be made: the finish step ends the session
            log.warning("nudge %s: no plan, finishing", sk)
            decision = FinishLater()
        if isinstance(decision, EndSession):  # ended by its finish step, as a task
            decision = FinishLater()
        self._publish_not_running(sk, decision)
        return True

    def _publish_not_running(self, sk: str, decision: Decision) -> None:
        """Publish what `decision` publishes, but the steps already leased or published. A
        call whose tool step is published but has no outcome was handed over to the
        background queue: its background step is published again unless it is active."""
        if isinstance(decision, CallNext):
            if not self.store.active_steps([keys.round_step(sk, decision.round_no)]):
                self.apply(sk, decision)
            return
        if not isinstance(decision, StartTools):
            self.apply(sk, decision)
            return
        round_no = decision.plan.round_no
        tools = {keys.tool_step(sk, round_no, i): i for i in decision.publish}
        active = self.store.active_steps(list(tools))
        handed = self.store.published_steps([step for step in tools if step in active])
        calls = {keys.background_step(sk, round_no, tools[s]): tools[s] for s in handed}
        for step in sorted(set(calls) - self.store.active_steps(list(calls))):
            self.dispatch.background(sk, round_no, calls[step])
        idle = tuple(i for step, i in tools.items() if step not in active)
        self.apply(sk, replace(decision, publish=idle))

    def _settled(self, sk: str) -> Session:
        """The session once none of its steps runs (StepsInFlight until then: a model call in
        flight ends first, so its tokens count and its events come before the end). Read
        again after the look at its steps: a round that ended between the two reads is in."""
        session = self._session(sk)
        while True:
            running = self.store.leased_steps(running_steps(sk, session))
            if running:
                wait_ms = min(max(running.values()), FINISH_POLL_MS)
                raise StepsInFlight(max(wait_ms, 50) / 1000, len(running))
            settled = self._session(sk)
            if len(settled.rounds) == len(session.rounds):
                return settled
            session = settled

    def end_overdue(self, sk: str, deadline_ms: int) -> None:
        """A session past the fleet's deadline with no progress ends deadline_exceeded: its
        failure is recorded (first failure wins) and its finish step writes the body."""
        body = DeadlineExceededError(
            f"session showed no progress and passed the fleet's deadline of {deadline_ms // 1000} s"
        ).body()
        self.store.dead_letter(f"{sk}.deadline", sk, body, "deadline")
        self.dispatch.finish(sk)

    # finish --------------------------------------------------------------------------------

    def finish(
        self, sk: str, first: bool | None = None, arrival: Arrival | None = None
    ) -> str | None:
        def body(_: StepStart, outbox: Outbox) -> None:
            spec = self.store.load_spec(sk)
            if isinstance(spec, ProgramSpec):  # only a failed run is finished here
                failure = self.store.failure(sk)
                result = failure or CancelledError("program run cancelled").body()
                ending = Ending(result, failed_program_record(spec, result))
                self.applier.apply(sk, WriteEnding(ending), outbox)
                return
            self.applier.apply(sk, EndSession(self._settled(sk), None), outbox)

        step = keys.finish_step(sk)
        return self.guard.run(step, sk, body, stop_if_cancelled=False, first=first, arrival=arrival)


def _rides_commit(decision: Decision) -> bool:
    """Whether a round's reply is stored with its step's commit: when its plan writes nothing
    before that commit (tool steps to publish; no calls answered without running, no calls
    queued behind a window, no ending)."""
    return isinstance(decision, StartTools) and not decision.plan.presets and not decision.queued
