"""Session spec schemas (docs/architecture.md section 1).

``SessionSpecSchema().load(obj)`` validates one producer-submitted spec and returns the
canonical plain dict the worker consumes: flags and limits filled with defaults, tools in
the wrapped ``{"module", "export", "table_index", "function"}`` form.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from marshmallow import (
    Schema,
    ValidationError,
    fields,
    post_load,
    pre_load,
    validate,
    validates,
    validates_schema,
)

from schemas.limits import COMPRESS_MODES, LIMIT_ALIASES, LIMIT_BOUNDS
from schemas.mcp import SERVER_ID
from schemas.policy_schema import TOOL_REFERENCES, ToolPolicySchema
from schemas.spec_types import (
    INVALID_CALL_NAME,
    TASK_STATUS,
    SessionSpec,
    default_parameters,
    spec_from_json,
)
from schemas.strict import FUNCTION_NAME_PATTERN, StrictBool, strict_int
from schemas.tool_schema import schema_problem

ROLES = ("system", "user", "assistant", "tool")
# Patterns end in \Z, not $: marshmallow's Regexp uses re.match, and "$" accepts a
# trailing newline ("abc\n" would pass).
ID_PATTERN = r"[A-Za-z0-9._:/@+-]+\Z"
ID_MAX_CHARS = 200
# The worker owns these upstream request fields; letting params override them would
# bypass validation (model, messages, tools) or break response assembly (stream).
RESERVED_PARAMS = ("model", "messages", "tools", "stream")
LEGACY_FUNCTION_KEYS = ("name", "description", "parameters")


Content = str | list[dict[str, Any]] | None


class ContentField(fields.Field[Content]):
    """A string, null, or a list of content parts (objects with a string ``type``)."""

    default_error_messages = {
        "invalid": "Must be a string, null or a list of content parts.",
        "invalid_part": "Content part {index} must be an object with a string 'type'.",
    }

    def _deserialize(
        self, value: Any, attr: str | None, data: Mapping[str, Any] | None, **kwargs: Any
    ) -> Content:
        if isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise self.make_error("invalid")
        for index, part in enumerate(value):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise self.make_error("invalid_part", index=index)
        return value


class ToolCallFunctionSchema(Schema):
    name = fields.String(required=True, validate=validate.Length(min=1))
    arguments = fields.String(required=True)


class ToolCallSchema(Schema):
    id = fields.String(required=True, validate=validate.Length(min=1))
    type = fields.String(load_default="function", validate=validate.OneOf(["function"]))
    function = fields.Nested(ToolCallFunctionSchema, required=True)


class MessageSchema(Schema):
    role = fields.String(required=True, validate=validate.OneOf(ROLES))
    content = ContentField(allow_none=True)
    name = fields.String()
    tool_calls = fields.List(fields.Nested(ToolCallSchema))
    tool_call_id = fields.String(validate=validate.Length(min=1))

    @validates_schema
    def _check_role_fields(self, data: dict[str, Any], **kwargs: Any) -> None:
        role = data["role"]
        errors: dict[str, list[str]] = {}
        if role == "tool" and "tool_call_id" not in data:
            errors["tool_call_id"] = ["Required when role is 'tool'."]
        if role != "tool" and "tool_call_id" in data:
            errors["tool_call_id"] = ["Only allowed when role is 'tool'."]
        if role != "assistant" and "tool_calls" in data:
            errors["tool_calls"] = ["Only allowed when role is 'assistant'."]
        if role in ("user", "system") and data.get("content") is None:
            errors["content"] = [f"Required (non-null) when role is '{role}'."]
        if errors:
            raise ValidationError(errors)


class FunctionSchema(Schema):
    name = fields.String(
        required=True,
        validate=validate.Regexp(
            FUNCTION_NAME_PATTERN, error="Must be 1-64 characters of A-Z a-z 0-9 _ -."
        ),
    )
    description = fields.String()
    parameters = fields.Dict(keys=fields.String(), load_default=default_parameters)

    @validates("name")
    def _check_name(self, value: str, **kwargs: Any) -> None:
        if value == INVALID_CALL_NAME:
            raise ValidationError(f"Reserved: '{INVALID_CALL_NAME}' names unreadable tool calls.")

    @validates("parameters")
    def _check_parameters(self, value: dict[str, Any], **kwargs: Any) -> None:
        problem = schema_problem(value)
        if problem is not None:
            raise ValidationError(problem[0].upper() + problem[1:])


def _globs() -> fields.List[str]:
    return fields.List(fields.String(validate=validate.Length(min=1, max=200)))


class PermissionsSchema(Schema):
    """Which tools a session may call (schemas.spec_types.Permissions)."""

    environment = fields.String(validate=validate.Length(min=1, max=200))
    user = fields.String(validate=validate.Length(min=1, max=200))
    allow_tools = _globs()
    deny_tools = _globs()
    grant = fields.List(fields.String(validate=validate.Regexp(FUNCTION_NAME_PATTERN)))


class ToolSpecSchema(Schema):
    module = fields.String(required=True, validate=validate.Length(min=1))
    export = fields.String(load_default=None, allow_none=True, validate=validate.Length(min=1))
    table_index = strict_int(load_default=None, allow_none=True, validate=validate.Range(min=0))
    type = fields.String(validate=validate.OneOf(["function"]))
    function = fields.Nested(FunctionSchema, required=True)
    policy = fields.Nested(ToolPolicySchema)

    @pre_load
    def _wrap_legacy(self, data: Any, **kwargs: Any) -> Any:
        """Legacy flat form: name/description/parameters beside module -> ``function``."""
        if not isinstance(data, dict) or "function" in data:
            return data
        if not any(key in data for key in LEGACY_FUNCTION_KEYS):
            return data
        wrapped = {k: v for k, v in data.items() if k not in LEGACY_FUNCTION_KEYS}
        wrapped["function"] = {k: data[k] for k in LEGACY_FUNCTION_KEYS if k in data}
        return wrapped

    @validates_schema
    def _check_target(self, data: dict[str, Any], **kwargs: Any) -> None:
        has_export = data.get("export") is not None
        has_index = data.get("table_index") is not None
        if has_export and has_index:
            raise ValidationError("Give export or table_index, not both.", "table_index")
        if not has_export and not has_index:
            raise ValidationError("One of export or table_index is required.", "export")

    @post_load
    def _canonical(self, data: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        # "type" is dropped: it can only be "function".
        keep = ("module", "export", "table_index", "function", "policy")
        return {k: data[k] for k in keep if k in data}


class ToolListField(fields.List[dict[str, Any]]):
    """List of tools whose function names are unique.

    The check sits here, after every tool loaded: marshmallow hands field and schema
    validators the partial data of a failed list, whose indexes need not line up.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(fields.Nested(ToolSpecSchema), **kwargs)

    def _deserialize(
        self, value: Any, attr: str | None, data: Mapping[str, Any] | None, **kwargs: Any
    ) -> list[dict[str, Any] | None]:
        tools = super()._deserialize(value, attr, data, **kwargs)
        first_index: dict[str, int] = {}
        errors: dict[int, Any] = {}
        for index, tool in enumerate(tools):
            name = tool["function"]["name"] if tool else None
            if name in first_index:
                message = f"Duplicate of tools.{first_index[name]}.function.name."
                errors[index] = {"function": {"name": [message]}}
            elif name is not None:
                first_index[name] = index
        for index, tool in enumerate(tools):
            policy = (tool or {}).get("policy")
            if not policy or index in errors:
                continue
            name = tool["function"]["name"]  # type: ignore[index]
            wrong = {
                key: ["Must name another tool of this session."]
                for key in TOOL_REFERENCES
                if policy.get(key) is not None
                and (policy[key] == name or policy[key] not in first_index)
            }
            if wrong:
                errors[index] = {"policy": wrong}
        if errors:
            raise ValidationError(errors)
        return tools


