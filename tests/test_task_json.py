"""kombu's JSON messages decoded by orjson (worker/edges/task_protocol.decode_json_fast) read as
kombu's own decoder reads them: its tagged types, what orjson refuses, every input type."""

from __future__ import annotations

import datetime
import math
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kombu.exceptions import DecodeError
from kombu.serialization import dumps, loads, register_json

from worker.edges.task_protocol import decode_json_fast


@pytest.fixture
def fast() -> Iterator[None]:
    decode_json_fast()
    yield
    register_json()  # kombu's own again, for the tests after


def _read(raw: Any) -> Any:
    return loads(raw, "application/json", "utf-8")


def test_a_task_body_and_kombus_tagged_types_read_as_kombu_reads_them(fast: None) -> None:
    sent = {
        "body": [["sk", 1, 0], {}, {"callbacks": None, "chain": None}],
        "when": datetime.datetime(2026, 1, 2, 3, 4, 5),
        "id": uuid.UUID(int=5),
        "text": "é ✓",
    }
    _, _, raw = dumps(sent, serializer="json")
    assert _read(raw) == sent
    plain = b'[["sk", 1], {}, {"callbacks": null, "errbacks": null}]'
    for form in (plain, plain.decode(), bytearray(plain), memoryview(plain)):
        assert _read(form) == [["sk", 1], {}, {"callbacks": None, "errbacks": None}]


def test_what_orjson_refuses_is_read_by_kombus_decoder(fast: None) -> None:
    read = _read("[NaN, 123456789012345678901234567890]")
    assert math.isnan(read[0]) and read[1] == 123456789012345678901234567890
    with pytest.raises(DecodeError, match="double quotes"):  # not JSON: kombu's error, as before
        _read("{oops")
