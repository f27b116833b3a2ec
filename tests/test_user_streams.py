"""The `user_stream_*` hostcalls (SPEAR's user streams; worker/guest/user_streams.py) at the
WAT level, on the in-memory twins as tests/test_hostcalls.py runs them: the user's side is
played on the MemoryStore (`user_send`, `user_received`), as `Client.stream` plays it on
Redis. Every return value and every byte the host wrote into guest memory is checked."""

from __future__ import annotations

import hashlib
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from schemas import keys
from schemas.user_stream import (
    CLOSE,
    DATA,
    MSG_CTRL,
    OPEN,
    Frame,
    StreamEvent,
    parse_frame,
)
from tests.conftest import GUESTS
from tests.test_hostcalls import Harness, Shared, _Source, jb, with_out
from tests.twin_pipeline import pipeline
from tests.wat_program import Dump, Program, Ref
from worker.guest.host import ChatDefaults, ProgramHost
from worker.guest.runner import ProgramRun, run_program
from worker.session.twins.store import MemoryStore

EBADF, EAGAIN, EINVAL, ENOSPC, ENOTCONN = 9, 11, 22, 28, 107
IN, OUT, BIDI = 1, 2, 3
CONNECTED, SESSION_CLOSED = 1, 2
EPOLLIN, EPOLLOUT, EPOLLHUP = 0x1, 0x4, 0x10
GET_KIND, GET_STATUS = 3, 4
ADD = 1


@pytest.fixture(scope="module")
def module_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("module-cache")


@pytest.fixture
def h(module_cache: Path, fresh_id: str) -> Iterator[Harness]:
    blobs: dict[str, bytes] = {}
    pipe = pipeline(blobs, module_cache)
    try:
        shared = Shared(pipe.store, pipe.store, pipe.queue, _Source(pipe.runtime), blobs, pipe)
        yield Harness(shared, fresh_id)
        assert pipe.crashed == []
    finally:
        pipe.close()


def frame(stream_id: int, text: str, seq: int = 1) -> bytes:
    return Frame(stream_id, text.encode(), seq=seq).encode()


def user_says(store: MemoryStore, *events: StreamEvent) -> Callable[[str], None]:
    """A `before` hook: the user's events, there before the program starts."""

    def before(run_sk: str) -> None:
        for event in events:
            store.user_send(run_sk, event)

    return before


def records(data: bytes) -> list[tuple[int, int]]:
    return [struct.unpack_from("<ii", data, n) for n in range(0, len(data), 8)]


def test_a_program_echoes_what_its_user_sent_and_sees_the_close_after_it(h: Harness) -> None:
    hello, world = frame(1, "hello"), frame(1, "world", 2)
    store = h.shared.store
    p = Program()
    ctl = p.call("user_stream_ctl_open")
    ev1 = with_out(p, "user_stream_ctl_read", Ref(ctl), cap=8)
    s = p.call("user_stream_open", 1, BIDI)
    ev2 = with_out(p, "user_stream_ctl_read", Ref(ctl), cap=8)  # frames not read: no close yet
    e = p.call("spear_epoll_create")
    p.call("spear_epoll_ctl", Ref(e), ADD, Ref(ctl), EPOLLIN | EPOLLHUP)
    p.call("spear_epoll_ctl", Ref(e), ADD, Ref(s), EPOLLIN | EPOLLOUT | EPOLLHUP)
    woke1 = with_out(p, "spear_epoll_wait", Ref(e), cap=64, tail=(-1,))
    r1 = with_out(p, "user_stream_read", Ref(s), cap=256)
    echo = p.data(hello)
    w1 = p.call("user_stream_write", Ref(s), echo.ptr, echo.len)
    small = with_out(p, "user_stream_read", Ref(s), cap=8, size=16)
    r2 = with_out(p, "user_stream_read", Ref(s), cap=256)
    woke2 = with_out(p, "spear_epoll_wait", Ref(e), cap=64, tail=(-1,))
    ev3 = with_out(p, "user_stream_ctl_read", Ref(ctl), cap=8)
    ev4 = with_out(p, "user_stream_ctl_read", Ref(ctl), cap=8)
    eof = with_out(p, "user_stream_read", Ref(s), cap=256)
    other = p.data(frame(2, "not mine"))
    w_other = p.call("user_stream_write", Ref(s), other.ptr, other.len)
    junk = p.data(b"SPSX" + hello[4:])
    w_junk = p.call("user_stream_write", Ref(s), junk.ptr, junk.len)
    close = p.call("user_stream_close", Ref(s))
    again = p.call("user_stream_close", Ref(s))
    closed_read = with_out(p, "user_stream_read", Ref(s), cap=256)
    ran = h.run(
        p,
        before=user_says(
            store,
            StreamEvent(OPEN, 1),
            StreamEvent(DATA, 1, hello),
            StreamEvent(DATA, 1, world),
            StreamEvent(CLOSE, 1),
        ),
    )
    assert (ran.r(ctl), ran.r(s), ran.r(e)) == (1000, 1001, 1002)
    assert ran.r(ev1.call) == 8 and ran.out(ev1.ptr, ev1.cell) == struct.pack("<II", 1, CONNECTED)
    assert ran.r(ev2.call) == -EAGAIN and ran.untouched(ev2.ptr, 8)
    assert records(ran.out(woke1.ptr, woke1.cell)) == [(1001, EPOLLIN | EPOLLOUT)]
    assert ran.r(r1.call) == len(hello) and ran.out(r1.ptr, r1.cell) == hello
    assert ran.r(w1) == 0
    assert ran.r(small.call) == -ENOSPC and ran.dump.u32(small.cell) == len(world)
    assert ran.untouched(small.ptr, 16)  # the frame stays queued
    assert ran.out(r2.ptr, r2.cell) == world
    # drained: the stream hangs up, and the ctl fd gives the session's close
    assert records(ran.out(woke2.ptr, woke2.cell)) == [
        (1000, EPOLLIN),
        (1001, EPOLLOUT | EPOLLHUP),
    ]
    assert ran.out(ev3.ptr, ev3.cell) == struct.pack("<II", 0, SESSION_CLOSED)
    assert ran.r(ev4.call) == -EAGAIN
    assert (ran.r(eof.call), ran.dump.u32(eof.cell)) == (0, 0)
    assert (ran.r(w_other), ran.r(w_junk)) == (-EINVAL, -EINVAL)
    assert (ran.r(close), ran.r(again), ran.r(closed_read.call)) == (0, 0, -EBADF)
    # the user got the echo, then the end of the program's side
    assert store.user_received(ran.run_sk) == [
        StreamEvent(DATA, 1, hello),
        StreamEvent(CLOSE, 1),
    ]


