"""The step of one tool call (docs/architecture.md section 2): read its run as its round planned
it and the call's stored outcome, run the call under its policy if it has none, store it, and
publish the next round once every call of the round is answered (or the next waiting call,
under max_parallel).

A `background` tool's call is handed over instead: its tool step publishes a background step
(its own step id, on the background queue) and ends; that step runs the call with the tool's
long timeout, reports its progress as task.progress events, and does the rest as above. The
round waits for it without holding a worker slot.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from schemas import keys
from schemas.fleet import ToolDefaults, max_parallel
from schemas.spec_types import BUILTIN_MODULE, SessionSpec
from worker.errors import InternalError, StoreError, ToolNotRunError, ToolValidationError
from worker.session.apply import Applier
from worker.session.decisions import ToolAnswered
from worker.session.engine import ToolRun
from worker.session.guard import StepGuard
from worker.session.model_call import ModelCaller
from worker.session.outcomes import ToolOutcome
from worker.session.ports import Outbox, ToolRuntime
from worker.session.store_ports import SessionWork, StepStart, ToolReads, spec_of
from worker.session.summaries import summarized
from worker.session.tool_policy import ToolCaller
from worker.session.trace import Arrival, event, tool_call_ended, tool_logs_kept

log = logging.getLogger(__name__)
PROGRESS_EVERY_S = 0.5  # task.progress events of one call, at most this often
CANCEL_CHECK_S = 1.0  # a background call looks whether its session goes on at most this often


@dataclass(frozen=True)
class ToolContext:
    """What a tool step works with."""

    store: SessionWork
    guard: StepGuard
    applier: Applier
    tools: Callable[[], ToolRuntime]  # lazy: a prefork child builds its own wasmtime engine
    fleet: ToolDefaults
    models: ModelCaller  # for summaries of long outputs
    trace: bool
    content: bool = False  # a call's arguments and result ride its event, for spans


@dataclass
class ToolStep:
    ctx: ToolContext
    sk: str
    round_no: int
    index: int
    background: bool = False

    def run(self, first: bool | None = None, arrival: Arrival | None = None) -> str | None:
        reads = ToolReads(self.round_no, self.index)
        return self.ctx.guard.run(
            self.step_id(), self.sk, self._body, reads=reads, first=first, arrival=arrival
        )

    def _body(self, start: StepStart, outbox: Outbox) -> None:
        ctx, round_no, index = self.ctx, self.round_no, self.index
        spec = spec_of(ctx.store, self.sk, SessionSpec)
        outbox.spec_ids[self.sk] = spec.id
        stored, outcome = start.tool_inputs or ctx.store.tool_inputs(self.sk, round_no, index)
        if stored is None or stored.is_error:
            raise StoreError(f"round {round_no} reply missing for tool step")
        run = stored.run(spec, index)
        if run is None:
            raise InternalError(f"call {index} of round {round_no} is not a tool run")
        policy = run.tool.policy
        if self.background and self._ended():
            return  # its session ended before the call could start: it never runs
        if self.background and policy.background_mode == "async":
            self._run_task(spec, run, outbox)  # its call was answered "submitted" long ago
            return
        if outcome is None:
            if run.tool.module == BUILTIN_MODULE:
                outcome = self._task_status(spec, run)
            elif policy.background and not self.background:
                self._hand_over(spec, run, outbox)
                if policy.background_mode != "async":
                    return  # the round waits: the background step stores the outcome
                outcome = self._submitted(run)
            else:
                called = self._call(spec, run, outbox)
                if self.background and self._ended():
                    return  # nothing waits for it any more (nor for its summary)
                outcome = summarized(ctx.models, spec, run, called)
        window = max_parallel(spec.limits, ctx.fleet)
        answered = ToolAnswered(round_no, index, outcome, stored.calls, window)
        ctx.applier.apply(self.sk, answered, outbox)

    # async background tasks ----------------------------------------------------------------

    def task_id(self) -> str:
        return f"task-{self.round_no}-{self.index}"

    def _submitted(self, run: ToolRun) -> ToolOutcome:
        """An async call's answer at once: its task id, to ask task_status with."""
        task_id = self.task_id()
        self.ctx.store.update_task(self.sk, task_id, {"status": "submitted"})
        return ToolOutcome.success(_compact({"task_id": task_id, "status": "submitted"}))

    def _run_task(self, spec: SessionSpec, run: ToolRun, outbox: Outbox) -> None:
        """An async call on the background queue: its outcome goes to its task, not to the
        round (which went on long ago)."""
        store, task_id = self.ctx.store, self.task_id()
        state = store.task_state(self.sk, task_id) or {}
        if state.get("status") in ("completed", "failed"):
            return  # a redelivery after the work was done
        store.update_task(self.sk, task_id, {"status": "running"})
        called = self._call(spec, run, outbox)
        if self._ended():
            return  # no one can ask for it any more
        outcome = summarized(self.ctx.models, spec, run, called)
        status = "completed" if outcome.ok else "failed"
        store.update_task(
            self.sk, task_id, {"status": status, "outcome": _compact(outcome.to_json())}
        )

    def _task_status(self, spec: SessionSpec, run: ToolRun) -> ToolOutcome:
        """The built-in task_status tool: a task's status, with its progress or outcome."""
        task_id = json.loads(run.arguments).get("task_id")
        state = self.ctx.store.task_state(self.sk, task_id) if isinstance(task_id, str) else None
        if state is None:
            return ToolOutcome.error(ToolValidationError(f"unknown task_id {task_id!r}"))
        answer: dict[str, Any] = {"task_id": task_id, "status": state["status"]}
        if "outcome" in state:
            done = ToolOutcome.from_json(json.loads(state["outcome"]))
            limit = spec.limits.compress_over_bytes
            shown = json.loads(done.message(True, limit, ref=task_id))  # a long one cut too
            answer.update(result=shown["data"], error=shown["error"])
            answer.update({k: shown[k] for k in ("truncated", "bytes", "summarized") if k in shown})
        elif "percent" in state:
            answer.update(percent=int(state["percent"]), message=state.get("message", ""))
        return ToolOutcome(ok=True, output=_compact(answer))  # ran no tool: not counted

    def _ended(self) -> bool:
        """Whether a background call's session has ended (its response is written: it was
        cancelled, passed the fleet's deadline, or answered without waiting for an async
        task). Then its call's result is dropped: nothing waits for it, and nothing of the
        session is written again but the call's events (how it stopped), to a trace stream
        that is there (TraceWrites)."""
        if not self.ctx.store.has_result(self.sk):
            return False
        log.info("step %s: its session ended, the call's result is dropped", self.step_id())
        return True

    def step_id(self) -> str:
        step = keys.background_step if self.background else keys.tool_step
        return step(self.sk, self.round_no, self.index)

    def _hand_over(self, spec: SessionSpec, run: ToolRun, outbox: Outbox) -> None:
        outbox.background(self.sk, self.round_no, self.index)
        if self.ctx.trace:
            outbox.events.append(event("task.submitted", spec.id, tool=run.name, **self.where(run)))

    def _call(self, spec: SessionSpec, run: ToolRun, outbox: Outbox) -> ToolOutcome:
        ctx = self.ctx
        watcher = BackgroundWatch(self, spec, run) if self.background else None
        if not ctx.trace:
            return ToolCaller(ctx.tools(), ctx.fleet).run(spec, run, watcher)
        where = self.where(run)
        started = event("tool.call.started", spec.id, tool=run.name, **where)
        if self.background:  # a long call: seen as it starts (its progress too)
            ctx.guard.trace_now(self.sk, started)
        else:  # written with the step's end, as its other events: no round trip of its own
            outbox.events.append(started)

        def retried(tool: str, attempt: int, code: str) -> None:
            outbox.events.append(
                event("tool.call.retried", spec.id, tool=tool, attempt=attempt, error=code, **where)
            )

        caller = ToolCaller(ctx.tools(), ctx.fleet, on_retry=retried)
        outcome = caller.run(spec, run, watcher)
        if outcome.logs or outcome.dropped_logs:  # before the end, which the step's time rides
            logged = tool_logs_kept(spec.id, self.round_no, run.call_id, run.name, outcome)
            outbox.events.append(logged)
        arguments = run.arguments if ctx.content else None
        outbox.events.append(
            tool_call_ended(spec.id, self.round_no, run.call_id, run.name, outcome, arguments)
        )
        if self.background:
            done = "task.completed" if outcome.ok else "task.failed"
            outbox.events.append(event(done, spec.id, tool=run.name, error=outcome.code, **where))
        return outcome

    def where(self, run: ToolRun) -> dict[str, Any]:
        return {"round": self.round_no, "call_id": run.call_id}


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


