"""The Celery shell (worker/tasks.py): a delivery to run again is never dropped."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from celery.exceptions import Reject, Retry

from schemas import task_names
from worker.errors import RetryLater
from worker.session.trace import now_ms
from worker.tasks import _retry


class _Task:
    """A bound task whose retry publishes, or fails as Celery's does when the broker is down
    (Task.retry: `except Exception as exc: raise Reject(exc, requeue=False)`)."""

    def __init__(self, broker_up: bool) -> None:
        self.broker_up = broker_up
        self.request = SimpleNamespace(id="abc.r0", kwargsrepr="{'session': 'eval/1'}")
        self.countdowns: list[float] = []
        self.headers: list[dict[str, Any]] = []
        self.kwargsreprs: list[str | None] = []

    def retry(self, countdown: float, headers: dict[str, Any], kwargsrepr: str | None) -> Any:
        self.countdowns.append(countdown)
        self.headers.append(headers)
        self.kwargsreprs.append(kwargsrepr)
        if not self.broker_up:
            raise Reject(ConnectionError("broker down"), requeue=False)
        raise Retry(when=countdown)


def test_a_retry_is_published_with_its_countdown() -> None:
    task = _Task(broker_up=True)
    before = now_ms()
    with pytest.raises(Retry):
        _retry(task, RetryLater(1.5, "step is leased"))
    assert task.countdowns == [1.5]
    # the retry's wait on its queue counts from when it falls due, not from when it was put off
    (headers,) = task.headers
    assert before + 1500 <= headers[task_names.SENT_HEADER] <= now_ms() + 1500
    # and it shows its session's spec id as the delivery did (Celery's own: its empty kwargs)
    assert task.kwargsreprs == ["{'session': 'eval/1'}"]


def test_a_retry_the_broker_cannot_take_gives_the_delivery_back() -> None:
    """Celery would reject the delivery with requeue=False: the step's message gone."""
    task = _Task(broker_up=False)
    with pytest.raises(Reject) as rejected:
        _retry(task, RetryLater(1.0, "store down"))
    assert rejected.value.requeue is True
