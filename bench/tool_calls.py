"""The cost of a tool call's policy, in process: the WASM call alone next to the same call under
its policy (ToolCaller), rendered as the result envelope, with its two trace events made and
encoded as the store writes them."""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path

import fixtures
from bench.codecs import median_us
from schemas.fleet import ToolDefaults
from schemas.spec_types import SessionSpec, spec_from_json
from worker.codecs.reply import Reply
from worker.edges.wasm_runtime import WasmToolRuntime
from worker.session.engine import tool_run
from worker.session.ports import ToolCall
from worker.session.tool_policy import ToolCaller
from worker.session.trace import event, tool_call_ended

GUESTS = Path(fixtures.__file__).parent / "guests"


def tool_call_rows(rows: list[tuple[str, str]]) -> None:
    blob = (GUESTS / "weather.wasm").read_bytes()
    sha = hashlib.sha256(blob).hexdigest()
    runtime = WasmToolRuntime(Path(tempfile.mkdtemp()), {sha: blob}.__getitem__)
    function = {"name": "get_weather", "parameters": {"type": "object"}}
    tool = {
        "module_sha256": sha,
        "export": "get_weather",
        "table_index": None,
        "function": function,
    }
    spec = spec_from_json({"id": "b", "model": "m", "messages": [], "tools": [tool]})
    assert isinstance(spec, SessionSpec)
    reply = {
        "choices": [
            {
                "message": {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                        }
                    ],
                }
            }
        ]
    }
    run = tool_run(spec, Reply.parse(reply), 0)
    assert run is not None
    limits = spec.limits
    call = ToolCall(sha, "get_weather", None, None, b'{"city":"Paris"}', 10_000,
                    limits.tool_memory_bytes, limits.max_tool_output_bytes)  # fmt: skip
    caller = ToolCaller(runtime, ToolDefaults())

    def bare() -> None:
        runtime.run(call)

    def full() -> None:
        started = event("tool.call.started", "b", round=0, call_id="c1", tool="get_weather")
        outcome = caller.run(spec, run)
        outcome.message(envelope=True)
        ended = tool_call_ended("b", 0, "c1", "get_weather", outcome)
        for made in (started, ended):
            json.dumps(made.to_json(), separators=(",", ":"))

    bare_ms, full_ms = median_us(bare) / 1000, median_us(full) / 1000
    rows.append(
        ("tool call, the WASM call alone (no policy, no envelope, no events)", f"{bare_ms:.3f} ms")
    )
    rows.append(
        ("  under its policy, as an envelope, with its 2 trace events",
         f"{full_ms:.3f} ms ({full_ms / bare_ms:.2f}x; +{(full_ms - bare_ms) * 1000:.0f} us)")
    )  # fmt: skip
    runtime.close()


def rate_limit_rows(redis_url: str, rows: list[tuple[str, str]]) -> None:
    """Issue 10, point 8: one acquire under a tokens-per-minute limit, with 10 and with 10,000
    calls in the window (the limiter keeps a running total: the two should cost the same)."""
    import redis

    from worker.config import BackendConfig
    from worker.edges.rate_limit import RedisRateLimiter

    client = redis.Redis.from_url(redis_url)
    limiter = RedisRateLimiter(client)
    timings = {}
    for filled in (10, 10_000):
        backend = BackendConfig(
            name=f"bench-{filled}", tokens_per_minute=10**12, rate_window_s=3600.0
        )
        for _ in range(filled):
            limiter.acquire(backend, 10)

        def acquire(b: BackendConfig = backend) -> None:
            limiter.acquire(b, 10)

        timings[filled] = median_us(acquire)
    rows.append(("rate limit acquire, 10 calls in the window", f"{timings[10]:.0f} us"))
    rows.append(
        ("  10,000 calls in the window (O(1))",
         f"{timings[10_000]:.0f} us ({timings[10_000] / timings[10]:.2f}x)")
    )  # fmt: skip
    client.close()
