"""The fleet's configuration (schemas/config.py), shared by the producer and the workers: its
validation, `cchatq config check`, and the checks submit makes with it (unknown backend, unset
API key variable), from the CLI and from `Client.submit` alike. No Redis is needed: all of it
is refused before anything is enqueued, which the unused REDIS_URL proves."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from producer.backend_check import backend_check
from producer.client import Client
from producer.specfile import SpecFileError, load_spec_file
from schemas.config import ConfigError, parse_config, read_config
from schemas.fleet_config import builtin_backends
from worker.config import load_settings

ROOT = Path(__file__).resolve().parents[1]
NO_REDIS = "redis://127.0.0.1:9/0"  # nothing listens there: a test that reaches Redis fails


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {"REDIS_URL": NO_REDIS, "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [sys.executable, "-m", "producer.cli", *args],
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )


def problems(raw: Any) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(raw)
    return [f"{path}: {message}" for path, message in info.value.problems]


def test_without_configuration_the_named_backends_are_the_real_apis_and_replay_is_local() -> None:
    config = read_config({})
    assert config.default_backend == "replay"
    assert config.backends["openai"].base_url == "https://api.openai.com/v1"
    assert config.backends["openai"].api_key_env == "OPENAI_API_KEY"
    assert config.backends["anthropic"].protocol == "anthropic"
    assert config.backends["anthropic"].api_key_env == "ANTHROPIC_API_KEY"
    assert config.backends["gemini"].base_url.startswith("https://generativelanguage.")
    assert config.backends["gemini"].api_key_env == "GEMINI_API_KEY"
    assert config.backends["replay"].base_url == "http://127.0.0.1:8011/v1"
    assert config.backends["replay"].api_key_env is None
    local = read_config({"CCHATQ_REPLAY_URL": "http://10.0.0.2:9/v1"})
    assert local.backends["replay"].base_url == "http://10.0.0.2:9/v1"
    # the workers read the very same thing
    assert load_settings({}).fleet.backends == config.backends


def test_the_configuration_is_checked_strictly_and_every_problem_named() -> None:
    found = problems(
        {
            "backends": {
                "x": {"stream": "yes", "max_attempts": "four", "base_url": "http://h/v1"},
                "y": {"protocol": "openai"},
                "z": {"base_url": "ftp://h", "api_key_env": "A KEY", "read_timeout_s": -1},
                "w": 3,
            },
            "default_backend": "nowhere",
            "colour": "blue",
        }
    )
    assert found == [
        "colour: unknown key",
        "backends.x.max_attempts: must be an integer",
        "backends.x.stream: must be true or false",
        "backends.y.base_url: required (only a built-in backend has one)",
        "backends.z.base_url: Not a valid URL.",
        "backends.z.api_key_env: must be a variable name",
        "backends.z.read_timeout_s: must be a positive number of seconds",
        "backends.w: must be an object",
        "default_backend: 'nowhere' is not a backend",
    ]
    assert problems({"backends": {"b": {"base_url": "http://h", "protocol": "grpc"}}}) == [
        "backends.b.protocol: Must be one of: openai, anthropic, gemini, openai-text-tags."
    ]
    assert problems([]) == [": must be a JSON object"]


def test_a_built_in_backend_configured_changes_only_what_it_gives() -> None:
    config = parse_config({"backends": {"openai": {"stream": True, "max_attempts": 2}}})
    openai = config.backends["openai"]
    assert (openai.stream, openai.max_attempts) == (True, 2)
    assert openai.base_url == builtin_backends()["openai"].base_url
    custom = parse_config({"backends": {"mine": {"base_url": "http://gpu-box:8000/v1"}}})
    assert custom.backends["mine"].protocol == "openai"


def test_the_example_configuration_passes(tmp_path: Path) -> None:
    example = ROOT / "fixtures" / "config" / "cchatq.json"
    config = read_config({"CCHATQ_CONFIG": str(example)})
    assert "claude" in config.backends
    broken = tmp_path / "broken.json"
    broken.write_text('{"backends": {"x": {"base_url": "http://h", "stream": "yes"}}}')
    with pytest.raises(ConfigError, match=r"broken\.json.*\n  backends\.x\.stream: must be true"):
        read_config({"CCHATQ_CONFIG": str(broken)})
    broken.write_text("{nope")
    with pytest.raises(ConfigError, match=r"invalid JSON: .* \(line 1 column 2\)"):
        read_config({"CCHATQ_CONFIG": str(broken)})


def test_config_check_lists_backends_and_keys_or_names_each_problem(tmp_path: Path) -> None:
    shown = cli("config", "check", env={"OPENAI_API_KEY": "sk-test"})
    assert shown.returncode == 0, shown.stderr
    assert "default backend: replay" in shown.stdout
    assert "$OPENAI_API_KEY set" in shown.stdout
    assert "$ANTHROPIC_API_KEY NOT SET here" in shown.stdout
    assert "sk-test" not in shown.stdout  # a key's value is never shown
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"backends": {"b": {"max_attempts": "four"}}}))
    refused = cli("config", "check", "--file", str(bad))
    assert refused.returncode == 2
    assert "backends.b.max_attempts: must be an integer" in refused.stderr
    assert "backends.b.base_url: required" in refused.stderr
    assert "Traceback" not in refused.stderr


def spec(spec_id: str, **fields: Any) -> dict[str, Any]:
    return {
        "id": spec_id,
        "model": "replay/plain",
        "messages": [{"role": "user", "content": "hi"}],
        **fields,
    }


def write(path: Path, *specs: dict[str, Any]) -> Path:
    path.write_text("".join(json.dumps(s) + "\n" for s in specs))
    return path


def test_submit_refuses_an_unknown_backend_and_an_unset_key_with_line_and_field(
    tmp_path: Path,
) -> None:
    path = write(
        tmp_path / "specs.jsonl",
        spec("a", provider="replay"),
        spec("b", provider="opneai"),
        spec("c", provider="openai"),
        spec("d", limits={"compress": "summarize", "compress_backend": "nope"}),
    )
    refused = cli("submit", str(path))
    assert refused.returncode == 2
    lines = refused.stderr.splitlines()
    assert lines[0] == "rejected, nothing enqueued:"
    assert lines[1].startswith(f"{path}:2: provider: unknown backend 'opneai'")
    assert lines[2] == (
        f"{path}:3: provider: backend 'openai' reads its API key from $OPENAI_API_KEY, which is"
        " not set (--no-key-check when only the workers hold it)"
    )
    assert lines[3].startswith(f"{path}:4: limits.compress_backend: unknown backend 'nope'")
    assert len(lines) == 4
    # the key set, or the check turned off: that line passes (and submit goes on to Redis)
    config, one = read_config({}), write(tmp_path / "c.jsonl", spec("c", provider="openai"))
    assert load_spec_file(one, backend_check(config, {"OPENAI_API_KEY": "sk-x"}))
    assert load_spec_file(one, backend_check(config, {}, check_keys=False))
    # a backend the configuration names is known to submit as to the workers
    configured = json.dumps({"backends": {"opneai": {"base_url": "http://127.0.0.1:9/v1"}}})
    again = cli("submit", str(path), env={"CCHATQ_BACKENDS": configured, "OPENAI_API_KEY": "k"})
    assert "provider" not in again.stderr and ":4: limits.compress_backend" in again.stderr


def test_a_default_backend_without_its_key_is_named_as_the_default(tmp_path: Path) -> None:
    path = write(tmp_path / "specs.jsonl", spec("a"))
    configured = json.dumps({"default_backend": "anthropic"})
    refused = cli("submit", str(path), env={"CCHATQ_BACKENDS": configured})
    assert refused.returncode == 2
    assert (
        f"{path}:1: provider: backend 'anthropic' (the default backend, 'anthropic') reads its"
        " API key from $ANTHROPIC_API_KEY" in refused.stderr
    )


def test_a_broken_configuration_refuses_submit_before_the_file_is_read(tmp_path: Path) -> None:
    path = write(tmp_path / "specs.jsonl", spec("a"))
    refused = cli("submit", str(path), env={"CCHATQ_BACKENDS": '{"default_backend": 7}'})
    assert refused.returncode == 2
    assert "configuration (CCHATQ_BACKENDS):\n  default_backend: Not a valid string." in (
        refused.stderr
    )


def test_client_submit_validates_as_the_cli_does(tmp_path: Path) -> None:
    bad = {"id": "no-messages", "model": "replay/plain"}
    path = write(tmp_path / "specs.jsonl", bad)
    from_cli = cli("submit", str(path)).stderr.splitlines()[1]
    client = Client(NO_REDIS, config=read_config({}))
    try:
        with pytest.raises(SpecFileError) as info:
            client.submit([bad])
        assert [str(issue) for issue in info.value.issues] == [
            "<specs>:1: messages: Missing data for required field."
        ]
        assert from_cli == f"{path}:1: messages: Missing data for required field."
        with pytest.raises(SpecFileError, match="<specs>:2: provider: unknown backend 'x'"):
            client.submit([spec("ok"), spec("x", provider="x")])
    finally:
        client.close()


def test_a_worker_with_a_broken_configuration_names_the_problem_and_does_not_start() -> None:
    bad = json.dumps({"backends": {"openai": {"stream": "yes"}}})
    refused = cli("worker", "--queues", "llm", env={"CCHATQ_BACKENDS": bad})
    assert refused.returncode == 2
    assert refused.stderr == (
        "configuration (CCHATQ_BACKENDS):\n  backends.openai.stream: must be true or false\n"
    )
