"""Every `cchatq` command that talks to Redis fails fast and plainly when it cannot: one line
on stderr naming the URL (and how to start a Redis, or the accepted schemes), exit code 4
(EXIT_UNREACHABLE), no traceback. Redis down, a server that never answers, an unknown host and
a URL that is not a Redis URL each, for each command: in-process (main() returns, having
printed one line), and as real processes for a few."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from producer import cli, cli_common
from producer.cli_common import EXIT_UNREACHABLE, redacted, unreachable_message
from tests.conftest import GUESTS

GUARD_S = 10  # a hung command fails the test instead of hanging it (not the assertion)


@pytest.fixture(scope="module")
def refused_port() -> int:
    with socket.socket() as sock:  # bound, never listening: a connection is refused
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def silent_port() -> Iterator[int]:
    """A socket the kernel accepts connections on and that never replies: a PING times out."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        yield int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def spec_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("infra") / "specs.jsonl"
    spec = {
        "id": "infra/a",
        "model": "replay/plain",
        "messages": [{"role": "user", "content": "x"}],
    }
    path.write_text(json.dumps(spec) + "\n")
    return path


COMMANDS = {
    "submit": ["submit", "{specs}", "--out", "{out}"],
    "status": ["status"],
    "status ID": ["status", "some-id"],
    "batch list": ["batch", "list"],
    "batch status": ["batch", "status", "some-batch"],
    "batch results": ["batch", "results", "some-batch", "--wait", "--out", "{out}"],
    "result": ["result", "some-id"],
    "trace": ["trace", "some-id"],
    "cancel": ["cancel", "some-id"],
    "stream": ["stream", "some-id"],
    "run": ["run", str(GUESTS / "prog_chat.wasm"), "--model", "replay/plain"],
    "view": ["view", "--port", "0"],
    "metrics": ["metrics", "--port", "0"],
}


@pytest.fixture()
def in_process(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path,
    spec_file: Path,
) -> Callable[[list[str], str], tuple[int, str, str]]:  # fmt: skip
    """`cchatq ARGS` run by main() here, with REDIS_URL=url: (exit code, stdout, stderr)."""
    for name in [k for k in os.environ if k.startswith("CCHATQ_")]:
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)

    def run(args: list[str], url: str) -> tuple[int, str, str]:
        monkeypatch.setenv("REDIS_URL", url)
        shown = [a.format(specs=spec_file, out=tmp_path / "out.jsonl") for a in args]
        code = cli.main(shown)  # an exception fails the test: it would be a traceback
        out, err = capsys.readouterr()
        return code, out, err

    return run


Run = Callable[[list[str], str], tuple[int, str, str]]


def run_cli(args: list[str], url: str, tmp_path: Path, spec_file: Path) -> tuple[int, str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CCHATQ_")}
    env["REDIS_URL"] = url
    shown = [a.format(specs=spec_file, out=tmp_path / "out.jsonl") for a in args]
    proc = subprocess.run(
        [sys.executable, "-m", "producer.cli", *shown],
        env=env, capture_output=True, text=True, timeout=GUARD_S, cwd=tmp_path,
    )  # fmt: skip
    return proc.returncode, proc.stdout, proc.stderr


def assert_one_line(code: int, stdout: str, stderr: str, *said: str) -> None:
    assert "Traceback" not in stderr + stdout
    assert code == EXIT_UNREACHABLE, stderr
    assert stderr.count("\n") == 1 and stderr.startswith("cchatq: "), stderr
    for part in said:
        assert part in stderr, stderr


@pytest.mark.parametrize("command", COMMANDS)
def test_redis_down(command: str, refused_port: int, in_process: Run) -> None:
    url = f"redis://127.0.0.1:{refused_port}/0"
    assert_one_line(
        *in_process(COMMANDS[command], url),
        f"cannot reach Redis at {url} (Connection refused)",
        f"redis-server --port {refused_port}",
        "REDIS_URL",
    )


@pytest.mark.parametrize("command", COMMANDS)
def test_a_server_that_never_answers(
    command: str, silent_port: int, in_process: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cli_common, "PROBE_TIMEOUT_S", 0.2)  # the real wait: the test below
    url = f"redis://127.0.0.1:{silent_port}/0"
    assert_one_line(
        *in_process(COMMANDS[command], url), f"cannot reach Redis at {url} (no answer within 0.2 s)"
    )


@pytest.mark.parametrize("command", COMMANDS)
def test_an_unknown_host(command: str, in_process: Run) -> None:
    url = "redis://no-such-host.invalid:6379/0"
    assert_one_line(
        *in_process(COMMANDS[command], url),
        f"cannot reach Redis at {url} (unknown host",
        "check the host name in REDIS_URL",
    )


@pytest.mark.parametrize("command", COMMANDS)
def test_a_url_that_is_not_redis(command: str, in_process: Run) -> None:
    assert_one_line(
        *in_process(COMMANDS[command], "http://x:6379/0"),
        "REDIS_URL 'http://x:6379/0' is not a Redis URL",
        "redis://, rediss://, unix://",
    )


@pytest.mark.parametrize("command", ["submit", "batch status", "run"])
def test_as_a_process(
    command: str, refused_port: int, silent_port: int, tmp_path: Path, spec_file: Path
) -> None:
    """The whole program: its exit code and its stderr, within the probe's 2 s a try."""
    for url, reason in (
        (f"redis://127.0.0.1:{refused_port}/0", "Connection refused"),
        (f"redis://127.0.0.1:{silent_port}/0", "no answer within 2 s"),
    ):
        assert_one_line(*run_cli(COMMANDS[command], url, tmp_path, spec_file), f"{url} ({reason})")


def test_a_missing_unix_socket_and_a_bad_port(tmp_path: Path, spec_file: Path) -> None:
    sock = tmp_path / "redis.sock"
    assert_one_line(
        *run_cli(["status"], f"unix://{sock}", tmp_path, spec_file),
        f"cannot reach Redis at unix://{sock} (No such file or directory)",
        f"redis-server --unixsocket {sock}",
    )
    assert_one_line(
        *run_cli(["status"], "redis://:pw@127.0.0.1:nope/0", tmp_path, spec_file),
        "REDIS_URL 'redis://:***@127.0.0.1:nope/0' is not valid",
    )


def test_a_connection_lost_later_ends_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], refused_port: int
) -> None:
    """Past the first contact the client rides out a restart for its RECONNECT_S; an error
    after that is one line too, not a traceback."""
    url = f"redis://:secret@127.0.0.1:{refused_port}/0"
    monkeypatch.setenv("REDIS_URL", url)

    def lost(**_: object) -> None:
        raise redis.ConnectionError(f"Error 111 connecting to 127.0.0.1:{refused_port}.")

    monkeypatch.setattr(cli, "connect", lost)
    assert cli.main(["status"]) == EXIT_UNREACHABLE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and redacted(url) in err and "secret" not in err


def test_the_message_never_shows_a_password() -> None:
    exc = redis.ConnectionError("refused")
    shown = unreachable_message("rediss://user:hunter2@cache:6380/1", exc)
    assert "hunter2" not in shown and "rediss://user:***@cache:6380/1" in shown
