"""Every route of `cchatq view` through Starlette's TestClient, over results files (no Redis):
pages and JSON twins, the DOM the browser tests select, escaping of a hostile prompt, ids
holding `/` and `#`, 404 pages, the token rule and the Host check; and the command's refusals."""

from __future__ import annotations

import re
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
from starlette.testclient import TestClient

from producer.cli import main
from producer.cli_common import redacted
from producer.viewer.app import HERE, create_app
from producer.viewer.auth import COOKIE, host_name, is_loopback
from producer.viewer.file_source import FileSource
from producer.viewer.model import RunRow
from producer.viewer.serve import run_viewer
from tests.viewer_data import HOSTILE, program_line, session_line, write_lines

BASE = "http://127.0.0.1"
ODD_ID = "eval/7#a:b@c+d/trace"  # a `/`, a `#`, and an ending that looks like the trace route


def q(value: str) -> str:
    return quote(value, safe="")


@pytest.fixture()
def results(tmp_path: Path) -> Path:
    lines = [
        session_line("b1/ok", latency_ms=300, tokens=50),
        session_line("b1/slow", latency_ms=900, tokens=20),
        session_line("b1/fail", code="provider_error", tools=False),
        session_line("b1/hostile", prompt=HOSTILE),
        session_line(ODD_ID),
        program_line("b1/prog"),
    ]
    return write_lines(tmp_path / "results.jsonl", lines)


@pytest.fixture()
def client(results: Path) -> Iterator[TestClient]:
    app = create_app(FileSource([results]), hosts={"127.0.0.1", "localhost"})
    with TestClient(app, base_url=BASE) as test_client:
        yield test_client


def test_healthz_and_static(client: TestClient) -> None:
    assert client.get("/healthz").text == "ok"
    assert "view.css" in client.get("/").text
    css = client.get("/static/view.css")
    assert css.status_code == 200 and "text/css" in css.headers["content-type"]
    assert client.get("/static/view.js").status_code == 200


def test_runs_page_lists_batches_and_program_runs(client: TestClient) -> None:
    page = client.get("/")
    assert page.status_code == 200
    html = page.text
    assert '<table id="runs"' in html
    row = re.search(r'<tr data-kind="batch" data-batch="b1".*?</tr>', html, re.S)
    assert row is not None
    cells = dict(re.findall(r'data-field="(\w+)"[^>]*>(.*?)</td>', row.group(0), re.S))
    assert cells["done"] == "6" and cells["failed"] == "1" and cells["queued"] == "0"
    assert ">done<" in cells["status"]
    assert '<a href="/batch/b1">' in row.group(0)
    assert 'data-kind="program" data-run="b1/prog"' in html
    assert f'href="/session/{q("b1/prog")}"' in html
    fragment = client.get("/?fragment=runs").text
    assert fragment.startswith('<div id="runs-live"') and '<table id="runs"' in fragment
    runs = client.get("/api/runs").json()["runs"]
    assert [(r["kind"], r["key"], r["status"]) for r in runs] == [
        ("batch", "b1", "done"),
        ("program", "b1/prog", "done"),
    ]


def test_batch_page_counts_filters_and_links(client: TestClient) -> None:
    html = client.get("/batch/b1").text
    assert '<section id="counts"' in html
    assert re.search(r'data-outcome="ok".*?<span class="value">5</span>', html, re.S)
    assert re.search(r'data-outcome="provider_error".*?<span class="value">1</span>', html, re.S)
    assert '<form id="filter"' in html
    for name in ("status", "code", "tool", "q", "sort"):
        assert f'name="{name}"' in html
    assert html.count("<tr data-session=") == 6
    assert f'href="/session/{q(ODD_ID)}?batch=b1"' in html  # the run this batch ran
    failed = client.get("/batch/b1", params={"status": "error"}).text
    assert re.findall(r'data-session="([^"]+)"', failed) == ["b1/fail"]
    assert '<td data-field="code">provider_error</td>' in failed
    slow = client.get("/batch/b1", params={"sort": "latency", "tool": "calculate", "q": "b1/"})
    assert re.findall(r'data-session="([^"]+)"', slow.text)[0] == "b1/slow"
    api = client.get("/api/batch/b1", params={"code": "provider_error"}).json()
    assert [r["spec_id"] for r in api["rows"]] == ["b1/fail"]
    assert api["outcomes"] == {"ok": 5, "provider_error": 1}


def test_session_page_shows_thread_and_summary(client: TestClient) -> None:
    html = client.get(f"/session/{q('b1/ok')}").text
    summary = html[html.index('id="summary"') : html.index('id="thread"')]
    assert '<dd data-field="latency_ms"' in summary and ">300</dd>" in summary
    assert re.search(r'data-field="tokens_in">40<', summary)
    thread = html[html.index('id="thread"') :]
    roles = re.findall(r'class="msg role-\w+" data-role="(\w+)"', thread)
    assert roles == ["system", "user", "assistant", "tool", "assistant"]
    assert '<details class="thinking">' in thread
    assert 'class="tool-call" data-call-id="call_0_0" data-tool="calculate"' in thread
    assert '<pre class="args">{\n  &#34;a&#34;: 1,' in thread
    assert '<pre class="result">' in thread and 'data-field="retries">0<' in thread
    assert 'id="timeline"' in html and "results file keeps no trace" in html
    assert 'id="trace-link"' not in html and 'id="flower-link"' not in html  # offline
    data = client.get(f"/api/session/{q('b1/ok')}").json()
    assert data["status"] == "ok" and data["live"] is False
    assert [m["role"] for m in data["messages"]][:2] == ["system", "user"]


