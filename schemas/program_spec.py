"""Program sessions: one WASM agent program run (`_start`) per spec line (guest-abi.md).

    {"id": "agents/7", "program": {"module": "agent.wasm", "args": ["--fast"], "stdin": "...",
     "env": {"LANG": "C"}}, "provider": "openai", "model": "gpt-4o-mini",
     "limits": {"run_timeout_ms": 60000}}

`provider` and `model` are the defaults of the program's chats (its `backend` / `model`
params win). The guest gets exactly the args, stdin and env given here: nothing else.
"""

from __future__ import annotations

from typing import Any

from marshmallow import RAISE, Schema, fields, post_load, validate

from schemas.limits import RUN_LIMIT_BOUNDS, RunLimits
from schemas.spec import ID_PATTERN
from schemas.spec_types import ProgramDef, ProgramSpec


class ProgramSchema(Schema):
    class Meta:
        unknown = RAISE

    module = fields.String(required=True, validate=validate.Length(min=1))
    args = fields.List(fields.String(), load_default=list)
    stdin = fields.String(load_default="")
    env = fields.Dict(
        keys=fields.String(validate=validate.Length(min=1)),
        values=fields.String(),
        load_default=dict,
    )


class RunLimitsSchema(Schema):
    class Meta:
        unknown = RAISE

    run_timeout_ms = fields.Integer(
        strict=True, validate=validate.Range(1, RUN_LIMIT_BOUNDS["run_timeout_ms"][1])
    )
    memory_bytes = fields.Integer(
        strict=True, validate=validate.Range(1 << 16, RUN_LIMIT_BOUNDS["memory_bytes"][1])
    )
    max_output_bytes = fields.Integer(
        strict=True, validate=validate.Range(0, RUN_LIMIT_BOUNDS["max_output_bytes"][1])
    )


class ProgramSpecSchema(Schema):
    class Meta:
        unknown = RAISE

    id = fields.String(
        required=True,
        validate=[
            validate.Length(min=1, max=200),
            validate.Regexp(ID_PATTERN, error="Must match [A-Za-z0-9._:/@+-]+."),
        ],
    )
    program = fields.Nested(ProgramSchema, required=True)
    provider = fields.String(load_default=None, allow_none=True, validate=validate.Length(min=1))
    model = fields.String(load_default=None, allow_none=True, validate=validate.Length(min=1))
    limits = fields.Nested(RunLimitsSchema, load_default=dict)
    metadata = fields.Dict(keys=fields.String(), load_default=dict)

    @post_load
    def _typed(self, data: dict[str, Any], **kwargs: Any) -> ProgramSpec:
        program = data["program"]
        return ProgramSpec(
            id=data["id"],
            program=ProgramDef(
                module=program["module"],
                args=tuple(program["args"]),
                stdin=program["stdin"],
                env=dict(program["env"]),
            ),
            provider=data.get("provider"),
            model=data.get("model"),
            limits=RunLimits(**(data.get("limits") or {})),
            metadata=data["metadata"],
        )


def is_program(obj: Any) -> bool:
    return isinstance(obj, dict) and "program" in obj
