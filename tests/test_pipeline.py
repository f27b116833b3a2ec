"""The batch pipeline end to end: real Redis, real Celery worker subprocesses, the replay
server over HTTP and real wasmtime. Outcomes are asserted exactly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import redis

from fixtures.demo_batch import check, demo_specs
from fixtures.demo_scenarios import CITIES, KINDS, WEATHER, weather_json
from fixtures.replay.conversation import read_envelope
from producer.client import CLIENT_NAME, Client
from producer.fleet import Fleet
from producer.specfile import load_spec_file, load_spec_from_objects
from producer.submitting import SpecConflictError
from schemas import keys
from schemas.task_names import ALL_QUEUES
from tests.conftest import GUESTS, Running
from worker.edges.broker_consumers import taken_messages

pytestmark = pytest.mark.fleet


def submit_specs(
    client: Client, specs: list[dict[str, Any]], tmp_path: Path, name: str = "s.jsonl"
) -> Any:
    """Through the real spec-file path: JSONL on disk, validated, modules uploaded."""
    path = tmp_path / name
    for spec in specs:
        for tool in spec.get("tools", []):
            tool["module"] = str(GUESTS / Path(tool["module"]).name)
        if "program" in spec and not Path(spec["program"]["module"]).is_absolute():
            spec["program"]["module"] = str(GUESTS / Path(spec["program"]["module"]).name)
    path.write_text("".join(json.dumps(s) + "\n" for s in specs))
    return client.enqueue([s.spec for s in load_spec_file(path)])


def run_specs(
    client: Client, specs: list[dict[str, Any]], tmp_path: Path, timeout_s: float = 120
) -> dict[str, dict[str, Any]]:
    sub = submit_specs(client, specs, tmp_path)
    return {record["id"]: record for _, record in client.wait(sub, timeout_s=timeout_s)}


def wait_for(condition: Any, timeout_s: float = 20) -> None:
    """Poll a state until it holds (bounded)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the state never came"
        time.sleep(0.02)


def assert_tool_messages_paired(record: dict[str, Any]) -> None:
    """Each assistant tool call is answered exactly once, right after it, in call order."""
    transcript = record["transcript"]
    for n, message in enumerate(transcript):
        calls = message.get("tool_calls") or []
        if message["role"] != "assistant" or not calls:
            continue
        answers = transcript[n + 1 : n + 1 + len(calls)]
        assert [a["role"] for a in answers] == ["tool"] * len(calls), record["id"]
        assert [a["tool_call_id"] for a in answers] == [c["id"] for c in calls], record["id"]
    ids = [m["tool_call_id"] for m in transcript if m["role"] == "tool"]
    assert len(ids) == len(set(ids)), f"{record['id']}: a tool message appears twice"


def test_the_demo_never_touches_the_users_redis(tmp_path: Path) -> None:
    """`make demo` with REDIS_URL set to a live Redis (the user's) runs on a Redis of its own:
    the user's key count is unchanged, and no worker of theirs takes its tasks."""
    users = Fleet(workdir=tmp_path)
    try:
        url = users.ensure_redis(private=True)
        theirs = redis.Redis.from_url(url)
        theirs.set("their:key", "1")
        theirs.rpush("their:list", "a", "b")
        before = theirs.dbsize()
        cmd = [sys.executable, "-m", "producer.cli", "demo", "--limit", "6",
               "--out", str(tmp_path / "demo.jsonl")]  # fmt: skip
        env = {"REDIS_URL": url, "PATH": os.environ["PATH"]}
        ran = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
        assert ran.returncode == 0, ran.stderr
        assert "checked 6 sessions against expected outcomes: all match" in ran.stderr
        assert f"redis {url}" not in ran.stderr
        assert sum(db["keys"] for db in theirs.info("keyspace").values()) == before == 2
    finally:
        users.stop()


def test_demo_batch_every_scenario_exact(running: Running, tmp_path: Path, fresh_id: str) -> None:
    specs = [{**spec, "id": f"{fresh_id}/{spec['id']}"} for spec, _ in demo_specs(105)]
    records = run_specs(running.client, specs, tmp_path)
    assert len(records) == 105
    problems = {sid: check({**r, "id": sid.split("/", 1)[1]}) for sid, r in records.items()}
    assert {sid: p for sid, p in problems.items() if p} == {}
    for record in records.values():
        if record.get("kind") != "program":
            assert_tool_messages_paired(record)


