"""`cchatq stream` and `cchatq status` on a real fleet, as a user runs them: a program run's
user stream names how the run ended (and refuses a run that already ended), and a streamed
round's partial state shows its thinking and tool-call arguments while it streams. Redis
database 2."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fixtures.demo_batch import on_backend
from producer.fleet import Fleet, replay_backend_name
from schemas import keys
from tests.conftest import Running, _workers
from tests.test_pipeline import submit_specs

pytestmark = pytest.mark.fleet

REDIS_DB = 2
CHUNK_DELAY_MS = 600  # a stream slow enough for `cchatq status` to catch it mid-round


@pytest.fixture(scope="module")
def fleet2(base_fleet: Fleet) -> Iterator[Running]:
    yield from _workers(base_fleet, db=REDIS_DB)


def cli_env(running: Running) -> dict[str, str]:
    return {**running.fleet.env, "REDIS_URL": running.redis_url}


def cli(running: Running, *argv: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    """A `cchatq` command as a user runs it, against this fleet's Redis."""
    return subprocess.run(
        [sys.executable, "-m", "producer.cli", *argv],
        input=stdin, env=cli_env(running), capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def echo_run(running: Running, tmp_path: Path, spec_id: str) -> Any:
    program = {"id": spec_id, "program": {"module": "prog_user_stream_echo.wasm"}}
    return submit_specs(running.client, [program], tmp_path)


def test_stream_names_how_the_run_ended_and_refuses_a_run_that_already_ended(
    fleet2: Running, tmp_path: Path, fresh_id: str
) -> None:
    spec_id = f"{fresh_id}/echo"
    sub = echo_run(fleet2, tmp_path, spec_id)
    streamed = cli(fleet2, "stream", spec_id, stdin="hello\n")
    assert streamed.stdout == "hello\n", streamed
    assert (streamed.returncode, streamed.stderr) == (0, f"run {spec_id} ended (ok, exit 0)\n")
    record = next(iter(fleet2.client.wait(sub, timeout_s=90)))[1]
    assert record["status"] == "ok" and record["exit_code"] == 0, record

    again = cli(fleet2, "stream", spec_id, stdin="anyone there?\n")
    assert (again.returncode, again.stdout) == (2, "")
    assert again.stderr == f"run {spec_id} ended (ok, exit 0): nothing to stream to\n"
    # nothing was sent to the ended run: its input holds only the first stream's events
    sent = fleet2.client.redis.xrange(keys.user_in(sub.order[0]))
    assert sent and not any(b"anyone there?" in v for _, fields in sent for v in fields.values())


def test_a_run_cancelled_while_streaming_ends_the_stream_with_exit_1(
    fleet2: Running, tmp_path: Path, fresh_id: str
) -> None:
    spec_id = f"{fresh_id}/echo-cancelled"
    echo_run(fleet2, tmp_path, spec_id)
    argv = [sys.executable, "-m", "producer.cli", "stream", spec_id]
    with subprocess.Popen(
        argv, env=cli_env(fleet2), text=True,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    ) as proc:  # fmt: skip
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        proc.stdin.write("still here\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == "still here\n"  # attached, and the program runs
        assert fleet2.client.cancel(spec_id)
        assert proc.wait(timeout=90) == 1
        assert proc.stdout.read() == ""
        assert proc.stderr.read() == f"run {spec_id} ended (error cancelled)\n"


def test_status_shows_a_streamed_rounds_thinking_and_tool_call_arguments_mid_round(
    fleet2: Running, tmp_path: Path, fresh_id: str
) -> None:
    prompt = f"Weather in Paris [[chunk_delay_ms:{CHUNK_DELAY_MS}]]"
    spec = on_backend(
        {"id": f"{fresh_id}/thinking", "model": "replay/weather",
         "messages": [{"role": "user", "content": prompt}],
         "tools": [{"module": "weather.wasm", "export": "get_weather", "name": "get_weather",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]},
        replay_backend_name("anthropic", True) + "-thinking",
        "anthropic",
    )  # fmt: skip
    sub = submit_specs(fleet2.client, [spec], tmp_path)
    thinking: list[str] = []
    calls: list[dict[str, str]] = []
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        shown = cli(fleet2, "status", spec["id"])
        assert shown.returncode == 0, shown
        status = json.loads(shown.stdout)
        if status["finished"]:
            break
        thinking += [status["partial_thinking"]] if status.get("partial_thinking") else []
        calls += status.get("partial_tool_calls", [])
    record = next(iter(fleet2.client.wait(sub, timeout_s=90)))[1]
    assert record["status"] == "ok", record
    assert thinking or calls, "neither partial thinking nor a partial tool call was ever shown"
    rounds = [m for m in record["transcript"] if m["role"] == "assistant"]
    thoughts = [m["reasoning_content"] for m in rounds]
    assert all(any(t.startswith(seen) for t in thoughts) for seen in thinking)
    [call] = rounds[0]["tool_calls"]
    arguments = call["function"]["arguments"]
    assert all(c["name"] == "get_weather" for c in calls)
    assert all(arguments.startswith(c["arguments"]) for c in calls)  # as far as it arrived
    assert "partial_text" not in json.loads(cli(fleet2, "status", spec["id"]).stdout)