def test_every_error_before_and_without_a_user(h: Harness) -> None:
    mine = frame(1, "too early")
    p = Program()
    bad_id = p.call("user_stream_open", -1, BIDI)
    bad_dir = p.call("user_stream_open", 1, 4)
    zero_dir = p.call("user_stream_open", 1, 0)
    s_in = p.call("user_stream_open", 1, IN)
    s_out = p.call("user_stream_open", 1, OUT)
    early = p.data(mine)
    on_in = p.call("user_stream_write", Ref(s_in), early.ptr, early.len)
    not_conn = p.call("user_stream_write", Ref(s_out), early.ptr, early.len)
    huge = p.call("user_stream_write", Ref(s_out), early.ptr, 1 << 20)
    short = p.call("user_stream_write", Ref(s_out), early.ptr, 31)
    read_out = with_out(p, "user_stream_read", Ref(s_out), cap=64)
    nothing = with_out(p, "user_stream_read", Ref(s_in), cap=64)
    ctl = p.call("user_stream_ctl_open")
    no_event = with_out(p, "user_stream_ctl_read", Ref(ctl), cap=8)
    ctl_on_stream = with_out(p, "user_stream_ctl_read", Ref(s_in), cap=8)
    read_on_ctl = with_out(p, "user_stream_read", Ref(ctl), cap=64)
    session = p.call("cchat_create")
    read_on_session = with_out(p, "user_stream_read", Ref(session), cap=64)
    close_session = p.call("user_stream_close", Ref(session))
    cchat_close_stream = p.call("cchat_close", Ref(s_in))
    unknown = p.call("user_stream_close", 4242)
    kind = with_out(p, "spear_fd_ctl", Ref(s_in), GET_KIND, cap=64)
    ctl_kind = with_out(p, "spear_fd_ctl", Ref(ctl), GET_KIND, cap=64)
    status = with_out(p, "spear_fd_ctl", Ref(s_out), GET_STATUS, cap=256)
    ran = h.run(p)
    assert [ran.r(c) for c in (bad_id, bad_dir, zero_dir)] == [-EINVAL] * 3
    assert (ran.r(s_in), ran.r(s_out), ran.r(ctl)) == (1000, 1001, 1002)
    assert [ran.r(c) for c in (on_in, huge, short)] == [-EINVAL] * 3
    assert ran.r(not_conn) == -ENOTCONN
    assert (ran.r(read_out.call), ran.r(nothing.call)) == (-EINVAL, -EAGAIN)
    assert ran.untouched(nothing.ptr, 64)
    assert ran.r(no_event.call) == -EAGAIN
    for out in (ctl_on_stream, read_on_ctl, read_on_session):
        assert ran.r(out.call) == -EBADF
    assert [ran.r(c) for c in (close_session, cchat_close_stream, unknown)] == [-EBADF] * 3
    assert ran.out(kind.ptr, kind.cell) == jb({"kind": "UserStream"})
    assert ran.out(ctl_kind.ptr, ctl_kind.cell) == jb({"kind": "UserStreamCtl"})
    assert ran.out(status.ptr, status.cell) == jb(
        {"closed": False, "flags": [], "kind": "UserStream", "poll_mask": []}
    )
    assert h.shared.store.user_received(ran.run_sk) == []


