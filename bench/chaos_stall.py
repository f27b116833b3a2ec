"""`python -m bench.chaos stall`: model streams that stall. Sessions on the replay server's
streaming backends of every protocol (each backend's default stream_idle_timeout_s, 60 s)
whose first streamed answer sends some content, then only keepalives every 15 s (`: ping`
comments; Anthropic's `ping` events) for 150 s, past the model call's 120 s deadline, then
closes unfinished: only abandoning the stream and asking again saves a session.

For each session: how long after the stall's last content the worker hung up on it, and when
its retry came, as the replay server saw them (GET /stalls), and how the session ended. The
goal: every session ok, each stalled stream abandoned at most 75 s after its last content.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import requests

from bench.chaos_fleet import history_problems, verdict_of
from bench.chaos_report import Row, dead_letters, log_digest, remove_dumps, tally
from bench.history_read import check_run, mark_run
from fixtures.replay.scenarios import conversation_key
from producer.client import Client
from producer.fleet import Fleet, replay_backend_name
from producer.specfile import load_spec_from_objects
from schemas.protocols import PROTOCOLS

PING_S = 15
STALL_S = 150  # past total_timeout_s (120): a stream that is never abandoned fails its session
GOAL_S = 75.0  # the idle timeout (60 s) and a keepalive's interval
WIRES = {"openai": "openai", "anthropic": "anthropic", "gemini": "gemini",
         "openai-text-tags": "tags"}  # fmt: skip


def stall_objects(run: str, n: int) -> list[dict[str, Any]]:
    """`n` plain sessions over the protocols' streaming backends, each stalling once."""
    objects = []
    for i in range(n):
        protocol = list(PROTOCOLS)[i % len(PROTOCOLS)]
        marker = f"[[stall_ms:{STALL_S * 1000}]] [[ping_ms:{PING_S * 1000}]]"
        objects.append({
            "id": f"{run}/{i}",
            "provider": replay_backend_name(protocol, stream=True),
            "model": PROTOCOLS[protocol].replay_model_for("plain"),
            "messages": [{"role": "user", "content": f"[{run} {i}] Stalled stream {marker}"}],
        })  # fmt: skip
    return objects


def _turn(obj: dict[str, Any]) -> str:
    protocol = list(PROTOCOLS)[int(obj["id"].rsplit("/", 1)[1]) % len(PROTOCOLS)]
    return conversation_key(WIRES[protocol], "plain", obj["messages"][0]["content"]) + ":0"


def _latency_s(record: dict[str, Any]) -> float | None:
    latency_ms = (record.get("metrics") or {}).get("latency_ms")
    return None if latency_ms is None else latency_ms / 1000


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


def scenario_stall(root: Path, n: int, deadline_s: float, seed: int) -> list[Row]:
    fleet = Fleet(workdir=root / "stall")
    fleet.workdir.mkdir(parents=True, exist_ok=True)
    with fleet:
        fleet.ensure_redis(private=True)
        fleet.start_replay()
        fleet.start_workers()
        fleet.wait_served()
        client = Client(fleet.redis_url)
        objects = stall_objects(f"stall-{uuid.uuid4().hex[:6]}", n)
        expected = {o["id"]: o["messages"][0]["content"].split(" [[")[0] for o in objects}
        expected = {i: f"Echo: {text}" for i, text in expected.items()}
        mark, delivered = mark_run(fleet.replay_url), list[str]()
        started = time.monotonic()
        sub = client.enqueue(load_spec_from_objects(objects))
        records: dict[str, dict[str, Any]] = {}
        try:
            for _, record in client.wait(sub, timeout_s=deadline_s, poll_s=0.5):
                records[record["id"]] = record
                delivered.append(str(record.get("id")))
        except TimeoutError:
            pass
        wall = time.monotonic() - started
        row = tally(client.redis, "stall: pings every 15 s after some content", sub.order, expected)
        row.wall_s = wall
        row.verdict = check_run(row.scenario, client, objects, mark, delivered)
        url = fleet.replay_url.removesuffix("/v1") + "/stalls"
        stalls = {s["turn"]: s for s in requests.get(url, timeout=5).json()["stalls"]}
        late: list[str] = []
        for obj in objects:
            stall = stalls.get(_turn(obj), {})
            record = records.get(obj["id"], {})
            error = (record.get("body") or {}).get("error") or {}
            ended = record.get("status", "unfinished") + (f" {error['code']}" if error else "")
            hung_up = stall.get("ended") == "client hung up"
            after = stall.get("ended_after_s") if hung_up else None
            if after is None or after > GOAL_S:
                late.append(obj["id"])
            row.notes.append(
                f"{obj['id']} ({obj['provider']}): abandoned {_seconds(after)} after its last "
                f"content ({stall.get('pings', 0)} pings), retried after "
                f"{_seconds(stall.get('retry_after_s'))}, model calls {stall.get('requests', 0)};"
                f" session {ended} after {_seconds(_latency_s(record))}"
            )
        problems = history_problems(row)
        problems += [f"{row.expected - row.ok} not ok"] if row.ok < row.expected else []
        problems += [f"{len(late)} not abandoned within {GOAL_S:.0f} s"] if late else []
        row.goal = verdict_of(problems)
        row.notes.extend(dead_letters(client.redis))
        row.notes.extend(["log digest:", *log_digest(fleet.workdir), *remove_dumps(fleet.workdir)])
        client.close()
    return [row]
