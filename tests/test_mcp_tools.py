"""The MCP edge (worker/edges/mcp_tools.py) against a real server: fixtures/mcp/server.py,
built with the official SDK, spawned over stdio for each listing and call (and once over
streamable HTTP). What the model reads of a result, and each failure as the error tree names
it; a server process never outlives its call."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

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


def call(
    tools: McpTools, tool: str, arguments: str, timeout_ms: int = 20_000, cap: int = 65_536
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
            mcp=McpToolRef("fx", tool),
        )
    )


def test_a_stdio_server_lists_its_tools_once_per_ttl(fixture_server: McpServerConfig) -> None:
    now = [0.0]
    tools = McpTools({"fx": fixture_server}, 20_000, clock=lambda: now[0])
    listed = tools.list_tools("fx")
    assert [t.name for t in listed] == ["add", "echo", "nap", "secret"]
    add = listed[0]
    assert add.description == "Add two integers." and add.read_only and not listed[1].read_only
    assert add.input_schema["properties"]["a"]["type"] == "integer"
    assert add.input_schema["required"] == ["a", "b"]
    assert tools.list_tools("fx") is listed  # kept: no second process
    now[0] = 31.0
    assert tools.list_tools("fx") is not listed  # listed again once the TTL passed


def test_a_call_answers_with_the_tools_structured_result(
    fixture_server: McpServerConfig, ran_log: Path
) -> None:
    tools = McpTools({"fx": fixture_server}, 20_000)
    assert call(tools, "add", '{"a":40,"b":2}') == '{"result":42}'
    assert call(tools, "echo", '{"text":"héllo"}') == '{"result":"héllo"}'
    assert [line.split()[0] for line in ran_log.read_text().splitlines()] == ["add", "echo"]


def test_failures_are_the_error_trees(fixture_server: McpServerConfig) -> None:
    tools = McpTools({"fx": fixture_server}, 20_000)
    with pytest.raises(ToolRuntimeError, match="Error executing tool echo") as refused:
        call(tools, "echo", '{"text":5}')  # the server's own validation: isError
    assert refused.value.ran
    with pytest.raises(ToolRuntimeError, match="Unknown tool: missing"):
        call(tools, "missing", "{}")
    with pytest.raises(ToolOutputTooLargeError, match="of 15 bytes exceeds"):
        call(tools, "echo", '{"text":"ab"}', cap=14)
    gone = McpServerConfig(id="fx", command=("/nonexistent/mcp-server",))
    broken = McpTools({"fx": gone}, 5_000)
    with pytest.raises(McpError, match="fx could not list its tools: FileNotFoundError"):
        broken.list_tools("fx")
    with pytest.raises(ToolRuntimeError, match="fx: FileNotFoundError") as unsent:
        call(broken, "add", '{"a":1,"b":2}')
    assert not unsent.value.ran  # never sent: a retry is safe whatever the tool
    with pytest.raises(McpError, match="'nope' is not configured"):
        broken.list_tools("nope")
    # a program's listing gets what is left of its run, when that is less than the timeout
    with pytest.raises(McpError, match="fx did not list its tools within 50 ms"):
        tools.list_tools("fx", budget_ms=50)


def test_a_call_past_its_timeout_stops_the_server_process(
    fixture_server: McpServerConfig, ran_log: Path
) -> None:
    tools = McpTools({"fx": fixture_server}, 20_000)
    # the timeout leaves the server (an interpreter importing the SDK: ~1.5 s, more on a
    # loaded machine) time to start and take the call, which then runs past it
    with pytest.raises(ToolTimeoutError, match="tool timed out after 8000 ms") as late:
        call(tools, "nap", '{"ms":60000}', timeout_ms=8000)
    assert late.value.ran
    [line] = ran_log.read_text().splitlines()
    pid = int(line.split()[1])
    with pytest.raises(ProcessLookupError):  # stopped (and reaped) before the call returned
        os.kill(pid, 0)


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
    assert [t.name for t in tools.list_tools("fx")] == ["add", "echo", "nap", "secret"]
    assert call(tools, "add", '{"a":2,"b":3}') == '{"result":5}'
