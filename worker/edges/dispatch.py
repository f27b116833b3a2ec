"""Publishing the next step: the worker's only celery importer besides the app module.

Task ids are the step ids, so a step published twice is the same task in Flower, and task
arguments are ids only (no prompt or tool argument ever travels in a message). Every step's
task shows its session's spec id as its keyword arguments, so Flower's `kwargs:session=<id>`
finds all of a session's tasks.

A step is published as one LPUSH of the message Celery itself would send (task protocol 2, as
kombu's Redis transport stores it), not through `app.send_task`: Celery's send path (routing,
producer pool, kombu's publish and declare) cost ~0.75 ms of CPU a message, a sixth of a
session's worker CPU; the LPUSH costs a tenth of that. On RabbitMQ the same message goes out
as an AMQP message on a confirmed channel (worker/edges/broker_amqp.py). tests/test_dispatch.py
holds the message to what `send_task` builds, field by field, so a Celery that changes its
protocol fails there and not in a fleet.
"""

from __future__ import annotations

import base64
import uuid
from collections.abc import Sequence
from typing import Any, Protocol

from celery import Celery

from schemas import json_codec, keys, task_names
from worker.edges.broker_taken import held_for, settle
from worker.edges.commit_script import APPLY, run_commit
from worker.edges.step_leases import translated
from worker.edges.store import RedisStore
from worker.edges.task_protocol import TaskMessage, task_headers
from worker.errors import ReplyTaken
from worker.session.ports import StepPublisher
from worker.session.store_ports import Commit, NextStep


def task_message(
    name: str,
    args: list[str | int],
    task_id: str,
    queue: str,
    parent: Any = None,
    shown_id: str = "",
    sent_ms: int | None = None,
) -> bytes:
    """The message `app.send_task(name, args, task_id=..., queue=...)` would push on kombu's
    Redis transport (its headers: task_protocol.task_headers)."""
    headers = task_headers(name, args, task_id, parent, shown_id, sent_ms)
    return redis_form(TaskMessage(queue, task_id, args, headers))


def redis_form(message: TaskMessage) -> bytes:
    """A task message as kombu's Redis transport stores it on the queue's list."""
    properties = {
        "correlation_id": message.task_id,
        "reply_to": "",
        "delivery_mode": 2,
        "delivery_info": {"exchange": "", "routing_key": message.queue},
        "priority": 0,
        "body_encoding": "base64",
        "delivery_tag": str(uuid.uuid4()),
    }
    stored = {
        "body": base64.b64encode(message.body()).decode(),
        "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": message.headers,
        "properties": properties,
    }
    return json_codec.dumps(stored)


def _task(step: NextStep) -> tuple[str, str]:
    """A step's task name and task id (its step id)."""
    args = step.args
    if step.kind == "round":
        return task_names.ROUND, keys.round_step(str(args[0]), int(args[1]))
    if step.kind == "tool":
        return task_names.TOOL, keys.tool_step(str(args[0]), int(args[1]), int(args[2]))
    if step.kind == "background":
        return task_names.BACKGROUND_TOOL, keys.background_step(
            str(args[0]), int(args[1]), int(args[2])
        )
    if step.kind == "finish":
        return task_names.FINISH, keys.finish_step(str(args[0]))
    if step.kind == "program":
        return task_names.PROGRAM, keys.program_step(str(args[0]))
    raise ValueError(f"no task for a step of kind {step.kind!r}")


class BrokerApart(Protocol):
    """Where a step's messages go when the broker is not the state's Redis: one call sends a
    step's messages, or raises a StoreError (the step is retried)."""

    def send(self, messages: Sequence[TaskMessage]) -> None: ...


