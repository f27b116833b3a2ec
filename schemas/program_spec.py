"""Program sessions: one WASM agent program run (`_start`) per spec line (docs/guest-abi.md).

    {"id": "agents/7", "program": {"module": "agent.wasm", "args": ["--fast"], "stdin": "...",
     "env": {"LANG": "C"}}, "provider": "openai", "model": "gpt-4o-mini",
     "limits": {"run_timeout_ms": 60000}}

`provider` and `model` are the defaults of the program's chats (its `backend` / `model`
params win). The guest gets exactly the args, stdin and env given here: nothing else.
"""

from __future__ import annotations

from typing import Any

from marshmallow import RAISE, Schema, fields, post_load, validate

from schemas.limits import RUN_LIMIT_BOUNDS
from schemas.spec import ID_PATTERN, PermissionsSchema
from schemas.spec_types import PROGRAM_KIND, ProgramSpec, spec_from_json


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
    permissions = fields.Nested(PermissionsSchema)  # for the tools its chats register

    @post_load
    def _typed(self, data: dict[str, Any], **kwargs: Any) -> ProgramSpec:
        # built as a stored spec is: one way to make a ProgramSpec
        spec = spec_from_json({**data, "kind": PROGRAM_KIND})
        assert isinstance(spec, ProgramSpec)
        return spec


def is_program(obj: Any) -> bool:
    return isinstance(obj, dict) and "program" in obj
