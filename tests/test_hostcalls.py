"""Every `spear` hostcall and every error path, at the WAT level (docs/guest-abi.md sections 1-3, 5
and 6). Programs run in this process (real wasmtime, `run_program` with a real ProgramHost);
their chats run on the in-memory twins (tests/twin_pipeline.py: a MemoryStore, a StepQueue
pumped by the program's own blocking waits, the real StepRunner, the replay scenarios in
process and the real WasmToolRuntime for the programs' tools). No Redis, no workers. Each
program is a straight list of calls built by tests/wat_program.py; it dumps every return value
and the memory the host wrote into to stdout, and the tests check them exactly."""

from __future__ import annotations

import hashlib
import json
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from wasmtime import Engine, Module, wat2wasm

from schemas import keys
from schemas.spec_types import ToolPolicy
from tests.twin_pipeline import Pipeline, pipeline
from tests.wat_program import FILL, OOB, PAGE, Arg, Dump, Program, Ref
from worker.edges.wasm_runtime import WasmToolRuntime
from worker.guest.host import ChatDefaults, ProgramHost
from worker.guest.runner import ProgramOutcome, ProgramRun, run_program
from worker.session.twins.queue import StepQueue
from worker.session.twins.store import MemoryStore

# errno (Linux numbers) and ABI constants, spelled out here rather than imported from the host
EPERM, ENOENT, EIO, EBADF, EAGAIN, EFAULT, EEXIST = 1, 2, 5, 9, 11, 14, 17
EINVAL, ENOSPC, ENOSYS = 22, 28, 38
SET_PARAM, GET_METRICS = 1, 2
SET_FLAGS, GET_FLAGS, GET_KIND, GET_STATUS, FD_GET_METRICS = 1, 2, 3, 4, 5
METRICS, AUTO_TOOL_CALL = 1, 2
ADD, MOD, DEL = 1, 2, 3
EPOLLIN, EPOLLOUT, EPOLLERR, EPOLLHUP = 0x1, 0x4, 0x8, 0x10
NONBLOCK = '{"set":["O_NONBLOCK"],"clear":[]}'
UNKNOWN_FD = 4242
REPLAY_CREATED = 1700000000


def jb(obj: Any) -> bytes:
    """Compact JSON with sorted keys: what the host must produce (section 5)."""
    return json.dumps(obj, separators=(",", ":"), sort_keys=True, ensure_ascii=False).encode()


def usage(prompt: int, completion: int) -> dict[str, int]:
    total = prompt + completion
    return {"completion_tokens": completion, "prompt_tokens": prompt, "total_tokens": total}


