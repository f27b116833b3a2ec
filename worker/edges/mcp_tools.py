"""MCP servers (Model Context Protocol) through the official `mcp` SDK: a server's tool list,
and one tool call (the McpClient port).

Every listing and every call is a session of its own, run in a fresh event loop (`anyio.run`)
in the calling thread, so a worker of any pool (prefork, threads) calls it as it calls a WASM
tool; the whole of it (starting the server, the handshake, the call) is bounded by the call's
timeout. A stdio server is a process started for the listing or call and stopped with it (the
SDK closes its stdin, then kills its process tree); its stderr is discarded, as it may echo
arguments. A listing is kept LIST_TTL_S per process, so the sends of one program and the
sessions of one batch share it.

SDK and transport exceptions are translated here, once: a listing that fails -> McpError; a
call past its timeout -> ToolTimeoutError; a result flagged isError, or a server that fails
-> ToolRuntimeError (`ran=False` when the call was never sent); an output over the cap ->
ToolOutputTooLargeError. Tool arguments and outputs are never logged.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx2
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.types import CallToolResult, PaginatedRequestParams, TextContent, Tool

from schemas.fleet import McpServerConfig
from schemas.mcp import McpToolInfo
from worker.errors import (
    McpError,
    ToolOutputTooLargeError,
    ToolRuntimeError,
    ToolTimeoutError,
)
from worker.session.ports import ToolCall

log = logging.getLogger(__name__)

LIST_TTL_S = 30.0
MESSAGE_CHARS = 500  # of a tool's error text, in its tool message
MAX_LISTED = 1000  # tools of one server (pages of its listing followed up to this)


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
        list_ttl_s: float = LIST_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._servers = dict(servers)
        self._default_timeout_ms = default_timeout_ms
        self._environ = os.environ if environ is None else environ
        self._list_ttl_s = list_ttl_s
        self._clock = clock
        self._lists: dict[str, tuple[float, tuple[McpToolInfo, ...]]] = {}
        self._lock = threading.Lock()

    def timeout_ms(self, server: McpServerConfig) -> int:
        return server.timeout_ms or self._default_timeout_ms

    # listing -------------------------------------------------------------------------------

    def list_tools(self, server_id: str, budget_ms: int | None = None) -> tuple[McpToolInfo, ...]:
        server = self._servers.get(server_id)
        if server is None:
            raise McpError(f"MCP server {server_id!r} is not configured")
        now = self._clock()
        with self._lock:
            cached = self._lists.get(server_id)
            if cached is not None and now - cached[0] < self._list_ttl_s:
                return cached[1]
        timeout_ms = self.timeout_ms(server)
        if budget_ms is not None:
            timeout_ms = max(1, min(timeout_ms, budget_ms))
        try:
            listed = anyio.run(self._list, server, timeout_ms / 1000)
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
        with self._lock:
            self._lists[server_id] = (now, listed)
        return listed

    async def _list(self, server: McpServerConfig, timeout_s: float) -> tuple[McpToolInfo, ...]:
        with anyio.fail_after(timeout_s):
            async with _session(server, self._environ, timeout_s) as session:
                tools: list[Tool] = []
                result = await session.list_tools()
                tools.extend(result.tools)
                while result.next_cursor and len(tools) < MAX_LISTED:
                    page = PaginatedRequestParams(cursor=result.next_cursor)
                    result = await session.list_tools(params=page)
                    tools.extend(result.tools)
        return tuple(_info(tool) for tool in tools[:MAX_LISTED])

    # a call --------------------------------------------------------------------------------

    def run(self, call: ToolCall) -> str:
        ref = call.mcp
        server = None if ref is None else self._servers.get(ref.server)
        if ref is None or server is None:
            where = "no MCP tool" if ref is None else f"MCP server {ref.server!r}"
            raise ToolRuntimeError(f"{where} is not configured on this worker", ran=False)
        arguments = json.loads(call.arguments)  # canonical JSON of an object, validated
        sent = _Sent()
        try:
            result = anyio.run(
                self._call, server, ref.tool, arguments, call.timeout_ms / 1000, sent
            )
        except Exception as exc:
            root = _root(exc)
            if isinstance(root, TimeoutError):
                raise ToolTimeoutError(
                    f"tool timed out after {call.timeout_ms} ms", ran=sent.value
                ) from None
            raise ToolRuntimeError(
                f"MCP server {server.id}: {_reason(root)}", ran=sent.value
            ) from None
        if result.is_error:
            text = _text(result) or "the MCP tool reported an error"
            raise ToolRuntimeError(text[:MESSAGE_CHARS], ran=True)
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
            async with _session(server, self._environ, timeout_s) as session:
                sent.value = True
                return await session.call_tool(tool, arguments)


@asynccontextmanager
async def _session(
    server: McpServerConfig, environ: Mapping[str, str], timeout_s: float
) -> AsyncIterator[ClientSession]:
    """An initialized client session on the server's transport."""
    async with _transport(server, environ, timeout_s) as streams:
        read, write = streams[0], streams[1]
        async with ClientSession(read, write) as session:
            await session.initialize()
            yield session


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
    return type(exc).__name__