def test_parallel_round_tool_messages_in_call_order(
    running: Running, tmp_path: Path, fresh_id: str
) -> None:
    cities = CITIES[:5]
    spec: dict[str, Any] = {
        "id": f"{fresh_id}/par",
        "model": "replay/parallel",
        "messages": [{"role": "user", "content": f"Weather in {', '.join(cities)}?"}],
        "tools": [dict(WEATHER)],
    }
    record = run_specs(running.client, [spec], tmp_path)[spec["id"]]
    assert record["status"] == "ok"
    tool_messages = [m for m in record["transcript"] if m["role"] == "tool"]
    assert [read_envelope(m["content"]) for m in tool_messages] == [weather_json(c) for c in cities]
    assert [m["tool_call_id"] for m in tool_messages] == [f"call_0_{i}" for i in range(5)]
    assert record["body"]["choices"][0]["message"]["content"] == " | ".join(
        weather_json(c) for c in cities
    )
    assert record["metrics"]["tool_calls"] == 5 and record["metrics"]["iterations"] == 2


def test_resubmitted_id_does_not_run_twice(running: Running, tmp_path: Path, fresh_id: str) -> None:
    spec: dict[str, Any] = {
        "id": f"{fresh_id}/once",
        "model": "replay/weather",
        "messages": [{"role": "user", "content": "Weather in Oslo?"}],
        "tools": [dict(WEATHER)],
    }
    first = run_specs(running.client, [dict(spec)], tmp_path)[spec["id"]]
    requests_before = running.replay_stats()["requests"]
    sub = submit_specs(running.client, [dict(spec)], tmp_path, name="again.jsonl")
    assert sub.new == set() and sub.done == {running.client.session_key(spec["id"])}
    again = dict(running.client.wait(sub, timeout_s=10))
    assert list(again.values()) == [first]
    redis = running.client.redis
    # nothing queued or running anywhere: whatever the resubmission could have started is done
    wait_for(lambda: not any(redis.llen(q) for q in ALL_QUEUES) and not taken_messages(redis))
    assert running.replay_stats()["requests"] == requests_before


def test_tool_that_never_returns_is_stopped_and_session_finishes(
    running: Running, tmp_path: Path, fresh_id: str
) -> None:
    spec: dict[str, Any] = {
        "id": f"{fresh_id}/spin",
        "model": "replay/call",
        "messages": [{"role": "user", "content": "[[call:spin {}]]"}],
        "tools": [
            {
                "module": "spin.wasm",
                "export": "spin",
                "name": "spin",
                "parameters": {"type": "object"},
            }
        ],
        "limits": {"tool_timeout_ms": 250},
    }
    record = run_specs(running.client, [spec], tmp_path, timeout_s=30)[spec["id"]]
    said = '{"error":{"code":"TIMEOUT","message":"tool timed out after 250 ms"}}'
    assert record["body"]["choices"][0]["message"]["content"] == f"Tool said: {said}"


def test_rate_limited_with_retry_after_completes(
    running: Running, tmp_path: Path, fresh_id: str
) -> None:
    faults_before = running.replay_stats()["faults"]
    spec: dict[str, Any] = {
        "id": f"{fresh_id}/429",
        "model": "replay/rate_limited",
        "messages": [{"role": "user", "content": f"Hello {fresh_id} [[retry_after:1]]"}],
    }
    started = time.monotonic()
    record = run_specs(running.client, [spec], tmp_path, timeout_s=30)[spec["id"]]
    assert record["status"] == "ok"
    assert record["body"]["choices"][0]["message"]["content"] == f"Echo: Hello {fresh_id}"
    assert running.replay_stats()["faults"] == faults_before + 1
    assert time.monotonic() - started >= 1.0  # Retry-After was honoured


