"""The steps driven through the in-memory twins (worker/session/twins/): no Redis, no
workers. Each test runs whole sessions step by step, as Celery would, and asserts the body
and transcript they end with, including when the store fails or the engine cannot go on."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest

from fixtures.replay.conversation import read_envelope
from schemas import keys
from schemas.spec_types import SessionSpec, spec_from_json
from tests.test_engine import WEATHER_FN
from worker.codecs.reply import Reply
from worker.config import BackendConfig, FleetConfig, Settings
from worker.errors import ProviderRequestError
from worker.session.engine import tool_run
from worker.session.steps import StepRunner
from worker.session.store_ports import NextStep
from worker.session.twins.failing import FailingStore
from worker.session.twins.models import OpenRateControl, OpenRateLimiter, ScriptedProvider
from worker.session.twins.queue import Published, StepQueue, run_step
from worker.session.twins.store import MemoryStore
from worker.session.twins.tools import PythonTools

SK = "sk1"


def reply(content: str | None = None, *calls: tuple[str, str, str]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [
            {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
            for cid, name, args in calls
        ]
    return {
        "id": "c",
        "object": "chat.completion",
        "model": "m",
        "choices": [
            {"index": 0, "message": message, "finish_reason": "tool_calls" if calls else "stop"}
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }


def spec(*functions: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {
        "id": "t/1",
        "provider": "replay",
        "model": "m",
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [
            {"module_sha256": "0" * 64, "export": f["name"], "table_index": None, "function": f}
            for f in functions
        ],
        "params": {},
        "flags": {"auto_tool_call": True, "metrics": True, "strict_unknown_tool": False},
        "limits": {},
        **extra,
    }


def answer_with_tool_result(request: Any) -> dict[str, Any]:
    return reply(f"Tool said: {read_envelope(request.messages[-1]['content'])}")


def weather_model(request: Any) -> dict[str, Any]:
    """Asks for the weather, then repeats what the tool said: the same reply to the same
    request, so a model call that is repeated (its reply was never stored) changes nothing."""
    if request.messages[-1]["role"] == "tool":
        return answer_with_tool_result(request)
    return reply(None, ("call_1", "get_weather", '{"city":"Paris"}'))


@dataclass
class Pipeline:
    store: MemoryStore
    queue: StepQueue
    runner: StepRunner
    provider: ScriptedProvider
    tools: PythonTools

    def run(self, step: Published) -> None:
        run_step(self.runner, step)

    def drain(self) -> int:
        return self.queue.drain(self.runner)

    def body(self) -> dict[str, Any]:
        body = self.store.result(SK)
        assert body is not None, "the session has no result"
        return body

    def transcript(self) -> list[dict[str, Any]]:
        record = self.store.record(SK)
        assert record is not None
        return list(record["transcript"])


def pipeline(
    script: list[Any],
    store: Any = None,
    tools: dict[str, Any] | None = None,
    trace: bool = True,
) -> Pipeline:
    memory = MemoryStore()
    queue = StepQueue()
    provider = ScriptedProvider(list(script))
    python_tools = PythonTools(tools or {"get_weather": lambda args: "sunny"})
    runner = StepRunner(
        store=store(memory) if store else memory,
        dispatch=queue,
        provider_for=provider,
        tools=lambda: python_tools,
        settings=Settings(
            fleet=FleetConfig(backends={"replay": BackendConfig(name="replay")}),
            max_step_attempts=3,
            trace=trace,
        ),
        rate_limiter=OpenRateLimiter(),
        rate_control=OpenRateControl(),
    )
    return Pipeline(memory, queue, runner, provider, python_tools)


def submit(p: Pipeline, session_spec: dict[str, Any]) -> None:
    p.store.submit(SK, spec_from_json(session_spec), batch="b")
    p.queue.round(SK, 0)


WEATHER_SCRIPT = [weather_model] * 4


def test_a_session_runs_its_tool_and_finishes() -> None:
    p = pipeline(WEATHER_SCRIPT)
    submit(p, spec(WEATHER_FN))
    p.drain()
    assert p.body()["choices"][0]["message"]["content"] == "Tool said: sunny"
    assert [m["role"] for m in p.transcript()] == ["user", "assistant", "tool", "assistant"]
    assert [c.arguments for c in p.tools.calls] == [b'{"city":"Paris"}']
    assert list(p.store.done["b"]) == [SK]  # the waiting batch is told
    assert p.queue.retries == 0


def test_a_round_whose_reply_another_delivery_stored_first_runs_on_that_reply() -> None:
    """Two deliveries of one round (a lease lost in a cut): the other stores its reply while
    this one's model call runs. This one's commit writes nothing (its reply rides it, first
    writer wins), and its body runs again on the stored reply: the two tools the stored reply
    asked for run, once each, with no try spent and no second call of this delivery's."""
    p = pipeline([])

    def raced(request: Any) -> dict[str, Any]:
        calls = [("call_8", "get_weather", '{"city":"Rome"}'),
                 ("call_9", "get_weather", '{"city":"Oslo"}')]  # fmt: skip
        theirs = Reply.parse(reply(None, *calls))
        session_spec = p.store.load_spec(SK)
        assert isinstance(session_spec, SessionSpec)
        runs = [tool_run(session_spec, theirs, i) for i in range(2)]
        p.store.store_round(SK, 0, theirs, tuple(r for r in runs if r is not None))
        return reply(None, ("call_1", "get_weather", '{"city":"Paris"}'))

    p.provider.script.extend([raced, answer_with_tool_result])
    submit(p, spec(WEATHER_FN))
    p.drain()
    assert sorted(c.arguments for c in p.tools.calls) == [b'{"city":"Oslo"}', b'{"city":"Rome"}']
    assert p.body()["choices"][0]["message"]["content"] == "Tool said: sunny"
    assert len(p.provider.requests) == 2
    assert p.queue.retries == 0
    assert p.store.tries[keys.round_step(SK, 0)] == 1


