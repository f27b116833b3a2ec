"""The control worker of the put-off tests (tests/amqp_fleet.py): cchatq's worker app with one
task more, which a step's put-off path runs as every step does (`_run`, `_retry`): its first
delivery raises RetryLater for the delay it is given, and the delivery that runs it records,
in the state's Redis, when it fell due and when it ran (both on Redis's clock)."""

from __future__ import annotations

import json
from typing import Any

from celery import Task

from schemas import task_names
from worker.errors import RetryLater
from worker.tasks import STEP_OPTIONS, _run, app
from worker.wiring import _current, fleet_clock

PUTOFF = "cchatq.test_putoff"
RAN = "test:putoffs:ran"  # a list of {"key", "due_ms", "ran_ms", "retries", "via"}


@app.task(name=PUTOFF, **STEP_OPTIONS)  # type: ignore[untyped-decorator]
def putoff(self: Task, key: str, delay_ms: int) -> Any:
    def call(_: Any) -> None:
        if not self.request.retries:
            raise RetryLater(delay_ms / 1000, "put off by the test")
        ran_ms = fleet_clock(app).now_ms()
        due_ms = getattr(self.request, task_names.SENT_HEADER, None)
        # the queues RabbitMQ dead-lettered it from (a delay queue's, on quorum queues)
        via = [str(d.get("queue")) for d in getattr(self.request, "x-death", None) or []]
        line = {"key": key, "due_ms": due_ms, "ran_ms": ran_ms,
                "retries": self.request.retries, "via": via}  # fmt: skip
        _current(app).store.client.rpush(RAN, json.dumps(line))

    return _run(self, call)