def test_cancelled_session_ends_with_cancelled_body(
    running: Running, tmp_path: Path, fresh_id: str
) -> None:
    spec: dict[str, Any] = {
        "id": f"{fresh_id}/cancel",
        "model": "replay/slow",
        "messages": [{"role": "user", "content": "take your time [[latency_ms:4000]]"}],
    }
    sub = submit_specs(running.client, [spec], tmp_path)
    sk = sub.order[0]
    wait_for(lambda: running.client.redis.hget(keys.meta(sk), "state") == b"round 0")
    assert running.client.cancel(spec["id"])
    record = dict(running.client.wait(sub, timeout_s=20))[sk]
    # the end waited for the call in flight, whose reply is in the trace and the transcript
    events = [e["event"] for e in running.client.trace(spec["id"])]
    assert events.count("model.call.finished") == 1 and events[-1] == "session.finished"
    assert [m["role"] for m in record["transcript"]] == ["user", "assistant"]
    assert record["status"] == "error"
    assert record["body"] == {"error": {"code": "cancelled", "message": "session cancelled"}}
    assert (
        running.client.response(spec["id"])
        == b'{"error":{"code":"cancelled","message":"session cancelled"}}'
    )
    # the session retired as it ended: a late step of it writes no state (its meta is gone,
    # and a step's state is written only while the meta is there), status reads its record
    assert not running.client.redis.exists(keys.meta(sk))
    status = running.client.status(spec["id"]) or {}
    assert (status["state"], status["outcome"]) == ("cancelled", "cancelled")


