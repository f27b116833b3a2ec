"""The per-call overhead of a stdio MCP tool, in process, through the worker's own edge
(worker/edges/mcp_tools.py) against the fixtures' server (fixtures/mcp/server.py): the first
call starts the server; each later one is timed."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import fixtures
from schemas.fleet import McpServerConfig
from schemas.spec_types import McpToolRef
from worker.edges.mcp_tools import McpTools
from worker.session.ports import ToolCall

ROOT = Path(fixtures.__file__).resolve().parent.parent
CALLS = 50

Row = tuple[str, str]


def _add(a: int) -> ToolCall:
    return ToolCall(
        module_sha256="",
        export=None,
        table_index=None,
        fork_sha256=None,
        arguments=f'{{"a":{a},"b":2}}'.encode(),
        timeout_ms=20_000,
        memory_bytes=0,
        max_output_bytes=65_536,
        mcp=McpToolRef("fx", "add"),
    )


def mcp_call_ms(calls: int = CALLS) -> tuple[float, float]:
    """The first call's time and the median of the `calls` after it, in ms."""
    server = McpServerConfig(
        id="fx", command=(sys.executable, "-m", "fixtures.mcp.server"), cwd=str(ROOT)
    )
    tools = McpTools({"fx": server}, 20_000)
    try:
        started = time.perf_counter()
        tools.run(_add(0))
        first_ms = (time.perf_counter() - started) * 1000
        samples = []
        for k in range(calls):
            started = time.perf_counter()
            tools.run(_add(k))
            samples.append((time.perf_counter() - started) * 1000)
    finally:
        close = getattr(tools, "close", None)
        if close is not None:
            close()
    return first_ms, statistics.median(samples)


def mcp_call_row() -> Row:
    first_ms, after_ms = mcp_call_ms()
    return (
        "MCP stdio tool call after the first (goal <= 20 ms; before ~1 s)",
        f"{after_ms:.1f} ms (first {first_ms:.0f} ms)",
    )


if __name__ == "__main__":
    print(*mcp_call_row(), sep="  ")