class FlagsSchema(Schema):
    auto_tool_call = StrictBool(load_default=True)
    metrics = StrictBool(load_default=True)
    strict_unknown_tool = StrictBool(load_default=False)
    tool_result_envelope = StrictBool(load_default=True)
    final_answer_on_limit = StrictBool(load_default=True)


def _limit_field(name: str, least: int = 1) -> fields.Integer:
    cap = LIMIT_BOUNDS[LIMIT_ALIASES.get(name, name)][1]
    return strict_int(
        validate=validate.Range(min=least, max=cap, error=f"Must be between {least} and {cap}.")
    )


class LimitsSchema(Schema):
    # Declared one by one so mypy sees a real class; tests/test_spec_schema.py checks the
    # field set equals LIMIT_BOUNDS plus LIMIT_ALIASES and the compress strings.
    max_iterations = _limit_field("max_iterations")
    max_total_tool_calls = _limit_field("max_total_tool_calls")
    max_tool_output_bytes = _limit_field("max_tool_output_bytes")
    default_tool_timeout_ms = _limit_field("default_tool_timeout_ms")
    tool_memory_bytes = _limit_field("tool_memory_bytes")
    max_tool_retries = _limit_field("max_tool_retries", least=0)
    max_parallel = _limit_field("max_parallel")
    compress_over_bytes = _limit_field("compress_over_bytes")
    request_timeout_ms = _limit_field("request_timeout_ms")
    compress = fields.String(validate=validate.OneOf(COMPRESS_MODES))
    compress_backend = fields.String(validate=validate.Length(min=1, max=200))
    compress_model = fields.String(validate=validate.Length(min=1, max=200))
    max_tool_calls = _limit_field("max_tool_calls")
    tool_timeout_ms = _limit_field("tool_timeout_ms")

    @validates_schema
    def _check_aliases(self, data: dict[str, Any], **kwargs: Any) -> None:
        # Both spellings at once would leave the winner up to dict order.
        for alias, name in LIMIT_ALIASES.items():
            if alias in data and name in data:
                raise ValidationError(f"Alias of {name}; give only one of them.", alias)


