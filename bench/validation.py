"""Spec-file validation at submit, on its own (no fleet): a generated 120k-session, ~50 MB
JSONL file (the size a tester submitted), validated by `load_spec_file` as `cchatq submit`
does, with its wall time and the peak memory of that step next to the goal.

`python -m bench.validation [SESSIONS]` runs it alone; `python -m bench` prints it as a row.
The load runs in a child process so its peak RSS is the load's own (ru_maxrss is a
process-lifetime high-water mark): the child reports its RSS after imports and its peak after
the load, and the row shows the difference.
"""

from __future__ import annotations

import json
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import fixtures

GUESTS = Path(fixtures.__file__).parent / "guests"
ROOT = Path(__file__).resolve().parent.parent
SESSIONS = 120_000
GOAL_S = 10.0
CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Quito", "Perth", "Hanoi", "Dakar"]
ASKS = [
    "What is the weather in {city} now? One short sentence.",
    "Is it raining in {city}? Asking before I leave (row {n}).",
    "The temperature in {city} in Celsius, please: case {n}.",
    "Should I take a coat to {city} today? Briefly.",
]
TOOL = {
    "module": "fixtures/guests/weather.wasm",
    "export": "get_weather",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def generate(folder: Path, sessions: int = SESSIONS, seed: int = 7) -> Path:
    """`folder/batch.jsonl` of `sessions` lines (~415 bytes each), with the weather module
    beside it at the path the lines name."""
    guests = folder / "fixtures" / "guests"
    guests.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(GUESTS / "weather.wasm", guests / "weather.wasm")
    rng = random.Random(seed)
    path = folder / "batch.jsonl"
    with path.open("w", encoding="utf-8") as out:
        for n in range(sessions):
            city = rng.choice(CITIES)
            spec = {
                "id": f"eval-{n // 1000:03d}/{n:06d}-{rng.randrange(16**6):06x}",
                "model": rng.choice(("gpt-4o-mini", "gpt-4o", "replay/weather")),
                "messages": [
                    {"role": "user", "content": rng.choice(ASKS).format(city=city, n=n)},
                ],
                "tools": [TOOL],
                "params": {"temperature": round(rng.random(), 2), "seed": n % 97},
                "metadata": {"row": n, "city": city},
            }
            out.write(json.dumps(spec, separators=(",", ":")) + "\n")
    return path


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def measure(path: Path) -> dict[str, float]:
    """In this process: load `path`, and report seconds, sessions and RSS before and after."""
    from producer.specfile import load_spec_file

    before = _peak_rss_mb()
    started = time.perf_counter()
    loaded = load_spec_file(path)
    seconds = time.perf_counter() - started
    return {
        "seconds": seconds,
        "sessions": len(loaded),
        "rss_before_mb": before,
        "rss_peak_mb": _peak_rss_mb(),
    }


def validation_row(sessions: int = SESSIONS) -> tuple[str, str]:
    with tempfile.TemporaryDirectory(prefix="cchatq-bench-validate-") as tmp:
        path = generate(Path(tmp), sessions)
        size_mb = path.stat().st_size / 1e6
        child = subprocess.run(
            [sys.executable, "-m", "bench.validation", "--measure", str(path)],
            cwd=ROOT,
            check=True,
            capture_output=True,
            text=True,
        )
        got = json.loads(child.stdout.strip().splitlines()[-1])
    grew = got["rss_peak_mb"] - got["rss_before_mb"]
    return (
        f"spec file validation, {sessions // 1000}k sessions (goal <= {GOAL_S:.0f} s)",
        f"{got['seconds']:.1f} s for {size_mb:.0f} MB, {got['sessions']:,.0f} sessions, "
        f"peak RSS +{grew:.0f} MB ({got['rss_peak_mb']:.0f} MB)",
    )


def main(argv: list[str]) -> int:
    if argv[:1] == ["--measure"]:
        print(json.dumps(measure(Path(argv[1]))))
        return 0
    sessions = int(argv[0]) if argv else SESSIONS
    key, value = validation_row(sessions)
    print(f"{key}  {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