def echo_body(first_user: str, text: str | None = None, model: str = "replay/plain") -> bytes:
    """The exact body of a one-message `replay/plain` chat (fixtures/replay/scenarios.py):
    `text` is the first user message without its [[markers]]."""
    content = f"Echo: {first_user if text is None else text}"
    digest = hashlib.sha256(f"{first_user}0".encode()).hexdigest()[:12]
    return jb(
        {
            "_spear": {"backend": "replay", "model": model},
            "choices": [
                {
                    "finish_reason": "stop",
                    "index": 0,
                    "message": {"content": content, "role": "assistant"},
                }
            ],
            "created": REPLAY_CREATED,
            "id": f"chatcmpl-replay-{digest}",
            "model": model,
            "object": "chat.completion",
            "usage": usage(10, len(content) // 4 + 1),
        }
    )


# the harness ---------------------------------------------------------------------------------


class _Source:
    """A ModuleSource over a WasmToolRuntime that loads the tests' modules."""

    def __init__(self, runtime: WasmToolRuntime) -> None:
        self.runtime = runtime

    def compiled(self, sha256: str) -> tuple[Engine, Module]:
        return self.runtime.compiled(sha256)

    def deadline_ticks(self, budget_ms: float) -> int:
        return self.runtime.deadline_ticks(budget_ms)


@dataclass
class Shared:
    store: MemoryStore
    programs: MemoryStore  # the same store, as the guest's ProgramStore port
    dispatcher: StepQueue
    source: _Source
    blobs: dict[str, bytes]
    pipe: Pipeline


@pytest.fixture(scope="module")
def module_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("module-cache")


@pytest.fixture
def shared(module_cache: Path) -> Iterator[Shared]:
    """A fresh pipeline per test; the compiled modules are cached across the file."""
    blobs: dict[str, bytes] = {}
    pipe = pipeline(blobs, module_cache)
    try:
        yield Shared(pipe.store, pipe.store, pipe.queue, _Source(pipe.runtime), blobs, pipe)
        # a step that raised (not a retry) would have reached the program as -EIO
        assert pipe.crashed == []
        assert (pipe.replay.unexpected, pipe.replay.rejected) == ([], [])
    finally:
        pipe.close()


@dataclass
class Ran:
    outcome: ProgramOutcome
    host: ProgramHost
    elapsed_s: float
    run_sk: str

    @property
    def dump(self) -> Dump:
        return Dump(self.outcome.stdout)

    def r(self, index: int) -> int:
        return self.dump.result(index)

    def out(self, out_ptr: int, len_ptr: int) -> bytes:
        """The bytes at out_ptr, as many as the length cell now says."""
        return self.dump.mem(out_ptr, self.dump.u32(len_ptr))

    def untouched(self, out_ptr: int, size: int) -> bool:
        return self.dump.mem(out_ptr, size) == bytes([FILL]) * size


class Harness:
    def __init__(self, shared: Shared, fresh_id: str) -> None:
        self.shared = shared
        self.fresh_id = fresh_id
        self.runs = 0

    def run(
        self,
        prog: Program | str,
        *,
        model: str | None = "replay/plain",
        deadline_s: float = 30.0,
        check: bool = True,
        before: Callable[[str], None] | None = None,
    ) -> Ran:
        """Run `prog` to its end. `before(run_sk)` is called just before it starts."""
        wat = prog if isinstance(prog, str) else prog.wat()
        blob = bytes(wat2wasm(wat))
        sha = hashlib.sha256(blob).hexdigest()
        # the program and the forks its chats' tools run in load it from here
        self.shared.blobs[sha] = blob
        self.runs += 1
        run_id = f"{self.fresh_id}/hostcalls{self.runs}"
        run_sk = keys.run_session_key(keys.DEFAULT_NAMESPACE, run_id, keys.new_generation())
        defaults = ChatDefaults(
            run_id=run_id,
            run_sk=run_sk,
            module_sha256=sha,
            backend=None,
            model=model,
            deadline=time.monotonic() + deadline_s,
        )
        host = ProgramHost(defaults, self.shared.programs, self.shared.dispatcher)
        if before is not None:
            before(run_sk)
        started = time.monotonic()
        outcome = run_program(
            self.shared.source,
            ProgramRun(module_sha256=sha, timeout_ms=int(deadline_s * 1000) + 5000),
            host,
        )
        ran = Ran(outcome, host, time.monotonic() - started, run_sk)
        if check:
            assert (outcome.exit_code, outcome.error_code, outcome.error) == (0, None, None)
            assert isinstance(prog, Program)
            assert len(outcome.stdout) == prog.dump_len()
        return ran


@pytest.fixture
def h(shared: Shared, fresh_id: str) -> Harness:
    return Harness(shared, fresh_id)


# program-building shorthands -----------------------------------------------------------------


def write_msg(p: Program, fd: Arg, role: str | bytes, content: str | bytes) -> int:
    r, c = p.data(role), p.data(content)
    return p.call("cchat_write_msg", fd, r.ptr, r.len, c.ptr, c.len)


def with_arg(p: Program, name: str, fd: Arg, cmd: int, content: str | bytes) -> int:
    """`name(fd, cmd, arg_ptr, arg_len_ptr)` with the bytes and a cell holding their length."""
    ptr, len_ptr = p.arg(content)
    return p.call(name, fd, cmd, ptr, len_ptr)


@dataclass(frozen=True)
class Out:
    call: int
    ptr: int
    cell: int
    size: int


def with_out(
    p: Program,
    name: str,
    *lead: Arg,
    cap: int = 1024,
    size: int | None = None,
    tail: tuple[Arg, ...] = (),
) -> Out:
    """`name(*lead, out_ptr, out_len_ptr, *tail)` with a fresh FILL buffer and a cell of `cap`."""
    size = cap if size is None else size
    ptr, cell = p.out(cap, size)
    return Out(p.call(name, *lead, ptr, cell, *tail), ptr, cell, size)


def chat(p: Program, text: str, flags: int = 0) -> tuple[int, int]:
    """A session with one user message, sent (blocking): (session call, response call)."""
    s = p.call("cchat_create")
    write_msg(p, Ref(s), "user", text)
    return s, p.call("cchat_send", Ref(s), flags)


def records(data: bytes) -> list[tuple[int, int]]:
    return [struct.unpack_from("<ii", data, n) for n in range(0, len(data), 8)]


# fds -------------------------------------------------------------------------------------------


def test_fd_numbers_start_at_1000_are_shared_and_never_reused(h: Harness) -> None:
    p = Program()
    calls = [
        p.call("cchat_create"),
        p.call("cchat_create"),
        p.call("spear_epoll_create"),
    ]
    calls.append(p.call("cchat_close", 1000))
    calls.append(p.call("cchat_create"))
    calls.append(p.call("spear_epoll_close", 1002))
    calls.append(p.call("spear_epoll_create"))
    calls.append(p.call("cchat_close", 1000))
    calls.append(p.call("cchat_create"))
    ran = h.run(p)
    assert [ran.r(c) for c in calls] == [1000, 1001, 1002, 0, 1003, 0, 1004, 0, 1005]
    assert sorted(ran.host.fds) == [1000, 1001, 1002, 1003, 1004, 1005]
    # the store's mirror of the fd table (cq:fds:<run> on Redis) holds every fd, closed ones
    # included
    mirror = h.shared.store.fd_mirror[ran.run_sk]
    assert sorted(int(k) for k in mirror) == [1000, 1001, 1002, 1003, 1004, 1005]
    assert mirror[1000] == jb(
        {"closed": True, "flags": [], "kind": "ChatSession", "messages": 0, "tools": []}
    )
    assert mirror[1002] == jb({"closed": True, "flags": [], "kind": "Epoll", "watch": []})


# cchat_write_msg -------------------------------------------------------------------------------


def test_write_msg_ok_and_every_error(h: Harness) -> None:
    p = Program()
    s = p.call("cchat_create")
    role, hi = p.data("user"), p.data("hi")
    ok = p.call("cchat_write_msg", Ref(s), role.ptr, role.len, hi.ptr, hi.len)
    bad_fd = p.call("cchat_write_msg", 999, role.ptr, role.len, hi.ptr, hi.len)
    role_oob = p.call("cchat_write_msg", Ref(s), OOB, 4, hi.ptr, hi.len)
    content_huge = p.call("cchat_write_msg", Ref(s), role.ptr, role.len, hi.ptr, 0x7FFF_FFFF)
    content_oob = p.call("cchat_write_msg", Ref(s), role.ptr, role.len, OOB, 2)
    bad_utf8 = write_msg(p, Ref(s), "user", b"caf\xc3(")
    bad_utf8_role = write_msg(p, Ref(s), b"us\xffer", "hi")
    unknown_role = write_msg(p, Ref(s), "robot", "hi")
    empty_role = write_msg(p, Ref(s), "", "hi")
    r = p.call("cchat_send", Ref(s), 0)
    on_response = write_msg(p, Ref(r), "user", "hi")
    epoll = p.call("spear_epoll_create")
    on_epoll = write_msg(p, Ref(epoll), "user", "hi")
    close = p.call("cchat_close", Ref(s))
    after_close = write_msg(p, Ref(s), "user", "hi")
    s2 = p.call("cchat_create")
    others = [write_msg(p, Ref(s2), role, f"a {role}") for role in ("system", "assistant", "tool")]
    empty_content = write_msg(p, Ref(s2), "user", "")
    ran = h.run(p)
    assert ran.r(ok) == 0
    assert ran.r(bad_fd) == -EBADF
    assert ran.r(role_oob) == -EFAULT
    assert ran.r(content_huge) == -EFAULT
    assert ran.r(content_oob) == -EFAULT
    assert ran.r(bad_utf8) == -EINVAL
    assert ran.r(bad_utf8_role) == -EINVAL
    assert ran.r(unknown_role) == -EINVAL
    assert ran.r(empty_role) == -EINVAL
    assert ran.r(r) == 1001
    assert ran.r(on_response) == -EBADF
    assert ran.r(on_epoll) == -EBADF
    assert ran.r(close) == 0
    assert ran.r(after_close) == -EBADF
    assert [ran.r(c) for c in others] == [0, 0, 0]
    assert ran.r(empty_content) == 0
    # only the good message was kept, and a plain send does not append the reply (section 4.6)
    assert ran.host.fds[1000].messages == [{"role": "user", "content": "hi"}]
    assert ran.host.fds[ran.r(s2)].messages == [
        {"role": "system", "content": "a system"},
        {"role": "assistant", "content": "a assistant"},
        {"role": "tool", "content": "a tool"},
        {"role": "user", "content": ""},
    ]


# cchat_write_fn --------------------------------------------------------------------------------

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def test_write_fn_ok_and_every_error(h: Harness) -> None:
    p = Program()
    tool = p.tool("first")
    other = p.other_function()
    beyond = p.table_size
    s = p.call("cchat_create")

    def fn(fd: Arg, offset: int, obj: Any) -> int:
        raw = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
        span = p.data(raw)
        return p.call("cchat_write_fn", fd, offset, span.ptr, span.len)

    ok = fn(Ref(s), tool, WEATHER_TOOL)
    legacy = fn(Ref(s), tool, {"name": "legacy", "parameters": {"type": "object"}})
    bad_json = fn(Ref(s), tool, b'{"name": "x",')
    bad_utf8 = fn(Ref(s), tool, b'{"name": "\xff"}')
    not_object = fn(Ref(s), tool, [WEATHER_TOOL])
    no_name = fn(Ref(s), tool, {"type": "function", "function": {"description": "x"}})
    legacy_no_name = fn(Ref(s), tool, {"parameters": {"type": "object"}})
    empty_name = fn(Ref(s), tool, {"name": ""})
    name_not_str = fn(Ref(s), tool, {"name": 7})
    null_slot = fn(Ref(s), 0, {"name": "a"})
    trailing_null_slot = fn(Ref(s), beyond - 1, {"name": "a"})
    beyond_table = fn(Ref(s), beyond, {"name": "a"})
    far_beyond = fn(Ref(s), 1_000_000, {"name": "a"})
    negative = fn(Ref(s), -1, {"name": "a"})
    other_sig = fn(Ref(s), other, {"name": "a"})
    json_oob = p.call("cchat_write_fn", Ref(s), tool, OOB, 10)
    bad_fd = fn(999, tool, {"name": "a"})
    duplicate = fn(Ref(s), tool, {"name": "get_weather", "description": "second"})
    ran = h.run(p)
    assert (ran.r(ok), ran.r(legacy)) == (0, 0)
    invalid = [
        bad_json, bad_utf8, not_object, no_name, legacy_no_name, empty_name, name_not_str,
        null_slot, trailing_null_slot, beyond_table, far_beyond, negative, other_sig,
    ]  # fmt: skip
    assert [ran.r(c) for c in invalid] == [-EINVAL] * len(invalid)
    assert ran.r(json_oob) == -EFAULT
    assert ran.r(bad_fd) == -EBADF
    assert ran.r(duplicate) == 0
    assert [(t.fn_offset, t.function) for t in ran.host.fds[1000].tools] == [
        (tool, WEATHER_TOOL["function"]),
        (tool, {"name": "legacy", "parameters": {"type": "object"}}),
    ]


def test_write_fn_takes_a_tool_policy_beside_the_function(h: Harness) -> None:
    """Issue 9: a program's tool carries the same policy object as a spec's tools[] entry;
    a bad one is -EINVAL and registers nothing."""
    p = Program()
    tool = p.tool("first")
    s = p.call("cchat_create")

    def fn(obj: Any) -> int:
        span = p.data(json.dumps(obj).encode())
        return p.call("cchat_write_fn", Ref(s), tool, span.ptr, span.len)

    policy = {"timeout_ms": 500, "max_retries": 2, "idempotent": False, "fallback": "other"}
    good = fn({**WEATHER_TOOL, "policy": policy})
    bad = fn({"type": "function", "function": {"name": "b"}, "policy": {"max_retries": -1}})
    unknown = fn({"type": "function", "function": {"name": "c"}, "policy": {"colour": "red"}})
    ran = h.run(p)
    assert [ran.r(c) for c in (good, bad, unknown)] == [0, -EINVAL, -EINVAL]
    [registered] = ran.host.fds[1000].tools
    assert registered.policy == ToolPolicy(
        timeout_ms=500, max_retries=2, idempotent=False, fallback="other"
    )


def test_write_fn_rejects_a_schema_the_engine_could_not_check(h: Harness) -> None:
    """The same check as at submit: a dangling $ref or an invalid schema is -EINVAL, and
    nothing is registered (a chat calling it would otherwise fail at call time)."""
    p = Program()
    tool = p.tool("first")
    s = p.call("cchat_create")

    def fn(parameters: dict[str, Any]) -> int:
        span = p.data(json.dumps({"name": "f", "parameters": parameters}).encode())
        return p.call("cchat_write_fn", Ref(s), tool, span.ptr, span.len)

    dangling = fn({"type": "object", "properties": {"city": {"$ref": "#/$defs/city"}}})
    remote = fn({"$ref": "https://example.invalid/schema.json"})
    invalid = fn({"type": "objectx"})
    resolvable = fn({"properties": {"c": {"$ref": "#/$defs/c"}}, "$defs": {"c": {}}})
    ran = h.run(p)
    assert [ran.r(c) for c in (dangling, remote, invalid)] == [-EINVAL] * 3
    assert ran.r(resolvable) == 0
    assert [t.function["name"] for t in ran.host.fds[1000].tools] == ["f"]


def test_write_fn_on_response_epoll_and_closed_fds_is_ebadf(h: Harness) -> None:
    p = Program()
    tool = p.tool("x")
    s, r = chat(p, "write_fn fds")
    e = p.call("spear_epoll_create")
    span = p.data('{"name":"a"}')
    on_response = p.call("cchat_write_fn", Ref(r), tool, span.ptr, span.len)
    on_epoll = p.call("cchat_write_fn", Ref(e), tool, span.ptr, span.len)
    p.call("cchat_close", Ref(s))
    on_closed = p.call("cchat_write_fn", Ref(s), tool, span.ptr, span.len)
    ran = h.run(p)
    assert [ran.r(c) for c in (on_response, on_epoll, on_closed)] == [-EBADF] * 3


def test_write_fn_duplicate_name_first_registration_runs(h: Harness) -> None:
    p = Program()
    first, second = p.tool("first"), p.tool("second")
    s = p.call("cchat_create")
    dup = p.data('{"name":"dup","parameters":{"type":"object","properties":{}}}')
    a = p.call("cchat_write_fn", Ref(s), first, dup.ptr, dup.len)
    b = p.call("cchat_write_fn", Ref(s), second, dup.ptr, dup.len)
    m = write_msg(p, Ref(s), "user", "[[call:dup {}]]")
    r = p.call("cchat_send", Ref(s), AUTO_TOOL_CALL | METRICS)
    body = with_out(p, "cchat_recv", Ref(r), cap=4096)
    metrics = with_out(p, "cchat_ctl", Ref(r), GET_METRICS, cap=1024)
    ran = h.run(p, model="replay/call")
    assert [ran.r(c) for c in (a, b, m, r)] == [0, 0, 0, 1001]
    data = ran.out(body.ptr, body.cell)
    assert ran.r(body.call) == len(data)
    reply = json.loads(data)
    assert data == jb(reply)
    assert reply["choices"][0]["message"] == {"content": "Tool said: first", "role": "assistant"}
    assert reply["_spear"] == {"backend": "replay", "model": "replay/call"}
    # the auto tool-call loop appended its messages to the session
    assert ran.host.fds[1000].messages == [
        {"role": "user", "content": "[[call:dup {}]]"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_0_0",
                    "type": "function",
                    "function": {"name": "dup", "arguments": "{}"},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_0_0", "content": "first"},
        {"role": "assistant", "content": "Tool said: first"},
    ]
    got = json.loads(ran.out(metrics.ptr, metrics.cell))
    assert ran.r(metrics.call) == len(ran.out(metrics.ptr, metrics.cell))
    assert ran.out(metrics.ptr, metrics.cell) == jb(
        {
            "iterations": 2,
            "latency_ms": got["latency_ms"],
            "tool_calls": 1,
            "tool_failures": 0,
            "tool_output_bytes": 5,
            # round 0: 1 message in, a tool call out (5); round 1: 3 in, "Tool said: first" out
            "usage": usage(10 + 30, 5 + len("Tool said: first") // 4 + 1),
        }
    )


@pytest.mark.parametrize("export", ["__indirect_function_table", "table", "funcs", None])
def test_write_fn_finds_the_function_table(h: Harness, export: str | None) -> None:
    """`__indirect_function_table`, else `table`, else the first exported table (section 3)."""
    p = Program(table_export=export)
    tool = p.tool("x")
    s = p.call("cchat_create")
    span = p.data('{"name":"t"}')
    rc = p.call("cchat_write_fn", Ref(s), tool, span.ptr, span.len)
    ran = h.run(p)
    assert ran.r(rc) == (0 if export else -EINVAL)


def test_hostcalls_inside_a_tool_call(h: Harness) -> None:
    """A tool runs in a fork (section 4): cchat_*, spear_fd_ctl and spear_epoll_* return
    -EPERM there, log works with the same length and pointer checks."""
    p = Program()
    line = p.data("from the tool")
    buf, cell = p.out(64)
    probe = p.hostcall_tool(
        [
            ("cchat_create", ()),
            ("cchat_write_msg", (1000, line.ptr, 4, line.ptr, 4)),
            ("cchat_write_fn", (1000, 1, line.ptr, line.len)),
            ("cchat_ctl", (1000, SET_PARAM, line.ptr, cell)),
            ("cchat_send", (1000, 0)),
            ("cchat_recv", (1001, buf, cell)),
            ("cchat_close", (1000,)),
            ("spear_fd_ctl", (1000, GET_KIND, buf, cell)),
            ("spear_epoll_create", ()),
            ("spear_epoll_ctl", (1002, ADD, 1001, EPOLLIN)),
            ("spear_epoll_wait", (1002, buf, cell, 0)),
            ("spear_epoll_close", (1002,)),
            ("log", (2, line.ptr, line.len)),
            ("log", (2, line.ptr, 16_385)),
            ("log", (2, OOB, 4)),
        ]
    )
    s = p.call("cchat_create")
    fn = p.data('{"name":"probe","parameters":{"type":"object","properties":{}}}')
    reg = p.call("cchat_write_fn", Ref(s), probe, fn.ptr, fn.len)
    write_msg(p, Ref(s), "user", "[[call:probe {}]]")
    r = p.call("cchat_send", Ref(s), AUTO_TOOL_CALL)
    body = with_out(p, "cchat_recv", Ref(r), cap=4096)
    ran = h.run(p, model="replay/call")
    assert (ran.r(reg), ran.r(r)) == (0, 1001)
    reply = json.loads(ran.out(body.ptr, body.cell))
    answer = "".join(chr(64 + e) for e in [EPERM] * 12 + [0, EINVAL, EFAULT])  # "AAA..@VN"
    assert reply["choices"][0]["message"]["content"] == f"Tool said: {answer}"
    assert sorted(ran.host.fds) == [1000, 1001]  # the tool's calls touched no program fd
    assert ran.untouched(buf, 64)  # nor the program's memory
    assert ran.dump.u32(cell) == 64


def test_log_level_out_of_range_inside_a_tool_call(h: Harness) -> None:
    p = Program()
    line = p.data("bad level")
    probe = p.hostcall_tool([("log", (9, line.ptr, line.len)), ("log", (-1, line.ptr, line.len))])
    s = p.call("cchat_create")
    fn = p.data('{"name":"probe","parameters":{"type":"object","properties":{}}}')
    p.call("cchat_write_fn", Ref(s), probe, fn.ptr, fn.len)
    write_msg(p, Ref(s), "user", "[[call:probe {}]]")
    r = p.call("cchat_send", Ref(s), AUTO_TOOL_CALL)
    body = with_out(p, "cchat_recv", Ref(r), cap=4096)
    ran = h.run(p, model="replay/call")
    reply = json.loads(ran.out(body.ptr, body.cell))
    assert reply["choices"][0]["message"]["content"] == "Tool said: VV"


# cchat_ctl -----------------------------------------------------------------------------------


def test_ctl_set_param_and_every_error(h: Harness) -> None:
    p = Program()
    s = p.call("cchat_create")
    ok = with_arg(p, "cchat_ctl", Ref(s), SET_PARAM, '{"key":"temperature","value":0.5}')
    ok2 = with_arg(p, "cchat_ctl", Ref(s), SET_PARAM, '{"key":"max_iterations","value":3}')
    bad = [
        with_arg(p, "cchat_ctl", Ref(s), SET_PARAM, raw)
        for raw in (
            '{"key":"temperature",',
            b'{"key":"\xff","value":1}',
            '{"key":"","value":1}',
            '{"value":1}',
            '{"key":7,"value":1}',
            '[{"key":"a","value":1}]',
            "",
        )
    ]
    unknown_cmd = with_arg(p, "cchat_ctl", Ref(s), 99, '{"key":"a","value":1}')
    cmd_zero = with_arg(p, "cchat_ctl", Ref(s), 0, '{"key":"a","value":1}')
    metrics_on_session = with_out(p, "cchat_ctl", Ref(s), GET_METRICS, cap=64)
    fd5_set = with_arg(p, "cchat_ctl", 5, SET_PARAM, '{"key":"a","value":1}')
    fd5_get = with_out(p, "cchat_ctl", 5, GET_METRICS, cap=64)
    arg = p.data('{"key":"a","value":1}')
    len_oob = p.call("cchat_ctl", Ref(s), SET_PARAM, arg.ptr, OOB)
    arg_oob = p.call("cchat_ctl", Ref(s), SET_PARAM, OOB, p.cell(arg.len))
    arg_len_huge = p.call("cchat_ctl", Ref(s), SET_PARAM, arg.ptr, p.cell(0x7FFF_FFFF))
    e = p.call("spear_epoll_create")
    on_epoll = with_arg(p, "cchat_ctl", Ref(e), SET_PARAM, '{"key":"a","value":1}')
    p.call("cchat_close", Ref(s))
    after_close = with_arg(p, "cchat_ctl", Ref(s), SET_PARAM, '{"key":"a","value":1}')
    ran = h.run(p)
    assert [ran.r(c) for c in (ok, ok2)] == [0, 0]
    assert [ran.r(c) for c in bad] == [-EIO] * len(bad)
    assert (ran.r(unknown_cmd), ran.r(cmd_zero)) == (-EINVAL, -EINVAL)
    assert ran.r(metrics_on_session.call) == -EBADF
    assert ran.untouched(metrics_on_session.ptr, 64)
    assert ran.dump.u32(metrics_on_session.cell) == 64
    assert (ran.r(fd5_set), ran.r(fd5_get.call)) == (-EBADF, -EBADF)
    assert [ran.r(c) for c in (len_oob, arg_oob, arg_len_huge)] == [-EFAULT] * 3
    assert ran.r(on_epoll) == -EBADF
    assert ran.r(after_close) == -EBADF
    assert ran.host.fds[1000].params == {"temperature": 0.5, "max_iterations": 3}


def test_ctl_get_metrics_on_response_fds(h: Harness) -> None:
    text = "metrics please"
    p = Program()
    s, r1 = chat(p, text, METRICS)
    full = with_out(p, "cchat_ctl", Ref(r1), GET_METRICS, cap=512)
    small = with_out(p, "cchat_ctl", Ref(r1), GET_METRICS, cap=10, size=64)
    len_oob = p.call("cchat_ctl", Ref(r1), GET_METRICS, p.buffer(8), OOB)
    out_oob = p.call("cchat_ctl", Ref(r1), GET_METRICS, OOB, p.cell(512))
    via_fd_ctl = with_out(p, "spear_fd_ctl", Ref(r1), FD_GET_METRICS, cap=512)
    set_on_response = with_arg(p, "cchat_ctl", Ref(r1), SET_PARAM, '{"key":"a","value":1}')
    r2 = p.call("cchat_send", Ref(s), 0)
    plain = with_out(p, "cchat_ctl", Ref(r2), GET_METRICS, cap=64)
    plain_tight = with_out(p, "cchat_ctl", Ref(r2), GET_METRICS, cap=1, size=8)
    p.call("cchat_close", Ref(r1))
    after_close = with_out(p, "cchat_ctl", Ref(r1), GET_METRICS, cap=512)
    ran = h.run(p)
    assert (ran.r(r1), ran.r(r2)) == (1001, 1002)
    data = ran.out(full.ptr, full.cell)
    got = json.loads(data)
    assert isinstance(got["latency_ms"], int | float)
    assert data == jb(
        {
            "iterations": 1,
            "latency_ms": got["latency_ms"],
            "tool_calls": 0,
            "tool_failures": 0,
            "tool_output_bytes": 0,
            "usage": usage(10, len(f"Echo: {text}") // 4 + 1),
        }
    )
    assert ran.r(full.call) == len(data)
    assert ran.untouched(full.ptr + len(data), 512 - len(data))
    # too small: -ENOSPC, the needed length in the cell and nothing else written
    assert ran.r(small.call) == -ENOSPC
    assert ran.dump.u32(small.cell) == len(data)
    assert ran.untouched(small.ptr, 64)
    assert (ran.r(len_oob), ran.r(out_oob)) == (-EFAULT, -EFAULT)
    assert ran.r(via_fd_ctl.call) == len(data)
    assert ran.out(via_fd_ctl.ptr, via_fd_ctl.cell) == data
    assert ran.r(set_on_response) == -EBADF
    # a send without the METRICS flag: `{}`
    assert ran.r(plain.call) == 2
    assert ran.out(plain.ptr, plain.cell) == b"{}"
    assert ran.untouched(plain.ptr + 2, 62)
    assert ran.r(plain_tight.call) == -ENOSPC
    assert ran.dump.u32(plain_tight.cell) == 2
    assert ran.untouched(plain_tight.ptr, 8)
    assert ran.r(after_close.call) == len(data)
    assert ran.out(after_close.ptr, after_close.cell) == data


# cchat_send ----------------------------------------------------------------------------------


def test_send_returns_the_next_fd_and_rejects_bad_fds(h: Harness) -> None:
    p = Program()
    s, r = chat(p, "send one")
    bad_fd = p.call("cchat_send", 999, 0)
    on_response = p.call("cchat_send", Ref(r), 0)
    e = p.call("spear_epoll_create")
    on_epoll = p.call("cchat_send", Ref(e), 0)
    s2, r2 = chat(p, "send two")
    close = p.call("cchat_close", Ref(s2))
    after_close = p.call("cchat_send", Ref(s2), 0)
    next_fd = p.call("cchat_create")
    ran = h.run(p)
    assert [ran.r(c) for c in (s, r, e, s2, r2, close, next_fd)] == [
        1000, 1001, 1002, 1003, 1004, 0, 1005,
    ]  # fmt: skip
    assert [ran.r(c) for c in (bad_fd, on_response, on_epoll, after_close)] == [-EBADF] * 4
    assert ran.host.sends == 2
    assert ran.host.responses == [1001, 1004]


def test_send_without_a_model_gives_an_error_body(h: Harness) -> None:
    p = Program()
    _, r = chat(p, "no model here")
    body = with_out(p, "cchat_recv", Ref(r), cap=1024)
    metrics = with_out(p, "cchat_ctl", Ref(r), GET_METRICS, cap=64)
    status = with_out(p, "spear_fd_ctl", Ref(r), GET_STATUS, cap=256)
    # the `model` param supplies what ChatDefaults lacks
    s2 = p.call("cchat_create")
    param = with_arg(p, "cchat_ctl", Ref(s2), SET_PARAM, '{"key":"model","value":"replay/plain"}')
    write_msg(p, Ref(s2), "user", "model by param")
    r2 = p.call("cchat_send", Ref(s2), 0)
    body2 = with_out(p, "cchat_recv", Ref(r2), cap=1024)
    ran = h.run(p, model=None)
    assert ran.r(r) == 1001
    data = ran.out(body.ptr, body.cell)
    assert ran.r(body.call) == len(data)
    err = json.loads(data)
    assert err["error"]["code"] == "invalid_request"
    assert set(err) == {"error"}
    assert isinstance(err["error"]["message"], str)
    assert data == jb(err)
    assert ran.r(metrics.call) == 2
    assert ran.out(metrics.ptr, metrics.cell) == b"{}"
    assert ran.out(status.ptr, status.cell) == jb(
        {"closed": False, "flags": [], "kind": "ChatResponse", "poll_mask": ["EPOLLIN"]}
    )
    assert (ran.r(param), ran.r(r2)) == (0, 1003)
    assert ran.out(body2.ptr, body2.cell) == echo_body("model by param")


def test_send_to_an_unknown_backend_gives_an_error_body(h: Harness) -> None:
    p = Program()
    s = p.call("cchat_create")
    param = with_arg(p, "cchat_ctl", Ref(s), SET_PARAM, '{"key":"backend","value":"nosuch"}')
    write_msg(p, Ref(s), "user", "unknown backend")
    r = p.call("cchat_send", Ref(s), 0)
    body = with_out(p, "cchat_recv", Ref(r), cap=2048)
    ran = h.run(p, deadline_s=20)
    assert (ran.r(param), ran.r(r)) == (0, 1001)
    data = ran.out(body.ptr, body.cell)
    assert ran.r(body.call) == len(data)
    err = json.loads(data)
    assert set(err) == {"error"}
    assert data == jb(err)


def test_timeout_ms_bounds_the_model_request_and_recv_reads_its_error_body(h: Harness) -> None:
    # SPEAR's timeout_ms is the model request's bound: past it the chat ends with an error
    # body, which a blocking send waits for and cchat_recv returns (never -EAGAIN)
    p = Program()
    s = p.call("cchat_create")
    param = with_arg(p, "cchat_ctl", Ref(s), SET_PARAM, '{"key":"timeout_ms","value":200}')
    write_msg(p, Ref(s), "user", "[[latency_ms:5000]] give up early")
    r = p.call("cchat_send", Ref(s), 0)
    body = with_out(p, "cchat_recv", Ref(r), cap=1024)
    status = with_out(p, "spear_fd_ctl", Ref(r), GET_STATUS, cap=256)
    quick = p.call("cchat_create")
    with_arg(p, "cchat_ctl", Ref(quick), SET_PARAM, '{"key":"timeout_ms","value":5000}')
    write_msg(p, Ref(quick), "user", "[[latency_ms:50]] in time")
    r2 = p.call("cchat_send", Ref(quick), 0)
    answer = with_out(p, "cchat_recv", Ref(r2), cap=1024)
    ran = h.run(p)
    assert (ran.r(param), ran.r(r), ran.r(r2)) == (0, 1001, 1003)
    data = ran.out(body.ptr, body.cell)
    assert ran.r(body.call) == len(data)
    assert json.loads(data) == {
        "error": {
            "code": "provider_timeout",
            "message": "the model request passed its timeout of 200 ms",
        }
    }
    assert data == jb(json.loads(data))
    assert json.loads(ran.out(status.ptr, status.cell))["poll_mask"] == ["EPOLLIN"]
    assert ran.out(answer.ptr, answer.cell) == echo_body("[[latency_ms:50]] in time", "in time")
    # the param reached the chat's spec as its request bound, not as a wire field
    chats = [ran.host.fds[fd].sk for fd in (1001, 1003)]
    limits = [h.shared.store.specs[sk]["limits"] for sk in chats]
    assert [lim["request_timeout_ms"] for lim in limits] == [200, 5000]
    assert all("timeout_ms" not in h.shared.store.specs[sk]["params"] for sk in chats)


def test_send_auto_appends_the_reply_to_the_session_plain_does_not(h: Harness) -> None:
    p = Program()
    s_auto, r_auto = chat(p, "auto no tools", AUTO_TOOL_CALL)
    s_plain, r_plain = chat(p, "plain no tools", 0)
    ran = h.run(p)
    assert [ran.r(c) for c in (s_auto, r_auto, s_plain, r_plain)] == [1000, 1001, 1002, 1003]
    assert ran.host.fds[1000].messages == [
        {"role": "user", "content": "auto no tools"},
        {"role": "assistant", "content": "Echo: auto no tools"},
    ]
    assert ran.host.fds[1002].messages == [{"role": "user", "content": "plain no tools"}]


def test_send_upstream_error_gives_a_response_fd_with_an_error_body(h: Harness) -> None:
    p = Program()
    _, r = chat(p, "upstream says no", METRICS)
    body = with_out(p, "cchat_recv", Ref(r), cap=1024)
    metrics = with_out(p, "cchat_ctl", Ref(r), GET_METRICS, cap=1024)
    ran = h.run(p, model="replay/bad_request")
    assert ran.r(r) == 1001
    data = ran.out(body.ptr, body.cell)
    assert ran.r(body.call) == len(data)
    err = json.loads(data)
    assert set(err) == {"error"}
    assert err["error"]["code"] == "provider_error"
    assert "400" in err["error"]["message"]
    assert data == jb(err)
    got = json.loads(ran.out(metrics.ptr, metrics.cell))
    assert ran.out(metrics.ptr, metrics.cell) == jb(
        {
            "iterations": 0,
            "latency_ms": got["latency_ms"],
            "tool_calls": 0,
            "tool_failures": 0,
            "tool_output_bytes": 0,
            "usage": {},
        }
    )


def test_send_with_an_out_of_range_limit_param_still_returns_a_response_fd(h: Harness) -> None:
    p = Program()
    s = p.call("cchat_create")
    param = with_arg(p, "cchat_ctl", Ref(s), SET_PARAM, '{"key":"max_iterations","value":1e400}')
    write_msg(p, Ref(s), "user", "huge limit")
    r = p.call("cchat_send", Ref(s), 0)
    body = with_out(p, "cchat_recv", Ref(r), cap=1024)
    ran = h.run(p)
    assert ran.r(param) == 0
    assert ran.r(r) == 1001
    assert ran.out(body.ptr, body.cell) == echo_body("huge limit")


def test_send_with_a_non_string_backend_param_gives_an_error_body(h: Harness) -> None:
    p = Program()
    s = p.call("cchat_create")
    with_arg(p, "cchat_ctl", Ref(s), SET_PARAM, '{"key":"backend","value":[1]}')
    with_arg(p, "cchat_ctl", Ref(s), SET_PARAM, '{"key":"timeout_ms","value":3000}')
    write_msg(p, Ref(s), "user", "list backend")
    r = p.call("cchat_send", Ref(s), 0)
    body = with_out(p, "cchat_recv", Ref(r), cap=2048)
    ran = h.run(p)
    assert ran.r(r) == 1001
    assert ran.r(body.call) > 0
    err = json.loads(ran.out(body.ptr, body.cell))
    assert set(err) == {"error"}


def test_a_blocking_send_past_the_deadline_ends_the_run(h: Harness) -> None:
    p = Program()
    chat(p, "[[latency_ms:3000]] too slow")
    ran = h.run(p, deadline_s=1.0, check=False)
    assert ran.outcome.error_code == "deadline_exceeded"
    assert (ran.outcome.exit_code, ran.outcome.stdout) == (None, b"")
    assert 0.9 <= ran.elapsed_s < 2.5
    assert sorted(ran.host.fds) == [1000, 1001]


def test_a_cancelled_run_traps_in_sleep_and_send(h: Harness) -> None:
    def cancel(run_sk: str) -> None:
        h.shared.store.cancel(run_sk)

    p = Program()
    p.call("cchat_create")
    p.call("sleep_ms", 5000)
    ran = h.run(p, check=False, before=cancel)
    assert ran.outcome.error_code == "cancelled"
    assert (ran.outcome.exit_code, ran.outcome.stdout) == (None, b"")
    assert ran.elapsed_s < 2
    assert sorted(ran.host.fds) == [1000]
    p = Program()
    chat(p, "never sent")
    ran = h.run(p, check=False, before=cancel)
    assert ran.outcome.error_code == "cancelled"
    assert ran.host.sends == 0
    assert ran.host.fds[1000].messages == [{"role": "user", "content": "never sent"}]


# cchat_recv ----------------------------------------------------------------------------------


def test_recv_exact_bytes_and_every_error(h: Harness) -> None:
    text = "hello recv"
    expected = echo_body(text)
    n = len(expected)
    p = Program(pages=1)
    s, r = chat(p, text)
    first = with_out(p, "cchat_recv", Ref(r), cap=1024)
    again = with_out(p, "cchat_recv", Ref(r), cap=1024)
    exact = with_out(p, "cchat_recv", Ref(r), cap=n)
    small = with_out(p, "cchat_recv", Ref(r), cap=5, size=64)
    one_short = with_out(p, "cchat_recv", Ref(r), cap=n - 1, size=n)
    zero = with_out(p, "cchat_recv", Ref(r), cap=0, size=8)
    len_oob = p.call("cchat_recv", Ref(r), p.buffer(8), OOB)
    out_oob = p.call("cchat_recv", Ref(r), OOB, p.cell(1024))
    out_straddles = p.call("cchat_recv", Ref(r), PAGE - 4, p.cell(1024))
    on_session = with_out(p, "cchat_recv", Ref(s), cap=64)
    unknown = with_out(p, "cchat_recv", UNKNOWN_FD, cap=64)
    e = p.call("spear_epoll_create")
    on_epoll = with_out(p, "cchat_recv", Ref(e), cap=64)
    close = p.call("cchat_close", Ref(r))
    after_close = with_out(p, "cchat_recv", Ref(r), cap=1024)
    p.call("cchat_close", Ref(s))
    session_closed = with_out(p, "cchat_recv", Ref(r), cap=1024)
    ran = h.run(p)
    assert ran.r(r) == 1001
    for out in (first, again, exact, after_close, session_closed):
        assert ran.r(out.call) == n
        assert ran.dump.u32(out.cell) == n
        assert ran.dump.mem(out.ptr, n) == expected
        assert ran.untouched(out.ptr + n, out.size - n)
    for out in (small, one_short, zero):
        assert ran.r(out.call) == -ENOSPC
        assert ran.dump.u32(out.cell) == n
        assert ran.untouched(out.ptr, out.size)
    assert [ran.r(c) for c in (len_oob, out_oob, out_straddles)] == [-EFAULT] * 3
    for out in (on_session, unknown, on_epoll):
        assert ran.r(out.call) == -EBADF
        assert ran.dump.u32(out.cell) == 64
        assert ran.untouched(out.ptr, 64)
    assert ran.r(close) == 0


def test_recv_body_keeps_utf8_unescaped(h: Harness) -> None:
    text = "héllo ✓ wörld"
    p = Program()
    _, r = chat(p, text)
    body = with_out(p, "cchat_recv", Ref(r), cap=1024)
    ran = h.run(p)
    expected = echo_body(text)
    assert "Echo: héllo ✓ wörld".encode() in expected
    assert ran.out(body.ptr, body.cell) == expected
    assert ran.r(body.call) == len(expected)


def test_recv_nonblocking_session_returns_eagain_until_ready(h: Harness) -> None:
    first_user = "[[latency_ms:1500]] slow hello"
    p = Program()
    s = p.call("cchat_create")
    flags = with_arg(p, "spear_fd_ctl", Ref(s), SET_FLAGS, NONBLOCK)
    write_msg(p, Ref(s), "user", first_user)
    t0 = p.call("time_now_ms")
    r = p.call("cchat_send", Ref(s), METRICS)
    t1 = p.call("time_now_ms")
    early = with_out(p, "cchat_recv", Ref(r), cap=1024)
    metrics_early = with_out(p, "cchat_ctl", Ref(r), GET_METRICS, cap=256)
    status = with_out(p, "spear_fd_ctl", Ref(r), GET_STATUS, cap=256)
    e = p.call("spear_epoll_create")
    add = p.call("spear_epoll_ctl", Ref(e), ADD, Ref(r), EPOLLIN)
    not_ready = with_out(p, "spear_epoll_wait", Ref(e), cap=64, tail=(0,))
    short_wait = with_out(p, "spear_epoll_wait", Ref(e), cap=64, tail=(100,))
    woke = with_out(p, "spear_epoll_wait", Ref(e), cap=64, tail=(-1,))
    t2 = p.call("time_now_ms")
    late = with_out(p, "cchat_recv", Ref(r), cap=1024)
    ran = h.run(p)
    assert (ran.r(flags), ran.r(r), ran.r(e), ran.r(add)) == (0, 1001, 1002, 0)
    assert ran.r(t1) - ran.r(t0) < 1000
    assert ran.r(early.call) == -EAGAIN
    assert ran.dump.u32(early.cell) == 1024
    assert ran.untouched(early.ptr, 1024)
    assert ran.r(metrics_early.call) == -EAGAIN
    assert ran.untouched(metrics_early.ptr, 256)
    assert ran.out(status.ptr, status.cell) == jb(
        {"closed": False, "flags": [], "kind": "ChatResponse", "poll_mask": []}
    )
    for out in (not_ready, short_wait):
        assert ran.r(out.call) == 0
        assert ran.dump.u32(out.cell) == 0
        assert ran.untouched(out.ptr, 64)
    assert ran.r(woke.call) == 1
    assert ran.dump.u32(woke.cell) == 8
    assert ran.dump.mem(woke.ptr, 8) == struct.pack("<ii", 1001, EPOLLIN)
    assert ran.r(t2) - ran.r(t0) >= 1400
    assert ran.out(late.ptr, late.cell) == echo_body(first_user, "slow hello")
    assert ran.r(late.call) == len(echo_body(first_user, "slow hello"))


# cchat_close ---------------------------------------------------------------------------------


def test_close_is_idempotent_and_rejects_unknown_fds(h: Harness) -> None:
    p = Program()
    s = p.call("cchat_create")
    once = p.call("cchat_close", Ref(s))
    twice = p.call("cchat_close", Ref(s))
    unknown = p.call("cchat_close", UNKNOWN_FD)
    negative = p.call("cchat_close", -1)
    e = p.call("spear_epoll_create")
    on_epoll = p.call("cchat_close", Ref(e))
    ran = h.run(p)
    assert [ran.r(c) for c in (once, twice)] == [0, 0]
    assert [ran.r(c) for c in (unknown, negative, on_epoll)] == [-EBADF] * 3
    assert ran.host.fds[1000].closed
    assert not ran.host.fds[1001].closed


# log, time, random, sleep --------------------------------------------------------------------


def test_log_levels_lengths_and_pointers(h: Harness) -> None:
    p = Program()
    hello, bye, bad = p.data("hello log"), p.data("bye"), p.data(b"\xff ok")
    big = p.data("a" * 16_384)
    calls = [
        p.call("log", 2, hello.ptr, hello.len),
        p.call("log", 4, bye.ptr, bye.len),
        p.call("log", 0, big.ptr, 16_384),
        p.call("log", 3, bad.ptr, bad.len),
        p.call("log", 1, hello.ptr, 0),
    ]
    too_long = p.call("log", 1, big.ptr, 16_385)
    negative_len = p.call("log", 1, hello.ptr, -1)
    ptr_oob = p.call("log", 2, OOB, 5)
    level9 = p.call("log", 9, hello.ptr, hello.len)
    level_neg = p.call("log", -1, hello.ptr, hello.len)
    ran = h.run(p)
    assert [ran.r(c) for c in calls] == [0] * 5
    assert [ran.r(c) for c in (too_long, negative_len, level9, level_neg)] == [-EINVAL] * 4
    assert ran.r(ptr_oob) == -EFAULT
    assert ran.host.logs == [
        {"level": "info", "message": "hello log"},
        {"level": "error", "message": "bye"},
        {"level": "trace", "message": "a" * 16_384},
        {"level": "warn", "message": "\ufffd ok"},
        {"level": "debug", "message": ""},
    ]


def test_time_random_and_sleep(h: Harness) -> None:
    p = Program()
    now_ms = p.call("time_now_ms")
    wall = p.call("wall_time_s")
    r1, r2, r3 = p.call("random_i64"), p.call("random_i64"), p.call("random_i64")
    p.call("sleep_ms", 50)
    after_ms = p.call("time_now_ms")
    p.call("sleep_ms", 0)
    p.call("sleep_ms", -5)
    started = time.time()
    ran = h.run(p)
    assert abs(ran.r(now_ms) - started * 1000) < 5000
    assert abs(ran.r(wall) - started) < 5
    assert len({ran.r(r1), ran.r(r2), ran.r(r3)}) == 3
    assert ran.r(after_ms) - ran.r(now_ms) >= 50
    assert ran.elapsed_s >= 0.05
    assert ran.outcome.exit_code == 0


def test_sleep_is_bounded_by_the_run_deadline(h: Harness) -> None:
    p = Program()
    p.call("sleep_ms", 20_000)
    ran = h.run(p, deadline_s=0.5, check=False)
    assert ran.outcome.error_code == "deadline_exceeded"
    assert ran.outcome.exit_code is None
    assert ran.outcome.stdout == b""
    assert ran.elapsed_s < 5


# spear_fd_ctl --------------------------------------------------------------------------------


def test_fd_ctl_every_command_and_error(h: Harness) -> None:
    p = Program()
    s, r = chat(p, "fd ctl")
    e = p.call("spear_epoll_create")
    set_ok = with_arg(p, "spear_fd_ctl", Ref(s), SET_FLAGS, NONBLOCK)
    set_again = with_arg(p, "spear_fd_ctl", Ref(s), SET_FLAGS, '{"set":["O_NONBLOCK"]}')
    bad = [
        with_arg(p, "spear_fd_ctl", Ref(s), SET_FLAGS, raw)
        for raw in (
            '{"set":["O_NONBLOCK"],',
            '{"set":["O_SYNC"],"clear":[]}',
            '{"set":[],"clear":["O_APPEND"]}',
            '{"set":"O_NONBLOCK","clear":[]}',
            '{"set":[1],"clear":[]}',
            '["O_NONBLOCK"]',
            b"\xff",
        )
    ]
    flags_s = with_out(p, "spear_fd_ctl", Ref(s), GET_FLAGS, cap=256)
    flags_r = with_out(p, "spear_fd_ctl", Ref(r), GET_FLAGS, cap=256)
    kinds = [with_out(p, "spear_fd_ctl", Ref(fd), GET_KIND, cap=256) for fd in (s, r, e)]
    statuses = [with_out(p, "spear_fd_ctl", Ref(fd), GET_STATUS, cap=256) for fd in (s, r, e)]
    metrics_s = with_out(p, "spear_fd_ctl", Ref(s), FD_GET_METRICS, cap=256)
    metrics_e = with_out(p, "spear_fd_ctl", Ref(e), FD_GET_METRICS, cap=256)
    unknown_cmd = [with_out(p, "spear_fd_ctl", Ref(s), cmd, cap=64) for cmd in (0, 6, 99)]
    unknown_fd = with_out(p, "spear_fd_ctl", UNKNOWN_FD, GET_KIND, cap=64)
    unknown_fd_set = with_arg(p, "spear_fd_ctl", UNKNOWN_FD, SET_FLAGS, NONBLOCK)
    small = with_out(p, "spear_fd_ctl", Ref(s), GET_KIND, cap=3, size=32)
    small_status = with_out(p, "spear_fd_ctl", Ref(r), GET_STATUS, cap=20, size=32)
    set_len_oob = p.call("spear_fd_ctl", Ref(s), SET_FLAGS, p.data(NONBLOCK).ptr, OOB)
    get_len_oob = p.call("spear_fd_ctl", Ref(s), GET_KIND, p.buffer(32), OOB)
    get_out_oob = p.call("spear_fd_ctl", Ref(s), GET_KIND, OOB, p.cell(256))
    clear = with_arg(p, "spear_fd_ctl", Ref(s), SET_FLAGS, '{"set":[],"clear":["O_NONBLOCK"]}')
    cleared = with_out(p, "spear_fd_ctl", Ref(s), GET_FLAGS, cap=256)
    p.call("cchat_close", Ref(r))
    p.call("cchat_close", Ref(s))
    p.call("spear_epoll_close", Ref(e))
    closed = [with_out(p, "spear_fd_ctl", Ref(fd), GET_STATUS, cap=256) for fd in (s, r, e)]
    ran = h.run(p)
    assert [ran.r(c) for c in (s, r, e)] == [1000, 1001, 1002]
    assert (ran.r(set_ok), ran.r(set_again)) == (0, 0)
    assert [ran.r(c) for c in bad] == [-EINVAL] * len(bad)

    def got(out: Out, expected: bytes) -> None:
        assert ran.out(out.ptr, out.cell) == expected
        assert ran.r(out.call) == len(expected)
        assert ran.untouched(out.ptr + len(expected), out.size - len(expected))

    got(flags_s, b'{"flags":["O_NONBLOCK"]}')
    got(flags_r, b'{"flags":[]}')
    for out, kind in zip(kinds, ("ChatSession", "ChatResponse", "Epoll"), strict=True):
        got(out, b'{"kind":"%s"}' % kind.encode())
    got(
        statuses[0],
        b'{"closed":false,"flags":["O_NONBLOCK"],"kind":"ChatSession","poll_mask":["EPOLLOUT"]}',
    )
    got(statuses[1], b'{"closed":false,"flags":[],"kind":"ChatResponse","poll_mask":["EPOLLIN"]}')
    got(statuses[2], b'{"closed":false,"flags":[],"kind":"Epoll","poll_mask":[]}')
    got(metrics_s, b"{}")
    got(metrics_e, b"{}")
    for out in (*unknown_cmd, unknown_fd):
        assert ran.untouched(out.ptr, 64)
        assert ran.dump.u32(out.cell) == 64
    assert [ran.r(o.call) for o in unknown_cmd] == [-EINVAL] * 3
    assert ran.r(unknown_fd.call) == -EBADF
    assert ran.r(unknown_fd_set) == -EBADF
    assert ran.r(small.call) == -ENOSPC
    assert ran.dump.u32(small.cell) == len(b'{"kind":"ChatSession"}')
    assert ran.untouched(small.ptr, 32)
    assert ran.r(small_status.call) == -ENOSPC
    assert ran.dump.u32(small_status.cell) == len(
        b'{"closed":false,"flags":[],"kind":"ChatResponse","poll_mask":["EPOLLIN"]}'
    )
    assert ran.untouched(small_status.ptr, 32)
    assert [ran.r(c) for c in (set_len_oob, get_len_oob, get_out_oob)] == [-EFAULT] * 3
    assert ran.r(clear) == 0
    got(cleared, b'{"flags":[]}')
    got(
        closed[0],
        b'{"closed":true,"flags":[],"kind":"ChatSession","poll_mask":["EPOLLHUP"]}',
    )
    got(
        closed[1],
        b'{"closed":true,"flags":[],"kind":"ChatResponse","poll_mask":["EPOLLIN","EPOLLHUP"]}',
    )
    got(closed[2], b'{"closed":true,"flags":[],"kind":"Epoll","poll_mask":["EPOLLHUP"]}')


# epoll ---------------------------------------------------------------------------------------


def test_epoll_ctl_every_op_and_error(h: Harness) -> None:
    p = Program()
    s1, r1 = chat(p, "epoll one")
    e = p.call("spear_epoll_create")
    add = p.call("spear_epoll_ctl", Ref(e), ADD, Ref(r1), EPOLLIN)
    add_twice = p.call("spear_epoll_ctl", Ref(e), ADD, Ref(r1), EPOLLIN)
    mod_member = p.call("spear_epoll_ctl", Ref(e), MOD, Ref(r1), EPOLLIN | EPOLLOUT)
    mod_stranger = p.call("spear_epoll_ctl", Ref(e), MOD, Ref(s1), EPOLLIN)
    del_stranger = p.call("spear_epoll_ctl", Ref(e), DEL, Ref(s1), 0)
    bad_ops = [p.call("spear_epoll_ctl", Ref(e), op, Ref(r1), EPOLLIN) for op in (0, 4, 7)]
    unknown_target = p.call("spear_epoll_ctl", Ref(e), ADD, UNKNOWN_FD, EPOLLIN)
    not_epoll = p.call("spear_epoll_ctl", Ref(s1), ADD, Ref(r1), EPOLLIN)
    response_as_epoll = p.call("spear_epoll_ctl", Ref(r1), ADD, Ref(s1), EPOLLIN)
    unknown_epfd = p.call("spear_epoll_ctl", UNKNOWN_FD, ADD, Ref(r1), EPOLLIN)
    add_session = p.call("spear_epoll_ctl", Ref(e), ADD, Ref(s1), EPOLLOUT)
    del_member = p.call("spear_epoll_ctl", Ref(e), DEL, Ref(s1), 0)
    del_again = p.call("spear_epoll_ctl", Ref(e), DEL, Ref(s1), 0)
    ran = h.run(p)
    assert [ran.r(c) for c in (s1, r1, e)] == [1000, 1001, 1002]
    assert [ran.r(c) for c in (add, mod_member, add_session, del_member)] == [0] * 4
    assert ran.r(add_twice) == -EEXIST
    assert [ran.r(c) for c in (mod_stranger, del_stranger, del_again)] == [-ENOENT] * 3
    assert [ran.r(c) for c in bad_ops] == [-EINVAL] * 3
    bad_fds = (unknown_target, not_epoll, response_as_epoll, unknown_epfd)
    assert [ran.r(c) for c in bad_fds] == [-EBADF] * 4
    assert ran.host.fds[1002].watch == {1001: EPOLLIN | EPOLLOUT}


def test_epoll_wait_records_and_every_error(h: Harness) -> None:
    p = Program()
    s1, r1 = chat(p, "epoll wait one")
    s2, r2 = chat(p, "epoll wait two")
    e = p.call("spear_epoll_create")
    p.call("spear_epoll_ctl", Ref(e), ADD, Ref(r2), EPOLLIN)  # added first, listed second
    p.call("spear_epoll_ctl", Ref(e), ADD, Ref(r1), EPOLLIN)
    both = with_out(p, "spear_epoll_wait", Ref(e), cap=64, tail=(0,))
    level = with_out(p, "spear_epoll_wait", Ref(e), cap=64, tail=(-1,))  # level-triggered
    room_for_one = with_out(p, "spear_epoll_wait", Ref(e), cap=12, size=24, tail=(0,))
    tiny = with_out(p, "spear_epoll_wait", Ref(e), cap=4, size=16, tail=(0,))
    zero = with_out(p, "spear_epoll_wait", Ref(e), cap=0, size=16, tail=(0,))
    out_oob = p.call("spear_epoll_wait", Ref(e), OOB, p.cell(64), 0)
    len_oob = p.call("spear_epoll_wait", Ref(e), p.buffer(16), OOB, 0)
    not_epoll = with_out(p, "spear_epoll_wait", Ref(s1), cap=64, tail=(0,))
    unknown = with_out(p, "spear_epoll_wait", UNKNOWN_FD, cap=64, tail=(0,))
    p.call("spear_epoll_ctl", Ref(e), DEL, Ref(r2), 0)
    one = with_out(p, "spear_epoll_wait", Ref(e), cap=64, tail=(-1,))
    # interest OUT only: a response is never writable, so nothing is ready
    p.call("spear_epoll_ctl", Ref(e), MOD, Ref(r1), EPOLLOUT)
    out_only = with_out(p, "spear_epoll_wait", Ref(e), cap=64, tail=(0,))
    p.call("spear_epoll_ctl", Ref(e), MOD, Ref(r1), EPOLLIN)
    p.call("spear_epoll_ctl", Ref(e), ADD, Ref(s2), EPOLLOUT)
    p.call("cchat_close", Ref(r1))
    hup = with_out(p, "spear_epoll_wait", Ref(e), cap=64, tail=(0,))
    p.call("cchat_close", Ref(s2))
    session_hup = with_out(p, "spear_epoll_wait", Ref(e), cap=64, tail=(0,))
    ran = h.run(p)
    r1_fd, r2_fd, s2_fd = ran.r(r1), ran.r(r2), ran.r(s2)
    assert (r1_fd, s2_fd, r2_fd, ran.r(e)) == (1001, 1002, 1003, 1004)

    def got(out: Out, recs: list[tuple[int, int]]) -> None:
        data = b"".join(struct.pack("<ii", fd, ev) for fd, ev in recs)
        assert ran.r(out.call) == len(recs)
        assert ran.dump.u32(out.cell) == len(data)
        assert ran.dump.mem(out.ptr, len(data)) == data
        assert ran.untouched(out.ptr + len(data), out.size - len(data))

    got(both, [(1001, EPOLLIN), (1003, EPOLLIN)])
    assert ran.dump.mem(both.ptr, 16) == bytes.fromhex("e903000001000000eb03000001000000")
    got(level, [(1001, EPOLLIN), (1003, EPOLLIN)])
    got(room_for_one, [(1001, EPOLLIN)])
    for out in (tiny, zero):
        assert ran.r(out.call) == -ENOSPC
        assert ran.dump.u32(out.cell) == 8
        assert ran.untouched(out.ptr, 16)
    assert (ran.r(out_oob), ran.r(len_oob)) == (-EFAULT, -EFAULT)
    for out in (not_epoll, unknown):
        assert ran.r(out.call) == -EBADF
        assert ran.dump.u32(out.cell) == 64
        assert ran.untouched(out.ptr, 64)
    got(one, [(1001, EPOLLIN)])
    assert ran.dump.mem(one.ptr, 8) == bytes.fromhex("e903000001000000")
    got(out_only, [])
    got(hup, [(1001, EPOLLIN | EPOLLHUP), (1002, EPOLLOUT)])
    got(session_hup, [(1001, EPOLLIN | EPOLLHUP), (1002, EPOLLHUP)])


def test_epoll_close_is_idempotent_and_ends_the_instance(h: Harness) -> None:
    p = Program()
    s, r = chat(p, "epoll close")
    e = p.call("spear_epoll_create")
    p.call("spear_epoll_ctl", Ref(e), ADD, Ref(r), EPOLLIN)
    once = p.call("spear_epoll_close", Ref(e))
    twice = p.call("spear_epoll_close", Ref(e))
    wait_closed = with_out(p, "spear_epoll_wait", Ref(e), cap=64, tail=(0,))
    ctl_closed = p.call("spear_epoll_ctl", Ref(e), ADD, Ref(s), EPOLLOUT)
    on_session = p.call("spear_epoll_close", Ref(s))
    on_response = p.call("spear_epoll_close", Ref(r))
    unknown = p.call("spear_epoll_close", UNKNOWN_FD)
    ran = h.run(p)
    assert (ran.r(once), ran.r(twice)) == (0, 0)
    assert ran.r(wait_closed.call) == -EBADF
    assert ran.untouched(wait_closed.ptr, 64)
    assert [ran.r(c) for c in (ctl_closed, on_session, on_response, unknown)] == [-EBADF] * 4
    assert ran.host.fds[1002].closed
    assert not ran.host.fds[1000].closed


# imports ---------------------------------------------------------------------------------------


def test_unserved_spear_imports_link_and_return_enosys(h: Harness) -> None:
    p = Program(
        signatures={
            "mic_open": (("i32",), "i32"),
            "rtasr_read": (("i32", "i32", "i32"), "i32"),
            "mic_close": ((), "i32"),
            "mic_level": ((), "i64"),
            "rtasr_close": (("i32",), None),
        }
    )
    calls = [
        p.call("mic_open", 0),
        p.call("rtasr_read", 1000, 64, 128),
        p.call("mic_close"),
        p.call("mic_level"),
    ]
    p.call("rtasr_close", 3)
    after = p.call("cchat_create")
    ran = h.run(p)
    assert [ran.r(c) for c in calls] == [-ENOSYS] * 4
    assert ran.r(after) == 1000


def test_an_unknown_spear_import_fails_the_run_by_name(h: Harness) -> None:
    p = Program(signatures={"nope": ((), "i32")})
    p.call("nope")
    ran = h.run(p, check=False)
    assert ran.outcome.error_code == "guest_error"
    assert ran.outcome.error is not None and "spear::nope" in ran.outcome.error
    assert (ran.outcome.exit_code, ran.outcome.stdout) == (None, b"")


def test_a_known_import_with_the_wrong_type_fails_the_run(h: Harness) -> None:
    p = Program(signatures={"cchat_create": (("i32",), "i32")})
    p.call("cchat_create", 0)
    ran = h.run(p, check=False)
    assert ran.outcome.error_code == "guest_error"
    assert ran.outcome.error is not None and "spear::cchat_create" in ran.outcome.error
    assert (ran.outcome.exit_code, ran.outcome.stdout) == (None, b"")
    assert ran.host.fds == {}


def test_a_trapping_guest_ends_with_guest_trap_and_the_next_run_works(h: Harness) -> None:
    p = Program()
    p.call("cchat_create")
    p.trap()
    p.call("cchat_create")
    ran = h.run(p, check=False)
    assert ran.outcome.error_code == "guest_trap"
    assert ran.outcome.exit_code is None
    assert ran.outcome.error is not None and "unreachable" in ran.outcome.error
    assert sorted(ran.host.fds) == [1000]  # the call before the trap ran, the one after did not
    nxt = Program()
    s, r = chat(nxt, "after a trap")
    body = with_out(nxt, "cchat_recv", Ref(r), cap=1024)
    again = h.run(nxt)
    assert (again.r(s), again.r(r)) == (1000, 1001)
    assert again.out(body.ptr, body.cell) == echo_body("after a trap")