@pytest.mark.parametrize(
    "method",
    # a step's session and tool inputs are read with begin_step, in its round trip
    ["load_spec", "begin_step", "store_round", "ending_inputs"],
)
def test_a_store_failing_on_a_steps_read_retries_the_step_and_the_session_finishes(
    method: str,
) -> None:
    failing: list[FailingStore] = []

    def once(memory: MemoryStore) -> FailingStore:
        failing.append(FailingStore(memory, **{method: 1}))
        return failing[0]

    p = pipeline(WEATHER_SCRIPT, store=once)
    submit(p, spec(WEATHER_FN))
    p.drain()  # no producer, no nudge: the step's own retry finishes the session
    assert failing[0].raised == [method]
    assert p.body()["choices"][0]["message"]["content"] == "Tool said: sunny"
    assert p.store.deadletters == []
    # the model was called once per round, once more only when its reply was never stored
    assert len(p.provider.requests) == (3 if method == "store_round" else 2)
    if method != "load_spec":  # the spec read for the lease is advisory: no retry needed
        assert p.queue.retries >= 1


def test_a_schema_that_fails_only_at_call_time_is_a_validation_error_to_the_model() -> None:
    # infinitely self-referencing: a valid schema whose every $ref resolves, which passes
    # the submit check and loops only when arguments are validated, where it stops short of
    # Python's recursion limit (tests/test_schema_depth.py), always with the same message
    looping = {"name": "loop", "parameters": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#"}}}}
    p = pipeline([reply(None, ("call_1", "loop", '{"x":1}')), answer_with_tool_result])
    submit(p, spec(looping))
    p.drain()
    said = json.loads(p.body()["choices"][0]["message"]["content"].removeprefix("Tool said: "))
    assert said["error"]["code"] == "VALIDATION_ERROR"
    assert said["error"]["message"].startswith(
        "the tool's parameters schema cannot be checked: its $ref recursion runs too deep"
    )
    assert p.tools.calls == []  # never ran


def test_a_dangling_ref_that_reached_the_store_ends_with_a_validation_error_not_a_hang() -> None:
    # what submit rejects; a spec stored by an older producer still must not hang
    dangling = {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"$ref": "#/$defs/city"}}},
    }
    p = pipeline(WEATHER_SCRIPT)
    submit(p, spec(dangling))
    p.drain()
    said = json.loads(p.body()["choices"][0]["message"]["content"].removeprefix("Tool said: "))
    assert said["error"]["code"] == "VALIDATION_ERROR"
    assert p.store.deadletters == []


