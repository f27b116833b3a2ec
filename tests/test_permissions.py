"""Issue 9, point 7: which tools a session may call, by risk level, environment, user and the
spec's own globs; a denied call is answered PERMISSION_DENIED and never runs."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from marshmallow import ValidationError

from schemas.config import parse_config
from schemas.fleet import Environment, ToolDefaults
from schemas.spec import SessionSpecSchema
from schemas.spec_types import Permissions, SessionSpec, spec_from_json, tool_from_json
from tests.test_engine import TIME, USER, WEATHER, call, completion, err, make_spec, session
from tests.test_tool_policy import FlakyTools, _run
from worker.codecs.reply import Reply
from worker.errors import ToolRuntimeError
from worker.session.engine import RunTools, plan
from worker.session.permissions import permission_problem
from worker.session.state import Round

FLEET = ToolDefaults(
    environments={
        "prod": Environment(
            max_risk_level="medium",
            allow_tools=("get_*", "search"),
            deny_tools=("get_secret*",),
            users={"intern": ("get_time",)},
        ),
        "dev": Environment(),
    },
    default_environment="dev",
)


def tool(name: str, risk: str = "low") -> Any:
    return tool_from_json({**WEATHER, "function": {"name": name}, "policy": {"risk_level": risk}})


@pytest.mark.parametrize(
    ("name", "risk", "granted", "problem"),
    [
        ("get_weather", "low", Permissions(), None),
        ("rm", "high", Permissions(), "rm is a high-risk tool: the spec must grant it"),
        ("rm", "high", Permissions(grant=("rm",)), None),  # dev allows any risk
        ("rm", "high", Permissions(environment="prod", grant=("rm",)), "above environment prod"),
        ("get_weather", "medium", Permissions(environment="prod"), None),
        ("get_secret_key", "low", Permissions(environment="prod"), "environment prod denies"),
        ("delete", "low", Permissions(environment="prod"), "environment prod does not allow"),
        ("get_weather", "low", Permissions(environment="prod", user="intern"), "user intern"),
        ("get_time", "low", Permissions(environment="prod", user="intern"), None),
        ("get_time", "low", Permissions(environment="prod", user="other"), None),  # no list
        ("get_time", "low", Permissions(deny_tools=("get_t*",)), "the spec denies"),
        ("get_time", "low", Permissions(allow_tools=("search",)), "the spec does not allow"),
        ("get_time", "low", Permissions(environment="staging"), "unknown environment"),
    ],
)
def test_permission_rules(name: str, risk: str, granted: Permissions, problem: str | None) -> None:
    found = permission_problem(tool(name, risk), granted, FLEET)
    assert (found is None) == (problem is None), found
    if problem is not None:
        assert problem in (found or "")


def test_with_no_environment_configured_only_the_grant_and_the_spec_decide() -> None:
    bare = ToolDefaults()
    assert permission_problem(tool("x", "medium"), Permissions(), bare) is None
    assert permission_problem(tool("x", "high"), Permissions(), bare) is not None
    assert permission_problem(tool("x"), Permissions(deny_tools=("*",)), bare) is not None


def _high_spec(**permissions: Any) -> dict[str, Any]:
    risky = {**TIME, "policy": {"risk_level": "high"}}
    spec = make_spec(tools=[WEATHER, risky])
    spec["permissions"] = permissions
    return spec


def test_a_denied_call_is_answered_permission_denied_and_its_siblings_run() -> None:
    reply = completion(
        call("call_a", "get_weather", '{"city":"Paris"}'), call("call_b", "get_time", "{}")
    )
    step = plan(session(_high_spec(), Round(reply=Reply.parse(reply))))
    assert isinstance(step, RunTools) and [r.index for r in step.runs] == [0]
    message = "permission denied: get_time is a high-risk tool: the spec must grant it "
    assert step.presets == {1: err("PERMISSION_DENIED", message + "(permissions.grant)")}
    granted = plan(session(_high_spec(grant=["get_time"]), Round(reply=Reply.parse(reply))))
    assert isinstance(granted, RunTools) and [r.index for r in granted.runs] == [0, 1]


def test_the_fleets_environments_reach_the_plan() -> None:
    reply = completion(call("call_a", "get_weather", '{"city":"Paris"}'))
    s = replace(session(make_spec(), Round(reply=Reply.parse(reply))), fleet=FLEET)
    assert isinstance(plan(s), RunTools) and plan(s).runs  # type: ignore[union-attr]
    prod_intern = {**make_spec(), "permissions": {"environment": "prod", "user": "intern"}}
    denied = plan(replace(session(prod_intern, Round(reply=Reply.parse(reply))), fleet=FLEET))
    assert isinstance(denied, RunTools) and denied.runs == ()
    assert denied.presets[0].code == "PERMISSION_DENIED"


def test_a_fallback_is_no_way_around_a_denial() -> None:
    risky = {**TIME, "policy": {"risk_level": "high"}}
    weather = {**WEATHER, "policy": {"fallback": "get_time"}}
    typed = spec_from_json(make_spec(tools=[weather, risky]))
    assert isinstance(typed, SessionSpec)
    tools = FlakyTools(ToolRuntimeError("down"))
    outcome = _run(typed, tools)
    assert (outcome.code, outcome.fallback, len(tools.calls)) == ("RUNTIME_ERROR", None, 1)


def test_permissions_and_risk_levels_are_checked_at_submit() -> None:
    raw: dict[str, Any] = {
        "id": "p/1",
        "model": "m",
        "messages": [USER],
        "tools": [{"module": "w.wasm", "export": "a", "function": {"name": "a"},
                   "policy": {"risk_level": "extreme"}}],
        "permissions": {"grant": ["a", "nope"], "allow_tools": "a*", "colour": 1},
    }  # fmt: skip
    with pytest.raises(ValidationError) as info:
        SessionSpecSchema().load(raw)
    assert info.value.messages == {
        "tools": {0: {"policy": {"risk_level": ["Must be one of: low, medium, high."]}}},
        "permissions": {"allow_tools": ["Not a valid list."], "colour": ["Unknown field."]},
    }
    raw["tools"][0]["policy"] = {"risk_level": "high"}
    raw["permissions"] = {"grant": ["a", "nope"]}
    with pytest.raises(ValidationError) as info:
        SessionSpecSchema().load(raw)
    assert info.value.messages == {"permissions": {"grant": {1: ["Not a tool of this session."]}}}
    raw["permissions"] = {"grant": ["a"], "environment": "prod", "user": "u"}
    loaded = SessionSpecSchema().load(raw)
    assert loaded.permissions == Permissions(environment="prod", user="u", grant=("a",))


def test_environments_in_the_configuration_are_checked_when_it_loads() -> None:
    parsed = parse_config(
        {
            "tools": {
                "environments": {"prod": {"max_risk_level": "low", "users": {"u": ["get_*"]}}},
                "default_environment": "prod",
            }
        }
    ).tool_defaults
    assert parsed.environments["prod"] == Environment("low", users={"u": ("get_*",)})
    assert parsed.default_environment == "prod"
    for bad, message in [
        ({"environments": {"p": {"max_risk_level": "huge"}}}, "p.max_risk_level: Must be one of"),
        ({"environments": {"p": {"allow_tools": "x"}}}, "p.allow_tools: Not a valid list"),
        ({"environments": {"p": {"colour": 1}}}, "p.colour: unknown key"),
        ({"default_environment": "nowhere"}, "default_environment: is not an environment"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_config({"tools": bad})


def test_a_program_spec_carries_the_permissions_of_its_chats_tools() -> None:
    from schemas.program_spec import ProgramSpecSchema
    from schemas.spec_types import ProgramSpec, spec_to_json

    raw = {"id": "p/1", "program": {"module": "agent.wasm"}, "permissions": {"grant": ["sum"]}}
    spec = ProgramSpecSchema().load(raw)
    assert isinstance(spec, ProgramSpec) and spec.permissions == Permissions(grant=("sum",))
    assert spec_from_json(spec_to_json(spec)) == spec
