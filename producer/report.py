"""Live progress and the closing summary of a batch."""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Container, Sequence
from dataclasses import dataclass
from datetime import timedelta
from types import TracebackType
from typing import Any, TextIO

from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from producer.lookups import SessionLookups
from producer.submitting import Submission
from producer.waiting import STATE_SAMPLE
from schemas.bodies import outcome_code

SAMPLE_S = 1.0  # the pending sessions' states are read at most this often
PLAIN_EVERY_S = 10.0  # off a terminal: a progress line at most this often (and a final one)
TICK_S = 0.25  # the ticker thread's beat
REFRESH_PER_S = 4  # rich's refresh thread redraws the terminal display this often

# (queued, running) among the pending sessions, or a sample of them when there are many
States = Callable[[], tuple[int, int]]


def batch_states(client: SessionLookups, sub: Submission, finished: Container[str]) -> States:
    """A batch's queued vs running sessions, read from their meta hashes: every pending one, or
    an even spread of STATE_SAMPLE of them when more are pending (one pipeline a look).
    `sub.order` is read at each look: a session run again after a loss is followed there."""

    def look() -> tuple[int, int]:
        pending = [sk for sk in sub.order if sk not in finished]
        step = max(1, -(-len(pending) // STATE_SAMPLE))
        return client.state_counts(pending[::step])

    return look


def clock_text(seconds: float | None) -> str:
    return "-:--:--" if seconds is None else str(timedelta(seconds=max(0, int(seconds))))


def rate_text(rate: float) -> str:
    return f"{rate:.0f}" if rate >= 10 else f"{rate:.1f}" if rate >= 1 else f"{rate:.2f}"


@dataclass(frozen=True)
class Snapshot:
    """What the display shows at one moment."""

    total: int
    done: int
    ok: int
    earlier: int  # of `done`, those finished before this run (not in the rate)
    failures: tuple[tuple[str, int], ...]  # (error code, count), by code
    queued: int | None  # None: not looked at yet
    running: int | None
    elapsed_s: float

    @property
    def rate(self) -> float:
        """Sessions per second finished by this run."""
        return (self.done - self.earlier) / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def eta_s(self) -> float | None:
        left = self.total - self.done
        if left <= 0:
            return 0.0
        return left / self.rate if self.rate > 0 else None

    def counts(self) -> str:
        states = (
            f"pending {self.total - self.done}"
            if self.queued is None
            else f"queued {self.queued}  running {self.running}"
        )
        return f"{states}  done {self.done} (ok {self.ok})"

    def failed(self) -> str:
        return "failed: " + ", ".join(f"{code} {n}" for code, n in self.failures)

    def line(self) -> str:
        """The plain line written off a terminal."""
        return (
            f"{self.done}/{self.total}  elapsed {clock_text(self.elapsed_s)}"
            f"  ETA {clock_text(self.eta_s)}  {rate_text(self.rate)} sessions/s  {self.counts()}"
            + (f"  {self.failed()}" if self.failures else "")
        )


class Progress:
    """A batch's progress while it is waited for. On a terminal, a rich live display that
    rich's refresh thread redraws REFRESH_PER_S times a second whether or not a session
    finished: a bar with done/total, elapsed, ETA and the rate of this run (sessions already
    finished before it, `already`, are not counted in it); below it queued / running / done
    and the failures by error code. Off a terminal (CI, a file, a pipe): no cursor control, a
    plain line at most every `plain_every_s` and a final one. A ticker thread reads `states`
    at most every `sample_s` (and writes the plain lines). Used as a context manager, which
    stops the display however the wait ends (Ctrl-C, a timeout), leaving the last frame."""

    def __init__(
        self,
        total: int,
        out: Console | TextIO | None = None,
        *,
        already: Collection[str] = (),
        states: States | None = None,
        clock: Callable[[], float] = time.monotonic,
        sample_s: float = SAMPLE_S,
        plain_every_s: float = PLAIN_EVERY_S,
    ) -> None:
        self.total = total
        self.console = out if isinstance(out, Console) else Console(file=out or sys.stderr)
        self.terminal = self.console.is_terminal and not self.console.is_dumb_terminal
        self.already = already
        self.states = states
        self.clock = clock
        self.sample_s, self.plain_every_s = sample_s, plain_every_s
        self.started = self.printed_at = clock()
        self.sampled_at: float | None = None
        self.done = self.ok = self.earlier = 0
        self.failures = Counter[str]()
        self.sample: tuple[int, int] | None = None
        self._lock = threading.Lock()  # the counts, read by the refresh and ticker threads
        self._stopping = threading.Event()
        self._ticker: threading.Thread | None = None
        self._live: Live | None = None

    def update(self, sk: str, record: dict[str, Any]) -> None:
        with self._lock:
            self.done += 1
            self.earlier += sk in self.already
            if record.get("status") == "ok":
                self.ok += 1
            else:
                self.failures[outcome_code(record.get("body"))] += 1

    def snapshot(self) -> Snapshot:
        with self._lock:
            left = self.total - self.done
            queued = running = None
            if self.sample is not None:  # the sample's share of queued, of those left now
                q, r = self.sample
                queued = min(left, round(left * q / (q + r))) if q + r else 0
                running = left - queued
            return Snapshot(
                self.total, self.done, self.ok, self.earlier,
                tuple(sorted(self.failures.items())), queued, running,
                self.clock() - self.started,
            )  # fmt: skip

    def tick(self) -> None:
        """Read the states if due; off a terminal, write the progress line if due."""
        now = self.clock()
        if self.states is not None and (
            self.sampled_at is None or now - self.sampled_at >= self.sample_s
        ):
            self.sampled_at = now
            try:
                sample = self.states()
            except Exception:  # Redis unreachable a moment: the wait itself rides it out
                sample = None
            if sample is not None:
                with self._lock:
                    self.sample = sample
        if not self.terminal and now - self.printed_at >= self.plain_every_s:
            self.printed_at = now
            self._print_line()

    def _print_line(self) -> None:
        self.console.print(
            Text(self.snapshot().line()), soft_wrap=True, markup=False, highlight=False
        )

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        now = self.snapshot()
        bar = Table.grid(padding=(0, 1))
        bar.add_row(
            ProgressBar(total=max(now.total, 1), completed=now.done, width=40),
            Text(f"{now.done}/{now.total}", style="progress.download"),
            Text(f"elapsed {clock_text(now.elapsed_s)}", style="progress.elapsed"),
            Text(f"ETA {clock_text(now.eta_s)}", style="progress.remaining"),
            Text(f"{rate_text(now.rate)} sessions/s", style="progress.data.speed"),
        )
        counts = Text(now.counts())
        if now.failures:
            counts.append("  ").append(now.failed(), style="red")
        yield Group(bar, counts)

    def start(self) -> None:
        if self.terminal:
            self._live = Live(
                self,
                console=self.console,
                refresh_per_second=REFRESH_PER_S,
                redirect_stdout=False,  # results may go there; warnings on stderr go above
            )
            self._live.start()
        self._ticker = threading.Thread(target=self._beat, name="cchatq-progress", daemon=True)
        self._ticker.start()

    def _beat(self) -> None:
        self.tick()  # the first look at the states at once
        while not self._stopping.wait(TICK_S):
            self.tick()

    def stop(self) -> None:
        """Stop the ticker and the display: the last frame stays (off a terminal, the final
        line is written)."""
        self._stopping.set()
        if self._ticker is not None:
            self._ticker.join(timeout=5)
        if self._live is not None:
            self._live.stop()
        elif not self.terminal:
            self._print_line()

    def __enter__(self) -> Progress:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def percentile(values: Sequence[int], q: float) -> int:
    if not values:
        return 0
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


class Summary:
    """A batch's closing summary, added up a record at a time as its sessions finish: a
    waiting submit keeps these counts (and one latency a session), never the records."""

    def __init__(self) -> None:
        self.sessions = self.ok = self.programs = self.program_chats = 0
        self.rounds = self.tool_calls = self.tool_failures = 0
        self.errors = Counter[str]()
        self.latencies: list[int] = []
        self.usage = Counter[str]()

    def add(self, record: dict[str, Any]) -> None:
        self.sessions += 1
        if record.get("status") == "ok":
            self.ok += 1
        else:
            self.errors[outcome_code(record.get("body"))] += 1
        m = record.get("metrics") or {}
        if record.get("kind") == "program":
            self.programs += 1
            self.program_chats += int(m.get("chats", 0))
        self.latencies.append(int(m.get("latency_ms", 0)))
        self.usage.update({k: v for k, v in (m.get("usage") or {}).items() if isinstance(v, int)})
        self.rounds += int(m.get("iterations", 0))
        self.tool_calls += int(m.get("tool_calls", 0))
        self.tool_failures += int(m.get("tool_failures", 0))

    def text(self, wall_s: float) -> str:
        usage, latencies = self.usage, self.latencies
        rows = [
            ("sessions", str(self.sessions)),
            ("ok", str(self.ok)),
            ("errors", ", ".join(f"{c} {n}" for c, n in sorted(self.errors.items())) or "0"),
            ("program runs (their chats)", f"{self.programs} ({self.program_chats})"),
            ("rounds", str(self.rounds)),
            ("tool calls", str(self.tool_calls)),
            ("tool failures", str(self.tool_failures)),
            ("latency p50 / p95",
             f"{percentile(latencies, 0.5)} / {percentile(latencies, 0.95)} ms"),
            ("tokens (prompt/completion/total)",
             f"{usage['prompt_tokens']} / {usage['completion_tokens']} / {usage['total_tokens']}"),
            ("wall time", f"{wall_s:.2f} s ({self.sessions / max(wall_s, 1e-9):.1f} sessions/s)"),
        ]  # fmt: skip
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)


def summary(records: Sequence[dict[str, Any]], wall_s: float) -> str:
    totals = Summary()
    for record in records:
        totals.add(record)
    return totals.text(wall_s)