class RedisBroker:
    """The broker's own Redis (a client of it): a step's messages in one round trip."""

    def __init__(self, client: Any) -> None:
        self.client = client

    @translated
    def send(self, messages: Sequence[TaskMessage]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for message in messages:
            pipe.lpush(message.queue, redis_form(message))
        pipe.execute()


class CeleryDispatcher(StepPublisher):
    def __init__(self, app: Celery, store: RedisStore, broker: BrokerApart | None = None) -> None:
        """`broker`: where the messages go when the broker is not the store's Redis (another
        Redis, RabbitMQ: schemas/fleet_urls.py); None when it is, and a step's messages and
        its published marker go in one write, on the store's client."""
        self.app = app
        self.store = store
        self.broker = broker
        self._apply = store.client.register_script(APPLY)

    writes_commits = True

    @translated
    def publish(self, steps: Sequence[NextStep], commit: Commit | None = None) -> None:
        """The steps' messages with the commit, in one script (commit_script.py; the ending's,
        which holds scripts of its own, in one MULTI/EXEC): a Redis that refuses writes (full,
        failing to persist, a replica) refuses the whole commit, so a step that runs it again
        never finds half of it applied (its outcomes without its marker). With
        the broker apart: the fleet-wide writes (the batches told, the fleet's trace), the
        commit in one transaction, its published marker listing the steps, then the messages.
        A step that dies before its messages is delivered again (its message was not
        acknowledged), finds itself published and sends the steps its marker lists; its state
        is whole, and its trace said once."""
        current = self.app.current_worker_task
        parent = current.request if current is not None else None
        sent_ms = self.store.clock.now_ms()  # Redis's clock: its receiver's host may differ
        messages = [self._message(step, parent, sent_ms) for step in steps]
        client = self.store.client
        if commit is not None:  # the node of the step's session (a start step's: its batch's)
            client = self.store.on(keys.step_owner(commit.published or commit.sk))
        pipe = client.pipeline(transaction=False)
        if commit is not None and commit.outcomes:  # before the steps that read them
            self.store.add_outcomes(pipe, commit.sk, commit.outcomes)
        own = None  # the step's own message, when this process holds it (broker_taken.py)
        if self.broker is None:
            for message in messages:
                pipe.lpush(message.queue, redis_form(message))
            if commit is not None and parent is not None and not self.store.cluster:
                own = held_for(str(parent.id))
                if own is not None:
                    pipe.lrem(own.held_in, 1, own.raw)
        fleet = self.store.fleet_pipe(pipe)
        if commit is not None:
            if commit.notify:
                self.store.add_notify(fleet, commit.sk, commit.notify, commit.ended_as)
            if commit.published is not None:  # with the messages (or, apart, what they are)
                unsent = steps if self.broker is not None else ()
                self.store.mark_published(pipe, commit.published, unsent)
            if commit.trace is not None:  # after the marker: an ending deletes it
                self.store.add_trace(pipe, commit.trace, fleet)
            self.store.flush_fleet(fleet, pipe)
        claim = None
        if commit is not None and commit.reply is not None:
            claim = self.store.reply_claim(commit.sk, commit.reply)
        if (len(pipe) or claim) and run_commit(pipe, self._apply, client, claim) is not None:
            raise ReplyTaken(commit.published if commit and commit.published else "")
        if own is not None:
            settle(own.tag)
        if self.broker is not None and messages:
            self.broker.send(messages)

    def _message(self, step: NextStep, parent: Any, sent_ms: int) -> TaskMessage:
        """A step's message, to its queue (on Redis: the queue's list is the queue's name,
        priority 0, no key prefix: wiring's config)."""
        name, task_id = _task(step)
        shown_id = step.shown_id or self._spec_id(str(step.args[0]))
        args = list(step.args)
        headers = task_headers(name, args, task_id, parent, shown_id, sent_ms)
        return TaskMessage(task_names.ROUTES[name], task_id, args, headers)

    def _spec_id(self, sk: str) -> str:
        """The spec id of a session whose step was published by one that did not read its spec
        (a dead-lettered step's finish, a cancel, the reconciler's nudges): from the store's
        cache of specs, else one read. Shown only; a spec that cannot be read shows none."""
        try:
            return self.store.load_spec(sk).id
        except Exception:
            return ""
