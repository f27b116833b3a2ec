"""A program's `mcp.*` params (SPEAR's) at the WAT level: SET_PARAM answers -EACCES
when the run's environment allows no MCP server (or not the one named), -EINVAL for a value of
the wrong shape; with permission, a chat offers the allowed servers' tools filtered by its
allowlist, the model's calls of them run on their server, and no `mcp.` param goes upstream.
Programs run in this process on the twins (tests/twin_pipeline.py), MCP servers are MemoryMcp."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from wasmtime import wat2wasm

from schemas import keys
from schemas.fleet import McpServerConfig, ToolDefaults
from schemas.mcp import tool_name
from schemas.spec_types import SessionSpec
from tests.test_hostcalls import SET_PARAM, _Source, with_arg, with_out, write_msg
from tests.test_mcp_steps import servers
from tests.twin_pipeline import Pipeline, pipeline
from tests.wat_program import Dump, Program, Ref
from worker.guest.host import ChatDefaults, ProgramHost
from worker.guest.mcp_params import McpAccess
from worker.guest.runner import ProgramRun, run_program
from worker.session.mcp_offer import ToolRouter
from worker.session.twins.mcp import MemoryMcp

EACCES, EINVAL = 13, 22
AUTO_TOOL_CALL = 2
FLEET = ToolDefaults(mcp_servers={"fs": McpServerConfig(id="fs", command=("x",))})
ADD, ECHO, SECRET = (tool_name("fs", t) for t in ("add", "echo", "secret"))


@dataclass
class McpPipe:
    pipe: Pipeline
    mcp: MemoryMcp
    blobs: dict[str, bytes]


@pytest.fixture
def twins(tmp_path: Path) -> Iterator[McpPipe]:
    blobs: dict[str, bytes] = {}
    pipe = pipeline(blobs, tmp_path)
    mcp = servers()
    wasm = pipe.runtime
    pipe.runner.tools = lambda: ToolRouter(lambda: wasm, mcp)
    pipe.runner.mcp = mcp
    try:
        yield McpPipe(pipe, mcp, blobs)
        assert pipe.crashed == [] and pipe.replay.unexpected == []
    finally:
        pipe.close()


def run(twins: McpPipe, p: Program, allowed: tuple[str, ...]) -> tuple[ProgramHost, bytes, str]:
    blob = bytes(wat2wasm(p.wat()))
    sha = hashlib.sha256(blob).hexdigest()
    twins.blobs[sha] = blob
    run_sk = keys.run_session_key(
        keys.DEFAULT_NAMESPACE, f"mcp/{sha[:8]}{allowed}", keys.new_generation()
    )
    defaults = ChatDefaults(
        run_id="mcp/run",
        run_sk=run_sk,
        module_sha256=sha,
        backend=None,
        model="replay/call",
        deadline=time.monotonic() + 30,
        mcp=McpAccess(allowed=allowed, client=twins.mcp, fleet=FLEET),
    )
    host = ProgramHost(defaults, twins.pipe.store, twins.pipe.queue)
    outcome = run_program(_Source(twins.pipe.runtime), ProgramRun(module_sha256=sha), host)
    assert (outcome.exit_code, outcome.error) == (0, None)
    return host, outcome.stdout, run_sk


SETS = (
    '{"key":"mcp.enabled","value":true}',
    '{"key":"mcp.server_ids","value":["fs"]}',
    '{"key":"mcp.tool_allowlist","value":["add","e*"]}',
    '{"key":"mcp.enabled","value":false}',
    '{"key":"mcp.enabled","value":"yes"}',
    '{"key":"mcp.server_ids","value":"fs"}',
    '{"key":"mcp.server_ids","value":["fs",7]}',
    '{"key":"mcp.server_ids","value":["web"]}',
    '{"key":"mcp.tool_denylist","value":[1]}',
    '{"key":"mcp.task_tool_allowlist","value":["*"]}',
    '{"key":"mcp.servers","value":["fs"]}',
    '{"key":"mcp.enabled","value":true}',  # last: the chat's setting
    '{"key":"temperature","value":0}',
)


def program() -> tuple[Program, list[int], int]:
    p = Program()
    s = p.call("cchat_create")
    sets = [with_arg(p, "cchat_ctl", Ref(s), SET_PARAM, raw) for raw in SETS]
    calls = f'[[call:{ADD} {{"a":40,"b":2}}]] [[call:{SECRET} {{"name":"x"}}]]'
    write_msg(p, Ref(s), "user", calls)
    r = p.call("cchat_send", Ref(s), AUTO_TOOL_CALL)
    recv = with_out(p, "cchat_recv", Ref(r), cap=8192)
    return p, sets, recv.call


def test_without_permission_mcp_enabled_is_eacces_and_no_tool_is_offered(
    twins: McpPipe,
) -> None:
    p, sets, _ = program()
    host, stdout, run_sk = run(twins, p, allowed=())
    # enabling and naming a server: denied; an allowlist and disabling: allowed; then the
    # shape errors, a server not allowed, the host's task keys, an unknown mcp key; the last
    # enable is denied too
    got = [Dump(stdout).result(c) for c in sets]
    assert got == [-EACCES, -EACCES, 0, 0, -EINVAL, -EINVAL, -EINVAL, -EACCES, -EINVAL,
                   -EACCES, -EINVAL, -EACCES, 0]  # fmt: skip
    assert twins.mcp.listings == [] and twins.mcp.calls == []
    body = host.response_bodies()[0]
    said = body["choices"][0]["message"]["content"]
    assert said.count('"code":"TOOL_NOT_FOUND"') == 2  # nothing was offered
    chat = twins.pipe.store.load_spec(keys.chat_session_key(run_sk, 0))
    assert isinstance(chat, SessionSpec) and chat.tools == ()
    assert chat.params == {"temperature": 0}  # no mcp. param goes upstream


def test_with_permission_the_allowed_tools_are_offered_and_called(twins: McpPipe) -> None:
    p, sets, recv = program()
    host, stdout, run_sk = run(twins, p, allowed=("fs",))
    dump = Dump(stdout)
    assert [dump.result(c) for c in sets] == [0, 0, 0, 0, -EINVAL, -EINVAL, -EINVAL, -EACCES,
                                              -EINVAL, -EACCES, -EINVAL, 0, 0]  # fmt: skip
    chat = twins.pipe.store.load_spec(keys.chat_session_key(run_sk, 0))
    assert isinstance(chat, SessionSpec)
    assert [t.name for t in chat.tools] == [ADD, ECHO]  # the allowlist leaves out `secret`
    assert chat.params == {"temperature": 0}
    assert twins.mcp.listings == ["fs"]
    [budget] = twins.mcp.budgets  # the listing is bounded by what is left of the run
    assert budget is not None and 0 < budget <= 30_000
    assert twins.mcp.calls == [("fs", "add", {"a": 40, "b": 2})]
    body = host.response_bodies()[0]
    said = body["choices"][0]["message"]["content"]
    # raw outputs, as SPEAR programs read them: the whole CallToolResult of the sum, and
    # `secret` unknown (never offered)
    whole = '{"content":[{"type":"text","text":"{\\"result\\": 42}"}],"isError":false}'
    assert said.startswith(f'Tool said: {whole} | {{"error":{{"code":"TOOL_NOT_FOUND"')
    assert [t.mcp and t.mcp.whole_result for t in chat.tools] == [True, True]
    assert dump.result(recv) > 0


def test_a_server_that_cannot_list_is_skipped_with_a_warn_line(twins: McpPipe) -> None:
    twins.mcp.down.add("fs")
    p = Program()
    s = p.call("cchat_create")
    for raw in (*SETS[:2], '{"key":"model","value":"replay/plain"}'):
        with_arg(p, "cchat_ctl", Ref(s), SET_PARAM, raw)
    write_msg(p, Ref(s), "user", "hello")
    p.call("cchat_send", Ref(s), AUTO_TOOL_CALL)
    host, _, run_sk = run(twins, p, allowed=("fs",))
    assert twins.mcp.listings == ["fs"]
    # as SPEAR: the chat goes on without that server's tools, and the program's log says so
    [body] = host.response_bodies()
    assert "error" not in body and body["choices"][0]["message"]["content"]
    chat = twins.pipe.store.load_spec(keys.chat_session_key(run_sk, 0))
    assert isinstance(chat, SessionSpec) and chat.tools == ()
    assert host.logs == [
        {
            "level": "warn",
            "message": "MCP server fs could not list its tools: ConnectionError: "
            "its tools are not offered",
        }
    ]