class SessionSpecSchema(Schema):
    id = fields.String(
        required=True,
        validate=[
            validate.Length(min=1, max=ID_MAX_CHARS),
            validate.Regexp(ID_PATTERN, error="Must match [A-Za-z0-9._:/@+-]+."),
        ],
    )
    provider = fields.String(load_default=None, allow_none=True, validate=validate.Length(min=1))
    model = fields.String(required=True, validate=validate.Length(min=1))
    messages = fields.List(
        fields.Nested(MessageSchema), required=True, validate=validate.Length(min=1)
    )
    tools = ToolListField(load_default=list)
    params = fields.Dict(keys=fields.String(), load_default=dict)
    flags = fields.Nested(FlagsSchema)
    limits = fields.Nested(LimitsSchema)
    metadata = fields.Dict(keys=fields.String(), load_default=dict)
    permissions = fields.Nested(PermissionsSchema)
    # MCP servers of the configuration whose tools the session offers (checked at submit
    # against the configuration: producer/backend_check.py)
    mcp_servers = fields.List(
        fields.String(validate=validate.Regexp(SERVER_ID, error="Must be an MCP server id.")),
        load_default=list,
    )

    @validates("mcp_servers")
    def _check_mcp_servers(self, value: list[str], **kwargs: Any) -> None:
        if len(set(value)) != len(value):
            raise ValidationError("Each server once.")

    @validates_schema
    def _check_builtin_names(self, data: dict[str, Any], **kwargs: Any) -> None:
        tools = [t for t in data.get("tools") or [] if t]
        if not any((t.get("policy") or {}).get("background_mode") == "async" for t in tools):
            return
        taken = {
            n: {
                "function": {
                    "name": [f"Reserved: '{TASK_STATUS}' is the built-in tool of async tasks."]
                }
            }
            for n, t in enumerate(tools)
            if t["function"]["name"] == TASK_STATUS
        }
        if taken:
            raise ValidationError({"tools": taken})

    @validates_schema
    def _check_grants(self, data: dict[str, Any], **kwargs: Any) -> None:
        names = {t["function"]["name"] for t in data.get("tools") or [] if t}
        unknown = {
            n: ["Not a tool of this session."]
            for n, name in enumerate((data.get("permissions") or {}).get("grant") or [])
            if name not in names
        }
        if unknown:
            raise ValidationError({"permissions": {"grant": unknown}})

    @validates("params")
    def _check_params(self, value: dict[str, Any], **kwargs: Any) -> None:
        reserved = {
            key: [f"Reserved: '{key}' is set by the spec/worker, not params."]
            for key in RESERVED_PARAMS
            if key in value
        }
        if reserved:
            raise ValidationError(reserved)

    @post_load
    def _typed(self, data: dict[str, Any], **kwargs: Any) -> SessionSpec:
        spec = spec_from_json(data)  # built as a stored spec is: one way to make a SessionSpec
        assert isinstance(spec, SessionSpec)
        return spec
