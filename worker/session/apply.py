"""The one place a decision becomes store writes and published steps (worker.session.decisions):
the round, tool, finish, nudge and program steps hand theirs here."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from schemas.bodies import OK, dump_body
from worker.errors import StoreError
from worker.session.decisions import (
    CallNext,
    Decision,
    EndSession,
    FinishLater,
    StartTools,
    ToolAnswered,
)
from worker.session.ending import Ending, ending
from worker.session.ports import Dispatcher, Outbox
from worker.session.store_ports import SessionWork
from worker.session.trace import event


@dataclass
class Applier:
    store: SessionWork
    trace: bool  # a session's end makes its session.finished event

    def apply(self, sk: str, decision: Decision, send: Dispatcher) -> None:
        """Carry out `decision` for session `sk`; what it publishes goes through `send` (a
        step passes its Outbox, sent with the step's published marker)."""
        if isinstance(decision, CallNext):
            send.round(sk, decision.round_no)
        elif isinstance(decision, StartTools):
            self._start_tools(sk, decision, send)
        elif isinstance(decision, ToolAnswered):
            self._answered(sk, decision, send)
        elif isinstance(decision, EndSession):
            self._end(sk, decision, send)
        elif isinstance(decision, FinishLater):
            send.finish(sk)
        else:
            code = self._write(sk, decision.ending, send)
            if code is not None:
                self._finished(sk, decision.ending, code, send)

    def _start_tools(self, sk: str, decision: StartTools, send: Dispatcher) -> None:
        plan = decision.plan
        done = (
            self.store.store_tool_outcomes(sk, plan.round_no, plan.presets, plan.call_count)
            if plan.presets
            else 0
        )
        if decision.queued and decision.publish:  # a window opens: its calls hold places
            self.store.queue_calls(sk, plan.round_no, list(decision.publish), claim=False)
        for index in decision.publish:
            send.tool(sk, plan.round_no, index)
        if done >= plan.call_count:
            send.round(sk, plan.round_no + 1)
        elif decision.queued and not decision.publish:  # a nudge: start what has room
            self._refill(sk, plan.round_no, plan.call_count, decision.window, send)

    def _answered(self, sk: str, decision: ToolAnswered, send: Dispatcher) -> None:
        round_no, calls = decision.round_no, decision.call_count
        if calls == 1 and isinstance(send, Outbox):
            # the round's one call: its outcome completes the round, whoever stored it first,
            # so it is stored with the step's commit, before the next round it publishes
            send.outcomes[(round_no, decision.index)] = decision.outcome
            send.round(sk, round_no + 1)
            return
        done = self.store.store_tool_outcomes(
            sk, round_no, {decision.index: decision.outcome}, calls
        )
        if done >= calls:
            send.round(sk, round_no + 1)
        elif calls > decision.window:
            self._refill(sk, round_no, calls, decision.window, send)

    def _refill(self, sk: str, round_no: int, calls: int, window: int, send: Dispatcher) -> None:
        """A call of a max_parallel window finished: start the next waiting ones. Each is
        claimed first, so two calls finishing at once never start the same one twice."""
        waiting, placed = self.store.unstarted_calls(sk, round_no, calls)
        for index in self.store.queue_calls(
            sk, round_no, waiting[: max(0, window - placed)], claim=True
        ):
            send.tool(sk, round_no, index)

    def _end(self, sk: str, decision: EndSession, send: Dispatcher) -> None:
        """A chat session's ending, under the ending rules (they read its failure, its cancel
        flag and when it was submitted). Its session.finished event joins the step's Outbox,
        after the round's own events, when this step is the one that ended it."""
        session = decision.session
        inputs = self.store.ending_inputs(sk)
        latency_ms = inputs.latency_ms
        closing = ending(session, decision.step, inputs.failure, inputs.cancelled, latency_ms)
        code = self._write(sk, closing, send)
        if code is not None:
            self._finished(sk, closing, code, send, session.spec.id, latency_ms)

    def _finished(
        self,
        sk: str,
        closing: Ending,
        code: str,
        send: Dispatcher,
        spec_id: str | None = None,
        latency_ms: int | None = None,
    ) -> None:
        """The session.finished event of a session's end (a program run's: its record names
        it), with the outcome `code` written (a redelivery's ending may differ from it: a
        cancel since), after the step's own events; its latency counts from the submit."""
        if not self.trace or not isinstance(send, Outbox):
            return
        if latency_ms is None:  # a program run's: from when it was submitted, when known
            with contextlib.suppress(StoreError):
                latency_ms = self.store.ending_inputs(sk).latency_ms
        send.events.append(
            event(
                "session.finished",
                spec_id if spec_id is not None else str(closing.record.get("id", sk)),
                latency_ms=latency_ms,
                error=None if code == OK else code,
            )
        )

    def _write(self, sk: str, closing: Ending, send: Dispatcher) -> str | None:
        """Write the ending, first writer wins: the outcome code written when this step ended
        the session (it, and only it, makes the session.finished event), None when another
        step had."""
        body = dump_body(closing.body)
        if not isinstance(send, Outbox):
            return self.store.write_result(sk, body, closing.record)
        # the waiting batches are told with the step's commit
        code = self.store.write_result(sk, body, closing.record, send.notify, send.step)
        if code is not None:
            send.outcome = code  # the step's task result: a code
        return code
