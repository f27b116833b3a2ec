"""Every provider protocol, streaming on and off, through the real pipeline against the
replay server: the same sessions give the same outcomes; thinking is replayed verbatim."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from fixtures.demo_batch import check, demo_specs, on_backend
from fixtures.demo_scenarios import KINDS
from producer.fleet import replay_backend_name
from schemas.protocols import NAMES as PROTOCOL_NAMES
from tests.conftest import Running
from tests.test_pipeline import assert_tool_messages_paired, run_specs

pytestmark = pytest.mark.fleet
SPEC_KINDS = [k for k in KINDS if not k.startswith("program")]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("protocol", sorted(PROTOCOL_NAMES))
def test_demo_sessions_same_outcomes_on_every_protocol(
    running: Running, tmp_path: Path, fresh_id: str, protocol: str, stream: bool
) -> None:
    backend = replay_backend_name(protocol, stream)
    specs = [
        on_backend({**spec, "id": f"{fresh_id}/{spec['id']}"}, backend, protocol)
        for spec, _ in demo_specs(len(KINDS))
        if "program" not in spec
    ]
    assert len(specs) == len(SPEC_KINDS)
    records = run_specs(running.client, specs, tmp_path)
    problems = {sid: check({**r, "id": sid.split("/", 1)[1]}) for sid, r in records.items()}
    assert {sid: p for sid, p in problems.items() if p} == {}
    for record in records.values():
        assert_tool_messages_paired(record)
        if record["status"] == "ok":
            assert record["body"]["_spear"]["backend"] == backend
            assert "_provider" not in record["body"]["choices"][0]["message"]


def _thinking_tool_turns(
    running: Running, tmp_path: Path, spec_id: str, protocol: str, stream: bool
) -> list[dict[str, Any]]:
    """Run a two-tool-round session on the protocol's thinking backend; its tool-call turns.
    The replay server answers 400 unless each earlier turn's signed thinking comes back."""
    spec, _ = KINDS["two_rounds"](7)
    backend = replay_backend_name(protocol, stream) + "-thinking"
    spec = on_backend({**spec, "id": spec_id}, backend, protocol)
    record = run_specs(running.client, [spec], tmp_path)[spec_id]
    assert record["status"] == "ok", record["body"]
    assert record["body"]["choices"][0]["message"]["content"] == "Result: 100"
    turns = [m for m in record["transcript"] if m["role"] == "assistant" and m.get("tool_calls")]
    assert len(turns) == 2
    return turns


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_anthropic_thinking_blocks_replayed_verbatim(
    running: Running, tmp_path: Path, fresh_id: str, stream: bool
) -> None:
    for turn in _thinking_tool_turns(running, tmp_path, f"{fresh_id}/think", "anthropic", stream):
        blocks = turn["_provider"]["anthropic"]["content"]
        assert blocks[0]["type"] == "thinking" and blocks[0]["signature"]
        assert turn["reasoning_content"] == blocks[0]["thinking"]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_gemini_thought_signatures_echoed(
    running: Running, tmp_path: Path, fresh_id: str, stream: bool
) -> None:
    for turn in _thinking_tool_turns(running, tmp_path, f"{fresh_id}/sig", "gemini", stream):
        parts = turn["_provider"]["gemini"]["parts"]
        signed = [p for p in parts if "functionCall" in p and p.get("thoughtSignature")]
        assert signed, json.dumps(parts)


@pytest.mark.parametrize("protocol", ["openai", "anthropic"])
def test_status_shows_a_streamed_round_while_it_is_generated(
    running: Running, tmp_path: Path, fresh_id: str, protocol: str
) -> None:
    from tests.test_pipeline import submit_specs

    text = "a long enough message to come back in several pieces, one after another"
    spec = on_backend(
        {"id": f"{fresh_id}/live", "model": "replay/plain",
         "messages": [{"role": "user", "content": f"{text} [[chunk_delay_ms:250]]"}]},
        replay_backend_name(protocol, True),
        protocol,
    )  # fmt: skip
    sub = submit_specs(running.client, [spec], tmp_path)
    seen: list[str] = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        status = running.client.status(spec["id"]) or {}
        if status.get("finished"):
            break
        if status.get("partial_text"):
            seen.append(status["partial_text"])
        time.sleep(0.05)
    (record,) = dict(running.client.wait(sub, timeout_s=30)).values()
    final = record["body"]["choices"][0]["message"]["content"]
    assert final == f"Echo: {text}"
    partial = [s for s in seen if s != final]
    assert partial, "no partial text was ever shown"
    assert all(final.startswith(s) for s in seen)
    assert "partial_text" not in (running.client.status(spec["id"]) or {})
