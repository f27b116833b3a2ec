"""The script a user would write instead of cchatq: one asyncio process, the official `openai`
async client, a semaphore of C sessions, the same `.wasm` tools (a fresh instance per call).
Each session is the bench's workload: 3 model calls and 2 tool calls (replay/two_rounds)."""

from __future__ import annotations

import asyncio
import hashlib
import tempfile
from pathlib import Path
from typing import Any

from openai import AsyncOpenAI

from worker.edges.wasm_runtime import WasmToolRuntime
from worker.session.ports import ToolCall

MAX_ROUNDS = 8


async def _session(
    client: AsyncOpenAI,
    sem: asyncio.Semaphore,
    runtime: WasmToolRuntime,
    module_sha: str,
    tools: list[Any],
    k: int,
) -> str | None:
    messages: list[Any] = [{"role": "user", "content": f"Add {k} and 3, then multiply by 10"}]
    async with sem:
        for _ in range(MAX_ROUNDS):
            reply = await client.chat.completions.create(
                model="replay/two_rounds", messages=messages, tools=tools
            )
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                return message.content
            for call in message.tool_calls:
                arguments = call.function.arguments.encode()  # type: ignore[union-attr]
                output = runtime.run(ToolCall(module_sha, "calculate", None, None, arguments))
                messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
    return None


async def _run(base_url: str, function: dict[str, Any], module: Path, n: int, c: int) -> int:
    blob = module.read_bytes()
    sha = hashlib.sha256(blob).hexdigest()
    runtime = WasmToolRuntime(Path(tempfile.mkdtemp()), {sha: blob}.__getitem__)
    tools: list[Any] = [{"type": "function", "function": function}]
    sem = asyncio.Semaphore(c)
    try:
        async with AsyncOpenAI(base_url=base_url, api_key="replay", max_retries=0) as client:
            answers = await asyncio.gather(
                *(_session(client, sem, runtime, sha, tools, k) for k in range(n))
            )
    finally:
        runtime.close()
    return sum(1 for k, a in enumerate(answers) if a == f"Result: {(k + 3) * 10}")


def run_script(
    base_url: str, function: dict[str, Any], module: Path, n: int, concurrency: int = 64
) -> int:
    """Run n sessions; how many ended with the right answer."""
    return asyncio.run(_run(base_url, function, module, n, concurrency))
