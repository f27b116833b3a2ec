"""MCP on a real fleet: Redis, Celery workers, the replay server, and the
fixture MCP server (fixtures/mcp/server.py, the official SDK over stdio) that the workers start
for each listing and call. SPEAR's mcp_fs, written as SPEAR's samples are
(fixtures/guests/prog_mcp_fs.c), gets -EACCES for `mcp.enabled` where its environment allows
no MCP server; where it does, the allowed tools are offered and called, and the one its
allowlist leaves out is neither. A spec session naming `mcp_servers` does the same through the
configuration's globs. The fixture server logs each call it runs (tool name and pid)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from producer.fleet import Fleet
from producer.specfile import SpecFileError
from schemas import keys
from schemas.mcp import tool_name
from tests.conftest import GUESTS, ROOT, Running, _workers
from tests.test_pipeline import run_specs

pytestmark = pytest.mark.fleet

REDIS_DB = 10
ADD, ECHO, SECRET = (tool_name("fs", t) for t in ("add", "echo", "secret"))
SAFE_ADD, SAFE_SECRET = tool_name("fs_safe", "add"), tool_name("fs_safe", "secret")


@dataclass
class McpFleet:
    running: Running
    ran_log: Path  # the fixture server's: one line per call it ran

    def ran(self) -> list[str]:
        if not self.ran_log.exists():
            return []
        return [line.split()[0] for line in self.ran_log.read_text().splitlines()]


@pytest.fixture(scope="module")
def mcp_fleet(base_fleet: Fleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[McpFleet]:
    ran_log = tmp_path_factory.mktemp("mcp") / "ran.log"
    server = {
        "command": [sys.executable, "-m", "fixtures.mcp.server"],
        "cwd": str(ROOT),
        "env": {"CCHATQ_MCP_FIXTURE_LOG": str(ran_log)},
    }
    config = {  # submit checks mcp_servers against it too
        "mcp_servers": {"fs": server, "fs_safe": {**server, "deny_tools": ["secret"]}},
        "tools": {
            "environments": {"dev": {"mcp_servers": ["fs", "fs_safe"]}, "sandbox": {}},
        },
    }
    queues = ("llm", "tools", "control", "programs")
    for running in _workers(base_fleet, REDIS_DB, config=config, queues=queues):
        yield McpFleet(running, ran_log)


def run_mcp_fs(mcp: McpFleet, tmp_path: Path, spec_id: str, environment: str) -> dict[str, Any]:
    spec = {
        "id": spec_id,
        "program": {"module": str(GUESTS / "prog_mcp_fs.wasm")},
        "permissions": {"environment": environment},
    }
    return run_specs(mcp.running.client, [spec], tmp_path, timeout_s=120)[spec_id]


def chat_spec(mcp: McpFleet, run_id: str) -> dict[str, Any]:
    """The stored spec of a program run's first chat: what its model was offered."""
    redis = mcp.running.client.redis
    run_sk = keys.Claim.decode(redis.get(keys.id_claim(keys.DEFAULT_NAMESPACE, run_id))).sk
    spec = mcp.running.client.spec_json(keys.chat_session_key(run_sk, 0))
    assert spec is not None
    return spec


def test_mcp_enabled_without_permission_is_eacces(
    mcp_fleet: McpFleet, tmp_path: Path, fresh_id: str
) -> None:
    record = run_mcp_fs(mcp_fleet, tmp_path, f"{fresh_id}/denied", "sandbox")
    assert (record["status"], record["exit_code"]) == ("error", 1), record
    assert record["stdout"] == "set mcp.enabled failed: -13\n"
    assert record["responses"] == []  # it never sent a chat


def test_with_permission_the_allowed_tools_are_called_and_the_denied_not_offered(
    mcp_fleet: McpFleet, tmp_path: Path, fresh_id: str
) -> None:
    before = mcp_fleet.ran()
    run_id = f"{fresh_id}/allowed"
    record = run_mcp_fs(mcp_fleet, tmp_path, run_id, "dev")
    assert (record["status"], record["exit_code"]) == ("ok", 0), record
    body = json.loads(record["stdout"].split("response_json=", 1)[1])
    assert body == record["responses"][0]
    said = body["choices"][0]["message"]["content"]
    # the program reads raw tool outputs (SPEAR's): the whole CallToolResult of the fixture's
    # sum; `secret` was not offered
    whole = (
        '{"content":[{"type":"text","text":"42"}],"structuredContent":{"result":42},'
        '"isError":false}'
    )
    assert said == (
        f'Tool said: {whole} | {{"error":{{"code":"TOOL_NOT_FOUND",'
        f'"message":"unknown tool: {SECRET}"}}}}'
    )
    offered = chat_spec(mcp_fleet, run_id)
    assert [t["function"]["name"] for t in offered["tools"]] == [ADD, ECHO]  # add, e*
    assert [t["mcp"] for t in offered["tools"]] == [  # a program's: the whole result
        {"server": "fs", "tool": "add", "whole_result": True},
        {"server": "fs", "tool": "echo", "whole_result": True},
    ]
    assert not any(key.startswith("mcp.") for key in offered["params"])  # never upstream
    assert mcp_fleet.ran()[len(before) :] == ["add"]  # run once, on the server; secret never


def test_a_spec_session_offers_its_servers_tools_through_the_configurations_globs(
    mcp_fleet: McpFleet, tmp_path: Path, fresh_id: str
) -> None:
    before = mcp_fleet.ran()
    markers = f'[[call:{SAFE_ADD} {{"a":1,"b":2}}]] [[call:{SAFE_SECRET} {{"name":"x"}}]]'
    spec_id = f"{fresh_id}/spec"
    spec: dict[str, Any] = {
        "id": spec_id,
        "model": "replay/call",
        "messages": [{"role": "user", "content": f"Please run {markers}"}],
        "mcp_servers": ["fs_safe"],
        "permissions": {"environment": "dev"},
    }
    record = run_specs(mcp_fleet.running.client, [spec], tmp_path, timeout_s=120)[spec_id]
    assert record["status"] == "ok", record
    added, secret = [json.loads(m["content"]) for m in record["transcript"] if m["role"] == "tool"]
    assert (added["ok"], added["data"], added["error"]) == (True, {"result": 3}, None)
    assert secret["error"]["code"] == "TOOL_NOT_FOUND"  # fs_safe denies it: not offered
    assert mcp_fleet.ran()[len(before) :] == ["add"]
    # submit refuses a server the spec's environment does not allow, before anything runs
    with pytest.raises(SpecFileError, match="environment 'sandbox' does not allow MCP server"):
        mcp_fleet.running.client.submit(
            [{**spec, "id": f"{fresh_id}/refused", "permissions": {"environment": "sandbox"}}]
        )
