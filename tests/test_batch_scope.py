"""Where a spec id is unique, and what a batch's results are, on a real fleet: an OpenAI Batch
file's custom_ids are its own (two files reusing `request-1` both run), a namespace keeps ids
apart, `--rerun changed` runs only the changed id, `--resample` samples again without moving
the namespace's runs, and `cchatq batch results B` stays what B ran whatever reruns follow."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fixtures.demo_scenarios import WEATHER
from producer.client import Client
from tests.conftest import GUESTS, Running

pytestmark = pytest.mark.fleet

WEATHER_WASM = str(GUESTS / "weather.wasm")
WEATHER_TOOL = {"type": "function", "function": WEATHER["function"]}  # as OpenAI offers it


def request(custom_id: str, prompt: str, **body: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": prompt}]
    body = {"model": "replay/plain", "messages": messages, **body}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def spec(spec_id: str, prompt: str) -> dict[str, Any]:
    return {"id": spec_id, "model": "replay/plain",
            "messages": [{"role": "user", "content": prompt}]}  # fmt: skip


class Cli:
    def __init__(self, running: Running, tmp_path: Path) -> None:
        self.env = {"REDIS_URL": running.redis_url, "PATH": "/usr/bin:/bin",
                    "CCHATQ_BACKENDS": running.fleet.env["CCHATQ_BACKENDS"]}  # fmt: skip
        self.tmp_path = tmp_path
        self.files = 0

    def __call__(self, *args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "producer.cli", *args]
        return subprocess.run(
            cmd, env=self.env, capture_output=True, text=True, timeout=120, cwd=self.tmp_path
        )

    def write(self, lines: list[dict[str, Any]]) -> str:
        self.files += 1
        path = self.tmp_path / f"in{self.files}.jsonl"
        path.write_text("".join(json.dumps(x) + "\n" for x in lines))
        return str(path)

    def submit(self, lines: list[dict[str, Any]], *args: str) -> tuple[str, list[dict[str, Any]]]:
        """(batch, result lines) of a submit that ended with every session ok."""
        out = self.tmp_path / f"out{self.files + 1}.jsonl"
        done = self("submit", self.write(lines), "--out", str(out), *args)
        assert done.returncode == 0, done.stderr
        batch = done.stderr.split("batch ", 1)[1].split(":", 1)[0]
        return batch, [json.loads(x) for x in out.read_text().splitlines()]

    def results(self, batch: str, *args: str) -> list[dict[str, Any]]:
        out = self.tmp_path / f"{batch}.jsonl"
        done = self("batch", "results", batch, "--out", str(out), *args)
        assert done.returncode == 0, done.stderr
        return [json.loads(x) for x in out.read_text().splitlines()]


def text(line: dict[str, Any]) -> str:
    body = (
        line["response"]["body"] if "status_code" in line.get("response", {}) else line["response"]
    )
    return str(body["choices"][0]["message"]["content"])


def test_two_openai_files_reusing_a_custom_id_both_run(
    running: Running, tmp_path: Path, fresh_id: str
) -> None:
    cli = Cli(running, tmp_path)
    odd = f"{fresh_id} row #1 / é"  # any string OpenAI takes is a custom_id
    first, lines_1 = cli.submit(
        [request("request-1", "first file"), request(odd, "odd id")], "--format", "openai"
    )
    second, lines_2 = cli.submit([request("request-1", "second file")], "--format", "openai")
    assert first != second
    assert [x["custom_id"] for x in lines_1] == ["request-1", odd]
    assert text(lines_1[0]) == "Echo: first file" and text(lines_1[1]) == "Echo: odd id"
    assert [(x["custom_id"], text(x)) for x in lines_2] == [("request-1", "Echo: second file")]
    # the same file again is another batch, so it runs again, as OpenAI would
    third, lines_3 = cli.submit([request("request-1", "second file")], "--format", "openai")
    assert third not in (first, second) and text(lines_3[0]) == "Echo: second file"
    # an id of a batch's own is found through its batch
    shown = cli("result", "request-1", "--batch", first)
    assert shown.returncode == 0 and "Echo: first file" in shown.stdout, shown.stderr
    assert cli("result", "request-1").returncode == 1  # not an id of the namespace
    # in a namespace a user names, a custom_id is claimed there, and a refusal names it so
    cli.submit([request("request-1", "named")], "--format", "openai", "--namespace", fresh_id)
    path = cli.write([request("request-1", "changed")])
    refused = cli("submit", path, "--format", "openai", "--namespace", fresh_id)
    assert refused.returncode == 2
    assert not list(tmp_path.glob("results*"))  # refused: no results file left behind
    assert f"{path}:1: custom_id: 'request-1' was already submitted" in refused.stderr


def test_a_batchs_results_never_change_and_rerun_changed_runs_only_the_changed_id(
    running: Running, tmp_path: Path, fresh_id: str
) -> None:
    cli = Cli(running, tmp_path)
    a, b = f"{fresh_id}/a", f"{fresh_id}/b"
    first, lines = cli.submit([spec(a, "Ada"), spec(b, "same")])
    assert [(x["id"], x["attempt"], x["batch"]) for x in lines] == [(a, 1, first), (b, 1, first)]
    refused = cli("submit", cli.write([spec(a, "Grace"), spec(b, "same")]))
    assert refused.returncode == 2 and "--rerun changed" in refused.stderr
    second, again = cli.submit([spec(a, "Grace"), spec(b, "same")], "--rerun", "changed")
    assert [(x["id"], x["attempt"]) for x in again] == [(a, 2), (b, 1)]  # b: its first run
    assert text(again[0]) == "Echo: Grace" and text(again[1]) == "Echo: same"
    _, every = cli.submit([spec(a, "Grace"), spec(b, "same")], "--rerun", "all")
    assert [(x["id"], x["attempt"]) for x in every] == [(a, 3), (b, 2)]
    # the first batch's results are the runs it ran, whatever its ids ran since
    before = cli.results(first)
    assert [(x["id"], x["attempt"], x["batch"], text(x)) for x in before] == [
        (a, 1, first, "Echo: Ada"),
        (b, 1, first, "Echo: same"),
    ]
    assert [x["attempt"] for x in cli.results(second)] == [2, 1]
    assert "Echo: Grace" in cli("result", a).stdout  # the id's latest run in the namespace
    assert "Echo: Ada" in cli("result", a, "--batch", first).stdout


def test_resample_runs_again_and_a_namespace_keeps_ids_apart(
    running: Running, tmp_path: Path, fresh_id: str
) -> None:
    cli = Cli(running, tmp_path)
    q = f"{fresh_id}/q"
    first, _ = cli.submit([spec(q, "one")])
    resampled, lines = cli.submit([spec(q, "one")], "--resample")
    assert lines[0]["batch"] == resampled and lines[0]["attempt"] == 1
    config = running.fleet.config()
    client = Client(running.redis_url, config=config)
    first_sk = Client(running.redis_url, config=config, lookup_batch=first).session_key(q)
    assert first_sk is not None and client.session_key(q) == first_sk  # the namespace's, still
    with_batch = Client(running.redis_url, config=config, lookup_batch=resampled)
    assert with_batch.session_key(q) not in (None, first_sk)  # another run of the same spec
    # another namespace: the same id with another spec is another id, refused nowhere
    _, lines = cli.submit([spec(q, "two")], "--namespace", "team-b")
    assert text(lines[0]) == "Echo: two" and lines[0]["attempt"] == 1
    assert "Echo: one" in cli("result", q).stdout
    assert "Echo: two" in cli("result", q, "--namespace", "team-b").stdout
    assert cli("submit", cli.write([spec(q, "x")]), "--namespace", "bad/name").returncode == 2
    client.close()
    with_batch.close()


def test_an_openai_output_line_counts_every_rounds_usage(
    running: Running, tmp_path: Path, fresh_id: str
) -> None:
    cli = Cli(running, tmp_path)
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps({"get_weather": {"module": WEATHER_WASM, "export": "get_weather"}}))
    line = request("w1", "Weather in Paris?", model="replay/weather", tools=[WEATHER_TOOL])
    batch, lines = cli.submit(
        [line], "--format", "openai", "--tools", str(tools), "--include", "transcript"
    )
    body = lines[0]["response"]["body"]
    record = Client(running.redis_url, config=running.fleet.config(), lookup_batch=batch).record(
        "w1"
    )
    assert record is not None and record["metrics"]["iterations"] == 2
    total = record["metrics"]["usage"]
    assert (
        body["usage"] == total
        and total["total_tokens"] > body["_cchatq"]["round_usage"]["total_tokens"]
    )
    assert body["_cchatq"]["rounds"] == 2
    roles = [m["role"] for m in body["_cchatq"]["transcript"]]
    assert roles == ["user", "assistant", "tool", "assistant"]
    assert cli.results(batch, "--format", "openai")[0]["response"]["body"]["usage"] == total
