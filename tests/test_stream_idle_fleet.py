"""Stalled model streams on a real fleet: a backend with a short stream_idle_timeout_s, the
replay server stalling each round's first streamed answer after some content (keepalives
only), every protocol. The sessions end ok with the whole answer, and the replay server saw
each stalled round asked exactly twice: the stalled stream, then the retry. Redis database 11.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from fixtures.demo_scenarios import WEATHER, weather_json
from fixtures.replay.scenarios import conversation_key
from producer.fleet import Fleet
from schemas.protocols import PROTOCOLS
from tests.conftest import Running, _workers
from tests.test_pipeline import run_specs

pytestmark = pytest.mark.fleet

REDIS_DB = 11
IDLE_S = 1.0
STALL = "[[stall_ms:8000]] [[ping_ms:100]]"  # keepalives only, far past the idle timeout
WIRE_NAMES = {"openai": "openai", "anthropic": "anthropic", "gemini": "gemini",
              "openai-text-tags": "tags"}  # fmt: skip


def stall_backend(protocol: str) -> str:
    return f"stall-{protocol}"


@pytest.fixture(scope="module")
def fleet11(base_fleet: Fleet) -> Iterator[Running]:
    root = base_fleet.replay_url.removesuffix("/v1")
    backends = {
        stall_backend(name): {"protocol": name, "base_url": root + declared.replay_path,
                              "stream": True, "stream_idle_timeout_s": IDLE_S}
        for name, declared in PROTOCOLS.items()
    }  # fmt: skip
    yield from _workers(base_fleet, db=REDIS_DB, config={"backends": backends})


def stalled_rounds(running: Running, turns: list[str]) -> dict[str, dict[str, Any]]:
    """The replay server's records of these stalled rounds, once each stalled stream ended."""
    url = running.fleet.replay_url.removesuffix("/v1") + "/stalls"
    deadline = time.monotonic() + 30
    while True:
        stalls = {s["turn"]: s for s in requests.get(url, timeout=5).json()["stalls"]}
        found = {t: stalls[t] for t in turns if t in stalls}
        if len(found) == len(turns) and all(s["ended"] != "stalling" for s in found.values()):
            return found
        assert time.monotonic() < deadline, f"stalls never ended: {found}"
        time.sleep(0.05)


def test_stalled_streams_are_retried_and_their_sessions_end_ok(
    fleet11: Running, tmp_path: Path, fresh_id: str
) -> None:
    specs, turns, answers = [], [], {}
    for protocol, declared in PROTOCOLS.items():
        text = f"Stall {fresh_id} {protocol} {STALL}"
        spec_id = f"{fresh_id}/{protocol}"
        specs.append({"id": spec_id, "provider": stall_backend(protocol),
                      "model": declared.replay_model_for("plain"),
                      "messages": [{"role": "user", "content": text}]})  # fmt: skip
        turns.append(conversation_key(WIRE_NAMES[protocol], "plain", text) + ":0")
        answers[spec_id] = f"Echo: Stall {fresh_id} {protocol}"
    # two rounds (a tool call, then the answer), each stalled on its first attempt
    weather = f"Weather {fresh_id} in Paris? {STALL}"
    specs.append({"id": f"{fresh_id}/weather", "provider": stall_backend("openai"),
                  "model": "replay/weather", "messages": [{"role": "user", "content": weather}],
                  "tools": [dict(WEATHER)]})  # fmt: skip
    turns += [conversation_key("openai", "weather", weather) + f":{t}" for t in (0, 1)]
    answers[f"{fresh_id}/weather"] = f"Weather report: {weather_json('Paris')}"

    records = run_specs(fleet11.client, specs, tmp_path, timeout_s=90)

    for spec_id, answer in answers.items():
        record = records[spec_id]
        assert record["status"] == "ok", record
        assert record["body"]["choices"][0]["message"]["content"] == answer, record
    for turn, stall in stalled_rounds(fleet11, turns).items():
        # the stalled stream and the retry; the worker hung up on the stalled one
        assert stall["requests"] == 2 and stall["ended"] == "client hung up", (turn, stall)
