"""`cchat_write_fn`'s checks of a program's tool JSON, each failure named: the field and a
short reason that quotes nothing the program wrote beyond a field's name (the line goes to the
run's `logs`, as a `warn`, beside the -EINVAL). Pure: no wasmtime here."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from marshmallow import ValidationError

from schemas.policy_schema import ToolPolicySchema
from schemas.spec_types import ToolPolicy, default_parameters
from schemas.tool_schema import schema_problem_reason

MAX_FIELD_CHARS = 40  # a field name the program chose (an unknown policy key) is cut here


@dataclass(frozen=True)
class Rejected:
    """Why a tool was not registered: its field and a short reason."""

    field: str
    reason: str

    def log_line(self) -> str:
        return f"cchat_write_fn: {self.field}: {self.reason}"


def parse_tool_json(raw: bytes) -> tuple[dict[str, Any], ToolPolicy] | Rejected:
    """An OpenAI tool (or a legacy bare function) -> the function object (its parameters a
    usable JSON Schema, checked as at submit) and the tool's policy (a `policy` object beside
    `function`, as in a spec's tools), or why not."""
    try:
        obj = json.loads(raw.decode())
    except UnicodeDecodeError:
        return Rejected("tool JSON", "not UTF-8")
    except json.JSONDecodeError as exc:  # its message is the parser's, its place a number
        return Rejected("tool JSON", f"not valid JSON ({exc.msg} at char {exc.pos})")
    if not isinstance(obj, dict):
        return Rejected("tool JSON", "not a JSON object")
    policy = _policy(obj.get("policy") or {})
    if isinstance(policy, Rejected):
        return policy
    wrapped = obj.get("type", "function") == "function" and "function" in obj
    function, at = (obj.get("function"), "function.") if wrapped else (obj, "")
    if not isinstance(function, dict):
        return Rejected("function", "not a JSON object")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        reason = "missing" if name is None else "empty" if name == "" else "not a string"
        return Rejected(f"{at}name", reason)
    out: dict[str, Any] = {"name": name}
    if isinstance(function.get("description"), str):
        out["description"] = function["description"]
    params = function.get("parameters")
    out["parameters"] = params if isinstance(params, dict) else default_parameters()
    problem = schema_problem_reason(out["parameters"])
    if problem is not None:
        return Rejected(f"{at}parameters", problem)
    return out, policy


def _policy(raw: Any) -> ToolPolicy | Rejected:
    try:
        return ToolPolicy.from_json(ToolPolicySchema().load(raw))
    except ValidationError as exc:
        messages = exc.messages if isinstance(exc.messages, dict) else {}
        key, problems = next(iter(messages.items()), ("_schema", []))
        if key == "_schema":  # the whole value: not an object
            return Rejected("policy", "not a JSON object")
        first = problems[0] if isinstance(problems, list) and problems else "not valid"
        # marshmallow's words name the declared bounds and choices, never the value
        return Rejected(f"policy.{str(key)[:MAX_FIELD_CHARS]}", str(first).rstrip("."))
