"""The Celery app and its tasks: a thin shell over StepRunner. `celery -A worker.tasks ...`.

Arguments are ids only (session key, round, call index), so Flower and the logs never see a
prompt, a tool argument or a key; a step's task shows its session's spec id as its keyword
arguments (for Flower's search) and returns the outcome code of a session it ended. Results
live in Redis response fds.
"""

from __future__ import annotations

import logging
import os
from datetime import UTC, datetime, timedelta
from typing import Any, NoReturn

from celery import Celery, Task
from celery.exceptions import Reject, Retry
from celery.signals import (
    after_setup_logger,
    celeryd_init,
    worker_init,
    worker_process_shutdown,
    worker_ready,
    worker_shutdown,
    worker_shutting_down,
)
from celery.worker.request import Request

from schemas import task_names
from schemas.fleet_clock import FleetClock
from schemas.limits import BACKGROUND_TIMEOUT_CAP_MS
from worker.config import load_settings
from worker.edges.broker_amqp import PutOff
from worker.edges.task_protocol import decode_json_fast
from worker.errors import RetryLater, StoreError
from worker.session.refusals import STOPPING
from worker.session.steps import StepRunner
from worker.session.trace import Arrival
from worker.wiring import (
    BROKER_AMQP,
    EvictingRedis,
    add_step_context,
    celery_config,
    check_redis_memory,
    check_spans,
    check_state,
    close_mcp,
    declare_broker,
    delayed_on_broker,
    fleet_clock,
    flush_spans,
    program_steps,
    put_off,
    runner,
    set_worker_concurrency,
    start_reconciler,
)

log = logging.getLogger(__name__)
EX_CONFIG = 78  # sysexits: the worker's configuration (its Redis) is wrong

app = Celery("cchatq", amqp=BROKER_AMQP)
_settings = load_settings()
app.conf.update(celery_config(_settings))
decode_json_fast()  # before a prefork pool forks: its children decode the bodies
# on RabbitMQ's quorum queues a step is put off through the broker's delay queues, not held
# by the worker as Celery's eta is (worker/edges/amqp_topology.py)
DELAYED_ON_BROKER = delayed_on_broker(_settings)


@celeryd_init.connect
def _record_concurrency(conf: Any = None, options: Any = None, **_: Any) -> None:
    """Size the worker's Redis pool to its concurrency (`-c`) before any task runs."""
    configured = conf.worker_concurrency if conf is not None else None
    set_worker_concurrency((options or {}).get("concurrency") or configured)


@after_setup_logger.connect
def _log_steps(logger: Any = None, **_: Any) -> None:
    """Every log line of a worker names the step (and so the session) it was written in."""
    if logger is not None:
        add_step_context(list(logger.handlers))


@worker_init.connect
def _check_spans(**_: Any) -> None:
    """Spans asked for without the otel extra: said once, as the worker starts."""
    check_spans(load_settings())


@worker_init.connect
def _check_redis(**_: Any) -> None:
    """A Redis that may evict cchatq's keys, or a broker on a Redis Cluster, stops the worker
    before it takes any task, in one line (EX_CONFIG); eviction is allowed with
    CCHATQ_ALLOW_EVICTION: then one loud warning."""
    try:
        settings = load_settings()
        check_state(settings)
        check_redis_memory(settings)
    except EvictingRedis as exc:
        log.critical("%s", exc)
        logging.shutdown()
        os._exit(EX_CONFIG)  # Celery would log SystemExit from a signal handler with a trace


@worker_init.connect
def _declare_queues(**_: Any) -> None:
    """On RabbitMQ: the fleet's queues (and delay queues) declared as the worker starts."""
    declare_broker(load_settings())


@worker_shutting_down.connect
def _stop_waiting(**_: Any) -> None:
    """Steps waiting for a Redis that refuses writes are handed back now, not at the end of
    their wait: a warm shutdown finishes its running tasks first."""
    STOPPING.set()


@worker_process_shutdown.connect
@worker_shutdown.connect
def _flush_spans(**_: Any) -> None:
    """A stopping worker process sends the spans it holds (a prefork child, or the main
    process of a threads pool)."""
    flush_spans()


@worker_process_shutdown.connect
@worker_shutdown.connect
def _close_mcp(**_: Any) -> None:
    """A stopping worker process closes its MCP sessions: its stdio servers stop with it."""
    close_mcp()


@worker_ready.connect
def _start_reconciler(sender: Any = None, **_: Any) -> None:
    """A control worker runs the fleet's reconciler (a Redis lock lets one act at a time)."""
    queues = {q.name for q in sender.task_consumer.queues} if sender is not None else set()
    if task_names.QUEUE_CONTROL in queues:
        start_reconciler(app)


class FleetRequest(Request):  # type: ignore[misc]
    """A delivery whose due time (a retry's eta) was stamped on Redis's clock (`_retry`), read
    here on this host's wall clock, which Celery's timer holds it against: a step retried on a
    host whose clock is ahead is not held back minutes on one whose clock is behind."""

    @property
    def eta(self) -> datetime | None:
        stamped: datetime | None = self._eta
        if stamped is None:
            return None
        return stamped - timedelta(milliseconds=fleet_clock(app).offset_ms())


# Unbounded here: a step's deliveries are counted in Redis (StepRunner) and a step that keeps
# failing is dead-lettered there, with its session ended. Celery's own cap (3) would instead
# drop the task and leave the session waiting forever.
STEP_OPTIONS = {"bind": True, "max_retries": None, "Request": FleetRequest}


