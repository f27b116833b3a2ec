"""How a round is stored (its reply key, `keys.model_out`): the model's reply and, when its
plan runs tools, the runs the plan made (each call's id, tool and canonical arguments) and how
many calls the round has. A tool step reads its own run as the round step planned it: it plans
nothing and decodes no arguments. Shared by the Redis store and its twin."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from schemas import json_codec
from schemas.bodies import is_error_body
from schemas.spec_types import SessionSpec
from worker.codecs.reply import Reply
from worker.session.engine import ToolRun, tool_run


@dataclass(frozen=True)
class PlannedRun:
    call_id: str
    name: str
    arguments: str  # canonical JSON, validated when the round was planned


@dataclass(frozen=True)
class StoredRound:
    completion: dict[str, Any]  # the reply: a canonical chat.completion, or an error body
    calls: int  # how many tool calls the reply made (the round's fan-in)
    runs: dict[int, PlannedRun] | None = None  # None: stored without its plan's runs

    @property
    def is_error(self) -> bool:
        return is_error_body(self.completion)

    def run(self, spec: SessionSpec, index: int) -> ToolRun | None:
        """Call `index`'s run as its round planned it; None when the plan made no run of it.
        A round stored without its runs has them made from its reply."""
        if self.runs is None:
            return tool_run(spec, Reply.parse(self.completion), index)
        planned = self.runs.get(index)
        if planned is None:
            return None
        tool = spec.tool(planned.name)
        if tool is None:
            return None
        return ToolRun(index, planned.call_id, planned.name, tool, planned.arguments)


def encode_round(reply: Reply, runs: Sequence[ToolRun]) -> bytes:
    """The stored form of a round and its plan's runs."""
    record: dict[str, Any] = {"reply": reply.completion}
    if reply.call_count:
        record["calls"] = reply.call_count
        record["runs"] = [[r.index, r.call_id, r.name, r.arguments] for r in runs]
    return json_codec.dumps(record)


def decode_round(raw: bytes | str) -> StoredRound:
    record = json_codec.loads(raw)
    if "reply" not in record:  # a bare reply (no plan stored with it)
        return StoredRound(record, Reply.parse(record).call_count)
    runs = {int(i): PlannedRun(c, name, args) for i, c, name, args in record.get("runs", ())}
    return StoredRound(record["reply"], int(record.get("calls", 0)), runs)
