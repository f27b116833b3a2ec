"""Which keys a step reads with its lease (RedisStore.begin_step), and what they say: a round's
replies with their first calls' outcomes, or a tool step's round and its own outcome."""

from __future__ import annotations

import json

from schemas import keys
from worker.session.outcomes import ToolOutcome
from worker.session.round_record import decode_round
from worker.session.store_ports import ToolInputs

GUESSED_CALLS = 4  # outcome keys read with the replies, per round


def round_keys(sk: str, last: int) -> list[str]:
    """Rounds 0..last: their replies, then their first GUESSED_CALLS calls' outcomes."""
    return [keys.model_out(sk, r) for r in range(last + 1)] + [
        keys.tool_out(sk, r, i) for r in range(last + 1) for i in range(GUESSED_CALLS)
    ]


def tool_keys(sk: str, round_no: int, index: int) -> list[str]:
    return [keys.model_out(sk, round_no), keys.tool_out(sk, round_no, index)]


def parsed_tool_inputs(raw: list[bytes | None]) -> ToolInputs:
    stored, outcome = raw
    return (
        None if stored is None else decode_round(stored),
        None if outcome is None else ToolOutcome.from_json(json.loads(outcome)),
    )
