"""Model aliases on a real fleet (Redis DB 15): the configuration maps `gpt-4o-mini`, the model
SPEAR's samples ask for, to the replay server's `replay/plain` on backend `replay-openai`,
while the fleet's default backend is the real OpenAI API (no key here: a call that reached it
would fail). A spec session and a WASM agent program (SPEAR's chat_completion sample, written
its way) asking for `gpt-4o-mini` with no provider both finish with the replay's answer; a spec
naming a provider sends the name as it is, and the replay server knows no such model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from producer.fleet import Fleet
from tests.conftest import GUESTS, Running, _workers
from tests.test_pipeline import run_specs

pytestmark = pytest.mark.fleet

REDIS_DB = 15
UPSTREAM = {"backend": "replay-openai", "model": "replay/plain"}


@pytest.fixture(scope="module")
def aliased(base_fleet: Fleet) -> Iterator[Running]:
    # submit checks the alias's backend against the same configuration (the default
    # backend's key is unset here: only aliased or explicit specs pass)
    config = {
        "default_backend": "openai",
        "models": {"gpt-4o-mini": {**UPSTREAM, "params": {"temperature": 0}}},
    }
    yield from _workers(base_fleet, REDIS_DB, config=config, queues=("llm", "control", "programs"))


def chat(spec_id: str, text: str, **extra: Any) -> dict[str, Any]:
    return {
        "id": spec_id,
        "model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": text}],
        **extra,
    }


def test_a_spec_asking_for_an_alias_runs_on_its_backend_and_upstream_model(
    aliased: Running, tmp_path: Path, fresh_id: str
) -> None:
    specs = [
        chat(f"{fresh_id}/alias", "hello alias"),
        # an explicit provider wins: the name goes to it as it is, unknown to the replay
        chat(f"{fresh_id}/explicit", "hello as is", provider="replay-openai"),
    ]
    records = run_specs(aliased.client, specs, tmp_path, timeout_s=90)
    record = records[f"{fresh_id}/alias"]
    assert record["status"] == "ok", record
    assert record["body"]["choices"][0]["message"]["content"] == "Echo: hello alias"
    assert record["body"]["_spear"] == UPSTREAM
    explicit = records[f"{fresh_id}/explicit"]
    assert explicit["status"] == "error", explicit
    assert explicit["body"]["error"]["code"] == "provider_error", explicit


def test_a_spear_sample_asking_for_the_alias_runs_through_it_unmodified(
    aliased: Running, tmp_path: Path, fresh_id: str
) -> None:
    # SPEAR's chat_completion sample sets no model itself: its run's `model` is its chats'
    spec_id = f"{fresh_id}/sample"
    program = {
        "module": str(GUESTS / "prog_chat_timeout.wasm"),
        "args": ["30000", "hello from a program"],
    }
    spec = {"id": spec_id, "program": program, "model": "gpt-4o-mini"}
    record = run_specs(aliased.client, [spec], tmp_path, timeout_s=90)[spec_id]
    assert record["status"] == "ok" and record["exit_code"] == 0, record
    body = json.loads(record["stdout"].splitlines()[1].removeprefix("response_json="))
    assert body["choices"][0]["message"]["content"] == "Echo: hello from a program"
    assert body["_spear"] == UPSTREAM
    assert record["responses"] == [body]
