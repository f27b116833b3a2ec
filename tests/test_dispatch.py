"""The CeleryDispatcher pushes the message Celery's own `send_task` would: the same task protocol 2
headers, properties and body, on the same Redis list. Held field by field against the installed
Celery (on the private Redis: fleet marker), so an upgrade that changes the protocol fails here."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis
from celery import Celery

from producer.fleet import Fleet
from schemas import keys, task_names
from schemas.bodies import dump_body
from worker.codecs.reply import Reply
from worker.edges.broker import TRANSPORT
from worker.edges.dispatch import CeleryDispatcher, RedisBroker, task_message
from worker.edges.store import RedisStore
from worker.errors import ReplyTaken
from worker.session.outcomes import ToolOutcome
from worker.session.store_ports import Commit, NextStep, PendingReply

pytestmark = pytest.mark.fleet
REDIS_DB = 11
# differ by nature between two sends: a fresh delivery tag, a reply queue per app
PER_SEND = {"delivery_tag", "reply_to"}


@pytest.fixture
def broker(base_fleet: Fleet) -> Iterator[tuple[Celery, redis.Redis]]:
    url = base_fleet.redis_url.rsplit("/", 1)[0] + f"/{REDIS_DB}"
    app = Celery("contract", broker=url)
    app.conf.update(
        broker_transport=TRANSPORT,
        task_serializer="json",
        task_routes={name: {"queue": q} for name, q in task_names.ROUTES.items()},
    )
    client = redis.Redis.from_url(url)
    client.flushdb()
    yield app, client
    client.flushdb()
    client.close()


def _pushed(client: redis.Redis, queue: str) -> dict[str, Any]:
    raw: Any = client.rpop(queue)
    assert raw is not None, f"nothing on {queue}"
    return dict(json.loads(raw))


@dataclass
class Parent:
    id: str
    root_id: str | None


def test_the_pushed_message_is_the_one_send_task_pushes(
    broker: tuple[Celery, redis.Redis],
) -> None:
    app, client = broker
    args: list[str | int] = ["sk-1", 2, 0]
    step = keys.tool_step("sk-1", 2, 0)
    queue = task_names.ROUTES[task_names.TOOL]
    sent = 1_700_000_000_123  # the header a sender stamps: when it sent the message
    app.send_task(
        task_names.TOOL, args=args, task_id=step, queue=queue, argsrepr=repr(args),
        headers={task_names.SENT_HEADER: sent},
    )  # fmt: skip
    theirs = _pushed(client, queue)
    before = time.time_ns() // 1_000_000
    CeleryDispatcher(app, RedisStore(client, ttl_s=60)).tool("sk-1", 2, 0)
    after = time.time_ns() // 1_000_000
    ours = _pushed(client, queue)
    assert ours.keys() == theirs.keys()
    assert before <= ours["headers"][task_names.SENT_HEADER] <= after
    ours["headers"][task_names.SENT_HEADER] = sent
    assert ours["headers"] == theirs["headers"]
    assert {k: v for k, v in ours["properties"].items() if k not in PER_SEND} == {
        k: v for k, v in theirs["properties"].items() if k not in PER_SEND | {"argsrepr"}
    }
    assert json.loads(base64.b64decode(ours["body"])) == json.loads(
        base64.b64decode(theirs["body"])
    )
    assert {k: ours[k] for k in ("content-type", "content-encoding")} == {
        k: theirs[k] for k in ("content-type", "content-encoding")
    }


def test_a_step_published_from_a_task_names_it_as_parent_and_keeps_its_root() -> None:
    message = json.loads(
        task_message(task_names.ROUND, ["sk", 1], "sk.r1", "llm", Parent("sk.t0.0", "sk.r0"))
    )
    assert message["headers"]["parent_id"] == "sk.t0.0"
    assert message["headers"]["root_id"] == "sk.r0"
    alone = json.loads(task_message(task_names.ROUND, ["sk", 1], "sk.r1", "llm"))
    assert (alone["headers"]["parent_id"], alone["headers"]["root_id"]) == (None, "sk.r1")


def test_a_steps_messages_and_its_published_marker_go_in_one_write(
    broker: tuple[Celery, redis.Redis],
) -> None:
    app, client = broker
    dispatcher = CeleryDispatcher(app, RedisStore(client, ttl_s=60))
    assert dispatcher.writes_commits  # the marker is written with the steps: not by the caller
    dispatcher.publish(
        [NextStep("tool", ("sk-2", 0, 0)), NextStep("tool", ("sk-2", 0, 1))],
        Commit("sk-2", published=keys.round_step("sk-2", 0)),
    )
    queue = task_names.ROUTES[task_names.TOOL]
    assert [_pushed(client, queue)["headers"]["id"] for _ in range(2)] == [
        keys.tool_step("sk-2", 0, 0),
        keys.tool_step("sk-2", 0, 1),
    ]
    assert client.get(keys.step_state(keys.round_step("sk-2", 0))) == keys.STEP_DONE
    assert 0 < int(client.ttl(keys.step_state(keys.round_step("sk-2", 0)))) <= 60


def test_a_commit_writes_its_outcomes_and_notifications_with_its_steps(
    broker: tuple[Celery, redis.Redis],
) -> None:
    """A tool step's commit: its outcome (first writer wins), the next round, the batches told,
    its marker: one write."""
    app, client = broker
    store = RedisStore(client, ttl_s=60)
    first, later = ToolOutcome.success("sunny"), ToolOutcome.success("rain")
    client.set(keys.tool_out("sk-3", 0, 1), dump_body(first.to_json()))  # stored before
    CeleryDispatcher(app, store).publish(
        [NextStep("round", ("sk-3", 1))],
        Commit(
            "sk-3",
            published=keys.tool_step("sk-3", 0, 0),
            outcomes={(0, 0): first, (0, 1): later},
            notify=("b1",),
        ),
    )
    assert _pushed(client, task_names.ROUTES[task_names.ROUND])["headers"]["id"] == (
        keys.round_step("sk-3", 1)
    )
    assert client.get(keys.tool_out("sk-3", 0, 0)) == dump_body(first.to_json())
    assert client.get(keys.tool_out("sk-3", 0, 1)) == dump_body(first.to_json())
    assert client.lrange(keys.done_list("b1"), 0, -1) == [b"sk-3"]
    assert client.get(keys.step_state(keys.tool_step("sk-3", 0, 0))) == keys.STEP_DONE


def _round_reply(text: str) -> PendingReply:
    completion = {"choices": [{"message": {"role": "assistant", "content": text}}]}
    return PendingReply(0, Reply.parse(completion))


def test_a_round_commit_stores_its_reply_first_and_writes_nothing_when_another_won(
    broker: tuple[Celery, redis.Redis],
) -> None:
    """A round's reply rides its step's commit, first writer wins: a commit that finds
    another delivery's reply stored writes none of its steps, marker or reply (ReplyTaken);
    one that finds its own (its earlier send landed) writes the rest."""
    app, client = broker
    store = RedisStore(client, ttl_s=60)
    dispatcher = CeleryDispatcher(app, store)
    queue = task_names.ROUTES[task_names.TOOL]
    step = keys.round_step("sk-4", 0)
    theirs, mine = _round_reply("theirs"), _round_reply("mine")
    client.set(keys.model_out("sk-4", 0), store.reply_claim("sk-4", theirs).value)
    commit = Commit("sk-4", published=step, reply=mine)
    with pytest.raises(ReplyTaken):
        dispatcher.publish([NextStep("tool", ("sk-4", 0, 0))], commit)
    assert client.llen(queue) == 0 and client.get(keys.step_state(step)) is None
    assert client.get(keys.model_out("sk-4", 0)) == store.reply_claim("sk-4", theirs).value

    client.set(keys.model_out("sk-4", 0), store.reply_claim("sk-4", mine).value)
    dispatcher.publish([NextStep("tool", ("sk-4", 0, 0))], commit)
    assert client.get(keys.step_state(step)) == keys.STEP_DONE
    assert _pushed(client, queue)["headers"]["id"] == keys.tool_step("sk-4", 0, 0)

    client.delete(keys.model_out("sk-5", 0))  # none stored: this commit's is
    dispatcher.publish([NextStep("tool", ("sk-5", 0, 0))], Commit("sk-5", reply=mine))
    assert client.get(keys.model_out("sk-5", 0)) == store.reply_claim("sk-5", mine).value
    assert 0 < int(client.ttl(keys.model_out("sk-5", 0))) <= 60


class DiedSending:
    """A broker apart whose worker dies (here: raises) before its messages go out."""

    def send(self, messages: Any) -> None:
        raise SystemExit("killed between the commit and the messages")


def test_apart_a_step_that_died_before_its_messages_sends_them_when_delivered_again(
    broker: tuple[Celery, redis.Redis],
) -> None:
    """With the broker apart, the commit's marker lists the steps it publishes: a delivery
    that finds the step published (its message was never acknowledged) sends them again."""
    app, client = broker
    store = RedisStore(client, ttl_s=60)
    step, steps = keys.tool_step("sk-4", 0, 0), [NextStep("round", ("sk-4", 1), "id-4")]
    with pytest.raises(SystemExit):
        CeleryDispatcher(app, store, broker=DiedSending()).publish(steps, Commit("sk-4", step))
    queue = task_names.ROUTES[task_names.ROUND]
    assert client.llen(queue) == 0  # nothing sent
    again = store.begin_step(step, 1000, None, "sk-4")
    assert again.published and again.unsent == tuple(steps)
    assert store.published_steps([step]) == {step}
    # what the guard does with them (worker/session/guard.py)
    CeleryDispatcher(app, store, broker=RedisBroker(client)).publish(again.unsent)
    assert _pushed(client, queue)["headers"]["id"] == keys.round_step("sk-4", 1)
    # on one Redis the marker lists nothing: the messages went in its own write
    CeleryDispatcher(app, store).publish(steps, Commit("sk-4", keys.tool_step("sk-4", 0, 1)))
    assert store.begin_step(keys.tool_step("sk-4", 0, 1), 1000, None, "sk-4").unsent == ()