def test_malformed_spec_line_rejected_and_nothing_enqueued(
    running: Running, tmp_path: Path, fresh_id: str
) -> None:
    good: dict[str, Any] = {
        "id": f"{fresh_id}/good",
        "model": "replay/plain",
        "messages": [{"role": "user", "content": "hi"}],
    }
    bad = {
        "id": f"{fresh_id}/bad",
        "model": "replay/plain",
        "messages": [{"role": "robot", "content": "hi"}],
    }
    path = tmp_path / "mixed.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n{not json\n")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "producer.cli",
            "submit",
            str(path),
            "--out",
            str(tmp_path / "r.jsonl"),
        ],
        env={"REDIS_URL": running.redis_url, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert f"{path}:2: messages.0.role:" in proc.stderr
    assert f"{path}:3: invalid JSON" in proc.stderr
    assert running.client.session_key(good["id"]) is None
    assert not (tmp_path / "r.jsonl").exists()


def test_task_arguments_carry_ids_only(running: Running, tmp_path: Path, fresh_id: str) -> None:
    """No prompt or tool argument travels in a task message (what Flower would show)."""
    secret = f"secret-{fresh_id}"
    spec: dict[str, Any] = {
        "id": f"{fresh_id}/quiet",
        "model": "replay/weather",
        "messages": [{"role": "user", "content": f"Weather in {secret}?"}],
        "tools": [dict(WEATHER)],
    }
    sub = submit_specs(running.client, [spec], tmp_path)
    seen: list[bytes] = []
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not running.client.redis.exists(
        keys.response(sub.order[0])
    ):
        for queue in ("llm", "tools", "control"):
            seen.extend(running.client.redis.lrange(queue, 0, -1))
        seen.extend(taken_messages(running.client.redis))
    dict(running.client.wait(sub, timeout_s=20))
    assert seen, "no task message was observed"
    assert not any(secret.encode() in raw for raw in seen)


def _unique_module(tmp_path: Path, fresh_id: str) -> Path:
    """weather.wasm plus a custom section: same code, a sha256 no worker has cached."""
    name = f"nonce-{fresh_id}".encode()
    payload = bytes([len(name)]) + name
    path = tmp_path / f"weather-{fresh_id}.wasm"
    path.write_bytes(
        (GUESTS / "weather.wasm").read_bytes() + b"\x00" + bytes([len(payload)]) + payload
    )
    return path


def run_poisoned(client: Client, tmp_path: Path, spec_id: str) -> tuple[str, dict[str, Any]]:
    """A session whose tool step fails on every delivery (its module vanished from Redis):
    its session key and the record it ends with."""
    module = _unique_module(tmp_path, spec_id.replace("/", "-"))
    spec: dict[str, Any] = {
        "id": spec_id,
        "model": "replay/weather",
        "messages": [{"role": "user", "content": "Weather in Lima?"}],
        "tools": [{**WEATHER, "module": str(module)}],
    }
    path = tmp_path / "poison.jsonl"
    path.write_text(json.dumps(spec) + "\n")
    upload = client.upload_modules

    def upload_then_lose(specs: Any) -> dict[str, str]:  # before any step can fetch it
        shas = upload(specs)
        client.redis.delete(*[keys.module(sha) for sha in shas.values()])
        return shas

    client.upload_modules = upload_then_lose  # type: ignore[method-assign]
    try:
        sub = client.enqueue([s.spec for s in load_spec_file(path)])
    finally:
        del client.upload_modules
    return sub.order[0], dict(client.wait(sub, timeout_s=60))[sub.order[0]]


def test_poison_step_is_dead_lettered_and_session_ends(
    running: Running, tmp_path: Path, fresh_id: str
) -> None:
    """A step that fails on every delivery (its module vanished from Redis) ends its session
    with a step_failed body instead of leaving the producer waiting; the tools worker's log
    lines of each failed try name the step, and so the session."""
    sk, record = run_poisoned(running.client, tmp_path, f"{fresh_id}/poison")
    assert record["status"] == "error"
    assert record["body"]["error"]["code"] == "step_failed"
    assert ".r0.t0 failed for good" in record["body"]["error"]["message"]
    tool_messages = [m for m in record["transcript"] if m["role"] == "tool"]
    assert [json.loads(m["content"])["error"]["code"] for m in tool_messages] == ["NOT_RUN"]
    entries = running.client.redis.xrange(keys.DEADLETTER)
    assert any(e[1][b"step"].endswith(b".r0.t0") for e in entries)
    logs = [p.read_text(errors="replace") for p in running.fleet.workdir.glob("tools*.log")]
    failed = [line for log in logs for line in log.splitlines() if f"step={sk}.r0.t0 " in line]
    assert any("failed (try 1)" in line for line in failed), failed
    assert any("dead-lettered" in line for line in failed), failed


def test_cli_status_and_result(running: Running, tmp_path: Path, fresh_id: str) -> None:
    spec: dict[str, Any] = {
        "id": f"{fresh_id}/cli",
        "model": "replay/plain",
        "messages": [{"role": "user", "content": "hi"}],
    }
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps(spec) + "\n")
    env = {"REDIS_URL": running.redis_url, "PATH": "/usr/bin:/bin"}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "producer.cli", *args]
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)

    out = tmp_path / "results.jsonl"
    submitted = cli("submit", str(path), "--out", str(out), "--timeout-s", "30")
    assert submitted.returncode == 0, submitted.stderr
    line = json.loads(out.read_text())
    assert line["id"] == spec["id"] and line["status"] == "ok" and line["error"] is None
    assert line["response"]["choices"][0]["message"]["content"] == "Echo: hi"
    assert [m["role"] for m in line["transcript"]] == ["user", "assistant"]
    result = cli("result", spec["id"])
    assert result.returncode == 0
    response = running.client.response(spec["id"])
    assert response is not None
    assert result.stdout.strip().encode() == response
    assert b", " not in response  # compact JSON, sorted keys
    status = json.loads(cli("status", spec["id"]).stdout)
    assert status["state"] == "done" and status["finished"] is True and status["outcome"] == "ok"
    assert status["flower_search"] == f"kwargs:session={spec['id']}"
    assert status["flower_tasks"].startswith("http://127.0.0.1:5555/api/tasks?search=kwargs")
    unknown = cli("result", f"{fresh_id}/nope")
    assert unknown.returncode == 1 and "unknown session id" in unknown.stderr


