"""SPEAR's user streams (`user_stream_*`; SPEAR's wasm-user-stream-bridge-en.md): a program
and the user of its run (`cchatq stream ID`, `Client.stream`) exchange SSF frames on numbered
streams. The user's events reach the run through Redis (`cq:us:<run>:in`, read from a cursor
kept here), the program's through `cq:us:<run>:out`; schemas/user_stream.py has both formats.

As in SPEAR: `user_stream_ctl_open` gives an fd whose reads are 8-byte events (u32 stream id,
u32 kind: 1 STREAM_CONNECTED, 2 SESSION_CLOSED); `user_stream_open(stream_id, direction)` an
fd that reads one frame per call (write-with-len) and writes one validated frame of its own
stream id per call (0 on success); reads never block (-EAGAIN: nothing yet), a guest waits
with `spear_epoll_*`, level-triggered: EPOLLIN frames queued (ctl: events unread), EPOLLOUT
connected, EPOLLHUP the peer closed or the fd did.

Where this differs from SPEAR, and why:
- A user attaching to a stream (`open`) connects it, before any frame (SPEAR: the first frame).
- A user's close is a half-close (the end of its input): what it sent before is read first.
  EPOLLHUP and SESSION_CLOSED come once the frames queued for the program's open readers are
  read (SPEAR flags them at once, and its echo sample, checking HUP first, drops the last
  frames), the program may still write (SPEAR: -EPIPE) until it closes its side, and a read
  of the closed, drained stream returns 0 (SPEAR: -EAGAIN for ever).
- A ctl fd opened after streams connected reports them too (SPEAR: only later ones).
- No outbound backpressure: a write goes to Redis at once (never -EAGAIN).
- The program closing its last writer of a stream tells the user (a `close` event).
A guest watching EPOLLOUT on an idle stream loops, as on SPEAR (epoll.py slows it down); the
Redis reads of a wait's first look are rate limited too (PULL_EVERY_S).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from schemas.user_stream import (
    CLOSE,
    CTL_SESSION_CLOSED,
    CTL_STREAM_CONNECTED,
    DATA,
    DIR_BIDI,
    DIR_IN,
    DIR_OUT,
    MAX_FRAME_BYTES,
    OPEN,
    StreamEvent,
    ctl_event,
    parse_frame,
)
from worker.guest import abi
from worker.guest.fds import FdEntry, FdTable, write_with_len
from worker.guest.imports import GuestMemory
from worker.guest.ports import ProgramStore

PULL_EVERY_S = 0.005  # a spinning epoll loop reads the user's events at most this often
_KINDS = (abi.KIND_USER_STREAM, abi.KIND_USER_STREAM_CTL)


@dataclass
class Channel:
    """One stream id, as the program sees it."""

    connected: bool = False
    closed: bool = False  # the user sent its last frame
    inbound: deque[bytes] = field(default_factory=deque)  # frames not read yet


class UserStreamCalls:
    def __init__(self, fds: FdTable, store: ProgramStore, run_sk: str) -> None:
        self.fds = fds
        self.store = store
        self.run_sk = run_sk
        self.channels: dict[int, Channel] = {}
        self.cursor = "0-0"  # the last user event read
        self.sent = 0  # events written to the user
        self._pulled_at = float("-inf")
        fds.pollers[abi.KIND_USER_STREAM] = self._stream_mask
        fds.pollers[abi.KIND_USER_STREAM_CTL] = self._ctl_mask
        fds.refreshers.append(self._refresh)

    # hostcalls ---------------------------------------------------------------------------

    def user_stream_open(self, mem: GuestMemory, stream_id: int, direction: int) -> int:
        if stream_id < 0 or direction not in (DIR_IN, DIR_OUT, DIR_BIDI):
            return -abi.EINVAL
        entry = FdEntry(kind=abi.KIND_USER_STREAM, stream_id=stream_id, direction=direction)
        return self.fds.new(entry)

    def user_stream_ctl_open(self, mem: GuestMemory) -> int:
        self._pull()
        connected = [
            (sid, CTL_STREAM_CONNECTED) for sid, ch in self.channels.items() if ch.connected
        ]
        return self.fds.new(FdEntry(kind=abi.KIND_USER_STREAM_CTL, ctl_events=connected))

    def user_stream_read(self, mem: GuestMemory, fd: int, out_ptr: int, out_len_ptr: int) -> int:
        entry = self.fds.get(fd, abi.KIND_USER_STREAM)
        if entry is None:
            return -abi.EBADF
        if not entry.direction & DIR_IN:
            return -abi.EINVAL
        if not self._queued(entry.stream_id):
            self._pull()
        channel = self.channels.get(entry.stream_id)
        if channel is None or not channel.inbound:
            if channel is not None and channel.closed:
                return write_with_len(mem, out_ptr, out_len_ptr, b"")  # the end of the stream
            return -abi.EAGAIN
        read = write_with_len(mem, out_ptr, out_len_ptr, channel.inbound[0])
        if read >= 0:
            channel.inbound.popleft()
        return read

    def user_stream_write(self, mem: GuestMemory, fd: int, buf_ptr: int, buf_len: int) -> int:
        entry = self.fds.get(fd, abi.KIND_USER_STREAM)
        if entry is None:
            return -abi.EBADF
        if not 0 <= buf_len <= MAX_FRAME_BYTES:
            return -abi.EINVAL
        raw = mem.read(buf_ptr, buf_len)
        frame = parse_frame(raw)
        if frame is None or not entry.direction & DIR_OUT or frame.stream_id != entry.stream_id:
            return -abi.EINVAL
        if not self._connected(entry.stream_id):
            self._pull()
            if not self._connected(entry.stream_id):
                return -abi.ENOTCONN  # no user on this stream yet
        self._emit(StreamEvent(DATA, entry.stream_id, raw))
        return 0

    def user_stream_close(self, mem: GuestMemory, fd: int) -> int:
        entry = self.fds.entries.get(fd)
        if entry is None or entry.kind not in _KINDS:
            return -abi.EBADF
        if entry.closed:
            return 0
        entry.closed = True
        self.fds.persist(fd)
        writer = entry.kind == abi.KIND_USER_STREAM and entry.direction & DIR_OUT
        if writer and not any(e.direction & DIR_OUT for e in self._open_streams(entry.stream_id)):
            self._emit(StreamEvent(CLOSE, entry.stream_id))  # its user's output ends
        return 0

    def user_stream_ctl_read(
        self, mem: GuestMemory, fd: int, out_ptr: int, out_len_ptr: int
    ) -> int:
        entry = self.fds.get(fd, abi.KIND_USER_STREAM_CTL)
        if entry is None:
            return -abi.EBADF
        if not entry.ctl_events:
            self._pull()
        event = self._next_ctl_event(entry)
        if event is None:
            return -abi.EAGAIN
        read = write_with_len(mem, out_ptr, out_len_ptr, ctl_event(*event))
        if read >= 0:
            if entry.ctl_events:
                entry.ctl_events.pop(0)
            else:
                entry.ctl_closed_read = True
        return read

    # state -------------------------------------------------------------------------------

    def _refresh(self, first: bool) -> None:
        if not any(e.kind in _KINDS and not e.closed for e in self.fds.entries.values()):
            return  # no stream open: a wait on chats reads nothing more
        if first and time.monotonic() - self._pulled_at < PULL_EVERY_S:
            return
        self._pull()

    def _pull(self) -> None:
        """Take in what the user sent since the last look (one batch of events)."""
        self._pulled_at = time.monotonic()
        for entry_id, event in self.store.user_events(self.run_sk, self.cursor):
            self.cursor = entry_id
            if event is not None:
                self._dispatch(event)

    def _dispatch(self, event: StreamEvent) -> None:
        channel = self.channels.setdefault(event.stream_id, Channel())
        if event.kind == CLOSE:
            channel.closed = True
            return
        if event.kind == OPEN:
            channel.closed = False  # a user attached (again)
        if not channel.connected:
            channel.connected = True
            for entry in self.fds.entries.values():
                if entry.kind == abi.KIND_USER_STREAM_CTL and not entry.closed:
                    entry.ctl_events.append((event.stream_id, CTL_STREAM_CONNECTED))
        if event.kind == DATA:
            channel.inbound.append(event.frame)

    def _emit(self, event: StreamEvent) -> None:
        self.sent += 1
        self.store.emit_user_event(self.run_sk, self.sent, event)

    def _open_streams(self, stream_id: int | None = None) -> list[FdEntry]:
        return [
            e
            for e in self.fds.entries.values()
            if e.kind == abi.KIND_USER_STREAM
            and not e.closed
            and (stream_id is None or e.stream_id == stream_id)
        ]

    def _queued(self, stream_id: int) -> bool:
        channel = self.channels.get(stream_id)
        return channel is not None and bool(channel.inbound)

    def _connected(self, stream_id: int) -> bool:
        channel = self.channels.get(stream_id)
        return channel is not None and channel.connected

    def _session_closed(self) -> bool:
        """Every stream's user closed, and the program's open readers have read what it sent."""
        if not self.channels or not all(ch.closed for ch in self.channels.values()):
            return False
        reading = {e.stream_id for e in self._open_streams() if e.direction & DIR_IN}
        return not any(self._queued(stream_id) for stream_id in reading)

    def _next_ctl_event(self, entry: FdEntry) -> tuple[int, int] | None:
        if entry.ctl_events:
            return entry.ctl_events[0]
        if not entry.ctl_closed_read and self._session_closed():
            return (0, CTL_SESSION_CLOSED)
        return None

    def _stream_mask(self, entry: FdEntry) -> int:
        if entry.closed:
            return abi.EPOLLHUP
        channel = self.channels.get(entry.stream_id)
        if channel is None:
            return 0
        readable = bool(entry.direction & DIR_IN and channel.inbound)
        mask = abi.EPOLLIN if readable else 0
        if entry.direction & DIR_OUT and channel.connected:
            mask |= abi.EPOLLOUT
        if channel.closed and not readable:
            mask |= abi.EPOLLHUP
        return mask

    def _ctl_mask(self, entry: FdEntry) -> int:
        if entry.closed:
            return abi.EPOLLHUP
        return abi.EPOLLIN if self._next_ctl_event(entry) is not None else 0
