"""`python -m bench.rate` (or `make bench-rate`): the adaptive rate controller against a
provider's rate limit, per protocol, each run on a fresh private fleet (Redis, the replay server,
workers) on 127.0.0.1:

  the replay server answers after 1 s and allows 20 requests/s per API key (a 1 s burst);
  one control worker and three llm worker processes (-c 64 threads);
  3,600 one-call sessions submitted at once (t0);
  t0+60 s the limit is halved (10/s), t0+120 s restored (20/s), t0+150 s a fourth llm worker
  process (-c 64) joins; then until every session has finished (or --timeout-s).

Figures (bench/rate_figures.py): utilisation of the limit in three phases, [t0+10, t0+60),
[t0+70, t0+120) and [t0+130, t_end), where t_end ends the first second after which fewer than
2 seconds' worth of sessions (2 x rps) were left neither accepted by the server nor failed; the
429 share of the run and of [t0+150, t0+170); the recovery (seconds after t0+120 until a 3 s
moving average of accepted requests reaches 80% of 20/s); sessions failed (by error code) and
unfinished. Goals: utilisation >= 90% in each phase, 429s <= 2% (also after the join),
recovery <= 60 s, none failed or unfinished.

`--before` also runs each protocol with every backend `"adaptive": false` first (the static
limit and in-call 429 retries: a session ends provider_unavailable after 4 attempts).
`--scale F` multiplies the session count and every time of the scenario (0.25: 900 sessions,
the limit halved at 15 s, restored at 30 s, the worker joining at 37.5 s, a run of about a
minute); the rates, the 1 s latency and the goals (recovery too) are not scaled.

The workers log at INFO (CCHATQ_LOG_LEVEL, unless set) so that each controller change
(`rate control <id>: <reason>, window W, pace P`) is counted by reason under the table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from bench import rate_figures as rf
from bench.chaos_report import log_digest, remove_dumps
from producer.client import Client
from producer.fleet import Fleet, replay_backends
from producer.specfile import load_spec_from_objects
from schemas.spec_types import Spec

PROTOCOLS = ("openai", "anthropic", "gemini")
MODELS = {"openai": "replay/plain", "anthropic": "replay/plain", "gemini": "replay-plain"}
LATENCY_MS = 1000
LLM_WORKERS = 3
LLM_CONCURRENCY = 64
SESSIONS = 3600
TIMEOUT_S = 900.0
_RATE_CONTROL = re.compile(r"rate control (\S+): ([^,]+), window ([\d.]+), pace (.+)$")


@dataclass
class Run:
    """What one run saw, besides the replay server's timeline."""

    events: dict[str, float] = field(default_factory=dict)  # name -> epoch seconds
    outcomes: Counter[str] = field(default_factory=Counter)
    failed_at: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def session_specs(protocol: str, run: str, n: int) -> list[Spec]:
    """One-call sessions, each with a first message of its own (the replay server keys a
    conversation by it)."""
    return load_spec_from_objects(
        [
            {
                "id": f"{run}/{i}",
                "provider": f"replay-{protocol}",
                "model": MODELS[protocol],
                "messages": [{"role": "user", "content": f"[{run} {i}] hi"}],
            }
            for i in range(n)
        ]
    )


def static_backends(replay_url: str) -> dict[str, dict[str, object]]:
    """The replay backends with adaptive rate control off (the behaviour before it)."""
    return {name: {**b, "adaptive": False} for name, b in replay_backends(replay_url).items()}


def outcome(record: dict[str, Any]) -> str:
    """The session's outcome: "ok", or its error code."""
    error = (record.get("body") or {}).get("error")
    if record.get("status") == "ok" and not error:
        return "ok"
    code = error.get("code") if isinstance(error, dict) else None
    return str(code or record.get("status"))


def at_times(
    fleet: Fleet, events: dict[str, float], plan: Sequence[tuple[str, float]], stop: threading.Event
) -> None:
    """Carry out the scenario's events at their epoch times (until `stop`)."""
    root = fleet.replay_url.removesuffix("/v1")
    for name, when in plan:
        if stop.wait(max(0.0, when - time.time())):
            return
        if name == "halved":
            requests.post(f"{root}/admin/limits", json={"rps": rf.HALVED_RPS}, timeout=10)
        elif name == "restored":
            requests.post(f"{root}/admin/limits", json={"rps": rf.RPS}, timeout=10)
        else:
            fleet.start_worker("llm", concurrency=LLM_CONCURRENCY)
        events[name] = time.time()


def rate_control_lines(workdir: Path) -> list[tuple[str, str]]:
    """(controller id, reason) of each `rate control` line of the workers' logs."""
    found = []
    for log in sorted(workdir.glob("*.log")):
        for line in log.read_text(errors="replace").splitlines():
            match = _RATE_CONTROL.search(line)
            if match:
                found.append((match.group(1), match.group(2)))
    return found


