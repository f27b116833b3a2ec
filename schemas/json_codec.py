"""JSON on the hot paths (a step's messages, trace events, round and bodies), by orjson: the
standard library's encoder and decoder were 9% of an llm worker's CPU (py-spy, `make bench`'s
workload); orjson's are 3-15x faster. Where orjson refuses what json takes (NaN read, integers
past 64 bits, keys that are not strings, lone surrogates), json does it, so what is written or
read is what json wrote or read: compact, UTF-8, keys sorted when asked. One difference: a NaN
or infinite float, which JSON has no form for, is written null (json wrote NaN)."""

from __future__ import annotations

import json
from typing import Any

import orjson


def loads(raw: bytes | bytearray | memoryview | str) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(bytes(raw) if isinstance(raw, memoryview) else raw)


def dumps(obj: Any, sort_keys: bool = False) -> bytes:
    """Compact UTF-8 JSON: json.dumps with separators (",", ":") and ensure_ascii=False."""
    try:
        return orjson.dumps(obj, option=orjson.OPT_SORT_KEYS if sort_keys else 0)
    except TypeError:  # orjson.JSONEncodeError: json says it, or writes it
        text = json.dumps(obj, separators=(",", ":"), sort_keys=sort_keys, ensure_ascii=False)
        return text.encode()
