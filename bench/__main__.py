"""`python -m bench` (or `make bench`): measured side by side in one run, on a private fleet.

1. per-step overhead of a session (zero-latency replay; start -> round -> tool -> round ->
   finish) next to a bare Celery no-op trampoline hop with the same settings;
2. sessions per second for 1,000 such sessions;
3. with 200 ms model latency and llm concurrency C: wall time next to the ideal
   (model calls x latency / C).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import fixtures
from fixtures.demo_batch import WEATHER
from producer.client import Client
from producer.fleet import WORKER_PROFILES, Fleet
from producer.specfile import LoadedSpec
from schemas.spec import SessionSpecSchema

GUESTS = Path(fixtures.__file__).parent / "guests"

STEPS_PER_SESSION = 5  # start, round 0, tool, round 1, finish


def weather_spec(spec_id: str, latency_ms: int = 0) -> dict[str, Any]:
    marker = f" [[latency_ms:{latency_ms}]]" if latency_ms else ""
    tool = {**WEATHER, "module": str(GUESTS / "weather.wasm")}
    raw = {
        "id": spec_id,
        "model": "replay/weather",
        "messages": [{"role": "user", "content": f"Weather in Paris?{marker}"}],
        "tools": [tool],
    }
    return dict(LoadedSpec(line=0, spec=SessionSpecSchema().load(raw)).spec)


def run(client: Client, specs: list[dict[str, Any]], timeout_s: float = 600) -> float:
    started = time.perf_counter()
    sub = client.submit(specs)
    for _ in client.wait(sub, timeout_s=timeout_s, poll_s=0.05):
        pass
    return time.perf_counter() - started


def trampoline_ms_per_hop(fleet: Fleet, hops: int = 300) -> float:
    import redis

    fleet.spawn(
        [sys.executable, "-m", "celery", "-A", "bench.trampoline", "worker", "-Q", "bench",
         "-P", "threads", "-c", "1", "-n", "bench@%h", "--without-gossip", "--without-mingle",
         "--loglevel", "WARNING"],
        "bench-trampoline",
        env=fleet.worker_env(),
    )  # fmt: skip
    from bench.trampoline import app

    r = redis.Redis.from_url(fleet.redis_url)
    samples = []
    for _ in range(4):  # the first run warms the worker up
        key = f"bench:done:{uuid.uuid4().hex}"
        started = time.perf_counter()
        app.send_task("bench.hop", args=[hops, key], queue="bench")
        r.blpop([key], timeout=120)
        samples.append((time.perf_counter() - started) * 1000 / (hops + 1))
    return statistics.median(samples[1:])


def main() -> int:
    rows: list[tuple[str, str]] = []
    with Fleet() as fleet:
        redis_url = fleet.ensure_redis(private=True)
        os.environ["REDIS_URL"] = redis_url
        fleet.start_replay()
        fleet.start_workers()
        client = Client(redis_url)
        run(client, [weather_spec(f"warm/{i}") for i in range(20)])  # compile + connect

        latencies = []
        for i in range(30):
            latencies.append(run(client, [weather_spec(f"seq/{i}")]) * 1000)
        session_ms = statistics.median(latencies)
        hop_ms = trampoline_ms_per_hop(fleet)
        step_ms = session_ms / STEPS_PER_SESSION
        rows.append(("bare Celery trampoline hop (no-op)", f"{hop_ms:.2f} ms/hop"))
        rows.append(("one session, 5 steps, zero-latency model", f"{session_ms:.1f} ms"))
        rows.append(("  per step", f"{step_ms:.2f} ms/step ({step_ms / hop_ms:.1f}x a bare hop)"))

        wall = run(client, [weather_spec(f"tp/{i}") for i in range(1000)])
        rows.append(
            ("1,000 sessions (2 model calls + 1 tool each)", f"{wall:.2f} s, {1000 / wall:.0f}/s")
        )

        concurrency = WORKER_PROFILES["llm"][1]
        n, latency_ms = 320, 200
        wall = run(client, [weather_spec(f"lat/{i}", latency_ms) for i in range(n)])
        ideal = n * 2 * latency_ms / 1000 / concurrency
        rows.append(
            (f"{n} sessions, 200 ms model latency, C={concurrency}",
             f"{wall:.2f} s vs ideal {ideal:.2f} s ({wall / ideal:.2f}x)")
        )  # fmt: skip
        client.close()
    width = max(len(k) for k, _ in rows)
    print(f"\n{'measure'.ljust(width)}  result\n{'-' * width}  {'-' * 40}")
    for key, value in rows:
        print(f"{key.ljust(width)}  {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