def test_cli_submit_exit_codes_and_an_interrupted_wait(
    running: Running, tmp_path: Path, fresh_id: str
) -> None:
    """Issue 11 (part): 0 all ok, 1 some failed, 2 rejected input (a results file that cannot
    be written is found before anything is enqueued), 3 interrupted (a timeout, or Ctrl-C):
    no traceback, what finished is in the results file, the rest keep running."""
    env = {"REDIS_URL": running.redis_url, "PATH": "/usr/bin:/bin"}

    def submit(specs: list[dict[str, Any]], *args: str) -> subprocess.CompletedProcess[str]:
        path = tmp_path / f"{uuid.uuid4().hex[:6]}.jsonl"
        path.write_text("".join(json.dumps(s) + "\n" for s in specs))
        cmd = [sys.executable, "-m", "producer.cli", "submit", str(path), *args]
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)

    def plain(name: str, marker: str = "") -> dict[str, Any]:
        content = f"hi {name}{marker}"
        return {"id": f"{fresh_id}/{name}", "model": "replay/plain",
                "messages": [{"role": "user", "content": content}]}  # fmt: skip

    out = tmp_path / "r.jsonl"
    assert submit([plain("ok")], "--out", str(out)).returncode == 0
    failing = {**plain("failing"), "model": "replay/bad_request"}  # the provider answers 400
    assert submit([plain("ok2"), failing], "--out", str(out)).returncode == 1
    unwritable = submit([plain("never")], "--out", str(tmp_path))  # a directory
    assert unwritable.returncode == 2 and f"--out {tmp_path}" in unwritable.stderr
    assert running.client.session_key(f"{fresh_id}/never") is None  # nothing enqueued
    slow = plain("slow", " [[latency_ms:5000]]")
    stopped = submit([plain("quick"), slow], "--out", str(out), "--timeout-s", "2")
    assert stopped.returncode == 3, stopped.stderr
    assert "1 of 2 done; the rest keep running" in stopped.stderr
    assert "Traceback" not in stopped.stderr
    written = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert written == [plain("quick")["id"]]
    assert running.client.response(slow["id"]) is None  # still running, on the fleet
    # Ctrl-C: the same, once the quick session's line is written
    path = tmp_path / "ctrl-c.jsonl"
    slow_again = plain("slow-again", " [[latency_ms:5000]]")
    path.write_text("".join(json.dumps(s) + "\n" for s in (plain("quick-again"), slow_again)))
    cmd = [sys.executable, "-m", "producer.cli", "submit", str(path), "--out", str(out)]
    # Ctrl-C as a terminal delivers it, whatever this run inherited (a shell's background job
    # ignores SIGINT, and an ignored signal stays ignored across exec)
    proc = subprocess.Popen(
        cmd, env=env, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    wait_for(lambda: out.exists() and "quick-again" in out.read_text())
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 3 and "1 of 2 done" in stderr and "Traceback" not in stderr
    # what the interrupted wait did not see, `batch results` collects: every line
    batch = stderr.split("batch ", 1)[1].split(":", 1)[0]
    assert f"cchatq batch results {batch}" in stderr
    wait_for(lambda: running.client.response(slow_again["id"]) is not None, timeout_s=30)
    collected = tmp_path / "collected.jsonl"
    cmd = [sys.executable, "-m", "producer.cli", "batch", "results", batch, "--out", str(collected)]
    assert subprocess.run(cmd, env=env, capture_output=True, timeout=60).returncode == 0
    lines = [json.loads(line) for line in collected.read_text().splitlines()]
    assert [(r["id"], r["status"], r["batch"]) for r in lines] == [
        (plain("quick-again")["id"], "ok", batch),
        (slow_again["id"], "ok", batch),
    ]
    worker = subprocess.run(
        [sys.executable, "-m", "producer.cli", "worker", "--queues", "tool"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert worker.returncode == 2 and "unknown queue 'tool'" in worker.stderr


def test_every_key_written_has_a_ttl(running: Running, tmp_path: Path, fresh_id: str) -> None:
    specs = [
        {**spec, "id": f"{fresh_id}/ttl/{spec['id']}"}
        for spec, _ in demo_specs(len(KINDS))  # one of each kind, the failing ones included
    ]
    run_specs(running.client, specs, tmp_path)
    without_ttl = [
        k
        for k in running.client.redis.scan_iter("cq:*", count=1000)
        if running.client.redis.ttl(k) < 0
    ]
    assert without_ttl == []


DANGLING_REF_TOOL = {
    "module": "weather.wasm",
    "export": "get_weather",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"$ref": "#/$defs/city"}}},
}


