"""Issue 10, point 6: a worker's log lines name the step (and so the session) they were
written in; outside a step they say `-`."""

from __future__ import annotations

import logging
import sys

import redis
from celery._state import _task_stack
from celery.exceptions import Reject
from kombu.exceptions import OperationalError

from worker.tasks import tool
from worker.wiring import STEP_LOG_FORMAT, HandedBackLine, StepContext


def line(message: str) -> str:
    record = logging.LogRecord(
        "worker.session.guard", logging.WARNING, __file__, 1, message, (), None
    )
    assert StepContext().filter(record)
    return logging.Formatter(STEP_LOG_FORMAT).format(record)


def test_a_log_line_names_the_step_it_was_written_in() -> None:
    assert " - worker.session.guard: outside" in line("outside")
    tool.push_request(id="0f3a9c.r0.t1", args=["0f3a9c", 0, 1])
    _task_stack.push(tool)
    try:
        written = line("step failed (try 1): StoreError")
    finally:
        _task_stack.pop()
        tool.pop_request()
    assert "step=0f3a9c.r0.t1 worker.session.guard: step failed (try 1): StoreError" in written


def _reject_record(reason: Exception) -> logging.LogRecord:
    try:
        raise Reject(reason, requeue=True)
    except Reject:
        return logging.LogRecord(
            "celery.app.trace", logging.WARNING, __file__, 1, "reject", (), sys.exc_info()
        )


def test_a_step_handed_back_for_an_unanswering_or_refusing_redis_logs_no_traceback() -> None:
    """A partition or a failover hands steps back by the dozen: one line each, no traceback;
    a Reject for any other reason keeps Celery's traceback."""
    quiet = [
        OperationalError("Timeout connecting to server"),
        redis.ConnectionError("Error 111 connecting to 10.0.0.1:6379. Connection refused."),
        redis.ResponseError("MISCONF Errors writing to the AOF file"),
    ]
    for reason in quiet:
        record = _reject_record(reason)
        assert HandedBackLine().filter(record) and record.exc_info is None, reason
    record = _reject_record(ValueError("a bug"))
    assert HandedBackLine().filter(record) and record.exc_info is not None
