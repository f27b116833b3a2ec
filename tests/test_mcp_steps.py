"""MCP tools in spec sessions, through the twins (worker/session/twins/, its mcp.py): the
first round lists the servers' tools and stores them with the session, the model is offered
the allowed ones under SPEAR's names, and a call of one is a tool call like any other (its
envelope, retries and trace events), routed to its server. No Redis, no server process."""

from __future__ import annotations

import json
from typing import Any

from schemas.fleet import Environment, McpServerConfig, ToolDefaults
from schemas.mcp import McpToolInfo, offered_tools, tool_name
from schemas.spec_types import McpToolRef, SessionSpec, spec_from_json
from tests.test_steps import SK, reply
from worker.config import BackendConfig, FleetConfig, Settings
from worker.errors import ToolRuntimeError
from worker.session.mcp_offer import ToolRouter
from worker.session.ports import ToolCall
from worker.session.steps import StepRunner
from worker.session.twins.mcp import MemoryMcp
from worker.session.twins.models import OpenRateControl, OpenRateLimiter, ScriptedProvider
from worker.session.twins.queue import StepQueue
from worker.session.twins.store import MemoryStore
from worker.session.twins.tools import PythonTools

ADD = tool_name("fs", "add")
SECRET = tool_name("fs", "secret")
INTEGERS = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
}
FLEET = ToolDefaults(
    environments={"dev": Environment(mcp_servers=("fs",)), "prod": Environment()},
    default_environment="dev",
    mcp_servers={"fs": McpServerConfig(id="fs", command=("x",), deny_tools=("secret",))},
)


def servers(fail_add: int = 0) -> MemoryMcp:
    mcp = MemoryMcp()
    failures = [fail_add]

    def add(args: dict[str, Any]) -> str:
        if failures[0] > 0:
            failures[0] -= 1
            raise ToolRuntimeError("Error executing tool add: busy", ran=True)
        return json.dumps({"result": args["a"] + args["b"]})

    mcp.add("fs", McpToolInfo("add", "Add two integers.", INTEGERS, read_only=True), add)
    mcp.add("fs", McpToolInfo("echo", "Say it back.", {"type": "object"}), lambda a: "echo")
    mcp.add("fs", McpToolInfo("secret", "Never offered.", {"type": "object"}), lambda a: "s3cr3t")
    return mcp


class Run:
    def __init__(self, script: list[Any], mcp: MemoryMcp, fleet: ToolDefaults = FLEET) -> None:
        self.store, self.queue, self.mcp = MemoryStore(), StepQueue(), mcp
        self.provider = ScriptedProvider(list(script))
        self.wasm = PythonTools({"get_weather": lambda args: "sunny"})
        router = ToolRouter(lambda: self.wasm, mcp)
        self.runner = StepRunner(
            store=self.store,
            dispatch=self.queue,
            provider_for=self.provider,
            tools=lambda: router,
            settings=Settings(
                fleet=FleetConfig(
                    backends={"replay": BackendConfig(name="replay")}, tool_defaults=fleet
                )
            ),
            rate_limiter=OpenRateLimiter(),
            rate_control=OpenRateControl(),
            mcp=mcp,
        )

    def session(self, **extra: Any) -> dict[str, Any]:
        spec = {
            "id": "mcp/1",
            "provider": "replay",
            "model": "m",
            "messages": [{"role": "user", "content": "Add 40 and 2"}],
            "mcp_servers": ["fs"],
            **extra,
        }
        self.store.submit(SK, spec_from_json(spec), batch="b")
        self.queue.round(SK, 0)
        self.queue.drain(self.runner)
        record = self.store.record(SK)
        assert record is not None
        return record


def calling(*calls: tuple[str, dict[str, Any]]) -> Any:
    def model(request: Any) -> dict[str, Any]:
        if request.messages[-1]["role"] == "tool":
            said = [m["content"] for m in request.messages if m["role"] == "tool"]
            return reply("Tool said: " + " | ".join(said))
        made = [(f"call_{i}", name, json.dumps(args)) for i, (name, args) in enumerate(calls)]
        return reply(None, *made)

    return model


