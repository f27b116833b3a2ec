"""The `spear` hostcalls of one program run (docs/guest-abi.md sections 2, 3 and 6).

Each `cchat_send` becomes a chat session on the same round/tool pipeline as a spec session
(id `<run id>#send<n>`), with its tools forked from the program's memory at the send. The fd
table (`fds.FdTable`) is mirrored to Redis (`cq:fds:<run>`); response bodies are read from the
chats' response fds, written by whichever worker finished them. `spear_fd_ctl` and the
`spear_epoll_*` calls are in `epoll`, the `user_stream_*` calls in `user_streams`, `log`, time,
random and `sleep_ms` in `shared` (as a tool call serves them); this module holds the chat
hostcalls.

Hostcalls return -errno and never raise, except RunAborted (deadline, cancellation), which
traps the guest and ends the run.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from schemas import keys
from schemas.bodies import dump_body
from schemas.limits import LIMIT_ALIASES, LIMIT_BOUNDS, Limits
from schemas.spec_types import Flags, FunctionSpec, Permissions, SessionSpec, ToolSpec
from worker.errors import (
    CancelledError,
    DeadlineExceededError,
    GuestFault,
    InvalidRequestError,
    RunAborted,
    SessionError,
    StoreError,
)
from worker.guest import abi
from worker.guest.epoll import EpollCalls
from worker.guest.fds import FdEntry, FdTable, RegisteredTool, write_with_len
from worker.guest.fork import ProgramFork
from worker.guest.hostcalls import Handler, Part, dispatch_table
from worker.guest.imports import GuestMemory
from worker.guest.mcp_params import McpAccess, chat_mcp_tools, is_mcp_param, set_mcp_param
from worker.guest.ports import ProgramStore
from worker.guest.run_log import RunLog
from worker.guest.shared import SharedCalls
from worker.guest.user_streams import UserStreamCalls
from worker.guest.write_fn import Rejected, parse_tool_json
from worker.session.ports import Dispatcher
from worker.session.tool_logs import LEVELS

WARN = LEVELS.index("warn")

log = logging.getLogger(__name__)
ROLES = ("system", "user", "assistant", "tool")
CONSUMED_PARAMS = (
    "model",
    "backend",
    "timeout_ms",
    "tool_arena_ptr",
    "tool_arena_len",
    "strict_unknown_tool",
    "tool_result_envelope",
)
WAIT_SLICE_S = 1.0  # blocking waits wake at least this often to check cancellation


@dataclass
class ChatDefaults:
    run_id: str
    run_sk: str
    module_sha256: str
    backend: str | None
    model: str | None
    deadline: float  # time.monotonic() at which the run ends
    permissions: Permissions = field(default_factory=Permissions)  # the spec's, for its chats
    mcp: McpAccess = field(default_factory=McpAccess)  # the MCP servers its chats may enable


class ProgramHost:
    def __init__(self, defaults: ChatDefaults, store: ProgramStore, dispatch: Dispatcher) -> None:
        self.d = defaults
        self.store = store
        self.dispatch = dispatch
        # the run's log, as its record shows it: its own lines and its chats' tool lines
        self.run_log = RunLog()
        self.fd_table = FdTable(store, defaults.run_sk, self.run_log.extend)
        self.fds = self.fd_table.entries
        self.sends = 0
        self.responses: list[int] = []  # response fds in send order
        self.exported_globals: list[str] = []
        self.table_name: str | None = None
        self._aborted: RunAborted | None = None
        epoll = EpollCalls(self.fd_table, self._wait)
        streams = UserStreamCalls(self.fd_table, store, defaults.run_sk)
        shared = SharedCalls(self._log_line, lambda: defaults.deadline, self._check_run)
        parts = {Part.CHAT: self, Part.FDS: epoll, Part.STREAMS: streams, Part.SHARED: shared}
        self._calls: dict[str, Handler] = dispatch_table("program", parts)

    # SpearHost -----------------------------------------------------------------------------

    def attach(self, exported_globals: list[str], table_name: str | None) -> None:
        self.exported_globals, self.table_name = exported_globals, table_name

    def abort_reason(self) -> RunAborted | None:
        return self._aborted

    def hostcall(self, name: str, mem: GuestMemory, args: tuple[int, ...]) -> int | None:
        if self._aborted is not None:
            raise self._aborted
        try:
            return self._calls[name](mem, *args)
        except (RunAborted, GuestFault):
            raise
        except StoreError:
            return -abi.EIO
        except Exception:
            # a host fault must not unwind through the guest: the ABI's internal failure
            log.exception("hostcall %s failed in run %s", name, self.d.run_sk)
            return -abi.EIO

    def _abort(self, ending: SessionError) -> RunAborted:
        self._aborted = RunAborted(ending)
        return self._aborted

    def _check_time(self) -> float:
        remaining = self.d.deadline - time.monotonic()
        if remaining <= 0:
            raise self._abort(DeadlineExceededError("program exceeded its deadline"))
        return remaining

    def _check_cancel(self) -> None:
        if self.store.is_cancelled(self.d.run_sk):
            raise self._abort(CancelledError("program run cancelled"))

    def _check_run(self) -> None:
        """What a sleeping program checks: its deadline and its cancellation."""
        self._check_time()
        self._check_cancel()

    @property
    def logs(self) -> list[dict[str, Any]]:
        """The run's log lines (bounded: RunLog), as its record shows them."""
        return self.run_log.entries()

    def _log_line(self, level: int, text: str) -> None:
        self.run_log.add({"level": LEVELS[level], "message": text})

    def _reject(self, rejected: Rejected) -> int:
        """-EINVAL, and a `warn` line in the run's logs saying which check failed."""
        self.run_log.add({"level": "warn", "message": rejected.log_line()})
        return -abi.EINVAL

    # chat hostcalls ------------------------------------------------------------------------

    def cchat_create(self, mem: GuestMemory) -> int:
        return self.fd_table.new(FdEntry(kind=abi.KIND_SESSION))

    def cchat_write_msg(
        self, mem: GuestMemory, fd: int, role_ptr: int, role_len: int, ptr: int, length: int
    ) -> int:
        entry = self.fd_table.get(fd, abi.KIND_SESSION)
        if entry is None:
            return -abi.EBADF
        try:
            role = mem.read(role_ptr, role_len).decode()
            content = mem.read(ptr, length).decode()
        except UnicodeDecodeError:
            return -abi.EINVAL
        if role not in ROLES:
            return -abi.EINVAL
        entry.messages.append({"role": role, "content": content})
        self.fd_table.persist(fd)
        return 0

    def cchat_write_fn(
        self, mem: GuestMemory, fd: int, fn_offset: int, ptr: int, length: int
    ) -> int:
        entry = self.fd_table.get(fd, abi.KIND_SESSION)
        if entry is None:
            return -abi.EBADF
        parsed = parse_tool_json(mem.read(ptr, length))
        if isinstance(parsed, Rejected):
            return self._reject(parsed)
        function, policy = parsed
        problem = mem.tool_function_problem(fn_offset, self.table_name)
        if problem is not None:
            return self._reject(Rejected(f"fn_offset {fn_offset}", problem))
        if all(t.function["name"] != function["name"] for t in entry.tools):  # the first wins
            entry.tools.append(RegisteredTool(fn_offset, function, policy))
            self.fd_table.persist(fd)
        return 0

    def cchat_ctl(self, mem: GuestMemory, fd: int, cmd: int, arg_ptr: int, arg_len_ptr: int) -> int:
        entry = self.fds.get(fd)
        if entry is None:
            return -abi.EBADF
        if cmd == abi.CTL_SET_PARAM:
            session = self.fd_table.get(fd, abi.KIND_SESSION)
            if session is None:
                return -abi.EBADF
            parsed = abi.parse_set_param(mem.read(arg_ptr, mem.read_u32(arg_len_ptr)))
            if isinstance(parsed, int):
                return parsed
            key, value = parsed
            if is_mcp_param(key):  # consumed at the send, never sent upstream
                rc = set_mcp_param(session.params, key, value, self.d.mcp)
                if rc < 0:
                    return rc
            else:
                session.params[key] = value
            self.fd_table.persist(fd)
            return 0
        if cmd == abi.CTL_GET_METRICS:
            if entry.kind != abi.KIND_RESPONSE:
                return -abi.EBADF
            return self.fd_table.metrics(mem, entry, arg_ptr, arg_len_ptr)
        return -abi.EINVAL

    def cchat_send(self, mem: GuestMemory, fd: int, flags: int) -> int:
        session = self.fd_table.get(fd, abi.KIND_SESSION)
        if session is None:
            return -abi.EBADF
        self._check_cancel()
        n, self.sends = self.sends, self.sends + 1
        chat_id = keys.chat_spec_id(self.d.run_id, n)
        sk = keys.chat_session_key(self.d.run_sk, n)
        auto = bool(flags & abi.SEND_AUTO_TOOL_CALL)
        metrics = bool(flags & abi.SEND_METRICS)
        response = FdEntry(
            kind=abi.KIND_RESPONSE, sk=sk, session_fd=fd, auto=auto, metrics=metrics,
            sent_messages=len(session.messages),
        )  # fmt: skip
        spec = self._chat_spec(mem, session, chat_id, auto, response.metrics)
        if isinstance(spec, bytes):  # a routing error: the response fd holds an error body
            response.body, response.record = spec, {"transcript": session.messages, "metrics": {}}
        else:
            new = self.store.submit_chat(sk, spec, keys.run_batch(self.d.run_sk))
            # A replayed run (its task redelivered) finds its chats stored; one still without an
            # answer is published again, which its round step's guards make harmless.
            if new or not self.store.ready([sk])[0]:
                self.dispatch.round(sk, 0)
        resp_fd = self.fd_table.new(response)
        self.responses.append(resp_fd)
        if abi.O_NONBLOCK in session.flags:
            response.nonblocking = True
        else:  # until the body is there: timeout_ms bounds the model request, not this wait
            self._wait(lambda: self.fd_table.observe(response))
        return resp_fd

    def _chat_spec(
        self, mem: GuestMemory, session: FdEntry, chat_id: str, auto: bool, metrics: bool
    ) -> SessionSpec | bytes:
        params = dict(session.params)
        consumed = {
            k: params.pop(k)
            for k in (*CONSUMED_PARAMS, *LIMIT_BOUNDS, *LIMIT_ALIASES)
            if k in params
        }
        mcp_params = {k: params.pop(k) for k in list(params) if is_mcp_param(k)}
        if "timeout_ms" in consumed and "request_timeout_ms" not in consumed:
            # SPEAR's timeout_ms is the model request's bound: the round's provider call
            consumed["request_timeout_ms"] = consumed["timeout_ms"]
        model = consumed.get("model") or self.d.model
        if not isinstance(model, str) or not model:
            return dump_body(InvalidRequestError("no model: set the `model` param").body())
        backend = consumed.get("backend") or self.d.backend
        if backend is not None and not isinstance(backend, str):
            return dump_body(InvalidRequestError("the `backend` param must be a string").body())
        fork_sha: str | None = None
        if session.tools and auto:  # only an auto tool-call loop runs the tools
            fork = ProgramFork(
                snapshot=mem.snapshot(),
                globals=mem.mutable_globals(self.exported_globals),
                arena_ptr=_int_or_none(consumed.get("tool_arena_ptr")),
                arena_len=_int_or_none(consumed.get("tool_arena_len")),
            )
            fork_sha = self.store.put_fork(fork.to_blob())
        tools = tuple(
            ToolSpec(
                function=FunctionSpec.from_json(tool.function),
                module="program",
                table_index=tool.fn_offset,
                module_sha256=self.d.module_sha256,
                fork_sha256=fork_sha,
                policy=tool.policy,
            )
            for tool in session.tools
        )
        # its MCP servers' tools, after its own (a name of its own wins); a server that
        # cannot list them is skipped with a warn line, as SPEAR skips it
        offered = chat_mcp_tools(
            mcp_params, self.d.mcp, self._left_ms, lambda text: self._log_line(WARN, text)
        )
        own = {t.name for t in tools}
        tools += tuple(t for t in offered if t.name not in own)
        return SessionSpec(
            id=chat_id,
            provider=backend,
            model=model,
            messages=tuple(session.messages),
            tools=tools,
            params=params,
            flags=Flags(
                auto_tool_call=auto,
                metrics=metrics,
                strict_unknown_tool=bool(consumed.get("strict_unknown_tool", False)),
                # SPEAR guests read their tools' raw output unless they ask for the envelope
                tool_result_envelope=consumed.get("tool_result_envelope") is True,
            ),
            limits=Limits.resolve(consumed),
            permissions=self.d.permissions,
        )

    def _left_ms(self) -> int:
        """What is left of the run, in ms (a blocking call is bounded by it); aborts at 0."""
        return max(1, int(self._check_time() * 1000))

    def _wait(self, ready: Callable[[], bool], until: float | None = None) -> bool:
        """Block until `ready()`, the run's deadline (which aborts), or `until`."""
        while not ready():
            remaining = self._check_time()
            if until is not None:
                remaining = min(remaining, until - time.monotonic())
                if remaining <= 0:
                    return False
            self._check_cancel()
            self.store.wait_done(keys.run_batch(self.d.run_sk), min(remaining, WAIT_SLICE_S))
        return True

    def cchat_recv(self, mem: GuestMemory, fd: int, out_ptr: int, out_len_ptr: int) -> int:
        # closed responses stay readable
        response = self.fd_table.get(fd, abi.KIND_RESPONSE, open_only=False)
        if response is None:
            return -abi.EBADF
        if not self.fd_table.observe(response):
            if response.nonblocking or abi.O_NONBLOCK in response.flags:
                return -abi.EAGAIN
            # blocks until the chat ends (a timeout_ms passed is an error body), or the run does
            self._wait(lambda: self.fd_table.observe(response))
        assert response.body is not None
        return write_with_len(mem, out_ptr, out_len_ptr, response.body)

    def cchat_close(self, mem: GuestMemory, fd: int) -> int:
        entry = self.fds.get(fd)
        if entry is None or entry.kind not in (abi.KIND_SESSION, abi.KIND_RESPONSE):
            return -abi.EBADF
        if not entry.closed:
            entry.closed = True
            self.fd_table.persist(fd)
        return 0

    # the run's result ----------------------------------------------------------------------

    def response_bodies(self) -> list[Any]:
        out = []
        for fd in self.responses:
            entry = self.fds[fd]
            self.fd_table.observe(entry)
            out.append(json.loads(entry.body) if entry.body is not None else None)
        return out


def _int_or_none(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return int(value)
