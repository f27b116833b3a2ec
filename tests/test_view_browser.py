"""`cchatq view` in a real browser: headless chromium (Debian's, `make chromium`) driven by
Playwright against the viewer started as a subprocess, on a private Redis (database 12) with
real workers and the replay server. The selectors are the viewer's contract (its data-*
attributes, not its styling). Every wait is on a state (a DOM expectation with a timeout, a
batch's results); every test leaves a full-page screenshot in build/screenshots/<test>.png."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright

from bench.browser import VIEWPORT, Viewer, batch_path, launch_chromium, session_path
from fixtures.demo_scenarios import CALCULATE
from fixtures.replay.conversation import read_envelope
from producer.batch import Batch, Result
from producer.fleet import Fleet, free_port
from tests.conftest import ROOT, Running, _workers

pytestmark = pytest.mark.fleet

SHOTS = ROOT / "build" / "screenshots"
DEMO_DIR = ROOT / "fixtures" / "demo"  # CALCULATE's module path is relative to it
DB = 12
WAIT_MS = 60_000  # the longest a DOM expectation waits for a state (a loaded machine)
HOSTILE = '<script>window.__pwned=1</script><img src=x onerror="window.__pwned=1">'


# --- fixtures -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def view_fleet(base_fleet: Fleet) -> Iterator[Running]:
    """Workers for every queue on database 12 of the private Redis."""
    yield from _workers(base_fleet, db=DB)


@pytest.fixture(scope="module")
def viewer(view_fleet: Running, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Viewer]:
    """`cchatq view --port <free>` reading the fleet at REDIS_URL (database 12)."""
    log = tmp_path_factory.mktemp("viewer") / "viewer.log"
    env = {**os.environ, **view_fleet.fleet.env, "REDIS_URL": view_fleet.redis_url}
    running = Viewer.start([], env, log)
    yield running
    running.stop()


@pytest.fixture(scope="session")
def browser() -> Iterator[Browser]:
    with sync_playwright() as pw:
        chromium = launch_chromium(pw)
        yield chromium
        chromium.close()


@pytest.fixture()
def page(browser: Browser, request: pytest.FixtureRequest) -> Iterator[Page]:
    """A fresh browser context at 1280x800; its full-page screenshot is written at the end
    (a failed test's too: what the page showed)."""
    context = browser.new_context(viewport=VIEWPORT)
    tab = context.new_page()
    try:
        yield tab
    finally:
        SHOTS.mkdir(parents=True, exist_ok=True)
        if tab.url.startswith("http"):
            tab.screenshot(path=SHOTS / f"{request.node.name}.png", full_page=True)
        context.close()


# --- helpers ------------------------------------------------------------------------------


def submit(running: Running, specs: list[dict[str, Any]]) -> tuple[Batch, dict[str, Result]]:
    """Submit a batch through the Python API and wait for every result."""
    batch = running.client.submit(specs, base_dir=DEMO_DIR)
    results = {r.id: r for r in batch.results(timeout_s=120)}
    assert set(results) == {s["id"] for s in specs}
    return batch, results


def plain(spec_id: str, text: str, **extra: Any) -> dict[str, Any]:
    return {"id": spec_id, "model": "replay/plain",
            "messages": [{"role": "user", "content": text}], **extra}  # fmt: skip


def two_rounds(spec_id: str, a: int, b: int, factor: int) -> dict[str, Any]:
    text = f"Add {a} and {b}, then multiply by {factor}"
    return {"id": spec_id, "model": "replay/two_rounds",
            "messages": [{"role": "user", "content": text}], "tools": [CALCULATE]}  # fmt: skip


def failing(spec_id: str) -> dict[str, Any]:
    """The provider answers 400: the session ends with a provider_error body."""
    return plain(spec_id, f"Bad request {spec_id}") | {"model": "replay/bad_request"}


def trapping_tool(spec_id: str) -> dict[str, Any]:
    """A tool that traps: its call is answered with a RUNTIME_ERROR, the session ends ok."""
    boom = {"module": "../guests/trap.wasm", "export": "boom", "name": "boom",
            "parameters": {"type": "object"}}  # fmt: skip
    return {"id": spec_id, "model": "replay/call",
            "messages": [{"role": "user", "content": "Please run [[call:boom {}]]"}],
            "tools": [boom]}  # fmt: skip


def texts(page: Page, selector: str) -> list[str]:
    return [t.strip() for t in page.locator(selector).all_inner_texts()]


def shown_result(text: str, content: str) -> bool:
    """Whether a `.result` shows a tool message's content: its data as the model read it, or
    the whole result envelope (both JSON, compared parsed; pretty-printing aside)."""
    data = read_envelope(content)
    try:
        shown = json.loads(text)
    except ValueError:
        return text.strip() in (data, content)
    wanted = [json.loads(content), json.loads(data)]
    return shown in wanted


def check_two_round_thread(page: Page, record: dict[str, Any], a: int, b: int, f: int) -> None:
    """#thread against the record: a message per transcript message, in order; a tool call
    per call, in order, with its id, tool, arguments (the replay scenario's) and result."""
    transcript = record["transcript"]
    expect(page.locator("#thread .msg")).to_have_count(len(transcript), timeout=WAIT_MS)
    roles = page.locator("#thread .msg").evaluate_all("els => els.map(e => e.dataset.role)")
    assert roles == [m["role"] for m in transcript]
    assert roles == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
    calls = [c for m in transcript if m["role"] == "assistant" for c in m.get("tool_calls") or []]
    answers = {m["tool_call_id"]: m["content"] for m in transcript if m["role"] == "tool"}
    shown = page.locator("#thread .tool-call")
    expect(shown).to_have_count(2)
    scripted = [{"a": a, "b": b, "op": "add"}, {"a": a + b, "b": f, "op": "mul"}]
    for n, (call, args) in enumerate(zip(calls, scripted, strict=True)):
        element = shown.nth(n)
        assert element.get_attribute("data-call-id") == call["id"]
        assert element.get_attribute("data-tool") == call["function"]["name"] == "calculate"
        assert json.loads(element.locator(".args").inner_text()) == args
        assert json.loads(call["function"]["arguments"]) == args
        result = element.locator(".result").inner_text()
        assert shown_result(result, answers[call["id"]]), (result, answers[call["id"]])
        assert element.locator(".error-class").count() == 0
    # the final answer, as text
    expect(page.locator("#thread .msg[data-role=assistant]").last).to_contain_text(
        f"Result: {(a + b) * f}"
    )


def hold_llm(fleet: Fleet) -> None:
    """Stop the llm workers (warm shutdown: nothing of theirs is running): sessions submitted
    now wait, queued, until `serve_llm`."""
    for name in [n for n in fleet.workers if n.startswith("llm")]:
        fleet.kill(fleet.workers.pop(name), signal.SIGTERM)


def serve_llm(fleet: Fleet) -> None:
    if not any(n.startswith("llm") for n in fleet.workers):
        fleet.start_worker("llm")


# --- tests --------------------------------------------------------------------------------


def test_runs_page_follows_a_live_batch_to_done(
    view_fleet: Running, viewer: Viewer, page: Page, fresh_id: str
) -> None:
    """The runs page shows a batch running, then done with every session counted, by
    refreshing itself: the document loaded once is still the one showing `done`. The batch is
    held queued (no llm worker) until the page showed it running, so the test sees both
    states whatever the machine's speed; its sessions then take 200 ms per model call (the
    `slow` backend), so its done count advances while the page watches."""
    size = 8
    specs = [plain(f"{fresh_id}/live/{n}", f"live {n}", provider="slow") for n in range(size)]
    fleet = view_fleet.fleet
    hold_llm(fleet)
    try:
        batch = view_fleet.client.submit(specs)
        page.goto(viewer.url + "/")
        row = page.locator(f'table#runs tr[data-batch="{batch.id}"]')
        expect(row.locator("[data-field=status]")).to_have_text("running", timeout=WAIT_MS)
        expect(row.locator("[data-field=done]")).to_have_text("0")
        page.evaluate("window.__loadedOnce = true")  # a reload would drop it
        serve_llm(fleet)
        expect(row.locator("[data-field=status]")).to_have_text("done", timeout=WAIT_MS)
        expect(row.locator("[data-field=done]")).to_have_text(str(size))
        expect(row.locator("[data-field=failed]")).to_have_text("0")
        assert page.evaluate("window.__loadedOnce") is True
    finally:
        serve_llm(fleet)
    assert {r.status for r in batch.results(timeout_s=120)} == {"ok"}


def test_two_round_session_page_shows_rounds_and_tool_calls_in_order(
    view_fleet: Running, viewer: Viewer, page: Page, fresh_id: str
) -> None:
    """A session of two tool rounds (add, then multiply): its thread against the record and
    the replay scenario's calls, its timeline's rounds and tool steps in time order. The id
    holds `/`, `:`, `@` and `+`, so its URL must be quoted."""
    spec_id = f"{fresh_id}/two:rounds@1+x"
    _, results = submit(view_fleet, [two_rounds(spec_id, 4, 3, 10)])
    assert results[spec_id].text == "Result: 70"
    record = view_fleet.client.record(spec_id)
    assert record is not None
    page.goto(viewer.url + session_path(spec_id))
    expect(page.locator("#summary [data-field=status]")).to_have_text("ok", timeout=WAIT_MS)
    check_two_round_thread(page, record, 4, 3, 10)
    assert page.locator("#error").count() == 0
    steps = page.locator("#timeline .step").evaluate_all("els => els.map(e => e.dataset.kind)")
    assert [k for k in steps if k in ("round", "tool")] == ["round", "tool"] * 2 + ["round"]
    trace = "/api" + session_path(spec_id) + "/trace"
    expect(page.locator("a#trace-link")).to_have_attribute("href", re.compile(re.escape(trace)))


def test_failed_session_shows_its_error_code(
    view_fleet: Running, viewer: Viewer, page: Page, fresh_id: str
) -> None:
    """A session the provider refused (400): status error, its code in the summary and in
    #error. A tool that trapped, in a session that ends ok: the call's error class."""
    failed, trapped = f"{fresh_id}/refused", f"{fresh_id}/trapped"
    _, results = submit(view_fleet, [failing(failed), trapping_tool(trapped)])
    code = results[failed].error_code
    assert code == "provider_error" and results[trapped].ok
    page.goto(viewer.url + session_path(failed))
    expect(page.locator("#summary [data-field=status]")).to_have_text("error", timeout=WAIT_MS)
    expect(page.locator("#summary [data-field=code]")).to_have_text(code)
    expect(page.locator("#error")).to_contain_text(code)
    page.goto(viewer.url + session_path(trapped))
    call = page.locator("#thread .tool-call[data-tool=boom]")
    expect(call.locator(".error-class")).to_have_text("RUNTIME_ERROR", timeout=WAIT_MS)
    assert call.locator(".result").count() == 0
    assert page.locator("#error").count() == 0


def test_hostile_prompt_renders_as_text(
    view_fleet: Running, viewer: Viewer, page: Page, fresh_id: str
) -> None:
    """A prompt of markup shows as its text: nothing it holds runs or becomes an element, on
    the session page (the prompt and the model's echo of it) nor on a batch page that
    repeats it in its search box."""
    spec_id = f"{fresh_id}/hostile"
    batch, results = submit(view_fleet, [plain(spec_id, HOSTILE)])
    assert results[spec_id].text == f"Echo: {HOSTILE}"
    page.goto(viewer.url + batch_path(batch.id))  # its row shows the answer
    expect(page.locator("table#sessions tr[data-session]")).to_have_count(1, timeout=WAIT_MS)
    assert_not_injected(page)
    page.goto(viewer.url + batch_path(batch.id) + "?" + urlencode({"q": HOSTILE}))
    expect(page.locator("form#filter [name=q]")).to_have_value(HOSTILE, timeout=WAIT_MS)
    assert_not_injected(page)
    page.goto(viewer.url + session_path(spec_id))
    expect(page.locator("#thread .msg[data-role=user]")).to_contain_text(HOSTILE, timeout=WAIT_MS)
    expect(page.locator("#thread .msg[data-role=assistant]")).to_contain_text(f"Echo: {HOSTILE}")
    assert_not_injected(page)


def assert_not_injected(page: Page) -> None:
    page.wait_for_load_state("load")  # an <img> that failed has fired its onerror by now
    assert page.evaluate("typeof window.__pwned") == "undefined"
    assert page.locator('img[src="x"], [onerror]').count() == 0
    scripts = page.locator("script").evaluate_all("els => els.map(e => e.textContent)")
    assert not [s for s in scripts if "__pwned" in s]


def test_batch_filter_and_links_from_runs_to_session(
    view_fleet: Running, viewer: Viewer, page: Page, fresh_id: str
) -> None:
    """Clicking through: the runs page's batch link, the batch's outcome counts and sessions,
    its filter form (status=error keeps only the failed), a failed session's link."""
    ok_ids = [f"{fresh_id}/ok/{n}" for n in range(3)]
    bad_ids = [f"{fresh_id}/bad/{n}" for n in range(2)]
    specs = [plain(i, f"hello {i}") for i in ok_ids] + [failing(i) for i in bad_ids]
    batch, _ = submit(view_fleet, specs)
    page.goto(viewer.url + "/")
    row = page.locator(f'table#runs tr[data-batch="{batch.id}"]')
    expect(row.locator("[data-field=status]")).to_have_text("done", timeout=WAIT_MS)
    expect(row.locator("[data-field=failed]")).to_have_text("2")
    row.locator("td").first.locator("a").click()
    expect(page).to_have_url(viewer.url + batch_path(batch.id), timeout=WAIT_MS)
    sessions = page.locator("table#sessions tr[data-session]")
    expect(sessions).to_have_count(5, timeout=WAIT_MS)
    expect(page.locator('#counts [data-outcome="ok"]')).to_contain_text("3")
    expect(page.locator('#counts [data-outcome="provider_error"]')).to_contain_text("2")
    # the filter form, as a user submits it
    status = page.locator("form#filter [name=status]")
    if status.evaluate("e => e.tagName") == "SELECT":
        status.select_option("error")
    else:
        status.fill("error")
    page.locator("form#filter").evaluate("f => f.requestSubmit()")
    expect(page).to_have_url(re.compile(r"[?&]status=error(&|$)"), timeout=WAIT_MS)
    expect(sessions).to_have_count(2, timeout=WAIT_MS)
    shown = sessions.evaluate_all("els => els.map(e => e.dataset.session)")
    assert sorted(shown) == sorted(bad_ids)
    assert texts(page, "table#sessions tr[data-session] [data-field=status]") == ["error"] * 2
    assert (
        texts(page, "table#sessions tr[data-session] [data-field=code]") == ["provider_error"] * 2
    )
    # and the first failed one's link
    first = sessions.first
    spec_id = first.get_attribute("data-session")
    assert spec_id is not None
    first.locator("td").first.locator("a").click()
    expect(page).to_have_url(viewer.url + session_path(spec_id, batch.id), timeout=WAIT_MS)
    expect(page.locator("#summary [data-field=code]")).to_have_text("provider_error")


def test_offline_viewer_reads_a_results_file_without_redis(
    view_fleet: Running, page: Page, tmp_path: Path, fresh_id: str
) -> None:
    """`cchatq view results.jsonl` with no Redis (REDIS_URL names a port nothing listens
    on): the results `cchatq batch results B --out F` wrote show as session pages."""
    ok_id, bad_id = f"{fresh_id}/offline:two@1", f"{fresh_id}/offline/bad"
    batch, _ = submit(view_fleet, [two_rounds(ok_id, 2, 5, 3), failing(bad_id)])
    record = view_fleet.client.record(ok_id)
    assert record is not None
    out = tmp_path / "results.jsonl"
    cmd = [sys.executable, "-m", "producer.cli", "batch", "results", batch.id, "--out", str(out)]
    env = {**os.environ, "REDIS_URL": view_fleet.redis_url}
    collected = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert collected.returncode == 1, collected.stderr  # one session failed
    assert {json.loads(x)["id"] for x in out.read_text().splitlines()} == {ok_id, bad_id}
    nowhere = {**os.environ, "REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"}
    offline = Viewer.start([str(out)], nowhere, tmp_path / "viewer.log")
    try:
        page.goto(offline.url + session_path(ok_id))
        expect(page.locator("#summary [data-field=status]")).to_have_text("ok", timeout=WAIT_MS)
        check_two_round_thread(page, record, 2, 5, 3)
        page.goto(offline.url + session_path(bad_id))
        expect(page.locator("#summary [data-field=status]")).to_have_text("error", timeout=WAIT_MS)
        expect(page.locator("#error")).to_contain_text("provider_error")
        page.goto(offline.url + batch_path(batch.id))
        expect(page.locator("table#sessions tr[data-session]")).to_have_count(2, timeout=WAIT_MS)
    finally:
        offline.stop()


def program_run(spec_id: str, stdin: str) -> dict[str, Any]:
    """A WASM agent program that asks the model once (replay/plain) and prints the answer."""
    return {"id": spec_id, "program": {"module": "../guests/prog_chat.wasm", "stdin": stdin}}


def test_every_element_the_contract_names_is_on_its_page(
    view_fleet: Running, viewer: Viewer, page: Page, fresh_id: str
) -> None:
    """The contract's selectors, page by page, on a batch of a two-round session, a refused
    one and a program run: the cells of the runs and batch rows and their links, the filter's
    inputs, the summary's fields and links, a tool call's retries, the timeline's fields, a
    program run's sections and chat links, and the JSON twins and health check."""
    two, bad, prog = f"{fresh_id}/c/two", f"{fresh_id}/c/bad", f"{fresh_id}/c/prog"
    batch, results = submit(
        view_fleet, [two_rounds(two, 1, 2, 3), failing(bad), program_run(prog, "contract\n")]
    )
    assert results[prog].ok, results[prog].record
    # runs page
    page.goto(viewer.url + "/")
    row = page.locator(f'table#runs tr[data-batch="{batch.id}"]')
    expect(row.locator("[data-field=status]")).to_have_text("done", timeout=WAIT_MS)
    for field in ("queued", "running", "done", "failed", "rate", "eta"):
        expect(row.locator(f"[data-field={field}]")).to_have_count(1)
    expect(row.locator("td").first.locator("a")).to_have_attribute("href", batch_path(batch.id))
    program_row = page.locator("table#runs tr[data-kind=program]").filter(
        has=page.locator(f'a[href="{session_path(prog)}"]')
    )
    expect(program_row).to_have_count(1)
    # batch page
    page.goto(viewer.url + batch_path(batch.id))
    sessions = page.locator("table#sessions tr[data-session]")
    expect(sessions).to_have_count(3, timeout=WAIT_MS)
    expect(page.locator("#counts [data-outcome]").first).to_be_visible()
    for spec_id in (two, bad, prog):
        session_row = page.locator(f'table#sessions tr[data-session="{spec_id}"]')
        for field in ("status", "code", "latency_ms", "tokens", "rounds", "tools"):
            expect(session_row.locator(f"[data-field={field}]")).to_have_count(1)
        link = session_row.locator("td").first.locator("a")
        expect(link).to_have_attribute("href", session_path(spec_id, batch.id))
    for name in ("status", "code", "tool", "q", "sort"):
        expect(page.locator(f"form#filter [name={name}]")).to_have_count(1)
    assert (page.locator("form#filter").get_attribute("method") or "get").lower() == "get"
    # a session page
    page.goto(viewer.url + session_path(two))
    summary = page.locator("#summary")
    expect(summary.locator("[data-field=status]")).to_have_text("ok", timeout=WAIT_MS)
    for field in ("code", "latency_ms", "tokens_in", "tokens_out"):
        expect(summary.locator(f"[data-field={field}]")).to_have_count(1)
    expect(page.locator("a#flower-link")).to_have_count(1)
    expect(page.locator("#thread .tool-call [data-field=retries]")).to_have_count(2)
    steps = page.locator("#timeline .step")
    expect(steps.first).to_be_visible()
    for field in ("ms", "worker", "attempt"):
        expect(steps.locator(f"[data-field={field}]")).to_have_count(steps.count())
    trace = page.locator("a#trace-link").get_attribute("href")
    assert trace is not None
    lines = page.request.get(viewer.url + trace).text().splitlines()
    assert lines and all(isinstance(json.loads(line), dict) for line in lines)
    # a program run's page
    page.goto(viewer.url + session_path(prog))
    expect(page.locator("#stdout")).to_contain_text("ANSWER: Echo: contract", timeout=WAIT_MS)
    for section in ("#chats", "#forks", "#logs", "#frames"):
        expect(page.locator(section)).to_have_count(1)
    chat = page.locator("#chats a").first
    chat_href = chat.get_attribute("href")
    assert chat_href is not None and chat_href.startswith("/session/")
    chat.click()
    expect(page.locator("#thread .msg[data-role=assistant]")).to_contain_text(
        "Echo: contract", timeout=WAIT_MS
    )
    # JSON twins and the health check
    assert page.request.get(viewer.url + "/healthz").text().strip() == "ok"
    api = page.request
    assert batch.id in api.get(viewer.url + "/api/runs").text()
    assert api.get(viewer.url + "/api" + batch_path(batch.id)).ok
    assert two in api.get(viewer.url + "/api" + session_path(two)).text()


def test_a_token_guards_every_request_and_a_public_address_needs_one(
    view_fleet: Running, page: Page, tmp_path: Path
) -> None:
    """With --token, a request without it is refused (401); `?token=T` once lets the browser
    in, a cookie keeps it in; a script may send `Authorization: Bearer T`. Without a token, a
    non-loopback --host is refused in one line, exit 2, before anything listens."""
    env = {**os.environ, "REDIS_URL": view_fleet.redis_url}
    env.pop("CCHATQ_VIEW_TOKEN", None)
    cmd = [sys.executable, "-m", "producer.cli", "view", "--host", "0.0.0.0"]
    refused = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused
    guarded = Viewer.start(["--token", "s3cret"], env, tmp_path / "viewer.log")
    try:
        response = page.goto(guarded.url + "/")
        assert response is not None and response.status == 401
        response = page.goto(guarded.url + "/?token=s3cret")
        assert response is not None and response.status == 200
        expect(page.locator("table#runs")).to_have_count(1)
        response = page.goto(guarded.url + "/healthz")  # the cookie, not the token, now
        assert response is not None and response.status == 200
        bearer = {"Authorization": "Bearer s3cret"}
        assert page.request.get(guarded.url + "/api/runs", headers=bearer).ok
        page.context.clear_cookies()
        assert page.request.get(guarded.url + "/api/runs").status == 401
        page.goto(guarded.url + "/?token=s3cret")  # the screenshot shows the page let in
    finally:
        guarded.stop()
