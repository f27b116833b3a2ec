"""The fd table of one program run: chat sessions, responses, epoll instances and user
streams, mirrored to Redis (`cq:fds:<run>`) on every change.

A response fd learns that its chat finished by reading the chat's response, written by
whichever worker finished it (`observe`); the poll mask of an fd follows from that. Kinds
served elsewhere (user streams) register their poll masks (`pollers`) and what brings their
state up to date before a poll (`refreshers`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from schemas.bodies import dump_body
from schemas.spec_types import ToolPolicy
from worker.guest import abi
from worker.guest.imports import GuestMemory
from worker.guest.ports import ProgramStore


@dataclass(frozen=True)
class RegisteredTool:
    """A tool a program registered on a chat (cchat_write_fn)."""

    fn_offset: int  # its index in the function table
    function: dict[str, Any]  # what the model sees
    policy: ToolPolicy


@dataclass
class FdEntry:
    kind: str
    closed: bool = False
    flags: set[str] = field(default_factory=set)
    # a chat session
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[RegisteredTool] = field(default_factory=list)
    params: dict[str, Any] = field(default_factory=dict)
    # a response
    sk: str = ""
    session_fd: int = 0
    auto: bool = False
    metrics: bool = False
    body: bytes | None = None
    record: dict[str, Any] | None = None
    sent_messages: int = 0
    nonblocking: bool = False  # sent from an O_NONBLOCK session: cchat_recv never blocks
    # an epoll instance: fd -> interest events
    watch: dict[int, int] = field(default_factory=dict)
    # a user stream (its stream id, direction), or a user stream ctl fd (its unread events,
    # as (stream id, kind), and whether it gave its session-closed event)
    stream_id: int = 0
    direction: int = 0
    ctl_events: list[tuple[int, int]] = field(default_factory=list)
    ctl_closed_read: bool = False

    def summary(self) -> dict[str, Any]:
        """What the Redis mirror shows (`cchatq status`): no message text."""
        out: dict[str, Any] = {
            "kind": self.kind,
            "closed": self.closed,
            "flags": sorted(self.flags),
        }
        if self.kind == abi.KIND_SESSION:
            out.update(messages=len(self.messages), tools=[t.function["name"] for t in self.tools])
        elif self.kind == abi.KIND_RESPONSE:
            out.update(session=self.sk, ready=self.body is not None)
        elif self.kind == abi.KIND_USER_STREAM:
            out.update(stream_id=self.stream_id, direction=self.direction)
        elif self.kind == abi.KIND_EPOLL:
            out.update(watch=sorted(self.watch))
        return out


class FdTable:
    """The fds of one run (`entries`, fd -> FdEntry), numbered from `abi.FIRST_FD`.

    `on_tool_logs` hears the log lines of a chat's tool calls (its record's `tool_logs`) when
    the run first sees the chat finished: where they fall among the program's own lines."""

    def __init__(
        self,
        store: ProgramStore,
        run_sk: str,
        on_tool_logs: Callable[[list[dict[str, Any]]], None] | None = None,
    ) -> None:
        self.store = store
        self.run_sk = run_sk
        self.entries: dict[int, FdEntry] = {}
        self.next_fd = abi.FIRST_FD
        self.on_tool_logs = on_tool_logs
        self.pollers: dict[str, Callable[[FdEntry], int]] = {}  # kind -> its poll mask
        self.refreshers: list[Callable[[bool], None]] = []  # arg: a first look (may be skipped)

    def new(self, entry: FdEntry) -> int:
        fd, self.next_fd = self.next_fd, self.next_fd + 1
        self.entries[fd] = entry
        self.persist(fd)
        return fd

    def persist(self, fd: int) -> None:
        self.store.save_fd(self.run_sk, fd, self.entries[fd].summary())

    def get(self, fd: int, kind: str, open_only: bool = True) -> FdEntry | None:
        entry = self.entries.get(fd)
        if entry is None or entry.kind != kind or (open_only and entry.closed):
            return None
        return entry

    def observe(self, response: FdEntry) -> bool:
        """Whether the chat behind a response fd has finished; on the first sight of it, take
        its body and (auto tool call) append its new messages to the session."""
        if response.body is not None:
            return True
        body, record = self.store.response_and_record(response.sk)
        if body is None:
            return False
        response.body, response.record = body, record
        if record is not None and record.get("tool_logs") and self.on_tool_logs is not None:
            self.on_tool_logs(list(record["tool_logs"]))
        session = self.entries.get(response.session_fd)
        if response.auto and session is not None and record is not None:
            transcript = record.get("transcript") or []
            session.messages.extend(transcript[response.sent_messages :])
        return True

    def observe_many(self, responses: list[FdEntry]) -> None:
        """One round trip to learn which of many chats finished (epoll's hot path)."""
        waiting = [r for r in responses if r.body is None]
        if not waiting:
            return
        for response, done in zip(waiting, self.store.ready([r.sk for r in waiting]), strict=True):
            if done:
                self.observe(response)

    def refresh(self, first: bool) -> None:
        """Bring the state of the registered kinds up to date before a poll. `first`: the
        first look of a wait, which a guest spinning on epoll repeats at once (may be rate
        limited); a look after a wait has slept is never skipped."""
        for refresh in self.refreshers:
            refresh(first)

    def poll_mask(self, entry: FdEntry) -> int:
        poller = self.pollers.get(entry.kind)
        if poller is not None:
            return poller(entry)
        mask = abi.EPOLLHUP if entry.closed else 0
        if entry.kind == abi.KIND_RESPONSE and self.observe(entry):
            mask |= abi.EPOLLIN
        if entry.kind == abi.KIND_SESSION and not entry.closed:
            mask |= abi.EPOLLOUT
        return mask

    def metrics(self, mem: GuestMemory, entry: FdEntry, out_ptr: int, out_len_ptr: int) -> int:
        """A response's metrics (`{}` unless its send asked for them) into guest memory."""
        if not self.observe(entry):
            return -abi.EAGAIN
        metrics = (entry.record or {}).get("metrics", {}) if entry.metrics else {}
        return write_with_len(mem, out_ptr, out_len_ptr, dump_body(metrics))


def write_with_len(mem: GuestMemory, out_ptr: int, out_len_ptr: int, data: bytes) -> int:
    capacity = mem.read_u32(out_len_ptr)
    need, fits = abi.write_with_len_plan(capacity, data)
    if not fits:
        mem.write_u32(out_len_ptr, need)
        return -abi.ENOSPC
    mem.write(out_ptr, data)
    mem.write_u32(out_len_ptr, need)
    return need