def test_a_step_failing_every_try_is_dead_lettered_and_the_session_ends() -> None:
    p = pipeline(WEATHER_SCRIPT, store=lambda m: FailingStore(m, store_tool_outcomes=99))
    submit(p, spec(WEATHER_FN))
    p.drain()
    body = p.body()
    assert body["error"]["code"] == "step_failed"
    assert keys.tool_step(SK, 0, 0) in body["error"]["message"]
    assert [step for step, _ in p.store.deadletters] == [keys.tool_step(SK, 0, 0)]
    assert p.queue.failed == [("tool", SK, 0, 0)]  # its task ends as a Celery FAILURE
    tool_message = p.transcript()[-1]
    assert tool_message["role"] == "tool"
    assert json.loads(tool_message["content"])["error"]["code"] == "NOT_RUN"


def test_a_finish_step_failing_every_try_still_writes_the_body_without_rerunning() -> None:
    # the last round cannot end the session (it is dead-lettered), nor can the finish step
    p = pipeline([reply("hello")], store=lambda m: FailingStore(m, ending_inputs=99))
    submit(p, spec())
    p.drain()
    assert p.body()["error"]["code"] == "step_failed"
    record = p.store.record(SK)
    assert record is not None and record["id"] == "t/1" and record["transcript"] == []
    assert [step for step, _ in p.store.deadletters] == [
        keys.round_step(SK, 0),
        keys.finish_step(SK),
    ]


def test_an_engine_that_cannot_build_the_transcript_ends_with_internal_error() -> None:
    p = pipeline([reply("hello")])
    broken = spec()
    submit(p, broken)
    p.drain()  # the round ran; now break what the finish step reads: a reply it cannot plan on
    p.store.responses.clear()
    p.store.records.clear()
    unreadable = {"choices": [{"message": {"role": "assistant", "tool_calls": [{"id": "x"}]}}]}
    p.store.replies[(SK, 0)] = json.dumps(unreadable).encode()
    p.store.published.discard(keys.finish_step(SK))
    p.queue.finish(SK)
    p.drain()
    assert p.body()["error"]["code"] == "internal_error"
    assert "KeyError" in p.body()["error"]["message"]


def test_a_provider_error_ends_the_session_with_its_body() -> None:
    p = pipeline([ProviderRequestError("HTTP 400: bad request", status=400)])
    submit(p, spec())
    p.drain()
    assert p.body() == {"error": {"code": "provider_error", "message": "HTTP 400: bad request"}}


def test_an_unknown_backend_ends_the_session_with_provider_error() -> None:
    p = pipeline([])
    submit(p, spec(provider="nowhere"))
    p.drain()
    assert p.body()["error"]["code"] == "provider_error"
    assert "nowhere" in p.body()["error"]["message"]


def test_cancel_ends_the_session_at_the_next_step() -> None:
    p = pipeline(WEATHER_SCRIPT)
    submit(p, spec(WEATHER_FN))
    p.queue.run_next(p.runner)  # the first round ran
    p.store.cancel(SK)
    p.drain()
    assert p.body()["error"]["code"] == "cancelled"
    assert p.tools.calls == []


