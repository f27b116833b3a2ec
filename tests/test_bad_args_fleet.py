"""A model's tool call whose arguments are no JSON object, on a real fleet against the replay
server, on every protocol, JSON and streamed: the call is answered with a VALIDATION_ERROR,
the next request replays the turn in a shape the API takes (the replay server refuses a
non-object Gemini `functionCall.args` or Anthropic `tool_use.input` with a 400, as those APIs
do), and the session finishes ok with the model's answer. Redis database 13."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fixtures.demo_scenarios import WEATHER
from fixtures.replay.conversation import read_envelope
from fixtures.replay.scenarios import BAD_ARGUMENTS
from producer.fleet import Fleet, replay_backend_name
from schemas.protocols import NAMES as PROTOCOL_NAMES
from schemas.protocols import declared
from tests.conftest import Running, _workers
from tests.test_pipeline import assert_tool_messages_paired, run_specs

pytestmark = pytest.mark.fleet

REDIS_DB = 13
RUNS = [(p, stream) for p in sorted(PROTOCOL_NAMES) for stream in (False, True)]


@pytest.fixture(scope="module")
def fleet13(base_fleet: Fleet) -> Iterator[Running]:
    yield from _workers(base_fleet, db=REDIS_DB)


def bad_args_spec(spec_id: str, protocol: str, stream: bool) -> dict[str, Any]:
    return {
        "id": spec_id,
        "provider": replay_backend_name(protocol, stream),
        "model": declared(protocol).replay_model_for("bad_args"),
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [copy.deepcopy(WEATHER)],
    }


def error_of(tool_message: dict[str, Any]) -> dict[str, Any]:
    """The error a tool message carries ({} when it carries none)."""
    said = json.loads(read_envelope(str(tool_message["content"])))
    error: dict[str, Any] = said.get("error") or {} if isinstance(said, dict) else {}
    return error


def test_a_call_with_arguments_that_are_no_object_is_answered_and_the_session_goes_on(
    fleet13: Running, tmp_path: Path, fresh_id: str
) -> None:
    ids = {f"{fresh_id}/{p}-{'stream' if s else 'json'}": (p, s) for p, s in RUNS}
    specs = [bad_args_spec(sid, p, s) for sid, (p, s) in ids.items()]
    records = run_specs(fleet13.client, specs, tmp_path)
    assert records.keys() == ids.keys()
    failed = {sid: r["body"] for sid, r in records.items() if r["status"] != "ok"}
    assert not failed, "\n".join(f"{sid}: {json.dumps(body)[:300]}" for sid, body in failed.items())
    sent = json.dumps(BAD_ARGUMENTS, separators=(",", ":"))
    for sid, record in records.items():
        assert_tool_messages_paired(record)
        transcript = record["transcript"]
        calls = [
            c for m in transcript if m["role"] == "assistant" for c in m.get("tool_calls") or []
        ]
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
            ("get_weather", sent)
        ], sid
        tools = [m for m in transcript if m["role"] == "tool"]
        assert [error_of(m).get("code") for m in tools] == ["VALIDATION_ERROR"], sid
        content = record["body"]["choices"][0]["message"]["content"]
        assert str(content).startswith("Tool said: "), sid
        assert json.loads(content.removeprefix("Tool said: "))["error"] == error_of(tools[0])
        assert record["metrics"]["tool_failures"] == 1, sid
