"""The README works as written: its spec example runs on a fleet with the replay server, its
Python API example runs, every `cchatq` command line it shows parses, every `make` target,
environment variable and backend key it names exists, and its policy table is the declaration's."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import uuid
from dataclasses import fields
from pathlib import Path

import pytest

from fixtures.replay.catalog import MARKERS, replay_table
from fixtures.replay.scenarios import SCENARIOS
from producer.cli import build_parser
from schemas.fleet_config import BackendConfig
from schemas.tool_policy import policy_table
from tests.conftest import Running
from tests.test_local_fleet import clean_env, marked_processes, wait_until_gone

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
# placeholders the README writes in its command lines, and a value each
PLACEHOLDERS = {"ID": "some/id", "B": "b123", "F": "out.jsonl", "CALL_ID": "c1", "NAME": "replay",
                "M": "m", "A": "a", "FILE": "in.txt", "Q": "llm", "DIR": "."}  # fmt: skip


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def command_lines() -> list[str]:
    lines = []
    for block in blocks("sh"):
        for line in block.splitlines():
            if line.startswith("cchatq "):
                lines.append(re.split(r" +# ", line)[0].strip())
    return lines


def test_the_readme_shows_commands_to_check() -> None:
    assert len(command_lines()) >= 25
    assert len(blocks("python")) == 1
    assert blocks("json")[0].startswith('{"id": "eval-17/0042"')


@pytest.mark.parametrize("line", command_lines())
def test_every_cchatq_command_line_parses(line: str) -> None:
    words = []
    for word in shlex.split(line)[1:]:
        word = word.strip("[]")
        if word == "...":
            continue
        words.append(PLACEHOLDERS.get(word, word))
    if words == ["--version"]:
        with pytest.raises(SystemExit) as shown:
            build_parser().parse_args(words)
        assert shown.value.code == 0
        return
    args = build_parser().parse_args(words)
    assert callable(args.fn)


def test_every_make_target_environment_variable_and_backend_key_exists() -> None:
    makefile = (ROOT / "Makefile").read_text()
    for target in set(re.findall(r"`make (\w+)", README)) | {"demo", "test"}:
        assert re.search(rf"^{target}:", makefile, flags=re.M), target
    sources = "".join(
        p.read_text() for d in ("worker", "producer", "schemas") for p in (ROOT / d).rglob("*.py")
    )
    for variable in set(re.findall(r"`(CCHATQ_[A-Z_]+)`", README)):
        assert f'"{variable}"' in sources, f"{variable} is read nowhere"
    table = README.split("| key | default | meaning |", 1)[1].split("\n\n", 1)[0]
    named = set(re.findall(r"^\| `(\w+)`(?:, `(\w+)`)?(?:, `(\w+)`)?(?:, `(\w+)`)?", table, re.M))
    keys = {k for row in named for k in row if k}
    assert keys and keys <= {f.name for f in fields(BackendConfig)}, keys


def test_the_policy_table_is_the_declarations() -> None:
    """A policy field's row is written from its declaration (schemas/tool_policy.py)."""
    table = policy_table()
    assert table in README, f"the README's policy table should read:\n{table}"


def section(heading: str) -> str:
    """A section's text, from its heading to the next heading of its level or above."""
    level = heading.split(" ", 1)[0]
    assert f"\n{heading}\n" in README, f"README.md has no section {heading!r}"
    text = README.split(f"\n{heading}\n", 1)[1]
    return re.split(rf"\n#{{1,{len(level)}}} ", text, maxsplit=1)[0]


def test_the_replay_table_names_every_model_and_marker() -> None:
    """Every scenario fixtures/replay/scenarios.py defines, and every marker, has its row, as
    fixtures/replay/catalog.py writes it (`python -m fixtures.replay.catalog`)."""
    text = section("### Replay models and markers")
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    models = {m for row in rows for m in re.findall(r"^\| `replay/(\w+)`", row)}
    assert models == set(SCENARIOS), f"missing {SCENARIOS - models}, unknown {models - SCENARIOS}"
    for syntax, _ in MARKERS.values():
        assert any(row.startswith(f"| `{syntax}` |") for row in rows), syntax
    assert replay_table() in text, f"the table should read:\n{replay_table()}"