def test_a_rate_limited_round_waits_without_spending_a_try() -> None:
    p = pipeline([reply("hello")])
    p.runner.models.control = OpenRateControl(wait_s=[0.5, 0.5, 0.5, 0.5])
    submit(p, spec())
    p.drain()
    assert p.body()["choices"][0]["message"]["content"] == "hello"
    assert p.queue.retries == 4  # more waits than max_step_attempts: none was a failure


def test_a_lost_message_is_recovered_by_a_nudge() -> None:
    p = pipeline(WEATHER_SCRIPT)
    submit(p, spec(WEATHER_FN))
    p.queue.run_next(p.runner)  # the round ran and published its tool step ...
    assert list(p.queue.pending) == [("tool", SK, 0, 0)]
    p.queue.pending.clear()  # ... which the broker lost
    p.runner.nudge(SK)
    assert list(p.queue.pending) == [("tool", SK, 0, 0)]
    p.drain()
    assert p.body()["choices"][0]["message"]["content"] == "Tool said: sunny"


def test_a_lost_background_call_is_recovered_by_a_nudge() -> None:
    """Issue 10: a tool step that handed its call over to the background queue is published,
    and has no outcome until the background step stores one. If the broker loses that
    background step's message, a nudge publishes it again (and only it)."""
    p = pipeline(WEATHER_SCRIPT)
    session_spec = spec(WEATHER_FN)
    session_spec["tools"][0]["policy"] = {"background": True, "timeout_ms": 600_000}
    submit(p, session_spec)
    p.queue.run_next(p.runner)  # round 0 published its tool step
    assert p.queue.run_next(p.runner) == ("tool", SK, 0, 0)  # which handed its call over ...
    assert list(p.queue.pending) == [("background", SK, 0, 0)]
    p.queue.pending.clear()  # ... in a message the broker lost
    p.runner.nudge(SK)
    assert list(p.queue.pending) == [("background", SK, 0, 0)]
    p.store.begin_step(keys.background_step(SK, 0, 0), 60_000, None, SK)  # now running
    p.queue.pending.clear()
    p.runner.nudge(SK)
    assert list(p.queue.pending) == []  # a running background call is left alone
    p.store.release_lease(keys.background_step(SK, 0, 0))
    p.runner.nudge(SK)
    p.drain()
    assert p.body()["choices"][0]["message"]["content"] == "Tool said: sunny"
    assert len(p.tools.calls) == 1


def test_a_redelivered_step_never_calls_the_model_twice() -> None:
    p = pipeline(WEATHER_SCRIPT)
    submit(p, spec(WEATHER_FN))
    p.drain()
    for step in list(p.queue.sent):  # every step delivered once more
        p.queue.pending.append(step)
    p.drain()
    assert len(p.provider.requests) == 2
    assert len(p.tools.calls) == 1


def test_a_step_found_published_sends_the_steps_its_marker_lists() -> None:
    """With the broker apart a worker may die between a step's commit and its messages: the
    step's next delivery finds it published and sends what its marker lists."""
    p = pipeline(WEATHER_SCRIPT)
    submit(p, spec(WEATHER_FN))
    p.queue.run_next(p.runner)  # round 0 ran and committed; its message is lost with it
    assert list(p.queue.pending) == [("tool", SK, 0, 0)]
    p.queue.pending.clear()
    p.store.unsent[keys.round_step(SK, 0)] = (NextStep("tool", (SK, 0, 0)),)
    p.queue.pending.append(("round", SK, 0))  # round 0's message, delivered again
    p.drain()
    assert p.body()["choices"][0]["message"]["content"] == "Tool said: sunny"
    assert len(p.provider.requests) == 2


