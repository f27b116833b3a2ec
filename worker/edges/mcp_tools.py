"""MCP servers (Model Context Protocol) through the official `mcp` SDK: a server's tool list,
and one tool call (the McpClient port).

The sessions are pooled (worker/edges/mcp_pool.py): a worker process keeps one client session
per server, started on first use, shared by its threads and started again when its server goes
away; a thread waits for its listing or call, which runs on the pool's loop. Each is bounded by
its timeout; a call past it is abandoned (the SDK tells the server to cancel it) and the
session stays. A stdio server's stderr is discarded, as it may echo arguments. A server's
listing is kept per process for its `list_ttl_s`, so the sends of one program and the sessions
of one batch share it.

SDK and transport exceptions are translated here, once: a listing that fails -> McpError; a
call past its timeout -> ToolTimeoutError; a result flagged isError, or a server that fails
-> ToolRuntimeError (`ran=False` when the call was never sent); an output over the cap ->
ToolOutputTooLargeError. A program's call (`whole_result`) answers with the whole
CallToolResult as SPEAR does, isError included. Tool arguments and outputs are never logged.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import json
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import anyio
import httpx2
from mcp import StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp.types import CONNECTION_CLOSED, CallToolResult, PaginatedRequestParams, TextContent, Tool

from schemas.fleet import McpServerConfig
from schemas.mcp import McpToolInfo
from worker.edges.mcp_pool import McpPool
from worker.errors import (
    McpError,
    ToolOutputTooLargeError,
    ToolRuntimeError,
    ToolTimeoutError,
)
from worker.session.ports import ToolCall

log = logging.getLogger(__name__)

T = TypeVar("T")
MESSAGE_CHARS = 500  # of a tool's error text, in its tool message
MAX_LISTED = 1000  # tools of one server (pages of its listing followed up to this)
WAIT_GRACE_S = 5.0  # past a timeout, how long a thread waits for the loop to give up


@dataclass
class _Sent:
    """Whether the call was sent to the server (a failure before that: it did not run)."""

    value: bool = False


class McpTools:
    def __init__(
        self,
        servers: Mapping[str, McpServerConfig],
        default_timeout_ms: int,
        environ: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._servers = dict(servers)
        self._default_timeout_ms = default_timeout_ms
        self._environ = os.environ if environ is None else environ
        self._clock = clock
        self._lists: dict[str, tuple[float, tuple[McpToolInfo, ...]]] = {}
        self._lock = threading.Lock()
        self.pool = McpPool(self._transport)

    def timeout_ms(self, server: McpServerConfig) -> int:
        return server.timeout_ms or self._default_timeout_ms

    def close(self) -> None:
        """Close the process's sessions (its stdio servers stop): the worker is stopping."""
        self.pool.close()

    def _transport(self, server: McpServerConfig) -> AbstractAsyncContextManager[Any]:
        return _transport(server, self._environ, self.timeout_ms(server) / 1000)

    def _wait(self, coroutine: Coroutine[Any, Any, T], timeout_s: float) -> T:
        """Run `coroutine` (bounded by `timeout_s` itself) on the pool's loop and wait for it;
        a loop that does not answer shortly after is given up on too."""
        future = self.pool.submit(coroutine)
        try:
            return future.result(timeout_s + WAIT_GRACE_S)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError from None

    # listing -------------------------------------------------------------------------------

    def list_tools(self, server_id: str, budget_ms: int | None = None) -> tuple[McpToolInfo, ...]:
        server = self._servers.get(server_id)
        if server is None:
            raise McpError(f"MCP server {server_id!r} is not configured")
        now = self._clock()
        with self._lock:
            cached = self._lists.get(server_id)
            if cached is not None and now - cached[0] < server.list_ttl_s:
                return cached[1]
        timeout_ms = self.timeout_ms(server)
        if budget_ms is not None:
            timeout_ms = max(1, min(timeout_ms, budget_ms))
        try:
            listed = self._wait(self._list(server, timeout_ms / 1000), timeout_ms / 1000)
        except Exception as exc:
            root = _root(exc)
            if isinstance(root, TimeoutError):
                raise McpError(
                    f"MCP server {server_id} did not list its tools within {timeout_ms} ms"
                ) from None
            raise McpError(
                f"MCP server {server_id} could not list its tools: {_reason(root)}"
            ) from None
        log.info("MCP server %s lists %d tools", server_id, len(listed))
        if server.list_ttl_s > 0:
            with self._lock:
                self._lists[server_id] = (now, listed)
        return listed

    async def _list(self, server: McpServerConfig, timeout_s: float) -> tuple[McpToolInfo, ...]:
        with anyio.fail_after(timeout_s):
            client = await self._client(server)
            tools: list[Tool] = []
            result = await client.list_tools()
            tools.extend(result.tools)
            while result.next_cursor and len(tools) < MAX_LISTED:
                page = PaginatedRequestParams(cursor=result.next_cursor)
                result = await client.list_tools(params=page)
                tools.extend(result.tools)
        return tuple(_info(tool) for tool in tools[:MAX_LISTED])

    async def _client(self, server: McpServerConfig) -> Any:
        """The server's live client session (the pool's, or one started now)."""
        session = await self.pool.session(server)
        client = session.client
        if client is None:  # its server went away between the two lines
            raise ConnectionError("the MCP session ended")
        return client

    # a call --------------------------------------------------------------------------------

    def run(self, call: ToolCall) -> str:
        ref = call.mcp
        server = None if ref is None else self._servers.get(ref.server)
        if ref is None or server is None:
            where = "no MCP tool" if ref is None else f"MCP server {ref.server!r}"
            raise ToolRuntimeError(f"{where} is not configured on this worker", ran=False)
        arguments = json.loads(call.arguments)  # canonical JSON of an object, validated
        sent = _Sent()
        timeout_s = call.timeout_ms / 1000
        try:
            result = self._wait(self._call(server, ref.tool, arguments, timeout_s, sent), timeout_s)
        except Exception as exc:
            root = _root(exc)
            if isinstance(root, TimeoutError):
                raise ToolTimeoutError(
                    f"tool timed out after {call.timeout_ms} ms", ran=sent.value
                ) from None
            raise ToolRuntimeError(
                f"MCP server {server.id}: {_reason(root)}", ran=sent.value
            ) from None
        if ref.whole_result:
            output = _compact(_whole(result))
        elif result.is_error:
            text = _text(result) or "the MCP tool reported an error"
            raise ToolRuntimeError(text[:MESSAGE_CHARS], ran=True)
        else:
            output = _output(result)
        size = len(output.encode())
        if size > call.max_output_bytes:
            raise ToolOutputTooLargeError(
                f"tool output of {size} bytes exceeds max_tool_output_bytes {call.max_output_bytes}"
            )
        return output

    async def _call(
        self,
        server: McpServerConfig,
        tool: str,
        arguments: dict[str, Any],
        timeout_s: float,
        sent: _Sent,
    ) -> CallToolResult:
        with anyio.fail_after(timeout_s):
            client = await self._client(server)
            sent.value = True
            result: CallToolResult = await client.call_tool(tool, arguments)
            return result


