"""Issue 10, point 6: a worker's log lines name the step (and so the session) they were
written in; outside a step they say `-`."""

from __future__ import annotations

import logging

from celery._state import _task_stack

from worker.tasks import tool
from worker.wiring import STEP_LOG_FORMAT, StepContext


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