def per_ten_s(timeline: rf.Timeline, t0: float) -> str:
    """Accepted/refused per 10 s from t0, to see the run's shape."""
    buckets: dict[int, list[int]] = {}
    for second, acc, ref in timeline:
        slot = buckets.setdefault(int((second - int(t0)) // 10), [0, 0])
        slot[0] += acc
        slot[1] += ref
    return " ".join(f"{k * 10}s:{a}/{r}" for k, (a, r) in sorted(buckets.items()))


def run_one(
    root: Path, protocol: str, adaptive: bool, sessions: int, scale: float, timeout_s: float
) -> rf.Figures:
    mode = "adaptive" if adaptive else "before"
    workdir = root / f"{protocol}-{mode}"
    workdir.mkdir(parents=True)
    run = Run()
    with Fleet(workdir=workdir) as fleet:
        fleet.ensure_redis(private=True)
        fleet.start_replay(LATENCY_MS, ["--rate-rps", f"{rf.RPS:g}", "--rate-burst-s", "1"])
        if not adaptive:
            fleet.env["CCHATQ_BACKENDS"] = json.dumps(
                {"backends": static_backends(fleet.replay_url)}
            )
        fleet.start_worker("control")
        for _ in range(LLM_WORKERS):
            fleet.start_worker("llm", concurrency=LLM_CONCURRENCY)
        fleet.wait_served(("control", "llm"))
        client = Client(fleet.redis_url, config=fleet.config())
        specs = session_specs(protocol, f"rate-{protocol}-{mode}-{uuid.uuid4().hex[:6]}", sessions)
        t0 = time.time()
        sub = client.enqueue(specs)
        run.notes.append(f"submitted {sessions} sessions in {time.time() - t0:.1f} s")
        plan = [("halved", t0 + rf.HALVE_AT_S * scale), ("restored", t0 + rf.RESTORE_AT_S * scale),
                ("joined", t0 + rf.JOIN_AT_S * scale)]  # fmt: skip
        stop = threading.Event()
        timer = threading.Thread(target=at_times, args=(fleet, run.events, plan, stop))
        timer.start()
        try:
            for _, record in client.wait(sub, timeout_s=timeout_s, poll_s=0.2):
                code = outcome(record)
                run.outcomes[code] += 1
                if code != "ok":
                    run.failed_at.append(time.time())
        except TimeoutError:
            pass
        wall = time.time() - t0
        stop.set()
        timer.join()
        run.outcomes["unfinished"] = sessions - sum(run.outcomes.values())
        root_url = fleet.replay_url.removesuffix("/v1")
        limits = requests.get(f"{root_url}/limits", timeout=10).json()
        client.close()
    late = {name: run.events.get(name, when) - when for name, when in plan}
    events = rf.Events(
        t0,
        halved_at=t0 + rf.HALVE_AT_S * scale + late["halved"],
        restored_at=t0 + rf.RESTORE_AT_S * scale + late["restored"],
        joined_at=t0 + rf.JOIN_AT_S * scale + late["joined"],
        margin_s=rf.MARGIN_S * scale,
        join_window_s=rf.JOIN_WINDOW_S * scale,
    )
    fig = rf.figures(protocol, mode, limits, events, run.outcomes, run.failed_at, sessions)
    fig.wall_s = wall
    lines = rate_control_lines(workdir)
    fig.rate_control = dict(Counter(reason for _, reason in lines).most_common())
    missed = [name for name, _ in plan if name not in run.events]
    run.notes.append(
        "events late by "
        + ", ".join(f"{name} {late[name] * 1000:.0f} ms" for name, _ in plan if name in run.events)
        + (f"; not reached (the run ended first): {missed}" if missed else "")
    )
    run.notes.append(f"server: accepted {fig.accepted}, refused {fig.refused}")
    run.notes.append(f"outcomes: {dict(run.outcomes.most_common())}")
    run.notes.append(f"per 10 s from t0 (accepted/refused): {per_ten_s(limits['timeline'], t0)}")
    run.notes.append(
        f"rate control log lines by reason ({len(lines)}, "
        f"{len({cid for cid, _ in lines})} controllers): {fig.rate_control or '-'}"
    )
    run.notes.extend(["log digest:", *log_digest(workdir), *remove_dumps(workdir)])
    print(f"\n== {protocol}, {mode} ({wall:.0f} s; logs in {workdir})", flush=True)
    print("\n".join(rf.table([fig])))
    for note in run.notes:
        print(f"  {note}")
    sys.stdout.flush()
    return fig


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.rate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--protocols", default=",".join(PROTOCOLS), help="comma-separated (default: all three)"
    )
    parser.add_argument(
        "--before", action="store_true", help="first run each protocol with adaptive off too"
    )
    parser.add_argument("--sessions", type=int, default=SESSIONS, help="before --scale")
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies sessions and times")
    parser.add_argument("--timeout-s", type=float, default=TIMEOUT_S, help="per run, from t0")
    parser.add_argument("--json", type=Path, help="also write the figures there")
    args = parser.parse_args(argv)
    protocols = [p.strip() for p in args.protocols.split(",") if p.strip()]
    unknown = sorted(set(protocols) - set(PROTOCOLS))
    if unknown or not protocols:
        parser.error(f"unknown protocols {unknown}: choose from {', '.join(PROTOCOLS)}")
    if not args.scale > 0:
        parser.error("--scale must be > 0")
    sessions = max(1, round(args.sessions * args.scale))
    os.environ.setdefault("CCHATQ_LOG_LEVEL", "INFO")  # the workers' `rate control` lines
    root = Path(tempfile.mkdtemp(prefix="cchatq-rate-"))
    print(f"fleet logs under {root}", flush=True)
    rows: list[rf.Figures] = []
    for protocol in protocols:
        for adaptive in ([False] if args.before else []) + [True]:
            rows.append(run_one(root, protocol, adaptive, sessions, args.scale, args.timeout_s))
    print(f"\n== all runs ({sessions} sessions, scale {args.scale:g})")
    print("\n".join(rf.table(rows)))
    print(
        "t_end: from t0 to the end of the first second after which fewer than 2 x rps sessions "
        "were left neither accepted nor failed (phase 3 ends there); recovery: from the restore "
        "to the end of the first 3 s averaging >= 80% of 20/s"
    )
    if args.json:
        args.json.write_text(json.dumps([f.as_json() for f in rows], indent=2) + "\n")
    return 0 if all(all(rf.verdicts(f)) for f in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