def _transport(
    server: McpServerConfig, environ: Mapping[str, str], timeout_s: float
) -> AbstractAsyncContextManager[Any]:
    if server.command:
        params = StdioServerParameters(
            command=server.command[0],
            args=list(server.command[1:]),
            env=dict(server.env) or None,
            cwd=Path(server.cwd) if server.cwd else None,
        )
        return stdio_client(params, errlog=_devnull())
    assert server.url is not None  # the configuration gives a command or a URL
    token = server.api_key(environ)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return _http(server.url, headers, timeout_s)


@asynccontextmanager
async def _http(url: str, headers: dict[str, str], timeout_s: float) -> AsyncIterator[Any]:
    """The streamable-HTTP transport, with an HTTP client of its own closed with it."""
    async with (
        httpx2.AsyncClient(headers=headers, timeout=timeout_s) as client,
        streamable_http_client(url, http_client=client) as streams,
    ):
        yield streams


_DEVNULL: Any = None


def _devnull() -> Any:
    """Where a stdio server's stderr goes: nowhere (it may echo arguments)."""
    global _DEVNULL
    if _DEVNULL is None or _DEVNULL.closed:
        _DEVNULL = open(os.devnull, "w")  # noqa: SIM115 - kept open for the process
        atexit.register(_DEVNULL.close)  # closed at exit, not left to the ResourceWarning
    return _DEVNULL


def _info(tool: Tool) -> McpToolInfo:
    hints = tool.annotations
    return McpToolInfo(
        name=tool.name,
        description=tool.description,
        input_schema=dict(tool.input_schema or {}),
        read_only=bool(hints and hints.read_only_hint),
        idempotent=bool(hints and hints.idempotent_hint),
    )


def _text(result: CallToolResult) -> str:
    return "\n".join(c.text for c in result.content if isinstance(c, TextContent))


def _output(result: CallToolResult) -> str:
    """What the model reads of a result: its structured content as JSON when it has one, else
    its text, else its content blocks as JSON (images, resources)."""
    if result.structured_content is not None:
        return _compact(result.structured_content)
    if all(isinstance(c, TextContent) for c in result.content):
        return _text(result)
    return _compact(
        [c.model_dump(mode="json", by_alias=True, exclude_none=True) for c in result.content]
    )


def _whole(result: CallToolResult) -> dict[str, Any]:
    """The result as SPEAR hands it to a program's chat: its content blocks, its structured
    content when it has one, and whether it is an error."""
    out: dict[str, Any] = {
        "content": [
            c.model_dump(mode="json", by_alias=True, exclude_none=True) for c in result.content
        ]
    }
    if result.structured_content is not None:
        out["structuredContent"] = result.structured_content
    out["isError"] = bool(result.is_error)
    return out


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _root(exc: BaseException) -> BaseException:
    """The first leaf of an exception group (anyio task groups wrap what their tasks raise)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def _reason(exc: BaseException) -> str:
    """A failure's class and a short message: never arguments, which servers may echo."""
    if isinstance(exc, OSError) and exc.strerror:
        return f"{type(exc).__name__}: {exc.strerror}"
    if isinstance(exc, MCPError) and exc.code == CONNECTION_CLOSED:
        return "the connection closed"  # the server went away: the next call starts it again
    return type(exc).__name__