class BackgroundWatch:
    """A background call's CallWatcher. Its progress is kept as it comes (at most once every
    PROGRESS_EVERY_S, and always the 100%): a task.progress event, and for an async task what
    task_status answers. Whether its session goes on (its cancel flag, then its response) is
    read at most once every CANCEL_CHECK_S, at the tool's reports and while it sleeps: a
    cancel, or a session that ended, stops the call (NOT_RUN)."""

    def __init__(self, step: ToolStep, spec: SessionSpec, run: ToolRun) -> None:
        self.step, self.spec, self.run = step, spec, run
        self.reported = self.checked = 0.0

    def progress(self, percent: int, message: str) -> None:
        step, now = self.step, time.monotonic()
        if percent < 100 and now - self.reported < PROGRESS_EVERY_S:
            return
        self.reported = now
        if self.run.tool.policy.background_mode == "async":  # what task_status answers
            fields = {"percent": str(percent), "message": message}
            step.ctx.store.update_task(step.sk, step.task_id(), fields)
        if step.ctx.trace:
            progress = event(
                "task.progress", self.spec.id, tool=self.run.name, percent=percent,
                message=message, **step.where(self.run),
            )  # fmt: skip
            step.ctx.guard.trace_now(step.sk, progress)

    def check(self) -> None:
        now = time.monotonic()
        if now - self.checked < CANCEL_CHECK_S:
            return
        self.checked = now
        store, sk = self.step.ctx.store, self.step.sk
        if store.is_cancelled(sk):
            raise ToolNotRunError("the session was cancelled while this call ran", ran=True)
        if store.has_result(sk):  # its deadline passed, or it ended without its async task
            raise ToolNotRunError("the session ended while this call ran", ran=True)
