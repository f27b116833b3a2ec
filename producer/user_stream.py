"""The user's side of a program run's user streams (SPEAR's `user_stream_*`; the program's
side is worker/guest/user_streams.py): `Client.stream(ID)` attaches to stream N of the run,
`send` writes one line (or `send_frame` one SSF frame) to the program, `lines()` / `frames()`
yield what the program writes, and `close` ends the input (a half-close: what the program
writes afterwards still arrives). `cchatq stream ID` pipes stdin and stdout through it.

On Redis (schemas/keys.py): the user's events go to `cq:us:<run>:in`, and a wake entry to the
run's done list so a program blocked in `spear_epoll_wait` sees them at once; the program's
events are read from `cq:us:<run>:out`. Reading ends when the program closes its side of the
stream or its run ends (its response fd is written). A run that already ended takes no new
input: `Client.stream` raises RunEnded, naming how it ended.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TextIO

from schemas import keys, redis_links
from schemas.session_record import read_record
from schemas.user_stream import (
    CLOSE,
    DATA,
    MAX_FRAME_BYTES,
    MSG_DATA,
    OPEN,
    Frame,
    StreamEvent,
    parse_frame,
)

READ_BLOCK_MS = 1000  # how long one read of the program's events blocks
END_POLL_S = 0.2  # how often the end of a run whose program closed its side is looked for


@dataclass(frozen=True)
class RunEnding:
    """How a program run ended, from its record: `ok` (ended ok, exit 0) and the words
    (`ok, exit 0`, `error, exit 3`, `error guest_trap`, `error cancelled`)."""

    ok: bool
    how: str

    @classmethod
    def from_record(cls, record: dict[str, Any] | None) -> RunEnding:
        if record is None:  # the result expired with the run: its end is all that is known
            return cls(False, "result expired")
        status = str(record.get("status", "error"))
        error = (record.get("body") or {}).get("error") or {}
        how = status if not error.get("code") else f"{status} {error['code']}"
        if record.get("exit_code") is not None:
            how += f", exit {record['exit_code']}"
        return cls(status == "ok", how)


class RunEnded(Exception):
    """The run ended before `Client.stream` attached: there is nothing to stream to."""

    def __init__(self, run_id: str, ending: RunEnding) -> None:
        super().__init__(f"run {run_id} ended ({ending.how}): nothing to stream to")
        self.ending = ending


class UserStream:
    """Stream `stream_id` of the program run `sk` (a Client makes them: `Client.stream`)."""

    def __init__(self, redis: Any, sk: str, stream_id: int, ttl_s: int) -> None:
        if not 0 <= stream_id <= 0xFFFFFFFF:
            raise ValueError(f"a stream id is a u32, not {stream_id}")
        self.redis = redis
        self.sk = sk
        self.stream_id = stream_id
        self.ttl_s = ttl_s
        self._cursor = "0-0"  # the last of the program's events read
        self._seq = 0  # frames sent
        self._closed = False

    # to the program ----------------------------------------------------------------------

    def open(self) -> None:
        """Attach: the stream is connected for the program (its ctl fd says so)."""
        self._put(StreamEvent(OPEN, self.stream_id))

    def send(self, data: str | bytes) -> None:
        """One DATA frame holding `data` (a line, without its newline)."""
        raw = data.encode() if isinstance(data, str) else data
        self._seq += 1
        self.send_frame(Frame(self.stream_id, raw, MSG_DATA, seq=self._seq).encode())

    def send_frame(self, frame: bytes) -> None:
        """One SSF v1 frame of this stream, as the program will read it."""
        parsed = parse_frame(frame)
        if parsed is None or parsed.stream_id != self.stream_id or len(frame) > MAX_FRAME_BYTES:
            raise ValueError(
                f"not an SSF v1 frame of stream {self.stream_id} of at most {MAX_FRAME_BYTES} bytes"
            )
        if self._closed:
            raise ValueError("the stream's input is closed")
        self._put(StreamEvent(DATA, self.stream_id, frame))

    def close(self) -> None:
        """No more input (once read, the program sees EPOLLHUP and SESSION_CLOSED)."""
        if not self._closed:
            self._closed = True
            self._put(StreamEvent(CLOSE, self.stream_id))

    def _put(self, event: StreamEvent) -> None:
        key, done = keys.user_in(self.sk), keys.done_list(keys.run_batch(self.sk))
        pipe = self.redis.pipeline(transaction=True)
        pipe.xadd(key, event.fields())
        pipe.expire(key, self.ttl_s)
        pipe.lpush(done, keys.USER_WAKE)  # a program blocked in a wait takes it in now
        pipe.expire(done, self.ttl_s)
        pipe.execute()

    # from the program --------------------------------------------------------------------

    def ending(self) -> RunEnding | None:
        """How the run ended; None while it runs."""
        response, record = self.redis.mget([keys.response(self.sk), keys.record(self.sk)])
        if response is None:
            return None
        return RunEnding.from_record(None if record is None else read_record(record).record)

    def wait_ending(self, poll_s: float = END_POLL_S) -> RunEnding:
        """How the run ended, once it has (Ctrl-C stops the wait; the run keeps going)."""
        while (ending := self.ending()) is None:
            time.sleep(poll_s)
        return ending

    def frames(self, block_ms: int = READ_BLOCK_MS) -> Iterator[Frame]:
        """The frames the program writes on this stream, as they come, until it closes its
        side or its run ends."""
        key = keys.user_out(self.sk)
        while True:
            finished = bool(self.redis.exists(keys.response(self.sk)))
            # once the run ended, what it wrote is all there: one last look, not blocking
            read = self.redis.xread(
                {key: self._cursor},
                count=256,
                block=None if finished else redis_links.block_ms(block_ms),
            )
            entries = read[0][1] if read else []
            for entry_id, fields in entries:
                self._cursor = entry_id.decode()
                event = StreamEvent.from_fields(fields)
                if event is None or event.stream_id != self.stream_id:
                    continue
                if event.kind == CLOSE:
                    return
                frame = parse_frame(event.frame)
                if frame is not None:
                    yield frame
            if finished and not entries:
                return

    def lines(self, block_ms: int = READ_BLOCK_MS) -> Iterator[str]:
        """The data of each DATA frame the program writes (other frame types are skipped)."""
        for frame in self.frames(block_ms):
            if frame.msg_type == MSG_DATA:
                yield frame.data.decode(errors="replace")


def pipe_lines(stream: UserStream, stdin: TextIO, stdout: TextIO) -> RunEnding:
    """`cchatq stream`: each stdin line to the program (its input closed at stdin's end),
    each line the program writes to stdout, until it closes its side or its run ends; then
    how the run ended (once the program closed its side, its run's end is waited for)."""

    def feed() -> None:
        try:
            for line in stdin:
                stream.send(line.removesuffix("\n").removesuffix("\r"))
        except ValueError as exc:  # a line over MAX_FRAME_BYTES: the input ends there
            print(f"cchatq stream: {exc}", file=sys.stderr)
        finally:
            stream.close()

    threading.Thread(target=feed, name="cchatq-stream-stdin", daemon=True).start()
    for line in stream.lines():
        stdout.write(line + "\n")
        stdout.flush()
    return stream.wait_ending()
