"""The fd-level hostcalls of one program run: `spear_fd_ctl` (flags, kind, status, metrics of
any fd) and the `spear_epoll_*` calls, over the run's fd table.

Like every hostcall they return -errno and never raise, except RunAborted from a blocking
`spear_epoll_wait` (deadline, cancellation), raised by the host's wait.

Level-triggered, as SPEAR's: a guest watching EPOLLOUT on an idle writable fd (SPEAR's
user_stream_echo sample does) gets it at every wait. A wait that would only repeat the
EPOLLOUT records the last one gave first waits IDLE_WRITABLE_S for anything else, so such a
guest loops a few hundred times a second, not as fast as a programs worker can.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from schemas.bodies import dump_body
from worker.guest import abi
from worker.guest.fds import FdEntry, FdTable, write_with_len
from worker.guest.imports import GuestMemory

IDLE_WRITABLE_S = 0.005  # how long a wait that would only repeat EPOLLOUT waits for more

# The host's blocking wait: until `ready()` (True), the `until` monotonic time (False), or
# the run's deadline or cancellation (RunAborted).
Wait = Callable[[Callable[[], bool], float | None], bool]


class EpollCalls:
    def __init__(self, fds: FdTable, wait: Wait) -> None:
        self.fds = fds
        self._wait = wait
        self._last: dict[int, list[tuple[int, int]]] = {}  # epfd -> what its last wait gave

    def spear_fd_ctl(
        self, mem: GuestMemory, fd: int, cmd: int, arg_ptr: int, arg_len_ptr: int
    ) -> int:
        entry = self.fds.entries.get(fd)
        if entry is None:
            return -abi.EBADF
        if cmd == abi.FD_SET_FLAGS:
            change = abi.parse_flag_change(mem.read(arg_ptr, mem.read_u32(arg_len_ptr)))
            if isinstance(change, int):
                return change
            entry.flags = (entry.flags | change[0]) - change[1]
            self.fds.persist(fd)
            return 0
        if cmd == abi.FD_GET_FLAGS:
            return write_with_len(
                mem, arg_ptr, arg_len_ptr, dump_body({"flags": sorted(entry.flags)})
            )
        if cmd == abi.FD_GET_KIND:
            return write_with_len(mem, arg_ptr, arg_len_ptr, dump_body({"kind": entry.kind}))
        if cmd == abi.FD_GET_STATUS:
            status = {"closed": entry.closed, "flags": sorted(entry.flags), "kind": entry.kind,
                      "poll_mask": _event_names(self.fds.poll_mask(entry))}  # fmt: skip
            return write_with_len(mem, arg_ptr, arg_len_ptr, dump_body(status))
        if cmd == abi.FD_GET_METRICS:
            if entry.kind != abi.KIND_RESPONSE:
                return write_with_len(mem, arg_ptr, arg_len_ptr, b"{}")
            return self.fds.metrics(mem, entry, arg_ptr, arg_len_ptr)
        return -abi.EINVAL

    def spear_epoll_create(self, mem: GuestMemory) -> int:
        return self.fds.new(FdEntry(kind=abi.KIND_EPOLL))

    def spear_epoll_ctl(self, mem: GuestMemory, epfd: int, op: int, fd: int, events: int) -> int:
        ep = self.fds.get(epfd, abi.KIND_EPOLL)
        if ep is None or fd not in self.fds.entries or fd == epfd:
            return -abi.EBADF
        if op == abi.EPOLL_CTL_ADD:
            if fd in ep.watch:
                return -17  # EEXIST
            ep.watch[fd] = events
        elif op == abi.EPOLL_CTL_MOD:
            if fd not in ep.watch:
                return -abi.ENOENT
            ep.watch[fd] = events
        elif op == abi.EPOLL_CTL_DEL:
            if ep.watch.pop(fd, None) is None:
                return -abi.ENOENT
        else:
            return -abi.EINVAL
        self.fds.persist(epfd)
        return 0

    def spear_epoll_wait(
        self, mem: GuestMemory, epfd: int, out_ptr: int, out_len_ptr: int, timeout_ms: int
    ) -> int:
        ep = self.fds.get(epfd, abi.KIND_EPOLL)
        if ep is None:
            return -abi.EBADF
        capacity = mem.read_u32(out_len_ptr)
        ready: list[tuple[int, int]] = []
        entries = self.fds.entries

        looks = 0

        def scan() -> bool:
            nonlocal looks
            self.fds.refresh(first=looks == 0)  # user streams read what their users sent
            looks += 1
            pending = [entries[fd] for fd in ep.watch if entries[fd].kind == abi.KIND_RESPONSE]
            self.fds.observe_many(pending)
            ready[:] = [
                (fd, revents)
                for fd, interest in ep.watch.items()
                if (
                    revents := self.fds.poll_mask(entries[fd])
                    & (interest | abi.EPOLLERR | abi.EPOLLHUP)
                )
            ]
            return bool(ready)

        until = None if timeout_ms < 0 else time.monotonic() + timeout_ms / 1000
        if timeout_ms == 0:
            scan()
        else:
            self._wait(scan, until)
            if self._last.get(epfd) == ready and all(ev == abi.EPOLLOUT for _, ev in ready):
                # Only writability, as the last wait reported: a guest spinning on an idle
                # writable fd (SPEAR's echo sample). Wait a moment for anything else first.
                idle = list(ready)
                soon = time.monotonic() + IDLE_WRITABLE_S
                self._wait(
                    lambda: scan() and ready != idle, soon if until is None else min(soon, until)
                )
        self._last[epfd] = list(ready)
        packed = abi.pack_epoll_records(ready, capacity)
        if isinstance(packed, int):
            mem.write_u32(out_len_ptr, abi.EPOLL_RECORD_BYTES)
            return packed
        data, count = packed
        mem.write(out_ptr, data)
        mem.write_u32(out_len_ptr, len(data))
        return count

    def spear_epoll_close(self, mem: GuestMemory, epfd: int) -> int:
        ep = self.fds.get(epfd, abi.KIND_EPOLL, open_only=False)
        if ep is None:
            return -abi.EBADF
        ep.closed = True
        self.fds.persist(epfd)
        return 0


def _event_names(mask: int) -> list[str]:
    names = {
        abi.EPOLLIN: "EPOLLIN",
        abi.EPOLLOUT: "EPOLLOUT",
        abi.EPOLLERR: "EPOLLERR",
        abi.EPOLLHUP: "EPOLLHUP",
    }
    return [name for bit, name in names.items() if mask & bit]
