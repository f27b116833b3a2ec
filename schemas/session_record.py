"""A finished session's record as Redis keeps it once the session is retired: one compressed
value holding its result record, its trace events, its meta (state, outcome, when it was
submitted and finished) and, for a session that ended with an error, its spec (what `cchatq
batch retry` submits again). Everything else the session wrote is deleted when it ends
(worker/edges/store_retire.py), so a finished session keeps this value, its response fd and its
id's claim.

A record written but not retired yet (its ending step's commit has not run) is the plain JSON
record; `read_record` reads both.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

from schemas import json_codec

RETIRED_MAGIC = b"\x00cq1"  # a retired record's first bytes (a plain record starts with "{")
COMPRESSION_LEVEL = 9
# Raw DEFLATE with a preset dictionary of what every record and trace says (field names, event
# names, the shapes of a chat completion and a tool envelope): a record of a few KB shares
# little with itself, and the dictionary halves it (weather sessions: 863 -> 436 bytes). Part
# of the format: another dictionary is another RETIRED_MAGIC.
ZDICT = (
    b'"meta":{"id":"","batch":"","submitted_ms":"","state":"done","finished_ms":"","outcome":"ok",'
    b'"ended_by":"","backend":"","round":"0"},"spec":{"id":"","model":"","messages":[{"role":"user",'
    b'"content":""}],"tools":[{"type":"function","function":{"name":"","description":"","parameters":'
    b'{"type":"object","properties":{},"required":[]}}}]},'
    b'"trace":[{"event":"session.started","session":"","ts_ms":},'
    b'{"event":"model.call.started","session":"","ts_ms":,"round":0},'
    b'{"event":"model.call.finished","session":"","ts_ms":,"round":0,"latency_ms":,'
    b'"request_id":"chatcmpl-","backend":"","tokens_in":,"tokens_out":,"kind":"round","step_ms":,'
    b'"model":"","response_model":"","finish_reason":"tool_calls","worker":"llm-0@","delivery":1,'
    b'"queue_ms":},{"event":"tool.call.started","session":"","ts_ms":,"round":0,'
    b'"call_id":"call_0_0","tool":""},{"event":"tool.call.finished","session":"","ts_ms":,'
    b'"round":0,"call_id":"call_0_0","tool":"","attempt":0,"latency_ms":,"output_bytes":,'
    b'"kind":"tool","step_ms":,"worker":"tools-0@","delivery":1,"queue_ms":},'
    b'{"event":"session.finished","session":"","ts_ms":,"latency_ms":,"kind":"round","step_ms":,'
    b'"worker":"","delivery":1,"queue_ms":}],'
    b'"record":{"body":{"_spear":{"backend":"","model":""},"choices":[{"finish_reason":"stop",'
    b'"index":0,"message":{"content":"","role":"assistant"}}],"created":,"id":"chatcmpl-",'
    b'"model":"","object":"chat.completion","usage":{"completion_tokens":,"prompt_tokens":,'
    b'"total_tokens":}},"error":{"code":"","message":"","type":""},"id":"","metrics":'
    b'{"iterations":,"latency_ms":,"tool_calls":,"tool_failures":0,"tool_output_bytes":,'
    b'"usage":{"completion_tokens":,"prompt_tokens":,"total_tokens":}},"status":"ok",'
    b'"transcript":[{"content":"","role":"user"},{"content":null,"role":"assistant",'
    b'"tool_calls":[{"function":{"arguments":"{\\"","name":""},"id":"call_0_0","type":"function"}]},'
    b'{"content":"{\\"ok\\":true,\\"data\\":{\\"\\":\\"\\"},\\"error\\":null,\\"metrics\\":'
    b'{\\"latency_ms\\":,\\"retries\\":0}}","role":"tool","tool_call_id":"call_0_0"},'
    b'{"content":"","role":"assistant"}]}'
)


@dataclass(frozen=True)
class StoredRecord:
    """A session's record with what its retirement folded into it (empty before)."""

    record: dict[str, Any]
    retired: bool = False
    trace: list[dict[str, Any]] = field(default_factory=list)  # its events, in write order
    meta: dict[str, str] = field(default_factory=dict)
    spec: dict[str, Any] | None = None  # kept for a session that ended with an error


def retired_value(
    record: dict[str, Any],
    trace: list[dict[str, Any]],
    meta: dict[str, str],
    spec: dict[str, Any] | None = None,
) -> bytes:
    """The one value a retired session keeps beside its response fd."""
    folded: dict[str, Any] = {"record": record, "trace": trace, "meta": meta}
    if spec is not None:
        folded["spec"] = spec
    text = json_codec.dumps(folded)
    packer = zlib.compressobj(
        COMPRESSION_LEVEL, zlib.DEFLATED, -15, 9, zlib.Z_DEFAULT_STRATEGY, ZDICT
    )
    return RETIRED_MAGIC + packer.compress(text) + packer.flush()


def read_record(raw: bytes) -> StoredRecord:
    """A stored record, retired or not."""
    if not raw.startswith(RETIRED_MAGIC):
        return StoredRecord(dict(json_codec.loads(raw)))
    unpacker = zlib.decompressobj(-15, zdict=ZDICT)
    folded = json_codec.loads(unpacker.decompress(raw[len(RETIRED_MAGIC) :]) + unpacker.flush())
    return StoredRecord(
        dict(folded["record"]),
        retired=True,
        trace=[dict(e) for e in folded.get("trace", [])],
        meta={str(k): str(v) for k, v in folded.get("meta", {}).items()},
        spec=folded.get("spec"),
    )