def test_the_first_round_offers_the_allowed_tools_and_a_call_runs_on_its_server() -> None:
    run = Run([calling((ADD, {"a": 40, "b": 2}), (SECRET, {}))] * 2, servers())
    record = run.session()
    offered = [t["function"]["name"] for t in run.provider.requests[0].tools]
    assert offered == [ADD, tool_name("fs", "echo")]  # the server denies `secret`
    add = run.provider.requests[0].tools[0]["function"]
    assert add["description"] == "Add two integers." and add["parameters"] == INTEGERS
    added, secret = [json.loads(m["content"]) for m in record["transcript"] if m["role"] == "tool"]
    assert (added["ok"], added["data"]) == (True, {"result": 42})
    assert secret["error"]["code"] == "TOOL_NOT_FOUND"  # not offered: not called either
    assert run.mcp.calls == [("fs", "add", {"a": 40, "b": 2})]
    assert run.mcp.listings == ["fs"]  # once: every later step read the stored tools
    assert run.mcp.budgets == [None]  # the server's own timeout bounds it
    assert run.wasm.calls == []
    # the second round offered the same tools, read back with the session
    assert run.provider.requests[1].tools == run.provider.requests[0].tools
    spec = run.store.load_spec(SK)
    assert isinstance(spec, SessionSpec) and spec.mcp_servers == ()
    offered_add = spec.tool(ADD)
    assert offered_add is not None and offered_add.mcp == McpToolRef("fs", "add")
    events = [(e.event, e.tool) for e in run.store.traces[SK]]
    assert ("tool.call.started", ADD) in events and ("tool.call.finished", ADD) in events


def test_an_mcp_call_runs_under_its_policy_as_a_wasm_call_does() -> None:
    run = Run([calling((ADD, {"a": 1, "b": 2}))] * 2, servers(fail_add=1))
    record = run.session(limits={"max_tool_retries": 1})
    [added] = [json.loads(m["content"]) for m in record["transcript"] if m["role"] == "tool"]
    assert added["ok"] and added["metrics"]["retries"] == 1  # read-only: retried
    events = [e.event for e in run.store.traces[SK]]
    assert "tool.call.retried" in events
    invalid = Run([calling((ADD, {"a": "one"}))] * 2, servers())
    record = invalid.session()
    [refused] = [json.loads(m["content"]) for m in record["transcript"] if m["role"] == "tool"]
    assert refused["error"]["code"] == "VALIDATION_ERROR"  # checked against its schema
    assert invalid.mcp.calls == []


def test_a_server_that_cannot_list_its_tools_ends_the_session_with_mcp_error() -> None:
    mcp = servers()
    mcp.down.add("fs")
    run = Run([calling((ADD, {"a": 1, "b": 2}))], mcp)
    record = run.session()
    assert record["body"] == {
        "error": {
            "code": "mcp_error",
            "message": "MCP server fs could not list its tools: ConnectionError",
        }
    }
    assert run.provider.requests == []  # the model was never called


def test_a_server_the_sessions_environment_does_not_list_is_refused_by_the_worker_too() -> None:
    run = Run([calling((ADD, {"a": 1, "b": 2}))], servers())
    record = run.session(permissions={"environment": "prod"})
    assert record["body"]["error"] == {
        "code": "mcp_error",
        "message": "MCP server 'fs' is not allowed in environment 'prod'",
    }
    assert run.mcp.listings == []


def test_the_first_listing_stored_is_the_one_every_step_sees() -> None:
    store = MemoryStore()
    spec = spec_from_json({"id": "x", "model": "m", "messages": [], "mcp_servers": ["fs"]})
    store.submit(SK, spec)
    assert store.load_spec(SK) == spec  # not listed yet
    first = servers()
    server = FLEET.mcp_servers["fs"]
    store.store_mcp_tools(SK, offered_tools(server, first.list_tools("fs")[:1]))
    store.store_mcp_tools(SK, offered_tools(server, first.list_tools("fs")))  # a redelivery's
    loaded = store.load_spec(SK)
    assert isinstance(loaded, SessionSpec) and [t.name for t in loaded.tools] == [ADD]


def test_the_router_sends_only_mcp_calls_to_the_servers() -> None:
    wasm = PythonTools({"get_weather": lambda args: "sunny"})
    mcp = servers()
    router = ToolRouter(lambda: wasm, mcp)
    call = ToolCall("0" * 64, "get_weather", None, None, b"{}", 1000, 1 << 20, 1000)
    assert router.run(call) == "sunny"
    ref = McpToolRef("fs", "add")
    mcp_call = ToolCall("", None, None, None, b'{"a":1,"b":1}', 1000, 0, 1000, mcp=ref)
    assert router.run(mcp_call) == '{"result": 2}'
    no_mcp = ToolRouter(lambda: wasm, None)
    try:
        no_mcp.run(mcp_call)
    except ToolRuntimeError as exc:
        assert exc.ran is False
    else:
        raise AssertionError("an MCP call ran with no MCP client")