@pytest.mark.fleet
def test_the_quickstart_runs_as_written(tmp_path: Path) -> None:
    """The quickstart's first sh block, but `make` lines and comments, in `bash -e`: in a
    folder of its own that sees the checkout's .venv and fixtures (so results.jsonl and the
    fleet's folder land there), in an environment with no fleet's address or configuration.
    It ends 0, and leaves no fleet folder and no process `cchatq up` started."""
    (block, *_) = re.findall(r"```sh\n(.*?)```", section("## Quickstart"), flags=re.S)
    lines = [
        line
        for line in block.splitlines()
        if line.strip() and not line.lstrip().startswith("#") and not line.startswith("make ")
    ]
    assert any("cchatq up" in line for line in lines) and "cchatq down" in lines[-1]
    for name in (".venv", "fixtures"):
        (tmp_path / name).symlink_to(ROOT / name)
    mark = uuid.uuid4().hex
    env = clean_env(mark, venv_on_path=False)  # `. .venv/bin/activate` puts cchatq there
    ran = subprocess.run(
        ["bash", "-e", "-c", "\n".join(lines)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    left = wait_until_gone(mark)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert not (tmp_path / ".cchatq-fleet").exists()
    assert left == [] and marked_processes(mark) == []
    results = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert results and all(r["status"] == "ok" for r in results)


@pytest.mark.fleet
def test_the_spec_example_runs_as_written(running: Running, tmp_path: Path) -> None:
    example = json.loads(blocks("json")[0])
    (tmp_path / "fixtures").symlink_to(ROOT / "fixtures")  # its module path, beside the file
    path = tmp_path / "sessions.jsonl"
    path.write_text(json.dumps(example) + "\n")
    out = tmp_path / "results.jsonl"
    env = {"REDIS_URL": running.redis_url, "PATH": os.environ["PATH"]}
    ran = subprocess.run(
        [sys.executable, "-m", "producer.cli", "submit", str(path), "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    (result,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert result["id"] == "eval-17/0042" and result["status"] == "ok"
    assert result["metrics"]["tool_calls"] == 1
    assert "Paris" in result["response"]["choices"][0]["message"]["content"]


@pytest.mark.fleet
def test_the_python_api_example_runs_as_written(running: Running, tmp_path: Path) -> None:
    env = {"REDIS_URL": running.redis_url, "PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT)}
    ran = subprocess.run(
        [sys.executable, "-c", blocks("python")[0]],
        env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    lines = ran.stdout.splitlines()
    assert lines[0].startswith("batch ") and lines[0].endswith(" 3 sessions")
    assert sorted(lines[1:4]) == [f"readme/{n} ok Echo: Say hello to {n}" for n in range(3)]
    assert lines[4] == "{'ok': 3}"


@pytest.mark.fleet
def test_the_openai_batch_example_runs_as_written(running: Running, tmp_path: Path) -> None:
    (script,) = [b for b in blocks("sh") if "cat > batch.jsonl" in b]
    (tmp_path / "fixtures").symlink_to(ROOT / "fixtures")
    bin_dir = Path(sys.executable).parent  # where `cchatq` is installed beside this Python
    env = {"REDIS_URL": running.redis_url, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    ran = subprocess.run(
        ["bash", "-c", script], env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert "Traceback" not in ran.stderr, ran.stderr
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    errors = [json.loads(line) for line in (tmp_path / "out.errors.jsonl").read_text().splitlines()]
    assert [line["custom_id"] for line in out] == ["q1", "q2"]
    assert all(line["response"]["status_code"] == 200 for line in out)
    assert [(e["custom_id"], e["response"]["status_code"]) for e in errors] == [("q3", 400)]


# every import SPEAR's runtime gives module `spear` (lfedgeai/SPEAR's wasmedge import builder)
SPEAR_IMPORTS = (
    # time
    "time_now_ms",
    "wall_time_s",
    "random_i64",
    "log",
    "sleep_ms",
    # cchat
    "cchat_create",
    "cchat_write_msg",
    "cchat_write_fn",
    "cchat_ctl",
    "cchat_send",
    "cchat_recv",
    "cchat_close",
    # rtasr
    "rtasr_create",
    "rtasr_ctl",
    "rtasr_write",
    "rtasr_read",
    "rtasr_close",
    # mic
    "mic_create",
    "mic_ctl",
    "mic_read",
    "mic_close",
    # user
    "user_stream_open",
    "user_stream_read",
    "user_stream_write",
    "user_stream_close",
    "user_stream_ctl_open",
    "user_stream_ctl_read",
    # spear
    "spear_epoll_create",
    "spear_epoll_ctl",
    "spear_epoll_wait",
    "spear_epoll_close",
    "spear_fd_ctl",
)


def test_the_spear_compatibility_table_names_every_import_and_each_links() -> None:
    from worker.guest.hostcalls import SPEAR_IMPORTS as SERVED
    from worker.guest.hostcalls import UNSERVED_PREFIXES

    table = README.split("### SPEAR compatibility", 1)[1].split("\n\n", 3)[2]
    named = re.findall(
        r"`([a-z_0-9]+)`", "\n".join(line.split(" | ")[0] for line in table.splitlines())
    )
    assert sorted(named) == sorted(SPEAR_IMPORTS)
    for name in SPEAR_IMPORTS:
        assert name in SERVED or name.startswith(UNSERVED_PREFIXES), name
    for row in table.splitlines()[2:]:
        status = row.split(" | ")[1]
        for name in re.findall(r"`([a-z_0-9]+)`", row.split(" | ")[0]):
            assert (status == "served") == (name in SERVED), name