def test_a_nudge_leaves_a_step_that_is_running_or_done_alone() -> None:
    """A session waiting on a slow model call is not stalled: a nudge that re-published its
    round would only queue a copy behind it."""
    p = pipeline(WEATHER_SCRIPT)
    submit(p, spec(WEATHER_FN))
    p.queue.run_next(p.runner)  # round 0 ran and published its tool step
    p.queue.pending.clear()
    p.store.begin_step(keys.tool_step(SK, 0, 0), 60_000, None, SK)  # a worker holds it
    p.runner.nudge(SK)
    assert list(p.queue.pending) == []
    p.store.release_lease(keys.tool_step(SK, 0, 0))  # that worker died: its lease ran out
    p.runner.nudge(SK)
    assert list(p.queue.pending) == [("tool", SK, 0, 0)]
    p.drain()
    assert p.body()["choices"][0]["message"]["content"] == "Tool said: sunny"


def test_deliveries_that_find_the_step_leased_spend_no_try() -> None:
    """Issue 10: duplicates of a step held by a slow (or dead) worker wait for its lease; they
    are not counted, so they never dead-letter a healthy step (max_step_attempts is 3 here)."""
    p = pipeline(WEATHER_SCRIPT)
    submit(p, spec(WEATHER_FN))
    p.queue.run_next(p.runner)  # round 0 ran and published its tool step
    step = keys.tool_step(SK, 0, 0)
    p.store.begin_step(step, 60_000, None, SK)  # another worker holds it
    for _ in range(10):  # redeliveries (nudges, a restored message): each waits
        p.queue.run_next(p.runner)
    assert p.queue.retries == 10 and p.store.deadletters == []
    p.store.release_lease(step)  # that worker died: its lease ran out
    p.drain()
    assert p.body()["choices"][0]["message"]["content"] == "Tool said: sunny"
    assert p.store.tries[step] == 2  # the worker that died, and the one that ran it


class ReconcileTwin:
    """The reconciler's store port over the twin: every unfinished session counts as stalled."""

    def __init__(self, store: MemoryStore, sks: list[str]) -> None:
        self.store, self.sks, self.turns = store, sks, 0
        self.forgotten: list[str] = []
        self.submitted: dict[str, int] = {}  # sk -> submitted_ms; unknown: None

    def take_reconciler_turn(self, hold_ms: int) -> bool:
        self.turns += 1
        return self.turns % 2 == 1  # another worker holds every other turn

    def stalled(self, quiet_ms: int, most: int) -> list[str]:
        return [sk for sk in self.sks if self.store.result(sk) is None]

    def forget_session(self, sk: str) -> None:
        self.forgotten.append(sk)

    def submitted_ms(self, sks: list[str]) -> list[int | None]:
        return [self.submitted.get(sk) for sk in sks]

    def now_ms(self) -> int:
        return self.store.clock()

    def trim_results(self, keep: int) -> int:
        return 0


def test_the_reconciler_recovers_a_lost_message_with_no_producer() -> None:
    from worker.session.reconciler import Reconciler

    p = pipeline(WEATHER_SCRIPT)
    submit(p, spec(WEATHER_FN))
    p.queue.run_next(p.runner)  # round 0 ran and published its tool step ...
    p.queue.pending.clear()  # ... which the broker lost
    twin = ReconcileTwin(p.store, [SK, "gone"])
    reconciler = Reconciler(p.runner, twin)
    assert reconciler.turn() == 1  # it nudged SK; "gone" has no spec: forgotten
    assert twin.forgotten == ["gone"]
    assert reconciler.turn() == 0  # not its turn: another worker reconciles
    p.drain()
    assert p.body()["choices"][0]["message"]["content"] == "Tool said: sunny"


