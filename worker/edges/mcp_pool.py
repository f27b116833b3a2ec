"""MCP client sessions kept open per worker process: one per configured server (a stdio
server's process, or a streamable-HTTP session), started on first use and shared by the
process's threads.

One background thread runs an asyncio event loop that owns every session; a thread calls
`submit(coroutine)` and waits on the future (asyncio.run_coroutine_threadsafe). Each session
is held by a task of its own, as the SDK's transports are anyio task groups that must be left
in the task that entered them. A session whose server went away (its stdout ended, its task
ended) is started again by the next use that finds it so: that use had not reached the server,
so it goes on with the new one. A prefork child finds the loop of the process it was forked
from unusable (its thread did not survive the fork) and starts its own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
from collections.abc import Callable, Coroutine
from contextlib import AbstractAsyncContextManager, suppress
from typing import Any, TypeVar

from mcp import ClientSession

from schemas.fleet import McpServerConfig

log = logging.getLogger(__name__)

T = TypeVar("T")
CLOSE_TIMEOUT_S = 10.0  # closing every session at shutdown (each stops its process)

Transport = Callable[[McpServerConfig], AbstractAsyncContextManager[Any]]


class McpSession:
    """One server's initialized client session, held open by a task of the loop until
    `close()` or until its server goes away."""

    def __init__(self, server: McpServerConfig, transport: Transport) -> None:
        self.server = server
        self._transport = transport
        self.client: ClientSession | None = None
        self._read: Any = None
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._hold(ready), name=f"mcp-{self.server.id}")
        try:
            await ready
        except BaseException:  # failed, or the caller's timeout: leave nothing running
            self._stop.set()
            self._task.cancel()  # the transport's own shutdown (stopping the process) is shielded
            raise

    async def _hold(self, ready: asyncio.Future[None]) -> None:
        try:
            async with self._transport(self.server) as streams:
                read, write = streams[0], streams[1]
                async with ClientSession(read, write) as client:
                    await client.initialize()
                    self.client, self._read = client, read
                    if not ready.done():
                        ready.set_result(None)
                    await self._stop.wait()
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc if isinstance(exc, Exception) else RuntimeError(exc))
            elif not isinstance(exc, asyncio.CancelledError | GeneratorExit):
                log.info("MCP server %s: session ended (%s)", self.server.id, type(exc).__name__)
        finally:
            self.client = None

    def alive(self) -> bool:
        """Whether the session can take a request: started, not stopped, and its server's
        side of the transport still open (a stdio server that exited closed its stdout)."""
        if self.client is None or self._task is None or self._task.done():
            return False
        stats = getattr(self._read, "statistics", None)
        return stats is None or stats().open_send_streams > 0

    async def close(self) -> None:
        self._stop.set()
        task = self._task
        if task is None or task.done():
            return
        try:
            await asyncio.wait_for(asyncio.shield(task), CLOSE_TIMEOUT_S)
        except (TimeoutError, asyncio.CancelledError):
            task.cancel()
            with suppress(BaseException):
                await task
        except Exception:  # its own failure, logged by _hold
            pass


class McpPool:
    """The process's MCP sessions, by server id, and the loop thread that owns them."""

    def __init__(self, transport: Transport) -> None:
        self._transport = transport
        self._lock = threading.Lock()
        self._pid: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sessions: dict[str, McpSession] = {}
        self._starting: dict[str, asyncio.Lock] = {}

    # the loop ------------------------------------------------------------------------------

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None or self._pid != os.getpid():
                # after a fork the parent's thread is gone: its sessions belong to the parent
                self._sessions, self._starting = {}, {}
                self._loop = asyncio.new_event_loop()
                self._pid = os.getpid()
                thread = threading.Thread(
                    target=self._loop.run_forever, name="cchatq-mcp", daemon=True
                )
                thread.start()
            return self._loop

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coroutine, self._running_loop())

    # sessions (on the loop) ----------------------------------------------------------------

    async def session(self, server: McpServerConfig) -> McpSession:
        """The server's live session: the kept one, or a new one when there is none or the
        kept one's server went away (that session is closed first, its process reaped)."""
        held = self._sessions.get(server.id)
        if held is not None and held.alive() and held.server == server:
            return held
        lock = self._starting.setdefault(server.id, asyncio.Lock())
        async with lock:
            held = self._sessions.get(server.id)
            if held is not None and held.alive() and held.server == server:
                return held
            if held is not None:
                del self._sessions[server.id]
                log.info("MCP server %s: starting it again", server.id)
                await held.close()
            started = McpSession(server, self._transport)
            await started.start()
            self._sessions[server.id] = started
            return started

    async def _close_all(self) -> None:
        sessions, self._sessions = list(self._sessions.values()), {}
        await asyncio.gather(*(s.close() for s in sessions), return_exceptions=True)

    def close(self) -> None:
        """Close every session (stopping stdio servers) and the loop: the worker process is
        stopping. Builds nothing; a forked child's inherited pool is not its own."""
        with self._lock:
            loop, mine = self._loop, self._pid == os.getpid()
            self._loop = None
        if loop is None or not mine or loop.is_closed():
            return
        try:
            future = asyncio.run_coroutine_threadsafe(self._close_all(), loop)
            future.result(CLOSE_TIMEOUT_S + 1)
        except Exception as exc:
            log.warning("MCP sessions not closed cleanly: %s", type(exc).__name__)
        loop.call_soon_threadsafe(loop.stop)

    def started(self, server_id: str) -> McpSession | None:
        """The kept session of a server, if any (tests, the bench)."""
        return self._sessions.get(server_id)
