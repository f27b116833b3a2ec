"""The Celery shell (worker/tasks.py): a delivery to run again is never dropped."""

from __future__ import annotations

from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import pytest
from celery.exceptions import Reject, Retry

import worker.tasks
from schemas import task_names
from schemas.fleet_clock import FleetClock, wall_ms
from worker.edges.broker_amqp import PutOff
from worker.errors import BrokerUnconfirmedError, RetryLater
from worker.tasks import FleetRequest, _retry

AHEAD_MS = 120_000  # Redis's clock ahead of this host's in these tests


def redis_ahead() -> FleetClock:
    """Redis's clock as a host 2 minutes behind it reads it (the offset it measures)."""
    return FleetClock(lambda: wall_ms() + AHEAD_MS)


class _Task:
    """A bound task whose retry publishes, or fails as Celery's does when the broker is down
    (Task.retry: `except Exception as exc: raise Reject(exc, requeue=False)`)."""

    def __init__(self, broker_up: bool) -> None:
        self.broker_up = broker_up
        self.name = task_names.ROUND
        self.request = SimpleNamespace(id="abc.r0", kwargsrepr="{'session': 'eval/1'}")
        self.etas: list[datetime] = []
        self.headers: list[dict[str, Any]] = []
        self.kwargsreprs: list[str | None] = []

    def retry(self, eta: datetime, headers: dict[str, Any], kwargsrepr: str | None) -> Any:
        self.etas.append(eta)
        self.headers.append(headers)
        self.kwargsreprs.append(kwargsrepr)
        if not self.broker_up:
            raise Reject(ConnectionError("broker down"), requeue=False)
        raise Retry(when=eta)


def test_a_retry_falls_due_on_redis_clock() -> None:
    """Its due time is stamped on Redis's clock (here 2 minutes ahead of this host's), not
    the host's: the worker that takes it reads it on its own (FleetRequest)."""
    task = _Task(broker_up=True)
    before = wall_ms() + AHEAD_MS
    with pytest.raises(Retry):
        _retry(task, RetryLater(1.5, "step is leased"), redis_ahead())
    after = wall_ms() + AHEAD_MS
    (eta,) = task.etas
    assert before + 1500 - 1 <= eta.timestamp() * 1000 <= after + 1500 + 1
    # the retry's wait on its queue counts from when it falls due, not from when it was put off
    (headers,) = task.headers
    assert headers[task_names.SENT_HEADER] == round(eta.timestamp() * 1000)
    # and it shows its session's spec id as the delivery did (Celery's own: its empty kwargs)
    assert task.kwargsreprs == ["{'session': 'eval/1'}"]


def test_a_retry_falls_due_on_the_host_that_takes_it_as_on_the_one_that_sent_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A retry sent from a host whose clock is 2 minutes ahead of Redis's, taken by this one,
    2 minutes behind it: Celery's timer (which compares the eta to the local wall clock) is
    handed the eta on the taker's clock, due in 1.5 s there too, not in 4 minutes."""
    task = _Task(broker_up=True)
    sender = FleetClock(lambda: wall_ms() + AHEAD_MS, wall=lambda: wall_ms() + 2 * AHEAD_MS)
    with pytest.raises(Retry):
        _retry(task, RetryLater(1.5, "rate limited"), sender)
    (stamped,) = task.etas
    taker = redis_ahead()
    monkeypatch.setattr(worker.tasks, "fleet_clock", lambda _app: taker)
    request = FleetRequest.__new__(FleetRequest)  # a delivery of that message, on this host
    request._eta = stamped
    local_eta = request.eta
    assert local_eta is not None
    due_s = (local_eta - datetime.now(UTC)).total_seconds()
    assert 1.0 < due_s <= 1.5
    request._eta = None
    assert request.eta is None


def test_a_retry_the_broker_cannot_take_gives_the_delivery_back() -> None:
    """Celery would reject the delivery with requeue=False: the step's message gone."""
    task = _Task(broker_up=False)
    with pytest.raises(Reject) as rejected:
        _retry(task, RetryLater(1.0, "store down"))
    assert rejected.value.requeue is True


def test_on_quorum_queues_a_retry_is_put_off_through_the_broker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Not Celery's eta (the worker would hold it): a put-off to the delay queues, due on
    Redis's clock, one retry more, the same lineage and shown kwargs; this delivery ends as a
    retry. A put-off the broker does not confirm gives the delivery back."""
    sent: list[PutOff] = []
    monkeypatch.setattr(worker.tasks, "DELAYED_ON_BROKER", True)
    monkeypatch.setattr(worker.tasks, "put_off", lambda _app, step: sent.append(step))
    task = _Task(broker_up=True)
    task.request = SimpleNamespace(
        id="abc.r1", args=["abc", 1], root_id="abc.r0", parent_id="abc.t0.0", retries=1,
        kwargsrepr="{'session': 'eval/1'}",
    )  # fmt: skip
    before = wall_ms() + AHEAD_MS
    with pytest.raises(Retry):
        _retry(task, RetryLater(0.4, "rate limited"), redis_ahead())
    assert task.etas == []  # Celery's retry was never asked
    (step,) = sent
    assert before + 400 - 1 <= step.due_ms <= wall_ms() + AHEAD_MS + 400 + 1
    assert (step.name, step.args, step.task_id) == (task_names.ROUND, ["abc", 1], "abc.r1")
    assert (step.root_id, step.parent_id, step.retries) == ("abc.r0", "abc.t0.0", 2)
    assert step.shown == "{'session': 'eval/1'}"

    def refused(_app: Any, _step: PutOff) -> None:
        raise BrokerUnconfirmedError("messages for ['llm'] not confirmed")

    monkeypatch.setattr(worker.tasks, "put_off", refused)
    with pytest.raises(Reject) as rejected:
        _retry(task, RetryLater(0.4, "rate limited"), redis_ahead())
    assert rejected.value.requeue is True
