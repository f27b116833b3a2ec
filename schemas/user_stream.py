"""User streams (SPEAR's `user_stream_*`): what a user and a running program say to each other,
as both sides write it to Redis. Pure data, shared by the producer (the user's side) and the
worker (the program's hostcalls).

A payload is one SSF v1 frame (Spear Stream Frame, SPEAR's
docs/api/spear-hostcall/wasm-user-stream-bridge-en.md), little-endian:

    0 magic "SPST" | 4 version u16 = 1 | 6 header_len u16 >= 32 | 8 msg_type u16 |
    10 flags u16 | 12 stream_id u32 | 16 seq u64 | 24 meta_len u32 | 28 data_len u32 |
    header_len: meta, then data

Each side appends `StreamEvent`s to a Redis stream of the run (schemas/keys.py `user_in`,
`user_out`): `open` (the user attached to stream N), `data` (one frame of stream N), `close`
(no more frames on stream N from that side: a half-close, the other side may still write).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass

SSF_MAGIC = b"SPST"
SSF_VERSION = 1
SSF_HEADER_BYTES = 32
_HEADER = struct.Struct("<4sHHHHIQII")

# msg_type values (SPEAR_SSF_MSG_TYPE_*): the host routes frames by stream id, never by type
MSG_CTRL, MSG_DATA, MSG_COMMIT = 1, 2, 3
# user_stream_open directions
DIR_IN, DIR_OUT, DIR_BIDI = 1, 2, 3
# user_stream_ctl_read events: (u32 stream_id, u32 kind)
CTL_STREAM_CONNECTED, CTL_SESSION_CLOSED = 1, 2
CTL_EVENT_BYTES = 8

MAX_FRAME_BYTES = 256 * 1024  # one frame, either way
OPEN, DATA, CLOSE = "open", "data", "close"
KINDS = (OPEN, DATA, CLOSE)


@dataclass(frozen=True)
class Frame:
    stream_id: int
    data: bytes = b""
    msg_type: int = MSG_DATA
    meta: bytes = b""
    seq: int = 0
    flags: int = 0

    def encode(self) -> bytes:
        header = _HEADER.pack(
            SSF_MAGIC, SSF_VERSION, SSF_HEADER_BYTES, self.msg_type, self.flags,
            self.stream_id, self.seq, len(self.meta), len(self.data),
        )  # fmt: skip
        return header + self.meta + self.data


def parse_frame(raw: bytes) -> Frame | None:
    """A frame, or None where SPEAR's host refuses it (-EINVAL): short, wrong magic or
    version, a header_len below 32 or past the end, lengths that do not add up."""
    if len(raw) < SSF_HEADER_BYTES:
        return None
    magic, version, header_len, msg_type, flags, stream_id, seq, meta_len, data_len = (
        _HEADER.unpack_from(raw)
    )
    if magic != SSF_MAGIC or version != SSF_VERSION:
        return None
    if header_len < SSF_HEADER_BYTES or header_len > len(raw):
        return None
    if meta_len + data_len != len(raw) - header_len:
        return None
    meta = raw[header_len : header_len + meta_len]
    return Frame(stream_id, raw[header_len + meta_len :], msg_type, meta, seq, flags)


def ctl_event(stream_id: int, kind: int) -> bytes:
    return struct.pack("<II", stream_id, kind)


@dataclass(frozen=True)
class StreamEvent:
    kind: str  # OPEN | DATA | CLOSE
    stream_id: int
    frame: bytes = b""  # DATA: one SSF frame of stream_id

    def fields(self) -> dict[str, bytes]:
        """The Redis stream entry."""
        out = {"k": self.kind.encode(), "s": str(self.stream_id).encode()}
        if self.kind == DATA:
            out["f"] = self.frame
        return out

    @classmethod
    def from_fields(cls, fields: Mapping[bytes, bytes]) -> StreamEvent | None:
        """An entry as read back; None for one this version does not know."""
        kind = fields.get(b"k", b"").decode(errors="replace")
        try:
            stream_id = int(fields.get(b"s", b""))
        except ValueError:
            return None
        if kind not in KINDS or not 0 <= stream_id <= 0xFFFFFFFF:
            return None
        return cls(kind, stream_id, bytes(fields.get(b"f", b"")) if kind == DATA else b"")
