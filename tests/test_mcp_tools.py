"""The MCP edge (worker/edges/mcp_tools.py) against a real server: fixtures/mcp/server.py,
built with the official SDK, over stdio (and once over streamable HTTP). What the model reads
of a result (a program's: the whole CallToolResult), and each failure as the error tree names
it. The pool keeps one server process for a process's listings and calls, from every thread;
starts it again when it dies; starts its own after a fork; stops it at close."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from producer.fleet import free_port
from schemas.fleet import McpServerConfig
from schemas.spec_types import McpToolRef
from worker.edges.mcp_tools import McpTools
from worker.errors import McpError, ToolOutputTooLargeError, ToolRuntimeError, ToolTimeoutError
from worker.session.ports import ToolCall

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = (sys.executable, "-m", "fixtures.mcp.server")


@pytest.fixture()
def ran_log(tmp_path: Path) -> Path:
    return tmp_path / "ran.log"


@pytest.fixture()
def fixture_server(ran_log: Path) -> McpServerConfig:
    env = {"CCHATQ_MCP_FIXTURE_LOG": str(ran_log)}
    return McpServerConfig(id="fx", command=FIXTURE, env=env, cwd=str(ROOT))


@pytest.fixture()
def tools(fixture_server: McpServerConfig) -> Iterator[McpTools]:
    pooled = McpTools({"fx": fixture_server}, 20_000)
    yield pooled
    pooled.close()


def pids(ran_log: Path) -> list[int]:
    """The server process of each call the fixture ran, in order."""
    return [int(line.split()[1]) for line in ran_log.read_text().splitlines()]


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def call(
    tools: McpTools,
    tool: str,
    arguments: str,
    timeout_ms: int = 20_000,
    cap: int = 65_536,
    whole: bool = False,
) -> str:
    return tools.run(
        ToolCall(
            module_sha256="",
            export=None,
            table_index=None,
            fork_sha256=None,
            arguments=arguments.encode(),
            timeout_ms=timeout_ms,
            memory_bytes=0,
            max_output_bytes=cap,
            mcp=McpToolRef("fx", tool, whole_result=whole),
        )
    )


def test_a_stdio_server_lists_its_tools_once_per_ttl(fixture_server: McpServerConfig) -> None:
    now = [0.0]
    tools = McpTools({"fx": fixture_server}, 20_000, clock=lambda: now[0])
    try:
        listed = tools.list_tools("fx")
        assert [t.name for t in listed] == ["add", "echo", "nap", "secret"]
        add = listed[0]
        assert add.description == "Add two integers." and add.read_only and not listed[1].read_only
        assert add.input_schema["properties"]["a"]["type"] == "integer"
        assert add.input_schema["required"] == ["a", "b"]
        now[0] = 59.0
        assert tools.list_tools("fx") is listed  # kept for list_ttl_s (60 by default)
        now[0] = 61.0
        assert tools.list_tools("fx") is not listed  # listed again once it passed
    finally:
        tools.close()
    uncached = McpTools({"fx": replace(fixture_server, list_ttl_s=0)}, 20_000)
    try:
        assert uncached.list_tools("fx") is not uncached.list_tools("fx")  # 0: never kept
    finally:
        uncached.close()


def test_a_call_answers_with_the_tools_structured_result(tools: McpTools, ran_log: Path) -> None:
    assert call(tools, "add", '{"a":40,"b":2}') == '{"result":42}'
    assert call(tools, "echo", '{"text":"héllo"}') == '{"result":"héllo"}'
    assert [line.split()[0] for line in ran_log.read_text().splitlines()] == ["add", "echo"]


def test_a_programs_call_answers_with_the_whole_result_as_spear_does(tools: McpTools) -> None:
    whole = json.loads(call(tools, "add", '{"a":40,"b":2}', whole=True))
    assert whole == {
        "content": [{"type": "text", "text": "42"}],
        "structuredContent": {"result": 42},
        "isError": False,
    }
    # an isError result is the tool message too, not a failure (SPEAR passes it through)
    refused = json.loads(call(tools, "echo", '{"text":5}', whole=True))
    assert (
        refused["isError"] is True and "Error executing tool echo" in refused["content"][0]["text"]
    )
    assert "structuredContent" not in refused


def test_one_process_serves_the_listings_and_calls_of_every_thread(
    tools: McpTools, ran_log: Path
) -> None:
    tools.list_tools("fx")
    with ThreadPoolExecutor(8) as threads:
        sums = list(threads.map(lambda k: call(tools, "add", f'{{"a":{k},"b":1}}'), range(32)))
    assert sums == [f'{{"result":{k + 1}}}' for k in range(32)]
    assert len(set(pids(ran_log))) == 1  # no process per call
    [pid] = set(pids(ran_log))
    tools.close()
    assert gone(pid)  # stopped (and reaped) at close


def test_failures_are_the_error_trees(tools: McpTools) -> None:
    with pytest.raises(ToolRuntimeError, match="Error executing tool echo") as refused:
        call(tools, "echo", '{"text":5}')  # the server's own validation: isError
    assert refused.value.ran
    with pytest.raises(ToolRuntimeError, match="Unknown tool: missing"):
        call(tools, "missing", "{}")
    with pytest.raises(ToolOutputTooLargeError, match="of 15 bytes exceeds"):
        call(tools, "echo", '{"text":"ab"}', cap=14)
    gone_server = McpServerConfig(id="fx", command=("/nonexistent/mcp-server",))
    broken = McpTools({"fx": gone_server}, 5_000)
    try:
        with pytest.raises(McpError, match="fx could not list its tools: FileNotFoundError"):
            broken.list_tools("fx")
        with pytest.raises(ToolRuntimeError, match="fx: FileNotFoundError") as unsent:
            call(broken, "add", '{"a":1,"b":2}')
        assert not unsent.value.ran  # never sent: a retry is safe whatever the tool
        with pytest.raises(McpError, match="'nope' is not configured"):
            broken.list_tools("nope")
    finally:
        broken.close()
    # a program's listing gets what is left of its run, when that is less than the timeout
    slow = McpTools({"fx": tools._servers["fx"]}, 20_000)
    try:
        with pytest.raises(McpError, match="fx did not list its tools within 50 ms"):
            slow.list_tools("fx", budget_ms=50)
    finally:
        slow.close()


def test_a_call_past_its_timeout_ends_and_the_session_keeps_serving(
    tools: McpTools, ran_log: Path
) -> None:
    call(tools, "add", '{"a":1,"b":1}')  # started: the timeout below is the call's alone
    with pytest.raises(ToolTimeoutError, match="tool timed out after 500 ms") as late:
        call(tools, "nap", '{"ms":60000}', timeout_ms=500)
    assert late.value.ran
    assert call(tools, "add", '{"a":2,"b":2}') == '{"result":4}'  # not queued behind the nap
    assert len(set(pids(ran_log))) == 1


def test_a_server_that_died_is_started_again_by_the_next_call(
    tools: McpTools, ran_log: Path
) -> None:
    call(tools, "add", '{"a":1,"b":1}')
    [first] = pids(ran_log)
    os.kill(first, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while (held := tools.pool.started("fx")) is not None and held.alive():
        assert time.monotonic() < deadline, "the pool never saw its server die"
        time.sleep(0.01)
    # it had not reached the dead server: it goes to a new one
    assert call(tools, "add", '{"a":2,"b":2}') == '{"result":4}'
    second = pids(ran_log)[-1]
    assert second != first and gone(first)


def test_a_call_in_flight_when_its_server_dies_fails_as_sent(
    tools: McpTools, ran_log: Path
) -> None:
    call(tools, "add", '{"a":1,"b":1}')
    [pid] = pids(ran_log)
    with ThreadPoolExecutor(1) as thread:
        napping = thread.submit(call, tools, "nap", '{"ms":60000}')
        deadline = time.monotonic() + 10
        while len(pids(ran_log)) < 2:  # the nap is running on the server
            assert time.monotonic() < deadline, "the nap never started"
            time.sleep(0.01)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(ToolRuntimeError, match="fx: the connection closed") as died:
            napping.result(timeout=20)
    assert died.value.ran  # it may have run: not sent again
    assert call(tools, "add", '{"a":2,"b":2}') == '{"result":4}'  # and the next call restarts


def _call_in_child(tools: McpTools, out: Any) -> None:
    out.put(call(tools, "add", '{"a":3,"b":4}'))
    tools.close()


def test_a_forked_child_starts_its_own_server(tools: McpTools, ran_log: Path) -> None:
    call(tools, "add", '{"a":1,"b":1}')
    fork = multiprocessing.get_context("fork")
    out = fork.Queue()
    child = fork.Process(target=_call_in_child, args=(tools, out))
    child.start()
    assert out.get(timeout=60) == '{"result":7}'
    child.join(30)
    parent_pid, child_pid = pids(ran_log)
    assert child_pid != parent_pid and gone(child_pid)  # the child's own, stopped at its close
    assert call(tools, "add", '{"a":2,"b":2}') == '{"result":4}'  # the parent's still serves
    assert pids(ran_log)[-1] == parent_pid


@pytest.fixture()
def http_server(ran_log: Path) -> Iterator[str]:
    port = free_port()
    env = {**os.environ, "CCHATQ_MCP_FIXTURE_LOG": str(ran_log)}
    proc = subprocess.Popen(
        [*FIXTURE, "--http", str(port)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:  # until it listens
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert proc.poll() is None and time.monotonic() < deadline, "no HTTP server"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_a_streamable_http_server_is_listed_and_called(http_server: str) -> None:
    server = McpServerConfig(id="fx", url=http_server, api_key_env="FX_TOKEN")
    tools = McpTools({"fx": server}, 20_000, environ={"FX_TOKEN": "t0ken"})
    try:
        assert [t.name for t in tools.list_tools("fx")] == ["add", "echo", "nap", "secret"]
        assert call(tools, "add", '{"a":2,"b":3}') == '{"result":5}'
        assert call(tools, "add", '{"a":3,"b":3}') == '{"result":6}'  # the same session
    finally:
        tools.close()
