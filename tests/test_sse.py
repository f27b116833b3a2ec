"""SSE parsing as docs/provider-conformance.md asks of it: fields, line ends, split characters,
comments and keep-alives, [DONE], and a reply that is no stream."""

from __future__ import annotations

import pytest

from worker.codecs.protocol import SseEvent
from worker.codecs.sse import SseParser, looks_like_sse


def parse(*reads: bytes) -> list[SseEvent]:
    parser = SseParser()
    events: list[SseEvent] = []
    for data in reads:
        events.extend(parser.feed(data))
    return events + parser.close()


# One realistic stream: an OpenRouter keep-alive, CRLF and CR line ends, a named event with an
# id, multi-line data, multibyte text (2-, 3- and 4-byte UTF-8), a retry hint, [DONE].
SAMPLE = (
    b": OPENROUTER PROCESSING\r\n\r\n"
    b'data: {"choices":[{"delta":{"content":"Gr\xc3\xbc\xc3\x9fe \xe2\x82\xac"}}]}\r\n\r\n'
    b"event: update\rid: 7\rdata:first\rdata: second\r\r"
    b"retry: 3000\n"
    b'data: {"choices":[{"delta":{"content":"\xf0\x9f\x98\x80"}}]}\n\n'
    b": keep-alive\n\n"
    b"data: [DONE]\n\n"
)
SAMPLE_EVENTS = [
    SseEvent("message", '{"choices":[{"delta":{"content":"Grüße €"}}]}'),
    SseEvent("update", "first\nsecond", "7"),
    SseEvent("message", '{"choices":[{"delta":{"content":"😀"}}]}', "7"),
    SseEvent("message", "[DONE]", "7"),
]


def test_data_with_and_without_leading_space() -> None:
    events = parse(b"data: a\n\ndata:b\n\ndata:  c\n\n")
    assert [e.data for e in events] == ["a", "b", " c"]  # only one space is dropped


def test_several_data_lines_joined_with_newline() -> None:
    assert parse(b'data: {\ndata:  "a": 1\ndata: }\n\n') == [SseEvent("message", '{\n "a": 1\n}')]


def test_empty_data_line_still_dispatches() -> None:
    assert parse(b"data\n\ndata:\n\n") == [SseEvent("message", ""), SseEvent("message", "")]


def test_event_id_and_retry_fields() -> None:
    parser = SseParser()
    events = parser.feed(
        b"event: message_start\nid: 1\nretry: 1500\ndata: {}\n\n"
        b"data: x\n\n"  # the last event id persists; the event name does not
        b"id\ndata: y\n\n"  # an empty id resets it
        b"retry: soon\nunknown: field\ndata: z\n\n"  # a bad retry and an unknown field: ignored
    )
    assert events == [
        SseEvent("message_start", "{}", "1"),
        SseEvent("message", "x", "1"),
        SseEvent("message", "y", ""),
        SseEvent("message", "z", ""),
    ]
    assert parser.retry_ms == 1500


@pytest.mark.parametrize("end", [b"\n", b"\r\n", b"\r"])
def test_line_endings(end: bytes) -> None:
    body = b"event: e" + end + b"data: 1" + end + b"data: 2" + end + end + b"data: 3" + end + end
    assert parse(body) == [SseEvent("e", "1\n2"), SseEvent("message", "3")]


def test_crlf_split_across_reads_is_one_line_end() -> None:
    # "data: a\r" | "\n" must not read as "data: a", "" (a dispatch) and then "data: b".
    assert parse(b"data: a\r", b"\ndata: b\r\n\r\n") == [SseEvent("message", "a\nb")]
    assert parse(b"data: a\r", b"", b"\n", b"data: b\r", b"\n\r", b"\n") == [
        SseEvent("message", "a\nb")
    ]
    # a lone CR at the end of a read is still a line end when no LF follows
    assert parse(b"data: a\r", b"data: b\r\r") == [SseEvent("message", "a\nb")]


def test_multibyte_character_split_across_reads() -> None:
    euro = "data: 5 €\n\n".encode()
    for cut in range(len(euro) + 1):
        assert parse(euro[:cut], euro[cut:]) == [SseEvent("message", "5 €")]
    assert parse(*[bytes([b]) for b in "data: 😀\n\n".encode()]) == [SseEvent("message", "😀")]


def test_invalid_utf8_is_replaced_not_raised() -> None:
    assert parse(b"data: \xff\n\n") == [SseEvent("message", "\ufffd")]


def test_blank_line_dispatches_and_blocks_without_data_do_not() -> None:
    parser = SseParser()
    assert parser.feed(b"data: a\n") == []
    assert parser.feed(b"\n") == [SseEvent("message", "a")]
    assert parser.feed(b"event: ping\n\nid: 3\n\n\n\n") == []
    assert parser.feed(b"data: b\n\n") == [SseEvent("message", "b", "3")]


def test_bom_stripped_once() -> None:
    assert parse(b"\xef\xbb\xbf", b"data: a\n\n") == [SseEvent("message", "a")]


def test_comments_and_keep_alives_ignored() -> None:
    body = (
        b": keep-alive\n: OPENROUTER PROCESSING\n\ndata: a\n:comment inside an event\ndata: b\n\n"
    )
    assert parse(body) == [SseEvent("message", "a\nb")]


def test_ping_events_are_plain_events() -> None:
    body = b'event: ping\ndata: {"type": "ping"}\n\n'
    assert parse(body) == [SseEvent("ping", '{"type": "ping"}')]


def test_done_is_an_ordinary_event_for_the_parser() -> None:
    assert parse(b"data: [DONE]\n\n") == [SseEvent("message", "[DONE]")]


@pytest.mark.parametrize(
    ("content_type", "expected"),
    [
        ("text/event-stream", True),
        ("text/event-stream; charset=utf-8", True),
        ("Text/Event-Stream ;charset=UTF-8", True),
        ("application/json", False),
        ("application/json; charset=utf-8", False),
        ("text/html", False),
        ("text/plain", False),
        ("", False),
    ],
)
def test_non_sse_reply_is_not_a_stream(content_type: str, expected: bool) -> None:
    assert looks_like_sse(content_type) is expected


def test_close_flushes_a_final_event_without_blank_line() -> None:
    assert parse(b"data: a\n\ndata: b") == [SseEvent("message", "a"), SseEvent("message", "b")]
    assert parse(b"data: a\ndata: b\n") == [SseEvent("message", "a\nb")]
    assert parse(b"data: a\r") == [SseEvent("message", "a")]
    assert parse(b"") == []


def test_sample_stream_parses() -> None:
    assert parse(SAMPLE) == SAMPLE_EVENTS


def test_chunk_boundaries_at_every_byte_give_the_same_events() -> None:
    for cut in range(len(SAMPLE) + 1):
        assert parse(SAMPLE[:cut], SAMPLE[cut:]) == SAMPLE_EVENTS, cut
    for cut in range(1, len(SAMPLE)):
        assert parse(SAMPLE[:cut], SAMPLE[cut : cut + 1], SAMPLE[cut + 1 :]) == SAMPLE_EVENTS
    assert parse(*[bytes([b]) for b in SAMPLE]) == SAMPLE_EVENTS


def test_events_arrive_as_soon_as_dispatched() -> None:
    parser = SseParser()
    assert parser.feed(SAMPLE[:30]) == []
    got: list[SseEvent] = []
    for b in SAMPLE[30:]:
        got.extend(parser.feed(bytes([b])))
        if got:
            break
    assert got == SAMPLE_EVENTS[:1]
