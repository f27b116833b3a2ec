"""WASM agent programs (C, built against sdk/c/ or written SPEAR's way) on the worker fleet:
their chats run through the round and tool tasks, their tools in forked instances on a tools
worker, and failures end in error results while the workers carry on."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from producer.specfile import load_spec_file
from schemas import keys
from tests.conftest import GUESTS, Running
from tests.test_pipeline import run_specs, submit_specs

pytestmark = pytest.mark.fleet


def run_program(
    running: Running, tmp_path: Path, spec_id: str, module: str, **extra: Any
) -> dict[str, Any]:
    program = {"module": str(GUESTS / module), **extra.pop("program", {})}
    spec = {"id": spec_id, "program": program, **extra}
    return run_specs(running.client, [spec], tmp_path, timeout_s=90)[spec_id]


def test_chat_program_answers_through_recv(running: Running, tmp_path: Path, fresh_id: str) -> None:
    record = run_program(
        running, tmp_path, f"{fresh_id}/chat", "prog_chat.wasm", program={"stdin": "hi there\n"}
    )
    assert record["status"] == "ok" and record["exit_code"] == 0, record
    lines = record["stdout"].splitlines()
    assert lines[0] == "ANSWER: Echo: hi there"
    metrics = json.loads(lines[1].removeprefix("METRICS: "))
    assert metrics["iterations"] == 1 and metrics["usage"]["total_tokens"] > 0
    assert record["logs"] == [{"level": "info", "message": "chat done"}]
    assert [r["choices"][0]["message"]["content"] for r in record["responses"]] == [
        "Echo: hi there"
    ]
    assert record["responses"][0]["_spear"] == {"backend": "replay", "model": "replay/plain"}


def test_program_tool_runs_in_a_fork_that_sees_main_state(
    running: Running, tmp_path: Path, fresh_id: str
) -> None:
    record = run_program(
        running, tmp_path, f"{fresh_id}/sum", "prog_sum_tool.wasm", program={"args": ["x", "y"]}
    )
    assert record["status"] == "ok", record
    lines = record["stdout"].splitlines()
    assert lines[:5] == ["BADJSON -22", "NONAME -22", "BADOFFSET -22", "BADRANGE -22", "BADSIG -22"]
    # g_bias = 1000 + 2 args was set by main at run time, g_label is on main's heap
    assert lines[5] == 'ANSWER: Tool said: {"label":"sum-from-heap","sum":1007}'
    response = record["responses"][0]
    assert (
        response["choices"][0]["message"]["content"]
        == 'Tool said: {"label":"sum-from-heap","sum":1007}'
    )


def test_spear_style_program_runs_unmodified(
    running: Running, tmp_path: Path, fresh_id: str
) -> None:
    record = run_program(running, tmp_path, f"{fresh_id}/spear", "prog_spear_style.wasm")
    assert record["status"] == "ok", record
    assert record["stdout"].splitlines()[-1] == 'ANSWER: Tool said: {\\"result\\":42}'


def test_a_forked_tools_log_lines_reach_the_program_result_and_cchatq_run(
    running: Running, tmp_path: Path, fresh_id: str
) -> None:
    """Issue 12: SPEAR's tool-sum sample, written SPEAR's way, whose tool logs, prints on
    stderr and on stdout; the model calls it twice in one round."""
    record = run_program(running, tmp_path, f"{fresh_id}/toollog", "prog_spear_tool_log.wasm")
    assert record["status"] == "ok", record
    assert record["stdout"] == 'ANSWER: Tool said: {\\"sum\\":42} | {\\"sum\\":3}\n'
    logs = record["logs"]
    assert [(e.get("call_id"), e["message"]) for e in logs] == [
        (None, "program: sending"),
        ("call_0_0", "sum invoked: a=7 b=35 sum=42 cap=65536"),
        ("call_0_0", "sum stderr: a=7 b=35"),
        ("call_0_0", "sum stdout: sum=42"),
        ("call_0_1", "sum invoked: a=1 b=2 sum=3 cap=65536"),
        ("call_0_1", "sum stderr: a=1 b=2"),
        ("call_0_1", "sum stdout: sum=3"),
        (None, "program: answered"),
    ]
    assert {(e["source"], e["tool"], e["round"]) for e in logs[1:-1]} == {("tool", "sum", 0)}

    env = {"REDIS_URL": running.redis_url, "PATH": "/usr/bin:/bin"}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "producer.cli", *args]
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)

    ran = cli("run", str(GUESTS / "prog_spear_tool_log.wasm"))
    assert ran.returncode == 0, ran.stderr
    err = ran.stderr.splitlines()
    assert err[1:] == [
        "[info] program: sending",
        "[info] sum call_0_0: sum invoked: a=7 b=35 sum=42 cap=65536",
        "[info] sum call_0_0 stderr: sum stderr: a=7 b=35",
        "[info] sum call_0_0 stdout: sum stdout: sum=42",
        "[info] sum call_0_1: sum invoked: a=1 b=2 sum=3 cap=65536",
        "[info] sum call_0_1 stderr: sum stderr: a=1 b=2",
        "[info] sum call_0_1 stdout: sum stdout: sum=3",
        "[info] program: answered",
    ]
    # the run's chat is a session of its own: its record keeps the lines per call, its trace
    # counts them without their text
    chat = err[0].removeprefix("run ") + "#send0"
    full = cli("result", chat, "--full")
    assert full.returncode == 0, full.stderr
    tool_logs = json.loads(full.stdout)["tool_logs"]
    assert [(e["call_id"], e["stream"]) for e in tool_logs] == [
        ("call_0_0", "log"), ("call_0_0", "stderr"), ("call_0_0", "stdout"),
        ("call_0_1", "log"), ("call_0_1", "stderr"), ("call_0_1", "stdout"),
    ]  # fmt: skip
    trace = cli("trace", chat)
    assert trace.returncode == 0, trace.stderr
    events = [json.loads(line) for line in trace.stdout.splitlines()]
    counted = sorted((e["call_id"], e["lines"]) for e in events if e["event"] == "tool.logs")
    assert counted == [("call_0_0", 3), ("call_0_1", 3)]
    assert "sum invoked" not in trace.stdout


def test_timeout_ms_below_the_model_latency_gives_an_error_body_and_exit_0(
    running: Running, tmp_path: Path, fresh_id: str
) -> None:
    # SPEAR's chat_completion sample, its way: timeout_ms bounds the model request, and a
    # request that passes it leaves an error body for cchat_recv (the sample exits 0)
    record = run_program(
        running, tmp_path, f"{fresh_id}/timeout", "prog_chat_timeout.wasm",
        program={"args": ["300", "[[latency_ms:5000]] too slow"]}, model="replay/plain",
    )  # fmt: skip
    assert record["status"] == "ok" and record["exit_code"] == 0, record
    size, body = record["stdout"].splitlines()
    error = json.loads(body.removeprefix("response_json="))
    assert size == f"response_bytes={len(body.removeprefix('response_json=').encode())}"
    assert error["error"]["code"] == "provider_timeout"
    assert error["error"]["message"].startswith("the model request passed its timeout of 300 ms")
    assert record["responses"] == [error]


def test_a_program_echoes_the_lines_sent_with_cchatq_stream(
    running: Running, tmp_path: Path, fresh_id: str
) -> None:
    # SPEAR's user_stream_echo sample, written its way (its own imports, a static arena): the
    # user's lines come back on cchatq stream's stdout, and the end of its stdin ends the run
    spec_id = f"{fresh_id}/echo"
    program = {"id": spec_id, "program": {"module": "prog_user_stream_echo.wasm"}}
    sub = submit_specs(running.client, [program], tmp_path)
    env = {"REDIS_URL": running.redis_url, "PATH": "/usr/bin:/bin"}
    streamed = subprocess.run(
        [sys.executable, "-m", "producer.cli", "stream", spec_id],
        input="hello\nworld, with spaces \u2713\n", env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert (streamed.returncode, streamed.stderr) == (0, f"run {spec_id} ended (ok, exit 0)\n")
    assert streamed.stdout == "hello\nworld, with spaces \u2713\n"
    record = next(iter(running.client.wait(sub, timeout_s=90)))[1]
    assert record["status"] == "ok" and record["exit_code"] == 0, record
    assert record["stdout"].splitlines() == [
        "user_stream_echo started (waiting for user streams)",
        "stream connected: stream_id=1 fd=1002",
        "session closed",
    ]
    unknown = subprocess.run(
        [sys.executable, "-m", "producer.cli", "stream", f"{fresh_id}/nope"],
        input="", env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert (unknown.returncode, unknown.stderr) == (1, f"unknown session id: {fresh_id}/nope\n")


def test_fanout_chats_run_concurrently(running: Running, tmp_path: Path, fresh_id: str) -> None:
    running.slow_replay_reset()
    record = run_program(running, tmp_path, f"{fresh_id}/fan", "prog_fanout.wasm", provider="slow")
    assert record["status"] == "ok", record
    lines = record["stdout"].splitlines()
    assert lines[0] == "FIRST_RECV -11"  # non-blocking: the body was not there yet
    assert lines[1:] == [f"GOT {i} Echo: chat {i}" for i in range(10)] + ["DONE 10"]
    # the ten 200 ms completions were in flight together, not one after another
    assert running.replay_stats(running.fleet.env["CCHATQ_SLOW_URL"])["max_in_flight"] >= 5


def test_bad_pointers_get_error_codes_and_the_program_survives(
    running: Running, tmp_path: Path, fresh_id: str
) -> None:
    record = run_program(running, tmp_path, f"{fresh_id}/badptr", "prog_badptr.wasm")
    assert record["status"] == "ok", record
    lines = record["stdout"].splitlines()
    recv_small = next(line for line in lines if line.startswith("recv_small"))
    assert recv_small.startswith("recv_small -28 need=") and int(recv_small.split("=")[1]) > 100
    assert [line for line in lines if not line.startswith("recv_small")] == [
        "write_msg_role_ptr -14", "write_msg_content_len -14", "write_fn_json_ptr -14",
        "ctl_arg_len_ptr -14", "recv_out_len_ptr -14", "log_ptr -14", "log_len -22",
        "fd_ctl_arg_len_ptr -14", "epoll_wait_out_ptr -14", "write_msg_fd_999 -9",
        "write_msg_resp_fd -9", "ctl_cmd_99 -22", "ctl_metrics_session -9",
        "set_param_bad_json -5", "close1 0", "close2 0", "write_msg_closed -9", "SURVIVED",
    ]  # fmt: skip


def test_trapping_and_endless_programs_end_with_errors_and_workers_survive(
    running: Running, tmp_path: Path, fresh_id: str
) -> None:
    trap = run_program(running, tmp_path, f"{fresh_id}/trap", "prog_trap.wasm")
    assert trap["status"] == "error" and trap["body"]["error"]["code"] == "guest_trap"
    assert "unreachable" in trap["body"]["error"]["message"]
    assert trap["logs"] == [{"level": "warn", "message": "about to trap"}]
    spin = run_program(
        running, tmp_path, f"{fresh_id}/spin", "prog_spin.wasm", limits={"run_timeout_ms": 1500}
    )
    assert spin["status"] == "error"
    assert spin["body"] == {
        "error": {
            "code": "deadline_exceeded",
            "message": "program exceeded its deadline of 1500 ms",
        }
    }
    # the same programs worker takes the next run
    after = run_program(
        running, tmp_path, f"{fresh_id}/after", "prog_chat.wasm", program={"args": ["again"]}
    )
    assert after["status"] == "ok" and after["stdout"].startswith("ANSWER: Echo: again")


def test_cchatq_run_and_program_lines_in_a_batch(
    running: Running, tmp_path: Path, fresh_id: str
) -> None:
    env = {"REDIS_URL": running.redis_url, "PATH": "/usr/bin:/bin"}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "producer.cli", *args]
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)

    ran = cli("run", str(GUESTS / "prog_chat.wasm"), "--arg", f"cli {fresh_id}")
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.splitlines()[0] == f"ANSWER: Echo: cli {fresh_id}"
    assert re.fullmatch(r"run run/[0-9a-f]{12}", ran.stderr.splitlines()[0])  # first, to cancel it
    assert "[info] chat done" in ran.stderr
    trapped = cli("run", str(GUESTS / "prog_trap.wasm"))
    assert trapped.returncode == 1 and "program failed: guest_trap" in trapped.stderr

    # one program, many inputs, next to a spec session, in one JSONL file
    lines: list[dict[str, Any]] = [
        {
            "id": f"{fresh_id}/in/{n}",
            "program": {"module": str(GUESTS / "prog_chat.wasm"), "stdin": f"input {n}\n"},
        }
        for n in range(3)
    ]
    lines.append(
        {
            "id": f"{fresh_id}/plain",
            "model": "replay/plain",
            "messages": [{"role": "user", "content": "x"}],
        }
    )
    batch = tmp_path / "mixed.jsonl"
    batch.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "results.jsonl"
    submitted = cli("submit", str(batch), "--out", str(out), "--timeout-s", "60")
    assert submitted.returncode == 0, submitted.stderr
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in results] == [line["id"] for line in lines]
    for n, result in enumerate(results[:3]):
        assert result["kind"] == "program" and result["exit_code"] == 0 and result["error"] is None
        assert result["stdout"].startswith(f"ANSWER: Echo: input {n}\n")
        assert len(result["responses"]) == 1
    assert results[3]["response"]["choices"][0]["message"]["content"] == "Echo: x"


def test_cancelled_program_ends_at_its_next_hostcall_wait(
    running: Running, tmp_path: Path, fresh_id: str
) -> None:
    spec_id = f"{fresh_id}/cancel"
    spec = {
        "id": spec_id,
        "program": {
            "module": str(GUESTS / "prog_chat.wasm"),
            "stdin": "wait [[latency_ms:8000]]\n",
        },
    }
    path = tmp_path / "cancel.jsonl"
    path.write_text(json.dumps(spec) + "\n")
    sub = running.client.enqueue([s.spec for s in load_spec_file(path)])
    deadline = time.monotonic() + 10
    while running.client.status(spec_id).get("state") != "running" and time.monotonic() < deadline:  # type: ignore[union-attr]
        time.sleep(0.05)
    fds = keys.fds(sub.order[0])
    while b'"ChatResponse"' not in b"".join(running.client.redis.hvals(fds)):  # it sent
        assert time.monotonic() < deadline, "the program never sent its chat"
        time.sleep(0.02)
    assert running.client.cancel(spec_id)
    record = dict(running.client.wait(sub, timeout_s=30))[sub.order[0]]
    assert record["body"] == {"error": {"code": "cancelled", "message": "program run cancelled"}}
    assert record["stdout"] == ""  # it never got past the send


GROW_FOREVER = """
(module
  (import "wasi_snapshot_preview1" "proc_exit" (func $exit (param i32)))
  (memory (export "memory") 1)
  (func (export "_start")
    (local $pages i32)
    (block $refused
      (loop $more
        (br_if $refused (i32.eq (memory.grow (i32.const 16)) (i32.const -1)))
        (local.set $pages (i32.add (local.get $pages) (i32.const 16)))
        (br $more)))
    ;; exit code 7 says: growth was refused (returned -1) instead of crashing anything
    (call $exit (i32.const 7))))
