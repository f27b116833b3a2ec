"""Batches of 100,000: the producer's side of a big batch, measured against its goals.

    python -m bench.big_batch --sessions 100000     (make bench-big)

On a private Redis of its own and no workers: a JSONL file of plain one-message sessions is
submitted (`cchatq submit --no-wait`, its own process: wall time and peak RSS); the batch's
status is read while all its sessions are queued, once a third ended, and once all ended
(`cchatq batch status` as a command, and Batches.summary in this process); the viewer's batch
page is rendered (its app in this process, the first page and a later one); and `cchatq submit`
waiting on a second batch of the same size is watched writing its results file as sessions
end (lines there before the last session ended) and its peak RSS. Sessions are ended by the
workers' own write-once script (bench/synthetic_finish.py), not by a fleet: on 2 cores a fleet
would take hours for 100,000 sessions, and what is timed here is what reads them.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from bench.synthetic_finish import finish_sessions
from producer.fleet import Fleet
from schemas import keys

ROOT = Path(__file__).resolve().parent.parent
SUBMIT_GOAL_S, SUBMIT_GOAL_MB = 60.0, 400.0
READ_GOAL_S = 1.0


def write_file(path: Path, sessions: int, prefix: str) -> Path:
    with path.open("w") as out:
        for n in range(sessions):
            spec = {"id": f"{prefix}/{n:06d}", "model": "replay/plain",
                    "messages": [{"role": "user", "content": f"Say hello to session {n}"}],
                    "metadata": {"row": n}}  # fmt: skip
            out.write(json.dumps(spec, separators=(",", ":")) + "\n")
    return path


def child(argv: list[str]) -> int:
    """`cchatq ARGV` in this process, then its wall time and peak RSS as the last line."""
    from producer.cli import main

    started = time.perf_counter()
    code = main(argv)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(
        json.dumps(
            {
                "code": code,
                "seconds": time.perf_counter() - started,
                "cpu_s": usage.ru_utime + usage.ru_stime,
                "mb": usage.ru_maxrss / 1024,
            }
        )
    )
    return 0


class Bench:
    def __init__(self, sessions: int, folder: Path) -> None:
        self.sessions, self.folder = sessions, folder
        self.fleet = Fleet(workdir=folder / "fleet")
        self.fleet.workdir.mkdir()
        self.url = self.fleet.ensure_redis(private=True)
        self.redis: Any = redis.Redis.from_url(self.url)  # replies as bytes
        self.env = {k: v for k, v in os.environ.items()
                    if k not in ("CCHATQ_STATE_URL", "CCHATQ_BROKER_URL", "CCHATQ_CONFIG",
                                 "CCHATQ_BACKENDS")}  # fmt: skip
        self.env.update(REDIS_URL=self.url, PYTHONPATH=str(ROOT))
        self.rows: list[tuple[str, str, str, bool | None]] = []
        self.seen: set[str] = set()  # batches found already

    def row(self, name: str, measured: str, goal: str = "", met: bool | None = None) -> None:
        self.rows.append((name, measured, goal, met))
        mark = "" if met is None else "  met" if met else "  NOT MET"
        print(f"  {name:<58} {measured:<34} {goal}{mark}", flush=True)

    def cchatq(self, *argv: str, wait: bool = True) -> Any:
        """`cchatq ARGV` as its own process: (wall s, its report), or the Popen."""
        command = [sys.executable, "-m", "bench.big_batch", "--child", *argv]
        started = time.perf_counter()
        proc = subprocess.Popen(command, cwd=ROOT, env=self.env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)  # fmt: skip
        if not wait:
            return proc
        out, err = proc.communicate()
        if proc.returncode:
            raise RuntimeError(f"cchatq {' '.join(argv)} failed: {err[-2000:]}")
        return time.perf_counter() - started, json.loads(out.strip().splitlines()[-1])

    def newest_batch(self, count: int, timeout_s: float = 600) -> str:
        """The batch submitted now (none of those before), once its `count` ids are named."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for raw in self.redis.zrange(keys.BATCHES, 0, -1):
                batch = str(raw.decode())
                if batch in self.seen:
                    continue
                if self.redis.llen(keys.batch_ids(batch)) == count:
                    self.seen.add(batch)
                    return batch
            time.sleep(0.5)
        raise TimeoutError("the batch was not enqueued in time")

    # the goals ----------------------------------------------------------------------------

    def submit(self) -> str:
        path = write_file(self.folder / "batch.jsonl", self.sessions, "big")
        wall_s, got = self.cchatq("submit", "--no-wait", str(path))
        size_mb = path.stat().st_size / 1e6
        name = f"submit --no-wait, {self.sessions:,} lines ({size_mb:.0f} MB)"
        met = wall_s <= SUBMIT_GOAL_S
        shown = f"{wall_s:.1f} s (CPU {got['cpu_s']:.1f} s)"
        self.row(name, shown, f"<= {SUBMIT_GOAL_S:.0f} s", met)
        self.row("  its peak RSS", f"{got['mb']:.0f} MB", f"< {SUBMIT_GOAL_MB:.0f} MB",
                 got["mb"] < SUBMIT_GOAL_MB)  # fmt: skip
        return self.newest_batch(self.sessions)

    def status(self, batch: str, when: str) -> None:
        from producer.batches import Batches
        from producer.client import Client
        from schemas.fleet_config import FleetConfig

        wall_s, got = self.cchatq("batch", "status", batch)
        shown = f"{wall_s:.2f} s (CPU {got['cpu_s']:.2f} s)"
        self.row(f"batch status, {when} (the command)", shown,
                 f"<= {READ_GOAL_S:.0f} s", wall_s <= READ_GOAL_S)  # fmt: skip
        client = Client(self.url, config=FleetConfig())
        try:
            seconds, summary = timed(lambda: Batches(client).summary(batch))
        finally:
            client.close()
        assert summary is not None
        sampled = f", sampled {summary.sampled}" if summary.sampled else ""
        self.row(f"  Batches.summary in-process{sampled}", f"{seconds:.3f} s",
                 f"<= {READ_GOAL_S:.0f} s", seconds <= READ_GOAL_S)  # fmt: skip

    def viewer(self, batch: str) -> None:
        from starlette.testclient import TestClient

        from producer.client import Client
        from producer.viewer.app import create_app
        from producer.viewer.fleet_source import FleetSource
        from schemas.fleet_config import FleetConfig

        app = create_app(FleetSource(Client(self.url, config=FleetConfig()), self.url))
        with TestClient(app) as http:
            for name, path in (("first page, a viewer just started", f"/batch/{batch}"),
                               ("first page again", f"/batch/{batch}"),
                               ("page 100", f"/batch/{batch}?page=100")):  # fmt: skip
                started = time.perf_counter()
                reply = http.get(path)
                seconds = time.perf_counter() - started
                ok = reply.status_code == 200 and seconds <= READ_GOAL_S
                self.row(f"viewer batch page, {name}", f"{seconds:.2f} s",
                         f"<= {READ_GOAL_S:.0f} s", ok)  # fmt: skip

    def waiting(self) -> None:
        """A second batch submitted with --wait: its results file grows as sessions end."""
        path = write_file(self.folder / "wait.jsonl", self.sessions, "wait")
        out = self.folder / "results.jsonl"
        proc = self.cchatq("submit", str(path), "--out", str(out), wait=False)
        batch = self.newest_batch(self.sessions)
        half = self.sessions // 2
        finish_sessions(self.redis, batch, most=half)
        seen, deadline = 0, time.monotonic() + 120
        while seen < half and time.monotonic() < deadline:
            time.sleep(1)
            seen = lines(out)
        finish_sessions(self.redis, batch)
        stdout, _ = proc.communicate()
        got = json.loads(stdout.strip().splitlines()[-1])
        self.row("submit --wait: result lines written before the batch ended",
                 f"{seen:,} of {self.sessions:,}", f"{half:,} ended by then",
                 seen == half)  # fmt: skip
        self.row("  its peak RSS", f"{got['mb']:.0f} MB", f"< {SUBMIT_GOAL_MB:.0f} MB",
                 got["mb"] < SUBMIT_GOAL_MB)  # fmt: skip
        self.row("  lines in the results file at its end", f"{lines(out):,}",
                 f"{self.sessions:,}", lines(out) == self.sessions)  # fmt: skip

    def run(self, wait_check: bool) -> bool:
        print(f"cchatq big batch, {self.sessions:,} sessions (Redis {self.url}, no workers)")
        batch = self.submit()
        self.status(batch, "all queued")
        finish_sessions(self.redis, batch, most=self.sessions // 3)
        self.status(batch, "a third ended (first read counts them)")
        self.status(batch, "a third ended")
        finish_sessions(self.redis, batch)
        self.status(batch, "all ended (first read counts them)")
        self.status(batch, "all ended")
        self.viewer(batch)
        if wait_check:
            self.waiting()
        return all(met is not False for *_, met in self.rows)

    def close(self) -> None:
        self.redis.close()
        self.fleet.stop()


def timed(call: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    found = call()
    return time.perf_counter() - started, found


def lines(path: Path) -> int:
    if not path.exists():
        return 0
    with path.open("rb") as fh:
        return sum(1 for _ in fh)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--child"]:
        return child(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m bench.big_batch")
    parser.add_argument("--sessions", type=int, default=100_000)
    parser.add_argument(
        "--no-wait-check", action="store_true", help="skip the second batch, waited for"
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="cchatq-big-batch-") as tmp:
        bench = Bench(args.sessions, Path(tmp))
        try:
            met = bench.run(not args.no_wait_check)
        finally:
            bench.close()
    print("all goals met" if met else "some goals NOT met")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