def test_the_reconciler_ends_a_stalled_session_past_the_fleets_deadline() -> None:
    """Issue 10: a session that shows no progress and is older than the deadline is not
    nudged again but ended, deadline_exceeded, before its keys expire without a body."""
    import time

    from worker.session.reconciler import Reconciler

    p = pipeline(WEATHER_SCRIPT)
    submit(p, spec(WEATHER_FN))
    p.queue.run_next(p.runner)  # round 0 ran and published its tool step ...
    p.queue.pending.clear()  # ... which the broker lost, long ago
    twin = ReconcileTwin(p.store, [SK])
    twin.submitted[SK] = int(time.time() * 1000) - 3_600_001
    reconciler = Reconciler(p.runner, twin, deadline_ms=3_600_000)
    assert reconciler.turn() == 0  # none nudged: it was ended
    assert list(p.queue.pending) == [("finish", SK)]
    p.drain()
    assert p.body()["error"]["code"] == "deadline_exceeded"
    tool_messages = [m for m in p.transcript() if m["role"] == "tool"]
    assert [json.loads(m["content"])["error"]["code"] for m in tool_messages] == ["NOT_RUN"]
    assert p.tools.calls == []
    (passed,) = [e.to_json() for e in p.store.traces[""]]
    assert (passed["nudged"], passed["overdue"]) == (0, 1)


def test_a_step_of_a_session_that_is_gone_is_dropped() -> None:
    """Its spec expired, or Redis lost it: the step is not retried, dead-lettered or ended
    (a result under a key no one reads); a waiting producer submits the session again."""
    p = pipeline(WEATHER_SCRIPT)
    submit(p, spec(WEATHER_FN))
    p.queue.run_next(p.runner)  # round 0 published its tool step
    del p.store.specs[SK]
    assert p.drain() == 1
    assert p.queue.retries == 0 and p.store.deadletters == []
    assert p.store.result(SK) is None and p.tools.calls == []


def test_a_round_reads_its_reply_once_and_decodes_each_calls_arguments_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A two-call round after one earlier round: its round step parses each stored reply once
    and decodes each call's arguments once; its tool steps read their runs as the round planned
    them, parsing and decoding nothing."""
    import worker.codecs.reply as reply_module

    parsed: list[str] = []
    decoded: list[str] = []
    parse = reply_module.Reply.parse.__func__  # type: ignore[attr-defined]
    decode = reply_module.decode_arguments  # type: ignore[attr-defined]

    def counting_parse(cls: type, completion: dict[str, Any]) -> Any:
        parsed.append(str(completion.get("id")))
        return parse(cls, completion)

    def counting_decode(raw: str) -> dict[str, Any]:
        decoded.append(raw)
        return decode(raw)

    monkeypatch.setattr(reply_module.Reply, "parse", classmethod(counting_parse))
    monkeypatch.setattr(reply_module, "decode_arguments", counting_decode)
    first = {**reply(None, ("c0", "get_weather", '{"city":"Paris"}')), "id": "r0"}
    second = {
        **reply(None, ("c1", "get_weather", '{"city":"Oslo"}'), ("c2", "get_weather", "{}")),
        "id": "r1",
    }
    p = pipeline([first, second, {**reply("done"), "id": "r2"}])
    submit(p, spec(WEATHER_FN))
    p.queue.run_next(p.runner)  # round 0
    p.queue.run_next(p.runner)  # its tool step
    parsed.clear()
    decoded.clear()
    assert p.queue.run_next(p.runner) == ("round", SK, 1)
    assert sorted(parsed) == ["r0", "r1"]  # each stored reply once: round 0's, and its own
    assert decoded.count('{"city":"Oslo"}') == 1 and decoded.count("{}") == 1
    assert decoded.count('{"city":"Paris"}') <= 1  # round 0's call, read to spot a repeat
    # the second call's arguments miss `city`: answered VALIDATION_ERROR without running
    assert list(p.queue.pending) == [("tool", SK, 1, 0)]
    parsed.clear()
    decoded.clear()
    p.queue.run_next(p.runner)  # the tool step of call 0: its run as the round planned it
    assert parsed == [] and decoded == []
    p.drain()
    assert p.body()["choices"][0]["message"]["content"] == "done"