def test_a_dangling_ref_schema_is_rejected_at_submit_with_line_and_field(
    running: Running, tmp_path: Path, fresh_id: str
) -> None:
    spec: dict[str, Any] = {
        "id": f"{fresh_id}/dangling",
        "model": "replay/call",
        "messages": [{"role": "user", "content": '[[call:get_weather {"city":"Paris"}]]'}],
        "tools": [dict(DANGLING_REF_TOOL, module=str(GUESTS / "weather.wasm"))],
    }
    path = tmp_path / "dangling.jsonl"
    path.write_text(json.dumps(spec) + "\n")
    proc = subprocess.run(
        [sys.executable, "-m", "producer.cli", "submit", str(path), "--out", str(tmp_path / "r")],
        env={"REDIS_URL": running.redis_url, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert (
        f"{path}:1: tools.0.function.parameters: Unresolvable $ref '#/$defs/city' "
        "at $.properties.city"
    ) in proc.stderr
    assert running.client.session_key(spec["id"]) is None


def test_a_schema_failing_only_at_call_time_is_a_validation_error_to_the_model(
    running: Running, tmp_path: Path, fresh_id: str
) -> None:
    # every $ref resolves (submit accepts it), but validating arguments recurses forever
    looping = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#"}}}
    spec: dict[str, Any] = {
        "id": f"{fresh_id}/looping",
        "model": "replay/call",
        "messages": [{"role": "user", "content": '[[call:get_weather {"city":"Paris"}]]'}],
        "tools": [dict(DANGLING_REF_TOOL, parameters=looping)],
    }
    record = run_specs(running.client, [spec], tmp_path, timeout_s=30)[spec["id"]]
    said = json.loads(
        record["body"]["choices"][0]["message"]["content"].removeprefix("Tool said: ")
    )
    assert said == {
        "error": {
            "code": "VALIDATION_ERROR",
            "message": "the tool's parameters schema cannot be checked: its $ref recursion runs "
            "too deep to check (a $ref that refers back to itself without descending into the "
            "arguments, or arguments nested too deep)",
        }
    }
    assert record["metrics"]["tool_calls"] == 1 and record["metrics"]["tool_failures"] == 1


def test_a_waiting_producer_rides_out_dropped_connections_and_lost_done_entries(
    running: Running, tmp_path: Path, fresh_id: str
) -> None:
    """Issue 10: the producer's connection is killed while it blocks on the batch's done
    list (as a Redis restart drops it), and no finished session reaches that list (as a
    restart can lose the last second of writes, or a dropped reply an entry it popped). The
    wait goes on and finds every finished session by its response fd."""
    client = Client(running.fleet.redis_url)
    specs = [
        {
            "id": f"{fresh_id}/reconnect/{n}",
            "model": "replay/plain",
            "messages": [{"role": "user", "content": f"Hello {n} [[latency_ms:1000]]"}],
        }
        for n in range(4)
    ]
    sub = submit_specs(client, specs, tmp_path)
    side = running.client.redis
    # the fleet tells the batch that submitted them; this wait reads a done list no one writes
    unseen = replace(sub, batch=f"{sub.batch}-unseen")
    got: list[str] = []
    waiting = threading.Thread(
        target=lambda: got.extend(sk for sk, _ in client.wait(unseen, timeout_s=60, stall_s=2))
    )
    waiting.start()

    def blocked() -> list[int]:
        return [
            int(c["id"])
            for c in side.client_list()
            if c["name"] == CLIENT_NAME and "b" in c["flags"]
        ]

    try:
        wait_for(lambda: bool(blocked()))
        for client_id in blocked():
            side.client_kill_filter(_id=client_id)
    finally:
        waiting.join(timeout=60)
    assert sorted(got) == sorted(sub.order)
    client.close()


def test_a_waiting_producer_submits_again_what_redis_lost(
    running: Running, tmp_path: Path, fresh_id: str
) -> None:
    """Issue 10: Redis lost the batch's sessions (restarted without persistence: their
    claims, specs and state are gone) while the producer waited. It submits them again, as a
    new generation, and yields every one, finished by the new run."""
    client = Client(running.fleet.redis_url)
    specs: list[dict[str, Any]] = [
        {
            "id": f"{fresh_id}/lost/{n}",
            "model": "replay/plain",
            "messages": [{"role": "user", "content": f"Hello {n} [[latency_ms:1500]]"}],
        }
        for n in range(3)
    ]
    sub = submit_specs(client, specs, tmp_path)
    first = list(sub.order)
    side = running.client.redis
    wait_for(lambda: all(side.hget(keys.meta(sk), "state") == b"round 0" for sk in first))
    for spec, sk in zip(specs, first, strict=True):
        side.delete(keys.id_claim(keys.DEFAULT_NAMESPACE, spec["id"]), keys.spec(sk), keys.meta(sk))
    records = dict(client.wait(sub, timeout_s=60, stall_s=2))
    assert set(records) == set(sub.order) and not set(sub.order) & set(first)
    assert [records[sk]["id"] for sk in sub.order] == [s["id"] for s in specs]
    assert all(r["status"] == "ok" for r in records.values()), records
    assert [client.session_key(s["id"]) for s in specs] == sub.order
    client.close()


def test_an_id_submitted_again_with_another_spec_is_refused_unless_rerun(
    running: Running, tmp_path: Path, fresh_id: str
) -> None:
    """Issue 11, point 2: an id answers for one spec. The same id with a changed prompt is
    refused at submit with its line (nothing enqueued, the old answer kept), unless --rerun,
    which runs it again as attempt 2; the result lines say which attempt and which batch."""
    env = {"REDIS_URL": running.redis_url, "PATH": "/usr/bin:/bin"}
    spec_id = f"{fresh_id}/one-id"

    def submit(prompt: str, *args: str) -> tuple[int, str, dict[str, Any]]:
        path = tmp_path / "same-id.jsonl"
        other = {"id": f"{fresh_id}/other", "model": "replay/plain",
                 "messages": [{"role": "user", "content": "unchanged"}]}  # fmt: skip
        mine = {"id": spec_id, "model": "replay/plain",
                "messages": [{"role": "user", "content": prompt}]}  # fmt: skip
        path.write_text(json.dumps(other) + "\n" + json.dumps(mine) + "\n")
        out = tmp_path / "same-id-results.jsonl"
        cmd = [sys.executable, "-m", "producer.cli", "submit", str(path), "--out", str(out), *args]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
        lines = [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []
        return done.returncode, done.stderr, {x["id"]: x for x in lines}

    code, _, first = submit("hi one")
    assert code == 0 and first[spec_id]["attempt"] == 1 and first[spec_id]["batch"]
    code, stderr, _ = submit("hi two")
    assert code == 2 and f"same-id.jsonl:2: id: '{spec_id}' was already submitted" in stderr
    assert b"Echo: hi one" in (running.client.response(spec_id) or b"")
    code, _, rerun = submit("hi two", "--rerun", "all")
    assert code == 0 and rerun[spec_id]["attempt"] == 2
    assert rerun[spec_id]["response"]["choices"][0]["message"]["content"] == "Echo: hi two"
    assert rerun[f"{fresh_id}/other"]["attempt"] == 2  # --rerun all runs every submitted id again
    code, stderr, again = submit("hi two")  # the same spec as its last attempt: its answer
    assert code == 0 and again[spec_id]["attempt"] == 2 and "2 already submitted" in stderr
    spec = load_spec_from_objects(
        [
            {
                "id": spec_id,
                "model": "replay/plain",
                "messages": [{"role": "user", "content": "hi three"}],
            }
        ]
    )
    with pytest.raises(SpecConflictError) as refused:  # the Python API refuses it too
        running.client.enqueue(spec)
    assert refused.value.spec_ids == [spec_id]


def test_cli_status_without_an_id_shows_the_fleet(running: Running, tmp_path: Path) -> None:
    """Issue 11, point 4: queued and running (taken, not acknowledged) tasks per queue, the
    worker processes taking tasks, active sessions and dead letters; a busy fleet is not all
    zeros. Here a slow round holds an llm task while the status is read."""
    env = {"REDIS_URL": running.redis_url, "PATH": "/usr/bin:/bin"}
    spec = {"id": f"fleet-status/{uuid.uuid4().hex[:8]}", "model": "replay/plain",
            "messages": [{"role": "user", "content": "slow [[latency_ms:8000]]"}]}  # fmt: skip
    sub = submit_specs(running.client, [spec], tmp_path)
    step = keys.round_step(sub.order[0], 0)
    wait_for(lambda: (running.client.redis.get(keys.step_state(step)) or b"").startswith(b"lease"))
    cmd = [sys.executable, "-m", "producer.cli", "status"]
    shown = json.loads(subprocess.run(cmd, env=env, capture_output=True, text=True).stdout)
    assert set(shown["queued"]) == set(ALL_QUEUES) and shown["taken"]["llm"] >= 1
    assert shown["consumers"] >= len(ALL_QUEUES) and shown["active_sessions"] >= 1
    assert all(shown["consumers_by_queue"][q] >= 1 for q in ALL_QUEUES)
    assert dict(running.client.wait(sub, timeout_s=30))[sub.order[0]]["status"] == "ok"


def test_cli_batch_list_status_results_and_cancel(
    running: Running, tmp_path: Path, fresh_id: str
) -> None:
    """Issue 11, point 1 (part): a batch submitted with --no-wait is listed, counted by state
    and outcome, its results collected (what finished, exit 3 while some run), and what still
    runs cancelled."""
    env = {"REDIS_URL": running.redis_url, "PATH": "/usr/bin:/bin"}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "producer.cli", *args]
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)

    specs = [
        {"id": f"{fresh_id}/b/{n}", "model": "replay/plain",
         "messages": [{"role": "user", "content": f"hi {n}{marker}"}]}
        for n, marker in enumerate(["", "", " [[latency_ms:30000]]"])
    ]  # fmt: skip
    path = tmp_path / "batch.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in specs))
    submitted = cli("submit", str(path), "--no-wait")
    batch = submitted.stdout.split(":")[0].removeprefix("batch ").strip()
    assert submitted.returncode == 0 and batch in cli("batch", "list").stdout

    def status() -> dict[str, Any]:
        return dict(json.loads(cli("batch", "status", batch, "--json").stdout))

    wait_for(lambda: status()["states"].get("done") == 2, timeout_s=30)
    assert status()["states"] == {"done": 2, "running": 1} and status()["sessions"] == 3
    assert status()["status"] == "in_progress" and status()["completed_at"] is None
    out = tmp_path / "collected.jsonl"
    partial = cli("batch", "results", batch, "--out", str(out))
    assert partial.returncode == 3 and "2 of 3 results" in partial.stderr
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == [
        specs[0]["id"], specs[1]["id"]
    ]  # fmt: skip
    assert "cancel requested for 1 session\n" in cli("batch", "cancel", batch).stdout
    # the cancelled one ends when its model call does (cancellation is read between steps)
    wait_for(lambda: status()["states"].get("done") == 3, timeout_s=60)
    assert status()["outcomes"] == {"ok": 2, "cancelled": 1} and status()["status"] == "cancelled"
    full = cli("batch", "results", batch, "--out", str(out))
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert full.returncode == 1 and [x["id"] for x in lines] == [s["id"] for s in specs]
    assert {(x["batch"], x["attempt"]) for x in lines} == {(batch, 1)}
    assert cli("batch", "status", "no-such-batch").returncode == 2
    # the cancelled one runs again as attempt 2, in a batch of its own; B keeps what it ran
    again = tmp_path / "again.jsonl"
    retried = cli("batch", "retry", batch, "--failed", "--out", str(again))
    (line,) = [json.loads(x) for x in again.read_text().splitlines()]
    assert retried.returncode == 0 and (line["id"], line["attempt"]) == (specs[2]["id"], 2)
    assert line["batch"] != batch and status()["outcomes"] == {"ok": 2, "cancelled": 1}


def test_submit_warns_when_no_worker_takes_from_a_needed_queue(
    running: Running, tmp_path: Path, fresh_id: str
) -> None:
    """Issue 11, point 4: a batch submitted where no worker consumes (a database of this
    Redis that no worker reads) is not left to wait in silence."""
    empty = running.redis_url.rsplit("/", 1)[0] + "/14"
    env = {"REDIS_URL": empty, "PATH": "/usr/bin:/bin"}
    tool = {**WEATHER, "module": str(GUESTS / "weather.wasm")}
    spec = {"id": f"{fresh_id}/unserved", "model": "replay/weather",
            "messages": [{"role": "user", "content": "hi"}], "tools": [tool]}  # fmt: skip
    path = tmp_path / "unserved.jsonl"
    path.write_text(json.dumps(spec) + "\n")
    cmd = [sys.executable, "-m", "producer.cli", "submit", str(path), "--no-wait"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    warned = [line for line in done.stderr.splitlines() if line.startswith("warning:")]
    assert done.returncode == 0 and [w.split("'")[1] for w in warned] == ["llm", "tools", "control"]
    Client(empty).redis.flushdb()