def test_a_blocked_epoll_wait_wakes_when_the_user_sends(h: Harness) -> None:
    """The user attaches and sends while the program waits (as `cchatq stream` does on a
    running program): the wait wakes on the send, not at its timeout."""
    store = h.shared.store
    ctrl = Frame(7, b"", MSG_CTRL, meta=b'{"hello":1}').encode()
    p = Program()
    ctl = p.call("user_stream_ctl_open")
    e = p.call("spear_epoll_create")
    p.call("spear_epoll_ctl", Ref(e), ADD, Ref(ctl), EPOLLIN)
    woke = with_out(p, "spear_epoll_wait", Ref(e), cap=64, tail=(20_000,))
    ev = with_out(p, "user_stream_ctl_read", Ref(ctl), cap=8)
    s = p.call("user_stream_open", 7, IN)
    p.call("spear_epoll_ctl", Ref(e), ADD, Ref(s), EPOLLIN)
    woke2 = with_out(p, "spear_epoll_wait", Ref(e), cap=64, tail=(20_000,))
    got = with_out(p, "user_stream_read", Ref(s), cap=256)
    runs: list[str] = []

    def made(fd: int) -> bool:
        deadline = time.monotonic() + 20
        while not runs or fd not in store.fd_mirror.get(runs[0], {}):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True

    def user() -> None:
        if made(1001):  # the epoll fd: the program is about to wait
            store.user_send(runs[0], StreamEvent(OPEN, 7))
        if made(1002):  # the stream fd
            store.user_send(runs[0], StreamEvent(DATA, 7, ctrl))

    feeder = threading.Thread(target=user, daemon=True)
    feeder.start()
    ran = h.run(p, before=runs.append)
    feeder.join(timeout=10)
    # woken by the sends (a timeout would return no record)
    assert records(ran.out(woke.ptr, woke.cell)) == [(1000, EPOLLIN)]
    assert ran.out(ev.ptr, ev.cell) == struct.pack("<II", 7, CONNECTED)
    assert records(ran.out(woke2.ptr, woke2.cell)) == [(1002, EPOLLIN)]
    assert parse_frame(ran.out(got.ptr, got.cell)) == Frame(7, b"", MSG_CTRL, b'{"hello":1}')


def test_a_replayed_run_reads_its_input_again_and_writes_each_frame_once(h: Harness) -> None:
    """A program run whose task is delivered again runs from the start: it reads what its
    user sent from the first event on, and its writes, numbered, land once."""
    store = h.shared.store
    hello = frame(3, "hi")
    p = Program()
    s = p.call("user_stream_open", 3, BIDI)
    r = with_out(p, "user_stream_read", Ref(s), cap=256)
    echo = p.data(hello)
    w = p.call("user_stream_write", Ref(s), echo.ptr, echo.len)
    p.call("user_stream_close", Ref(s))
    first = h.run(p, before=user_says(store, StreamEvent(OPEN, 3), StreamEvent(DATA, 3, hello)))
    host = ProgramHost(first.host.d, h.shared.programs, h.shared.dispatcher)
    run = ProgramRun(module_sha256=first.host.d.module_sha256, timeout_ms=30_000)
    replayed = Dump(run_program(h.shared.source, run, host).stdout)
    for dump in (first.dump, replayed):
        assert dump.mem(r.ptr, dump.u32(r.cell)) == hello
        assert dump.result(w) == 0
    assert store.user_received(first.run_sk) == [
        StreamEvent(DATA, 3, hello),
        StreamEvent(CLOSE, 3),
    ]


def test_spears_echo_sample_written_its_way_echoes_each_line_then_ends(h: Harness) -> None:
    """fixtures/guests/prog_user_stream_echo.c (SPEAR's sample: its own imports, a static
    arena) on the twins: the user attached, sent two frames and closed, before it started."""
    blob = (GUESTS / "prog_user_stream_echo.wasm").read_bytes()
    sha = hashlib.sha256(blob).hexdigest()
    h.shared.blobs[sha] = blob
    run_sk = keys.run_session_key(
        keys.DEFAULT_NAMESPACE, f"{h.fresh_id}/echo", keys.new_generation()
    )
    sent = [frame(1, "hello"), frame(1, "world", 2)]
    for event in (StreamEvent(OPEN, 1), *(StreamEvent(DATA, 1, f) for f in sent)):
        h.shared.store.user_send(run_sk, event)
    h.shared.store.user_send(run_sk, StreamEvent(CLOSE, 1))
    defaults = ChatDefaults(f"{h.fresh_id}/echo", run_sk, sha, None, None, time.monotonic() + 30)
    host = ProgramHost(defaults, h.shared.programs, h.shared.dispatcher)
    outcome = run_program(h.shared.source, ProgramRun(module_sha256=sha), host)
    assert (outcome.exit_code, outcome.error_code) == (0, None), outcome
    assert outcome.stdout.decode().splitlines() == [
        "user_stream_echo started (waiting for user streams)",
        "stream connected: stream_id=1 fd=1002",
        "session closed",
    ]
    assert h.shared.store.user_received(run_sk) == [
        *(StreamEvent(DATA, 1, f) for f in sent),
        StreamEvent(CLOSE, 1),
    ]
