"""A step's task message in Celery's task protocol 2, apart from how a broker carries it: its
headers and its body, built once here for both forms (kombu's Redis transport's JSON,
worker/edges/dispatch.py; an AMQP message on RabbitMQ, worker/edges/broker_amqp.py).
tests/test_dispatch.py and tests/test_broker_amqp.py hold both forms to what `send_task`
puts on each broker, field by field."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from celery.utils.nodenames import anon_nodename

from schemas import task_names

# the options of a task with no callbacks, as Celery embeds them in every message body
EMBED = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}


@dataclass(frozen=True)
class TaskMessage:
    """A task message on its way to `queue`: its protocol-2 headers and its arguments."""

    queue: str
    task_id: str
    args: list[str | int]
    headers: dict[str, Any]

    def body(self) -> bytes:
        """The body Celery sends: positional arguments, no keyword ones, the embedded options."""
        return json.dumps([self.args, {}, EMBED]).encode()  # byte for byte send_task's


def task_headers(
    name: str,
    args: list[str | int],
    task_id: str,
    parent: Any = None,
    shown_id: str = "",
    sent_ms: int | None = None,
) -> dict[str, Any]:
    """The headers `app.send_task(name, args, task_id=...)` sends, from a worker running task
    `parent` (Flower links the steps of a session by root and parent). `shown_id`, the
    session's spec id, is shown as the task's keyword arguments (Flower finds it with
    `kwargs:session=<id>`); the task gets none. `sent_ms` is stamped as the header
    task_names.SENT_HEADER, as `send_task(headers={...})` adds a header: the worker that takes
    the message reads how long it waited."""
    root_id = (getattr(parent, "root_id", None) or parent.id) if parent is not None else task_id
    headers = {
        "lang": "py",
        "task": name,
        "id": task_id,
        "shadow": None,
        "eta": None,
        "expires": None,
        "group": None,
        "group_index": None,
        "retries": 0,
        "timelimit": [None, None],
        "root_id": root_id,
        "parent_id": parent.id if parent is not None else None,
        "argsrepr": repr(args),
        "kwargsrepr": repr({"session": shown_id}) if shown_id else "{}",
        "origin": anon_nodename(),
        "ignore_result": None,
        "replaced_task_nesting": 0,
        "stamped_headers": None,
        "stamps": {},
    }
    if sent_ms is not None:
        headers[task_names.SENT_HEADER] = sent_ms
    return headers
