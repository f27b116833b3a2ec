"""Live progress and the closing summary of a batch."""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any, TextIO


class Progress:
    """One line redrawn in place on a terminal; a line every few seconds elsewhere (CI logs)."""

    def __init__(self, total: int, stream: TextIO = sys.stderr, every_s: float = 2.0) -> None:
        self.total = total
        self.stream = stream
        self.tty = stream.isatty()
        self.every_s = every_s if not self.tty else 0.1
        self.started = time.monotonic()
        self.last_draw = 0.0
        self.ok = self.failed = 0

    def update(self, record: dict[str, Any]) -> None:
        if record.get("status") == "ok":
            self.ok += 1
        else:
            self.failed += 1
        self.draw()

    def draw(self, final: bool = False) -> None:
        now = time.monotonic()
        if not final and now - self.last_draw < self.every_s:
            return
        self.last_draw = now
        done = self.ok + self.failed
        rate = done / max(now - self.started, 1e-9)
        width = 30
        filled = int(width * done / max(self.total, 1))
        bar = "#" * filled + "." * (width - filled)
        line = (
            f"[{bar}] {done}/{self.total} done  {self.ok} ok  {self.failed} failed  "
            f"{self.total - done} running  {rate:.1f} sessions/s"
        )
        if self.tty:
            self.stream.write("\r" + line + ("\n" if final else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def percentile(values: Sequence[int], q: float) -> int:
    if not values:
        return 0
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def summary(records: Sequence[dict[str, Any]], wall_s: float) -> str:
    errors = Counter(
        ((r.get("body") or {}).get("error") or {}).get("code", "?")
        for r in records
        if r.get("status") != "ok"
    )
    programs = [r for r in records if r.get("kind") == "program"]
    program_chats = sum(int((r.get("metrics") or {}).get("chats", 0)) for r in programs)
    metrics = [r.get("metrics") or {} for r in records]
    latencies = [int(m.get("latency_ms", 0)) for m in metrics]
    usage = Counter[str]()
    for m in metrics:
        usage.update({k: v for k, v in (m.get("usage") or {}).items() if isinstance(v, int)})
    rows = [
        ("sessions", str(len(records))),
        ("ok", str(sum(1 for r in records if r.get("status") == "ok"))),
        ("errors", ", ".join(f"{code} {n}" for code, n in sorted(errors.items())) or "0"),
        ("program runs (their chats)", f"{len(programs)} ({program_chats})"),
        ("rounds", str(sum(int(m.get("iterations", 0)) for m in metrics))),
        ("tool calls", str(sum(int(m.get("tool_calls", 0)) for m in metrics))),
        ("tool failures", str(sum(int(m.get("tool_failures", 0)) for m in metrics))),
        ("latency p50 / p95", f"{percentile(latencies, 0.5)} / {percentile(latencies, 0.95)} ms"),
        ("tokens (prompt/completion/total)",
         f"{usage['prompt_tokens']} / {usage['completion_tokens']} / {usage['total_tokens']}"),
        ("wall time", f"{wall_s:.2f} s ({len(records) / max(wall_s, 1e-9):.1f} sessions/s)"),
    ]  # fmt: skip
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)
