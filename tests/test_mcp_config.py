"""MCP servers in the fleet's configuration: how they are named and allowed per
environment, validated strictly; how their tools reach the model (SPEAR's names and filters);
and the spec sessions' `mcp_servers`, checked at submit against the configuration. Pure: no
server runs here (tests/test_mcp_tools.py talks to one)."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from producer.backend_check import backend_check
from producer.specfile import SpecFileError, load_spec_file
from schemas.config import ConfigError, parse_config
from schemas.fleet import McpServerConfig
from schemas.mcp import McpToolInfo, offered_tools, tool_name
from schemas.spec import SessionSpecSchema
from schemas.spec_types import (
    MCP_MODULE,
    McpToolRef,
    SessionSpec,
    spec_from_json,
    spec_to_json,
    tool_from_json,
    tool_to_json,
    with_mcp_tools,
)
from tests.test_config import cli

CONFIG: dict[str, Any] = {
    "mcp_servers": {
        "fs": {"command": ["python", "-m", "fixtures.mcp.server"], "env": {"ROOT": "/srv"}},
        "web": {"url": "https://mcp.example.com/mcp", "api_key_env": "WEB_MCP_TOKEN"},
    },
    "tools": {
        "default_environment": "dev",
        "environments": {"dev": {"mcp_servers": ["fs"]}, "prod": {}},
    },
}


def problems(raw: Any) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(raw)
    return [f"{path}: {message}" for path, message in info.value.problems]


def test_mcp_servers_are_named_once_and_allowed_per_environment() -> None:
    fleet = parse_config(CONFIG).tool_defaults
    fs, web = fleet.mcp_servers["fs"], fleet.mcp_servers["web"]
    assert (fs.transport, fs.command, dict(fs.env)) == (
        "stdio",
        ("python", "-m", "fixtures.mcp.server"),
        {"ROOT": "/srv"},
    )
    assert (web.transport, web.url, web.api_key_env) == (
        "http",
        "https://mcp.example.com/mcp",
        "WEB_MCP_TOKEN",
    )
    assert (fs.allow_tools, fs.deny_tools, fs.timeout_ms) == (("*",), (), None)
    assert (fs.risk_level, fs.list_ttl_s) == ("low", 60.0)
    kept = parse_config({"mcp_servers": {"fs": {"command": ["x"], "list_ttl_s": 0}}})
    assert kept.tool_defaults.mcp_servers["fs"].list_ttl_s == 0.0  # 0: listed for every use
    assert fleet.mcp_allowed("dev") == ("fs",)
    assert fleet.mcp_allowed(None) == ("fs",)  # the default environment's
    assert fleet.mcp_allowed("prod") == ()
    assert fleet.mcp_allowed("nowhere") == ()
    # no environment at all: no MCP server may be enabled
    alone = parse_config({"mcp_servers": CONFIG["mcp_servers"]})
    assert alone.tool_defaults.mcp_allowed(None) == ()


def test_mcp_configuration_is_checked_strictly_each_problem_by_its_path() -> None:
    assert problems(
        {
            "mcp_servers": {
                "both": {"command": ["x"], "url": "http://127.0.0.1:9/mcp"},
                "neither": {"timeout_ms": 5},
                "empty": {"command": []},
                "mixed": {"url": "http://127.0.0.1:9/mcp", "env": {"A": "b"}, "cwd": "/"},
                "keyed": {"command": ["x"], "api_key_env": "TOKEN"},
                "typed": {"command": ["x"], "timeout_ms": "5000", "risk_level": "extreme"},
                "ttl": {"command": ["x"], "list_ttl_s": -1},
                "ftp": {"url": "ftp://host/mcp"},
                "has space": {"command": ["x"]},
                "unknown": {"command": ["x"], "args": ["y"]},
            },
            "tools": {"environments": {"dev": {"mcp_servers": ["fs", 7]}}},
        }
    ) == [
        "tools.environments.dev.mcp_servers.1: Not a valid string.",
        "mcp_servers.has space: must be 1-32 of A-Z a-z 0-9 _ . -",
        "mcp_servers.both: give either command (stdio) or url (HTTP)",
        "mcp_servers.neither: give either command (stdio) or url (HTTP)",
        "mcp_servers.empty.command: must name the program to run",
        "mcp_servers.mixed.env: only with command",
        "mcp_servers.mixed.cwd: only with command",
        "mcp_servers.keyed.api_key_env: only with url",
        "mcp_servers.typed.timeout_ms: must be an integer",
        "mcp_servers.typed.risk_level: Must be one of: low, medium, high.",
        "mcp_servers.ttl.list_ttl_s: must be between 0 and 86400 seconds",
        "mcp_servers.ftp.url: Not a valid URL.",
        "mcp_servers.unknown.args: unknown key",
        "tools.environments.dev.mcp_servers.0: 'fs' is not one of mcp_servers",
    ]


def test_tools_are_named_as_spear_names_them() -> None:
    # mcp__<base64url(server)>__<base64url(tool)>, unpadded: any server or tool name fits the
    # model's function-name alphabet
    assert tool_name("fs", "read_file") == "mcp__ZnM__cmVhZF9maWxl"
    assert tool_name("git.hub", "list/issues?") == "mcp__Z2l0Lmh1Yg__bGlzdC9pc3N1ZXM_"


SERVER = McpServerConfig(id="fs", command=("x",), deny_tools=("delete_*",), timeout_ms=4000)
LISTED = (
    McpToolInfo("read_file", "Read a file", {"type": "object"}, read_only=True),
    McpToolInfo("list_dir", None, {}),
    McpToolInfo("write_file", "Write a file", {"type": "object"}),
    McpToolInfo("delete_file", "Delete a file", {"type": "object"}),
    McpToolInfo("read_" + "x" * 40, "too long a name", {"type": "object"}),
    McpToolInfo("read_broken", "a schema that checks nothing", {"type": 7}),
)


def test_offered_tools_pass_the_servers_globs_then_the_sessions_lists() -> None:
    everything = offered_tools(SERVER, LISTED)
    assert [t.mcp.tool for t in everything if t.mcp] == ["read_file", "list_dir", "write_file"]
    read = everything[0]
    assert read.name == tool_name("fs", "read_file") and read.module == MCP_MODULE
    assert read.mcp == McpToolRef("fs", "read_file")
    assert read.function.description == "Read a file"
    assert (read.policy.timeout_ms, read.policy.idempotent, read.policy.risk_level) == (
        4000,
        True,  # the server says read-only: a retry is harmless
        "low",
    )
    assert everything[1].function.parameters == {"type": "object", "properties": {}}
    assert not everything[2].policy.idempotent
    allowlisted = offered_tools(SERVER, LISTED, allowlist=["read_*", "list_*", "delete_*"])
    assert [t.mcp.tool for t in allowlisted if t.mcp] == ["read_file", "list_dir"]
    denied = offered_tools(SERVER, LISTED, allowlist=["*"], denylist=["list_*"])
    assert [t.mcp.tool for t in denied if t.mcp] == ["read_file", "write_file"]
    # a program's tool is stored with whole_result, and only then (spec sessions' unchanged)
    assert tool_to_json(read)["mcp"] == {"server": "fs", "tool": "read_file"}
    whole = replace(read, mcp=McpToolRef("fs", "read_file", whole_result=True))
    assert tool_to_json(whole)["mcp"]["whole_result"] is True
    assert tool_from_json(tool_to_json(whole)) == whole


def session_spec(**extra: Any) -> dict[str, Any]:
    return {
        "id": "s/1",
        "model": "replay/call",
        "messages": [{"role": "user", "content": "hi"}],
        **extra,
    }


def test_a_spec_names_mcp_servers_and_keeps_them_until_its_first_round_lists_them() -> None:
    spec = SessionSpecSchema().load(session_spec(mcp_servers=["fs"]))
    assert isinstance(spec, SessionSpec) and spec.mcp_servers == ("fs",)
    stored = spec_to_json(spec)
    assert stored["mcp_servers"] == ["fs"] and spec_from_json(stored) == spec
    plain = spec_to_json(SessionSpecSchema().load(session_spec()))
    assert "mcp_servers" not in plain  # a spec without any is stored as before
    tools = offered_tools(SERVER, LISTED[:2])
    resolved = with_mcp_tools(spec, tools)
    assert resolved.mcp_servers == () and resolved.tools == tools
    assert spec_from_json(json.loads(json.dumps(spec_to_json(resolved)))) == resolved
    with pytest.raises(Exception, match="Each server once"):
        SessionSpecSchema().load(session_spec(mcp_servers=["fs", "fs"]))


def test_submit_refuses_an_mcp_server_not_configured_or_not_allowed(tmp_path: Path) -> None:
    lines = [
        session_spec(id="ok", mcp_servers=["fs"]),
        session_spec(id="typo", mcp_servers=["sf"]),
        session_spec(id="prod", mcp_servers=["fs"], permissions={"environment": "prod"}),
        session_spec(id="web", mcp_servers=["web"]),
    ]
    path = tmp_path / "specs.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(SpecFileError) as info:
        load_spec_file(path, backend_check(parse_config(CONFIG, source="c.json")))
    assert [str(issue) for issue in info.value.issues] == [
        f"{path}:2: mcp_servers.0: unknown MCP server 'sf'; the configuration (c.json) has fs, web",
        f"{path}:3: mcp_servers.0: environment 'prod' does not allow MCP server 'fs'"
        " (tools.environments.prod.mcp_servers)",
        f"{path}:4: mcp_servers.0: environment 'dev' does not allow MCP server 'web'"
        " (tools.environments.dev.mcp_servers)",
    ]
    no_environment = parse_config({"mcp_servers": CONFIG["mcp_servers"]})
    path.write_text(json.dumps(lines[0]) + "\n")
    with pytest.raises(SpecFileError, match="needs an environment that lists it"):
        load_spec_file(path, backend_check(no_environment))


def test_the_readmes_mcp_example_is_a_valid_configuration() -> None:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    [example] = [b for b in re.findall(r"```json\n(.*?)```", readme, re.S) if '"mcp_servers"' in b]
    fleet = parse_config(json.loads(example)).tool_defaults
    assert sorted(fleet.mcp_servers) == ["fs", "web"]
    assert fleet.mcp_allowed(None) == ("fs", "web") and fleet.mcp_allowed("batch") == ("fs",)


def test_config_check_lists_the_mcp_servers_and_where_they_are_usable() -> None:
    shown = cli("config", "check", env={"CCHATQ_BACKENDS": json.dumps(CONFIG)})
    assert shown.returncode == 0, shown.stderr
    lines = [line.split() for line in shown.stdout.splitlines() if "mcp " in line]
    assert lines == [
        ["mcp", "fs", "stdio", "python", "usable", "in:", "dev"],
        ["mcp", "web", "http", "https://mcp.example.com/mcp", "usable", "in:", "no", "environment"],
    ]
