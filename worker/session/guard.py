"""The guard every step runs under (docs/architecture.md section 2): a lease while one delivery
works, a try count that dead-letters a step failing for good, the cancel flag read at every
step boundary, and the commit that publishes what the step decided together with its
published marker and trace events. Steps (worker.session.steps) and program runs
(worker.guest.step) hand it their bodies."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import NoReturn

from schemas import keys
from schemas.bodies import dump_body
from worker.config import Settings
from worker.errors import (
    RateLimited,
    ReplyTaken,
    RetryLater,
    SpecMissingError,
    StepDeadLettered,
    StepFailedError,
    StepsInFlight,
    StoreError,
    StoreUnavailableError,
    StoreUnreachableError,
)
from worker.session.commit_apart import commit_apart
from worker.session.ending import bare_record
from worker.session.ports import Dispatcher, NoSpans, Outbox, SpanSink
from worker.session.refusals import STEPS, Patience
from worker.session.spans import SpanSession, step_spans
from worker.session.store_ports import (
    STEP_LEASE_MS,
    Commit,
    PendingReply,
    RoundReads,
    SessionStore,
    StepStart,
    ToolReads,
    TraceWrite,
)
from worker.session.trace import Arrival, TraceEvent, event, rate_limit_waited, step_timed

log = logging.getLogger(__name__)

GUARD_RETRY_S = 1.0
REFUSED_RETRY_S = 5.0  # a step handed back after waiting out its budget for Redis


class StepGuard:
    def __init__(
        self,
        store: SessionStore,
        dispatch: Dispatcher,
        settings: Settings,
        spans: SpanSink | None = None,
    ) -> None:
        self.store = store
        self.dispatch = dispatch
        self.settings = settings
        self.spans: SpanSink = spans or NoSpans()
        self.sleep: Callable[[float], None] = time.sleep  # the waits for a refusing Redis

    def run(
        self,
        step: str,
        sk: str,
        body: Callable[[StepStart, Outbox], None],
        stop_if_cancelled: bool = True,
        targets: Callable[[], list[str]] | None = None,
        reads: RoundReads | ToolReads | None = None,
        first: bool | None = None,
        arrival: Arrival | None = None,
        **meta: str | int,
    ) -> str | None:
        """Run one delivery of a step under its guards; returns the outcome code of a session
        it ended ("ok" or an error code: its task's result). A step that keeps failing ends the
        sessions `targets()` names (its own session by default) and raises StepDeadLettered
        (its task ends as a FAILURE). Nothing else escapes but RetryLater: a failure of the
        guard's own Redis calls retries the delivery, so a message is never acknowledged
        with its work undone. What `reads` names is read with the lease, in the same round
        trip, and handed to `body` in its StepStart. `first`: whether this is the first
        delivery of its message, when the broker says (its try is then counted with no
        write). `arrival`: which worker runs it and how long its message waited (stamped on
        its trace events).

        A Redis that refuses writes (StoreUnavailableError: full, failing to persist, a
        replica, loading) spends no try: the delivery waits in its worker, with backoff, and
        runs again (its body, or only its commit when the body had done its work), for
        settings.store_wait_s at most; then it is handed back to its queue, still uncounted.
        In-process, because handing it back needs the broker, which refuses it too."""
        patience = Patience(self.settings.store_wait_s, self.sleep)
        try:
            while True:
                try:
                    outcome = self._run(
                        step, sk, body, stop_if_cancelled, targets, reads, first, arrival,
                        dict(meta), patience,
                    )  # fmt: skip
                except StoreUnavailableError as exc:  # its start, a cancel, a dead-letter
                    if not patience.wait(exc):
                        self._hand_back(step, exc, patience)
                    continue
                STEPS.accepted()
                return outcome
        except (RetryLater, StepDeadLettered):
            raise
        except Exception as exc:
            log.warning("step %s: guard failed: %s", step, type(exc).__name__)
            raise RetryLater(GUARD_RETRY_S, f"guard: {type(exc).__name__}") from exc

    def _run(
        self,
        step: str,
        sk: str,
        body: Callable[[StepStart, Outbox], None],
        stop_if_cancelled: bool,
        targets: Callable[[], list[str]] | None,
        reads: RoundReads | ToolReads | None,
        first: bool | None,
        arrival: Arrival | None,
        meta: dict[str, str | int],
        patience: Patience,
    ) -> str | None:
        sessions = targets or (lambda: [sk])
        counted = patience.counted
        # started again after a refusal: this delivery's try is counted already (first=True
        # writes no count), and its own lease, released, is taken over at once
        first = True if counted else first
        start = self.store.begin_step(step, STEP_LEASE_MS, meta, sk, reads, first)
        if counted is not None:
            start = replace(start, tries=counted[0], tries_stored=counted[1])
        if start.published:
            if start.unsent:  # its worker may have died before sending them (broker apart)
                self.dispatch.publish(start.unsent)
            return None
        if not start.leased:
            raise RetryLater(self.store.lease_left_ms(step) / 1000 + 0.05, f"step {step} is leased")
        patience.counted = (start.tries, start.tries_stored)
        # renewed while this worker lives, and known to this process as held until it ends
        with self.store.hold(step, start.lease):
            return self._leased(
                step, sk, body, start, stop_if_cancelled, sessions, arrival, patience
            )

    def _leased(
        self,
        step: str,
        sk: str,
        body: Callable[[StepStart, Outbox], None],
        start: StepStart,
        stop_if_cancelled: bool,
        sessions: Callable[[], list[str]],
        arrival: Arrival | None,
        patience: Patience,
    ) -> str | None:
        if start.ended and not self._ended_by(step, sk, start):
            # a late delivery of a step of a session that ended (and may be retired: its
            # outputs and markers deleted): there is nothing left for it to do
            self._release_quietly(step)
            return None
        if start.cancelled and stop_if_cancelled and not self._ended_by(step, sk, start):
            # cancellation is checked at every step boundary; finish writes the cancelled body
            cancel = Outbox(step)
            cancel.finish(sk)
            self.commit(step, sk, cancel)
            return None
        if start.tries > self.settings.max_step_attempts:
            self.poison(step, sessions(), f"delivered {start.tries} times")
        outbox = self._body(step, sk, body, start, sessions, arrival, patience)
        if log.isEnabledFor(logging.INFO):  # one line per step that ran: ids and counts only
            published = [s.kind for s in outbox.steps]
            log.info("step %s done: try %d, published %s", step, start.tries, published)
        return outbox.outcome

    def _body(
        self,
        step: str,
        sk: str,
        body: Callable[[StepStart, Outbox], None],
        start: StepStart,
        sessions: Callable[[], list[str]],
        arrival: Arrival | None,
        patience: Patience,
    ) -> Outbox:
        """Run the body and commit what it decided: a body whose writes Redis refused runs
        again, reading afresh (its stored outputs are first writer wins, so it finds what it
        wrote; a reply it bought and has not stored is kept: `paid`); a refused commit (one
        transaction: nothing of it applied) is written again; one that lost its reply to
        another delivery's runs the body again, on that reply."""
        started = time.monotonic()
        paid: PendingReply | None = None
        while True:
            outbox = Outbox(step, paid)
            try:
                to_commit = self._attempt(step, sk, body, start, outbox, sessions, arrival, started)
            except StoreUnavailableError as exc:
                if not patience.wait(exc):
                    self._hand_back(step, exc, patience, sk, start)
                paid = outbox.reply
                start = replace(start, session=None, tool_inputs=None)
                continue
            if not to_commit:
                return outbox
            while True:
                try:
                    self.commit(step, sk, outbox)
                    return outbox
                except ReplyTaken:  # the body again, on the reply another delivery stored
                    break
                except StoreUnavailableError as exc:
                    if not patience.wait(exc):
                        self._hand_back(step, exc, patience, sk, start)
                except StoreUnreachableError as exc:  # a paid reply waits, not bought again
                    if outbox.reply is None or not patience.wait(exc):
                        self._failed(step, start, sessions, exc)
                except Exception as exc:  # a commit that fails fails the step: retried
                    self._failed(step, start, sessions, exc)
            paid = None
            start = replace(start, session=None, tool_inputs=None)

    def _hand_back(
        self,
        step: str,
        exc: StoreUnavailableError,
        patience: Patience,
        sk: str = "",
        start: StepStart | None = None,
    ) -> NoReturn:
        """Redis refused writes for the whole of the delivery's wait: back to its queue, its
        try given back (when Redis takes that write: under MISCONF or READONLY it cannot, and
        the redelivery counts one)."""
        if start is not None:
            with contextlib.suppress(StoreError):
                self.store.defer_step(step, sk, start.tries_stored, int(REFUSED_RETRY_S * 1000))
        waited_s = self.settings.store_wait_s - patience.left_s
        log.warning(
            "step %s: Redis refused writes (%s) for %.0f s: handed back to its queue",
            step, exc.reason, waited_s,
        )  # fmt: skip
        raise RetryLater(REFUSED_RETRY_S, f"Redis refuses writes: {exc.reason}") from None

    def _failed(
        self, step: str, start: StepStart, sessions: Callable[[], list[str]], exc: Exception
    ) -> NoReturn:
        """A failure of the step's own: a try spent; past its attempts, dead-lettered."""
        self._release_quietly(step)
        if start.tries >= self.settings.max_step_attempts:
            self.poison(step, sessions(), f"{type(exc).__name__}: {exc}")
        log.warning("step %s failed (try %d): %s", step, start.tries, type(exc).__name__)
        raise RetryLater(min(0.2 * 2**start.tries, 10.0), f"{type(exc).__name__}: {exc}") from exc

    def _attempt(
        self,
        step: str,
        sk: str,
        body: Callable[[StepStart, Outbox], None],
        start: StepStart,
        outbox: Outbox,
        sessions: Callable[[], list[str]],
        arrival: Arrival | None,
        started: float,
    ) -> bool:
        """One run of the body: whether it has a commit to write. A StoreUnavailableError
        goes to the caller, which waits."""
        try:
            body(start, outbox)
            if self.settings.trace:  # its kind, duration, delivery... ride its last event
                step_timed(outbox.events, step, started, start.tries, arrival)
            return True
        except StoreUnavailableError:
            raise
        except RateLimited as exc:
            # waiting for the backend's rate limit is not a failure: no try is spent, and the
            # task gives its worker slot back until there may be room
            self.store.defer_step(step, sk, start.tries_stored, int(exc.wait_s * 1000))
            if self.settings.trace:  # an event for the metrics, never the step's failure
                with contextlib.suppress(StoreError):
                    spec_id = self._spec_id(sk)
                    waited = rate_limit_waited(spec_id, step, exc, start.tries, arrival)
                    self.trace_now(sk, waited, expire=True)
                    if self.spans.on:
                        self._export_spans(step, sk, [waited])
            raise RetryLater(exc.wait_s, "rate limited") from None
        except StepsInFlight as exc:
            # an ending waiting for its session's running steps is no failure either
            self.store.defer_step(step, sk, start.tries_stored, int(exc.wait_s * 1000))
            raise RetryLater(exc.wait_s, str(exc)) from None
        except SpecMissingError:
            # the session is gone (its spec expired, or was lost with Redis's data): there is
            # nothing to run and no one to tell; a producer that still waits submits it again
            self._release_quietly(step)
            log.warning("step %s: its session is gone, step dropped", step)
            return False
        except Exception as exc:
            self._failed(step, start, sessions, exc)

    def _ended_by(self, step: str, sk: str, start: StepStart) -> bool:
        """Whether this step wrote its session's ending in a delivery whose commit was never
        written: its body runs again (on what it stored, so no call is made twice), to commit
        the session's end. Read only for a step delivered again and cancelled."""
        if start.tries <= 1:
            return False
        return self.store.meta(sk).get("ended_by") == step

    def commit(self, step: str, sk: str, outbox: Outbox) -> None:
        """Publish what the step decided with what it writes as it ends: its round's reply
        (which the rest follows only if it wins: ReplyTaken), its tool outcomes, then its
        steps, its notifications, its published marker and its trace events; one write where
        the dispatcher shares the store's Redis. In that order, so a redelivery that finds the
        marker knows its continuation was sent."""
        trace = None
        if outbox.events:  # a session's first round and its last events set its stream's TTL
            ends = any(e.event == "session.finished" for e in outbox.events)
            opens = step == keys.round_step(sk, 0)
            ended_by = step if ends else ""
            trace = TraceWrite(sk, tuple(outbox.events), expire=ends or opens, ended_by=ended_by)
        elif outbox.outcome is not None:  # no events (trace off): the session retires still
            trace = TraceWrite(sk, (), expire=True, ended_by=step)
        outcomes, notify, ended_as = dict(outbox.outcomes), tuple(outbox.notify), outbox.outcome
        commit = Commit(sk, step, trace, outcomes, notify, ended_as or "", outbox.reply)
        if self.dispatch.writes_commits:
            self.dispatch.publish(outbox.shown(), commit)
        else:
            commit_apart(self.store, self.dispatch, step, outbox.shown(), commit)
        if self.spans.on and outbox.events:  # once committed: a step that failed made none
            self._export_spans(step, sk, outbox.events)

    def _export_spans(self, step: str, sk: str, events: list[TraceEvent]) -> None:
        """The spans of a step's committed events (worker.session.spans); a span that cannot be
        made is lost, never the step."""
        if not sk:  # a start step's: of no session
            return
        try:
            spec = None
            with contextlib.suppress(Exception):  # its spans still go, with fewer attributes
                spec = self.store.load_spec(sk)
            session = SpanSession(sk, spec, self.store.batch_of(sk) if spec else "")
            backends, content = self.settings.fleet.backends, self.settings.span_content
            self.spans.export(step_spans(session, step, events, backends, content))
        except Exception as exc:
            log.warning("step %s: spans lost: %s", step, type(exc).__name__)

    def trace_now(
        self, sk: str, *events: TraceEvent, expire: bool = False, ended_by: str = ""
    ) -> None:
        """Events written at once, not with the step's end (a background call's progress, a
        dead-lettered finish's session.finished: `ended_by`, as TraceWrite says)."""
        if self.settings.trace:
            self.store.trace(TraceWrite(sk, events, expire, ended_by))
        elif ended_by:  # no events (trace off): the session retires still
            self.store.trace(TraceWrite(sk, (), expire, ended_by))

    def _release_quietly(self, step: str) -> None:
        with contextlib.suppress(StoreError):
            self.store.release_lease(step)

    def poison(self, step: str, sks: list[str], reason: str) -> NoReturn:
        """A step that keeps failing ends its sessions: dead-letter it, finish with an error.
        A failing finish step is not run again: its body is written here, bare."""
        failed = StepFailedError(f"step {step} failed for good: {reason}"[:500])
        for sk in sks:
            self.store.dead_letter(step, sk, failed.body(), reason)
            if step == keys.finish_step(sk):
                spec_id = self._spec_id(sk)
                record = bare_record(spec_id, failed.body())
                if not self.store.write_result(sk, dump_body(failed.body()), record, None, step):
                    continue  # another step ended the session, and said so
                with contextlib.suppress(StoreError):  # its end, which sets its trace's TTL
                    latency_ms = self._since_submitted_ms(sk)
                    ended = event(
                        "session.finished", spec_id, latency_ms=latency_ms,
                        error=StepFailedError.code,
                    )  # fmt: skip
                    self.trace_now(sk, ended, expire=True, ended_by=step)
                    if self.spans.on:
                        self._export_spans(step, sk, [ended])
                continue
            self.dispatch.finish(sk)
        self.store.end_step(step)
        log.warning("step %s dead-lettered: %s", step, reason.split(":", 1)[0][:100])
        raise StepDeadLettered(f"step {step} dead-lettered")

    def _since_submitted_ms(self, sk: str) -> int | None:
        """Since the session's submit, from its meta (the ending's own reads may have failed)."""
        try:
            submitted = int(self.store.meta(sk).get("submitted_ms") or 0)
        except (StoreError, ValueError):
            return None
        return self.store.now_ms() - submitted if submitted > 0 else None

    def _spec_id(self, sk: str) -> str:
        try:
            return self.store.load_spec(sk).id
        except Exception:  # what failed may be this very read: the key still names it
            return sk
