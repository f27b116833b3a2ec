"""The documented Python API on a real fleet: `Client.submit(specs) -> Batch`, its results as
they finish, its status, cancelling it; sessions and program runs alike (README: Python API)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from producer.batch import Batch, Result
from producer.client import DEFAULT_TTL_S, result_ttl_s
from schemas import keys
from schemas.config import ConfigError
from tests.conftest import GUESTS, Running
from tests.test_pipeline import wait_for


def plain(spec_id: str, content: str = "hi") -> dict[str, Any]:
    return {
        "id": spec_id,
        "model": "replay/plain",
        "messages": [{"role": "user", "content": content}],
    }


def test_a_batch_yields_each_result_as_it_finishes_then_again_without_rerunning(
    running: Running, fresh_id: str
) -> None:
    specs = [plain(f"{fresh_id}/{n}", f"hello {n}") for n in range(3)]
    specs.append(
        {
            "id": f"{fresh_id}/prog",
            "program": {"module": str(GUESTS / "prog_chat.wasm"), "stdin": "in\n"},
        }
    )
    batch = running.client.submit(specs)
    assert isinstance(batch, Batch) and len(batch) == 4 and batch.enqueued == 4
    results = {r.id: r for r in batch.results(timeout_s=60)}
    assert sorted(results) == sorted(s["id"] for s in specs)
    for n in range(3):
        result = results[f"{fresh_id}/{n}"]
        assert isinstance(result, Result)
        assert (result.ok, result.status, result.error_code) == (True, "ok", None)
        assert result.text == f"Echo: hello {n}"
        assert (result.batch, result.attempt) == (batch.id, 1)
        line = json.loads(result.line())
        assert (line["id"], line["batch"], line["attempt"]) == (result.id, batch.id, 1)
        assert line["response"] == result.body
    program = results[f"{fresh_id}/prog"]
    assert program.ok and program.record["exit_code"] == 0 and program.text is None
    assert program.record["stdout"].startswith("ANSWER: Echo: in\n")
    status = batch.status()
    assert (status.sessions, status.states, status.outcomes) == (4, {"done": 4}, {"ok": 4})

    # the same ids and specs again: nothing runs, the stored results come back at once
    again = running.client.submit(specs)
    assert again.enqueued == 0 and again.id != batch.id
    assert {r.id: r.text for r in again.results(timeout_s=10)} == {
        i: r.text for i, r in results.items()
    }
    # a second look at the first batch finds them all finished too
    assert len(list(batch.results(timeout_s=10))) == 4


def test_cancelling_a_batch_ends_what_still_runs_with_a_cancelled_body(
    running: Running, fresh_id: str
) -> None:
    slow = {
        **plain(f"{fresh_id}/slow", "take your time [[latency_ms:4000]]"),
        "model": "replay/slow",
    }
    batch = running.client.submit([plain(f"{fresh_id}/quick"), slow])
    quick_sk, slow_sk = batch.submission.order
    wait_for(lambda: running.client.redis.hget(keys.meta(slow_sk), "state") == b"round 0")
    wait_for(lambda: running.client.redis.exists(keys.response(quick_sk)))
    assert batch.cancel() == 1  # the slow one; the quick one has finished
    by_id = {r.id: r for r in batch.results(timeout_s=20)}
    assert by_id[slow["id"]].error_code == "cancelled"
    assert by_id[slow["id"]].body == {
        "error": {"code": "cancelled", "message": "session cancelled"}
    }


def test_module_paths_are_relative_to_base_dir(running: Running, fresh_id: str) -> None:
    weather = json.loads((GUESTS.parent / "demo" / "sessions.jsonl").read_text().splitlines()[1])
    weather["id"] = f"{fresh_id}/weather"
    weather["tools"][0]["module"] = "weather.wasm"
    batch = running.client.submit([weather], base_dir=GUESTS)
    (result,) = batch.results(timeout_s=60)
    assert result.ok and "Paris" in (result.text or "")


def test_the_client_writes_with_the_fleets_key_ttl() -> None:
    """CCHATQ_RESULT_TTL_S is the TTL of every key, the producer's too (its specs, claims,
    batches); unset, a day; not a number of seconds, a ConfigError naming it."""
    assert result_ttl_s({"CCHATQ_RESULT_TTL_S": "600"}) == 600
    assert result_ttl_s({}) == DEFAULT_TTL_S
    for bad in ("0", "-5", "ten", "1.5"):
        with pytest.raises(ConfigError, match="CCHATQ_RESULT_TTL_S"):
            result_ttl_s({"CCHATQ_RESULT_TTL_S": bad})