def _run(task: Task, call: Any) -> dict[str, str] | None:
    """A step's task result: the outcome code of a session it ended (ids and codes only), so
    Flower and the task events show how each session ended. A put-off delivery that came
    before it fell due (a hop of a long put-off through the delay queues) is put off again
    for what is left, and does not run."""
    if DELAYED_ON_BROKER:
        due = getattr(task.request, task_names.DUE_HEADER, None)
        if isinstance(due, int) and due > fleet_clock(app).now_ms():
            _put_off(task, due, task.request.retries or 0)
    try:
        outcome = call(runner(app))
    except RetryLater as exc:
        _retry(task, exc)
    # StepDeadLettered goes through: the task ends as a FAILURE (its work is done and stored)
    return None if outcome is None else {"outcome": outcome}


def _first(task: Task) -> bool:
    """Whether this is the first delivery of the task's message: not a retry, not handed out
    again after its worker was lost (kombu marks those redelivered)."""
    request = task.request
    return not request.retries and not (request.delivery_info or {}).get("redelivered")


def _arrival(task: Task) -> Arrival:
    """Where the delivery runs (the worker's node name) and how long its message waited since
    it was sent, or fell due (SENT_HEADER; None when its sender did not stamp it)."""
    request = task.request
    sent = getattr(request, task_names.SENT_HEADER, None)
    waited = max(0, fleet_clock(app).now_ms() - sent) if isinstance(sent, int) else None
    return Arrival(worker=request.hostname or "", queue_ms=waited)


def _retry(task: Task, later: RetryLater, clock: FleetClock | None = None) -> None:
    """Run this delivery again in `countdown_s`. Celery publishes the retry as a new message
    and, when that fails (the broker is down), rejects this one with requeue=False: the step
    would be gone. Here the delivery is given back instead; if even that cannot reach the
    broker, the message stays among this consumer's taken ones, which a sweeper hands out
    again once the consumer stops beating, and the reconciler covers the rest. When it falls
    due is on Redis's clock (FleetRequest reads it on the host that takes it)."""
    due_ms = (clock or fleet_clock(app)).now_ms() + round(later.countdown_s * 1000)
    if DELAYED_ON_BROKER:
        _put_off(task, due_ms, (task.request.retries or 0) + 1)
    eta = datetime.fromtimestamp(due_ms / 1000, tz=UTC)
    # the retry shows what the delivery showed (its session's spec id), not the empty kwargs
    shown = getattr(task.request, "kwargsrepr", None) or None
    due = {task_names.SENT_HEADER: due_ms}
    try:  # its wait on the queue counts from when it falls due, not from this delivery
        raise task.retry(eta=eta, headers=due, kwargsrepr=shown) from None
    except Reject as rejected:
        log.warning("step %s: retry not published, given back", task.request.id)
        raise Reject(rejected.reason, requeue=True) from None


def _put_off(task: Task, due_ms: int, retries: int) -> NoReturn:
    """Run this delivery again at `due_ms` through RabbitMQ's delay queues, and end this one
    as Celery's retry does (acknowledged, the task shown RETRY). A put-off the broker does
    not confirm gives the delivery back to its queue instead, as `_retry` does."""
    request = task.request
    step = PutOff(
        name=task.name,
        args=list(request.args or ()),
        task_id=request.id,
        root_id=request.root_id,
        parent_id=request.parent_id,
        retries=retries,
        shown=getattr(request, "kwargsrepr", None) or "{}",
        due_ms=due_ms,
    )
    try:
        put_off(app, step)
    except StoreError as exc:
        log.warning("step %s: put-off not published, given back", request.id)
        raise Reject(exc, requeue=True) from None
    raise Retry(f"put off until {due_ms}", when=datetime.fromtimestamp(due_ms / 1000, tz=UTC))


@app.task(name=task_names.START, **STEP_OPTIONS)
def start(self: Task, batch: str, chunk_no: int) -> dict[str, str] | None:
    return _run(self, lambda r: StepRunner.start(r, batch, chunk_no, _first(self), _arrival(self)))


@app.task(name=task_names.ROUND, **STEP_OPTIONS)
def round_(self: Task, sk: str, round_no: int) -> dict[str, str] | None:
    return _run(self, lambda r: StepRunner.round(r, sk, round_no, _first(self), _arrival(self)))


@app.task(name=task_names.TOOL, **STEP_OPTIONS)
def tool(self: Task, sk: str, round_no: int, index: int) -> dict[str, str] | None:
    return _run(
        self,
        lambda r: StepRunner.tool(
            r, sk, round_no, index, first=_first(self), arrival=_arrival(self)
        ),
    )


@app.task(
    name=task_names.BACKGROUND_TOOL,
    # a background call may run for hours (its own timeout_ms, up to 6 h): its own limit
    time_limit=BACKGROUND_TIMEOUT_CAP_MS // 1000 + 120,
    **STEP_OPTIONS,
)
def background_tool(self: Task, sk: str, round_no: int, index: int) -> dict[str, str] | None:
    return _run(
        self, lambda r: StepRunner.tool(r, sk, round_no, index, True, _first(self), _arrival(self))
    )


@app.task(name=task_names.FINISH, **STEP_OPTIONS)
def finish(self: Task, sk: str) -> dict[str, str] | None:
    return _run(self, lambda r: StepRunner.finish(r, sk, _first(self), _arrival(self)))


@app.task(name=task_names.NUDGE, bind=True, ignore_result=True)
def nudge(self: Task, sk: str) -> None:
    runner(app).nudge(sk)


@app.task(name=task_names.PROGRAM, **STEP_OPTIONS)
def program(self: Task, sk: str) -> dict[str, str] | None:
    return _run(self, lambda _: program_steps(app).program(sk, _first(self), _arrival(self)))
