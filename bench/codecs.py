"""Codec and stream-assembly cost per round, per protocol, next to a plain json.loads of the
same reply bytes. The bytes are real: a tool-call round captured from the replay server."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import requests

from fixtures.demo_scenarios import WEATHER
from fixtures.replay import ReplayServer
from schemas.protocols import PROTOCOLS
from worker.codecs.protocol import ChatRequest, Codec
from worker.codecs.registry import CODECS
from worker.codecs.sse import SseParser


def median_us(fn: Callable[[], Any], runs: int = 300) -> float:
    for _ in range(20):
        fn()
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples) * 1e6


def _capture(server: ReplayServer, codec: Codec, request: ChatRequest) -> bytes:
    wire = codec.encode(request)
    url = server.root + PROTOCOLS[codec.protocol].replay_path + wire.path
    reply = requests.post(
        url, params=wire.query or None, json=wire.body, headers=wire.headers, timeout=10
    )
    reply.raise_for_status()
    return reply.content


def _protocol_rows(server: ReplayServer, protocol: str, codec: Codec) -> list[tuple[str, str]]:
    tool = {"type": "function", "function": WEATHER["function"]}
    message = {"role": "user", "content": "Weather in Paris, Tokyo, Lima?"}
    model = PROTOCOLS[protocol].replay_model_for("parallel")
    plain = ChatRequest(model=model, messages=[message], tools=[tool])
    streamed = ChatRequest(model=model, messages=[message], tools=[tool], stream=True)
    body, stream = _capture(server, codec, plain), _capture(server, codec, streamed)
    payloads = [e.data for e in SseParser().feed(stream) if e.data.startswith("{")]

    def loads_reply() -> None:
        json.loads(body)

    def round_trip() -> None:
        codec.encode(plain)
        codec.decode(json.loads(body), plain)

    def loads_events() -> None:
        for item in payloads:
            json.loads(item)

    def assemble() -> None:
        assembler, parser = codec.assembler(streamed), SseParser()
        for event in [*parser.feed(stream), *parser.close()]:
            assembler.feed(event)
        assembler.result()

    loads, decode = median_us(loads_reply), median_us(round_trip)
    loads_stream, assembled = median_us(loads_events), median_us(assemble)
    return [
        (f"{protocol}: json.loads of a tool-call reply ({len(body)} B)", f"{loads:.1f} us"),
        ("  encode + decode that round", f"{decode:.1f} us ({decode / loads:.1f}x)"),
        (
            f"  json.loads of its stream's {len(payloads)} events ({len(stream)} B)",
            f"{loads_stream:.1f} us",
        ),
        (
            "  SSE parse + assemble the stream",
            f"{assembled:.1f} us ({assembled / loads_stream:.1f}x)",
        ),
    ]


def codec_rows() -> list[tuple[str, str]]:
    with ReplayServer() as server:
        return [
            row
            for protocol, make in CODECS.items()
            for row in _protocol_rows(server, protocol, make())
        ]