def test_a_failed_session_shows_its_error(client: TestClient) -> None:
    html = client.get(f"/session/{q('b1/fail')}").text
    error = html[html.index('id="error"') :]
    assert "provider_error" in error and "provider_error happened" in error
    assert '<dd data-field="code">provider_error</dd>' in html


def test_a_hostile_prompt_shows_as_text(client: TestClient) -> None:
    html = client.get(f"/session/{q('b1/hostile')}").text
    assert HOSTILE not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert client.get(f"/api/session/{q('b1/hostile')}").json()["messages"][1]["content"] == (
        HOSTILE
    )
    assert "script-src 'self'" in client.get("/").headers["content-security-policy"]


def test_ids_with_slash_and_hash_round_trip(client: TestClient) -> None:
    page = client.get(f"/session/{q(ODD_ID)}")
    assert page.status_code == 200 and '<span class="id">eval/7#a:b@c+d/trace</span>' in page.text
    assert client.get(f"/api/session/{q(ODD_ID)}").json()["spec_id"] == ODD_ID
    # its trace route: a results file keeps none
    trace = client.get(f"/api/session/{q(ODD_ID)}/trace")
    assert trace.status_code == 404 and "trace" in trace.json()["error"]


def test_program_run_page(client: TestClient) -> None:
    html = client.get(f"/session/{q('b1/prog')}").text
    for part in ("chats", "forks", "logs", "frames", "stdout"):
        assert f'id="{part}"' in html
    chats = html[html.index('id="chats"') : html.index('id="forks"')]
    assert f'href="/session/{q("b1/prog#send0")}"' in chats
    assert "ANSWER: Echo: hi" in html and "summing" in html
    chat = client.get(f"/session/{q('b1/prog#send0')}")
    assert chat.status_code == 200 and "Echo: hi" in chat.text


def test_unknown_ids_get_a_clear_404(client: TestClient) -> None:
    for path, what in (
        (f"/session/{q('nope/1')}", "No session nope/1 in files results.jsonl"),
        ("/batch/nope", "No batch nope in"),
        ("/nothing/here", "No page"),
    ):
        page = client.get(path)
        assert page.status_code == 404 and what in page.text and 'id="not-found"' in page.text
    assert client.get("/api/batch/nope").status_code == 404
    assert client.get(f"/api/session/{q('nope')}").json()["error"].startswith("No session")


def test_token_is_required_when_set(results: Path) -> None:
    app = create_app(FileSource([results]), token="s3cret")
    with TestClient(app, base_url="http://10.0.0.5") as client:
        refused = client.get("/")
        assert refused.status_code == 401 and "token" in refused.text
        assert client.get("/", params={"token": "wrong"}).status_code == 401
        assert client.get("/", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        first = client.get("/api/runs", params={"token": "s3cret"})
        assert first.status_code == 200 and COOKIE in first.headers["set-cookie"]
        assert "HttpOnly" in first.headers["set-cookie"]
        assert client.get("/batch/b1").status_code == 200  # the cookie, from now on


def test_host_check_without_token(client: TestClient) -> None:
    assert client.get("/", headers={"host": "evil.example:8808"}).status_code == 400
    assert client.get("/", headers={"host": "localhost:8808"}).status_code == 200
    assert host_name("[::1]:8808") == "::1" and host_name("127.0.0.1:1") == "127.0.0.1"
    assert is_loopback("127.0.0.2") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("example.com")


def test_templates_never_turn_escaping_off() -> None:
    for template in (HERE / "templates").glob("*.html"):
        text = template.read_text()
        assert "|safe" not in text.replace(" ", ""), template.name
        assert "autoescape" not in text and "Markup" not in text, template.name


class Broken(FileSource):
    def runs(self) -> list[RunRow]:
        raise ConnectionError("gone")


def test_a_source_that_fails_gets_a_503_page(results: Path) -> None:
    app = create_app(Broken([results]))
    with TestClient(app, base_url=BASE, raise_server_exceptions=False) as client:
        page = client.get("/")
        assert page.status_code == 503 and "could not be read (ConnectionError)" in page.text
        assert client.get("/api/runs").json()["error"].startswith("files results.jsonl")


def test_a_redis_url_is_shown_without_its_password() -> None:
    assert redacted("redis://:pw@host:6380/2") == "redis://:***@host:6380/2"
    assert redacted("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


# the command -------------------------------------------------------------------------------


def test_a_public_host_without_token_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_viewer([], "0.0.0.0", 0, None, stream=sys.stderr) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--token" in err


def test_a_malformed_results_file_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text("{}\n")
    assert main(["view", str(path), "--port", "0"]) == 2
    assert "bad.jsonl:1: not a result line" in capsys.readouterr().err


def test_no_redis_is_refused_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("REDIS_URL", f"redis://127.0.0.1:{port}/0")
    assert main(["view", "--port", "0"]) == 4
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"cannot reach Redis at redis://127.0.0.1:{port}/0" in err


def test_without_the_extra_the_command_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delitem(sys.modules, "producer.viewer.serve", raising=False)
    monkeypatch.setitem(sys.modules, "uvicorn", None)
    assert main(["view"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'cchatq[view]'" in err