"""


def test_memory_growth_beyond_the_cap_is_refused(
    running: Running, tmp_path: Path, fresh_id: str
) -> None:
    import wasmtime

    module = tmp_path / "grow.wasm"
    module.write_bytes(wasmtime.wat2wasm(GROW_FOREVER))
    spec: dict[str, Any] = {
        "id": f"{fresh_id}/grow",
        "program": {"module": str(module)},
        "limits": {"memory_bytes": 8 << 20},
    }
    record = run_specs(running.client, [spec], tmp_path)[spec["id"]]
    assert (
        record["exit_code"] == 7
        and record["status"] == "error"
        and record["body"] == {"exit_code": 7}
    )


def test_a_program_registering_a_dangling_ref_schema_runs_on_without_it(
    running: Running, tmp_path: Path, fresh_id: str
) -> None:
    """On the fleet: cchat_write_fn checks a schema as submit does, so nothing is registered
    (the hostcall's -EINVAL is asserted in tests/test_hostcalls.py, where the program's memory
    dump is readable), and the program goes on to a chat that answers, with no tool."""
    from wasmtime import wat2wasm

    from tests.wat_program import Program, Ref

    p = Program()
    tool = p.tool("first")
    s = p.call("cchat_create")
    dangling = {"name": "f", "parameters": {"properties": {"c": {"$ref": "#/$defs/c"}}}}
    span = p.data(json.dumps(dangling).encode())
    p.call("cchat_write_fn", Ref(s), tool, span.ptr, span.len)
    role, text = p.data(b"user"), p.data(b"hi")
    p.call("cchat_write_msg", Ref(s), role.ptr, role.len, text.ptr, text.len)
    p.call("cchat_send", Ref(s), 0)
    module = tmp_path / "dangling.wasm"
    module.write_bytes(bytes(wat2wasm(p.wat())))
    spec_id = f"{fresh_id}/dangling"
    spec = {"id": spec_id, "program": {"module": str(module)}, "model": "replay/plain"}
    record = run_specs(running.client, [spec], tmp_path, timeout_s=60)[spec_id]
    assert record["status"] == "ok", record
    assert [r["choices"][0]["message"]["content"] for r in record["responses"]] == ["Echo: hi"]
    assert record["logs"] == [
        {"level": "warn", "message": "cchat_write_fn: parameters: a $ref that does not resolve"}
    ]
    fds = running.client.redis.hgetall(keys.fds(str(running.client.session_key(spec_id))))
    assert json.loads(fds[b"1000"])["tools"] == []  # the session fd registered no tool
    chat_sk = running.client.session_key(f"{spec_id}#send0")
    chat = running.client.spec_json(str(chat_sk))
    assert chat is not None and chat["tools"] == []
