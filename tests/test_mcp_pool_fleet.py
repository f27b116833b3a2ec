"""Pooled MCP sessions on a real fleet: a batch of spec sessions each calling a stdio MCP tool
(the fixture server's `nap`), whose server processes (one per tools worker process, started on
first use) are killed mid-batch. Every session still ends ok: a call that was on a killed
server ends as a RUNTIME_ERROR tool result the model answers after, and the calls after the
kill go to a server the pool started again. The fixture server logs each call it runs (tool
name and pid), which is how the test finds the processes to kill."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from producer.client import Client
from producer.fleet import Fleet
from schemas.mcp import tool_name
from tests.conftest import ROOT, _workers
from tests.test_pipeline import assert_tool_messages_paired, submit_specs, wait_for

pytestmark = pytest.mark.fleet

REDIS_DB = 1
NAP = tool_name("fs", "nap")
SESSIONS = 24
NAP_MS = 400
DIED = "MCP server fs: the connection closed"


def calls(ran_log: Path) -> list[tuple[str, int]]:
    """Each call the fixture server ran: its tool and the server's pid."""
    if not ran_log.exists():
        return []
    rows = [line.split() for line in ran_log.read_text().splitlines()]
    return [(tool, int(pid)) for tool, pid in rows]


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.fixture(scope="module")
def pool_fleet(
    base_fleet: Fleet, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Client, Path]]:
    ran_log = tmp_path_factory.mktemp("mcp_pool") / "ran.log"
    server = {
        "command": [sys.executable, "-m", "fixtures.mcp.server"],
        "cwd": str(ROOT),
        "env": {"CCHATQ_MCP_FIXTURE_LOG": str(ran_log)},
    }
    config = {
        "mcp_servers": {"fs": server},
        "tools": {"environments": {"dev": {"mcp_servers": ["fs"]}}},
    }
    for running in _workers(
        base_fleet, REDIS_DB, config=config, queues=("llm", "tools", "control")
    ):
        yield running.client, ran_log


def nap_spec(spec_id: str) -> dict[str, Any]:
    return {
        "id": spec_id,
        "model": "replay/call",
        "messages": [{"role": "user", "content": f'Rest [[call:{NAP} {{"ms":{NAP_MS}}}]]'}],
        "mcp_servers": ["fs"],
        "permissions": {"environment": "dev"},
    }


def test_every_session_ends_when_the_mcp_servers_are_killed_mid_batch(
    pool_fleet: tuple[Client, Path], tmp_path: Path, fresh_id: str
) -> None:
    client, ran_log = pool_fleet
    specs = [nap_spec(f"{fresh_id}/{k}") for k in range(SESSIONS)]
    sub = submit_specs(client, specs, tmp_path)
    wait_for(lambda: len(calls(ran_log)) >= 4, timeout_s=120)  # the batch is under way
    before = calls(ran_log)
    killed = {pid for _, pid in before}
    for pid in killed:
        os.kill(pid, signal.SIGKILL)
    records = {r["id"]: r for _, r in client.wait(sub, timeout_s=180)}

    assert sorted(records) == sorted(s["id"] for s in specs)  # no session lost
    answered, died = 0, 0
    for record in records.values():
        assert record["status"] == "ok", record
        assert_tool_messages_paired(record)
        [tool] = [json.loads(m["content"]) for m in record["transcript"] if m["role"] == "tool"]
        if tool["ok"]:
            assert tool["data"] == {"result": f"slept {NAP_MS} ms"}
            answered += 1
        else:  # it was on a killed server: it may have run, so it is not sent again
            assert tool["error"] == {"code": "RUNTIME_ERROR", "message": DIED}, record
            died += 1
        assert record["transcript"][-1]["role"] == "assistant"  # the model answered after
    assert answered + died == SESSIONS and answered > 0
    # calls after the kill ran on servers the pool started again; the killed ones are gone
    restarted = {pid for _, pid in calls(ran_log)[len(before) :]} - killed
    assert restarted, "no call ran on a server started after the kill"
    deadline = time.monotonic() + 10
    while not all(gone(pid) for pid in killed):  # reaped by the pool that held them
        assert time.monotonic() < deadline, "a killed server was never reaped"
        time.sleep(0.05)
