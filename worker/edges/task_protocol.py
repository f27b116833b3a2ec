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
from kombu.serialization import registry
from kombu.utils import json as kombu_json

from schemas import json_codec, task_names

# the options of a task with no callbacks, as Celery embeds them in every message body
EMBED = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}
_BODY_TAIL = json.dumps([{}, EMBED])[1:]  # after the arguments: `{}, {"callbacks": ...}]`


@dataclass(frozen=True)
class TaskMessage:
    """A task message on its way to `queue`: its protocol-2 headers and its arguments."""

    queue: str
    task_id: str
    args: list[str | int]
    headers: dict[str, Any]

    def body(self) -> bytes:
        """The body Celery sends: positional arguments, no keyword ones, the embedded options."""
        # byte for byte send_task's json.dumps([args, {}, EMBED]), its constant part made once
        return f"[{json.dumps(self.args)}, {_BODY_TAIL}".encode()


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


def decode_json_fast() -> None:
    """kombu decodes JSON messages (a task's body, a control command) by orjson: 3.7 us a task
    body against its own decoder's 7.8 (the standard library's, with a hook for its tagged
    types). Encoding stays kombu's, byte for byte."""
    registry.register(  # type: ignore[no-untyped-call]
        "json", kombu_json.dumps, _decoded, "application/json", "utf-8"
    )


def _decoded(data: str | bytes | bytearray | memoryview) -> Any:
    """What kombu's decoder returns: a message holding one of its tagged types (`__type__`: a
    datetime, a UUID, from another producer) is decoded by kombu's own; any other by
    json_codec (orjson, and the standard library's json where orjson refuses: NaN, integers
    past 64 bits), which is kombu's decoder without its hook."""
    raw = data.tobytes() if isinstance(data, memoryview) else data
    tagged = '"__type__"' in raw if isinstance(raw, str) else b'"__type__"' in raw
    if tagged:
        return kombu_json.loads(raw)  # type: ignore[no-untyped-call]
    return json_codec.loads(raw)
