"""A program run's parts in a fleet's Redis, for the viewer (producer/viewer/fleet_source.py):
its chats so far and its user-stream frames."""

from __future__ import annotations

from typing import Any

from producer.client import Client
from producer.viewer.model import FrameView
from schemas import keys
from schemas.user_stream import DATA, StreamEvent, parse_frame

MAX_FRAMES = 500  # user-stream events shown, each way
CHAT_PROBE = 16  # a program run's chats looked up per round trip


def chat_claims(client: Client, run_id: str) -> list[tuple[str, keys.Claim]]:
    """A program run's chats so far (`<run id>#send<n>`, stored as it sends each)."""
    run_sk = client.session_key(run_id)
    out: list[tuple[str, keys.Claim]] = []
    while run_sk is not None:
        numbers = range(len(out), len(out) + CHAT_PROBE)
        sks = [keys.chat_session_key(run_sk, n) for n in numbers]
        pipe = client.redis.pipeline(transaction=False)
        for sk in sks:  # a chat that ended is retired: its response stays
            pipe.exists(keys.meta(sk))
            pipe.exists(keys.response(sk))
        there = pipe.execute()
        for n, sk in zip(numbers, sks, strict=True):
            if not there[2 * (n - numbers[0])] and not there[2 * (n - numbers[0]) + 1]:
                return out
            out.append((keys.chat_spec_id(run_id, n), keys.Claim(sk)))
    return out


def read_frames(redis: Any, sk: str) -> tuple[FrameView, ...]:
    """A program run's user-stream events, to the program then from it."""
    pipe = redis.pipeline(transaction=False)
    pipe.xrange(keys.user_in(sk), count=MAX_FRAMES)
    pipe.xrange(keys.user_out(sk), count=MAX_FRAMES)
    out = []
    for direction, entries in zip(("in", "out"), pipe.execute(), strict=True):
        for _, fields in entries:
            event = StreamEvent.from_fields(fields)
            if event is None:
                continue
            frame = parse_frame(event.frame) if event.kind == DATA else None
            out.append(
                FrameView(
                    direction=direction,
                    stream_id=event.stream_id,
                    kind=event.kind,
                    seq=None if frame is None else frame.seq,
                    text="" if frame is None else frame.data.decode(errors="replace"),
                )
            )
    return tuple(out)
