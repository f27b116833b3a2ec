"""What a chaos run left (bench/chaos.py): each session's record, trace and tool tries read back
from Redis into one row of the table, with notes (dead letters, the commonest warnings of the
fleet's logs, a crashed producer's error)."""

from __future__ import annotations

import itertools
import re
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from bench.history import Verdict
from schemas import keys
from schemas.session_record import read_record

MGET = 1000
STALL_NOTE_S = 5.0  # a session quiet this long between two of its trace events is noted

# --- what a run left -------------------------------------------------------------------------


@dataclass
class Row:
    scenario: str
    expected: int
    finished: int = 0
    ok: int = 0
    step_failed: int = 0
    other_errors: int = 0
    duplicates: int = 0
    hung: int = 0
    wall_s: float = 0.0
    goal: str = ""  # "met", "NOT MET (...)", or "-" (informational)
    notes: list[str] = field(default_factory=list)
    verdict: Verdict | None = None  # the run judged as a whole history (bench/history.py)


def _records(r: Any, sks: Sequence[str]) -> list[dict[str, Any] | None]:
    out: list[dict[str, Any] | None] = []
    for start in range(0, len(sks), MGET):
        raw = r.mget([keys.record(sk) for sk in sks[start : start + MGET]])
        out.extend(None if v is None else read_record(v).record for v in raw)
    return out


def _trace(r: Any, sk: str, entries: list[Any]) -> list[dict[str, Any]]:
    """A session's trace events: its stream's, else (retired) its record's."""
    events = [event for _, fields in entries for event in keys.trace_events(fields)]
    if events:
        return events
    raw = r.get(keys.record(sk))
    return [] if raw is None else read_record(raw).trace


def finished_count(r: Any, sks: Sequence[str]) -> int:
    return sum(1 for record in _records(r, sks) if record is not None)


def _calls(record: dict[str, Any]) -> list[tuple[int, int, str]]:
    """(round, index, call id) of each tool call in the transcript."""
    calls = []
    rounds = [m for m in record.get("transcript", []) if m.get("role") == "assistant"]
    for round_no, message in enumerate(rounds):
        for index, call in enumerate(message.get("tool_calls") or []):
            calls.append((round_no, index, str(call.get("id"))))
    return calls


def duplicated(record: dict[str, Any], finished_events: Counter[str]) -> str:
    """Why this record holds a tool call twice ("" when it does not)."""
    calls = _calls(record)
    answers = [m.get("tool_call_id") for m in record.get("transcript", []) if m["role"] == "tool"]
    if len(answers) != len(set(answers)):
        return "a tool message twice for one call id"
    if len(answers) > len(calls):
        return f"{len(answers)} tool messages for {len(calls)} calls"
    executed = int((record.get("metrics") or {}).get("tool_calls", 0))
    if executed > len(calls):
        return f"metrics.tool_calls {executed} for {len(calls)} calls"
    twice = sorted(call for call, n in finished_events.items() if n > 1)
    if twice:
        return f"tool.call.finished twice for {twice}"
    return ""


def tally(r: Any, scenario: str, sks: Sequence[str], expected_content: dict[str, str]) -> Row:
    """The row of a run from what Redis holds: each session's record, trace and tool tries."""
    row = Row(scenario, len(sks))
    records = _records(r, sks)
    done = [(sk, rec) for sk, rec in zip(sks, records, strict=True) if rec is not None]
    pipe = r.pipeline(transaction=False)
    for sk, _ in done:
        pipe.xrange(keys.trace(sk))
    traces = pipe.execute() if done else []
    pipe = r.pipeline(transaction=False)  # a retired session's counts are gone: 1 each
    steps = [keys.tool_step(sk, n, i) for sk, rec in done for n, i, _ in _calls(rec)]
    for step in steps:
        pipe.get(keys.tries(step))
    tries = pipe.execute() if steps else []
    errors: Counter[str] = Counter()
    wrong: list[str] = []
    stalls: dict[str, list[tuple[float, str]]] = {}
    for (sk, record), trace in zip(done, traces, strict=True):
        row.finished += 1
        finished_events: Counter[str] = Counter()
        events = _trace(r, sk, trace)
        for event in events:
            if event.get("event") == "tool.call.finished":
                finished_events[str(event.get("call_id"))] += 1
        stall = longest_gap(events)
        if stall is not None and stall[0] >= STALL_NOTE_S:
            stalls.setdefault(stall[1], []).append((stall[0], sk))
        why = duplicated(record, finished_events)
        if why:
            row.duplicates += 1
            row.notes.append(f"duplicate in {record['id']}: {why}")
        error = (record.get("body") or {}).get("error")
        if record.get("status") == "ok" and not error:
            content = record["body"]["choices"][0]["message"].get("content")
            if content == expected_content[record["id"]]:
                row.ok += 1
            else:
                wrong.append(f"{record['id']}: {str(content)[:80]!r}")
        elif isinstance(error, dict) and error.get("code") == "step_failed":
            row.step_failed += 1
            errors["step_failed: " + str(error.get("message"))[:100]] += 1
        else:
            row.other_errors += 1
            code = error.get("code") if isinstance(error, dict) else record.get("status")
            message = error.get("message") if isinstance(error, dict) else ""
            errors[f"{code}: {str(message)[:100]}"] += 1
    row.hung = len(sks) - row.finished
    reruns = sum(1 for t in tries if keys.tries_count(t) > 1)
    row.notes.append(f"tool steps run more than once (a killed try, then one that ran): {reruns}")
    if wrong:
        row.other_errors += len(wrong)
        row.notes.append(f"ok but not the expected answer: {len(wrong)}, e.g. {wrong[:3]}")
    row.notes.extend(f"error body x{n}: {text}" for text, n in errors.most_common(6))
    for where, found in sorted(stalls.items(), key=lambda item: -len(item[1]))[:5]:
        worst, example = max(found)
        row.notes.append(
            f"sessions quiet >= {STALL_NOTE_S:.0f} s between {where}: {len(found)} "
            f"(longest {worst:.1f} s, session {example})"
        )
    if row.hung:
        row.notes.extend(
            hung_states(r, [sk for sk, rec in zip(sks, records, strict=True) if rec is None])
        )
    return row


def longest_gap(events: list[dict[str, Any]]) -> tuple[float, str] | None:
    """The longest quiet time between two trace events of a session, and between which."""
    best: tuple[float, str] | None = None
    for before, after in itertools.pairwise(events):
        gap = (int(after.get("ts_ms", 0)) - int(before.get("ts_ms", 0))) / 1000
        if best is None or gap > best[0]:
            best = (gap, f"{_label(before)} -> {_label(after)}")
    return best


def _label(event: dict[str, Any]) -> str:
    label = str(event.get("event"))
    return label if event.get("round") is None else f"{label} r{event['round']}"


def hung_states(r: Any, sks: list[str]) -> list[str]:
    """Where the sessions that did not finish stand: their state and their steps' states."""
    try:
        pipe = r.pipeline(transaction=False)
        for sk in sks:
            pipe.hget(keys.meta(sk), "state")
            pipe.exists(keys.spec(sk))
            pipe.ttl(keys.meta(sk))
        replies = pipe.execute()
    except redis.RedisError as exc:
        return [f"hung sessions: Redis did not answer ({exc})"]
    states: Counter[str] = Counter()
    for state, spec, ttl in zip(replies[0::3], replies[1::3], replies[2::3], strict=True):
        text = "no meta" if state is None else state.decode()
        text += "" if spec else ", no spec"
        text += ", meta without TTL" if ttl == -1 else ""
        states[text] += 1
    lines = [f"hung sessions by state: {dict(states.most_common())}"]
    for sk in sks[:3]:
        steps = sorted(k.decode() for k in r.scan_iter(f"{keys.step_state(sk)}*", count=1000))
        values = [(k.removeprefix(keys.step_state(sk)) or "start", r.get(k)) for k in steps]
        lines.append(
            f"  {sk}: steps {[(k, (v or b'')[:12].decode(errors='replace')) for k, v in values]}"
        )
    return lines


def dead_letters(r: Any, limit: int = 8) -> list[str]:
    try:
        entries = r.xrange(keys.DEADLETTER, count=limit)
        total = r.xlen(keys.DEADLETTER)
    except redis.RedisError:
        return []
    lines = [f"dead letters: {total}"] if total else []
    for _, fields in entries:
        step = fields.get(b"step", b"").decode()
        reason = fields.get(b"reason", b"").decode()
        lines.append(f"  dead letter {step}: {reason[:240]}")
    return lines


_VOLATILE = re.compile(r"\b[0-9a-f]{8,}\b|\d+(\.\d+)?")


def log_digest(workdir: Path, top: int = 8) -> list[str]:
    """The commonest warning, error and traceback lines of the fleet's logs, numbers and ids
    blanked so that one line stands for its kind, each with its count and one real example."""
    kinds: Counter[str] = Counter()
    example: dict[str, str] = {}
    for log in sorted(workdir.glob("*.log")):
        name = log.stem.rstrip("0123456789").rstrip("-")
        for line in log.read_text(errors="replace").splitlines():
            if not re.search(r"WARNING|ERROR|CRITICAL|Traceback|Error:|Exception", line):
                continue
            if "Memory overcommit" in line or line.startswith("Traceback"):
                continue  # redis-server's note about the host; a traceback's first line
            text = re.sub(r"^\[[^\]]*\]\s*", "", line.strip())  # Celery's [time: LEVEL/proc]
            kind = f"{name}: {_VOLATILE.sub('#', text)[:160]}"
            kinds[kind] += 1
            example.setdefault(kind, f"{log.name}: {line.strip()[:300]}")
    return [f"  x{n} {example[kind]}" for kind, n in kinds.most_common(top)]


_DUMP = re.compile(r"EMERGENCY DUMP STATE TO FILE -> (\S+) <-")


def remove_dumps(workdir: Path) -> list[str]:
    """kombu dumps the messages it could not give back to a broker that went away into files
    of the system's temporary directory: count them (that is what was held) and remove them."""
    dumps = []
    for log in workdir.glob("*.log"):
        dumps.extend(_DUMP.findall(log.read_text(errors="replace")))
    for dump in dumps:
        Path(dump).unlink(missing_ok=True)
    if not dumps:
        return []
    return [f"kombu emergency dumps (messages it could not restore), removed: {len(dumps)}"]


def crash_summary(log: Path) -> list[str]:
    """The last project frame of a process's traceback and its exception line."""
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    frames = [
        f"  {line.strip()} :: {lines[n + 1].strip()}"
        for n, line in enumerate(lines[:-1])
        if line.strip().startswith("File ")
        and "site-packages" not in line
        and "<frozen" not in line
    ]
    errors = [
        f"  {line.strip()[:240]}" for line in lines if re.match(r"^[\w.]+(Error|Exception)", line)
    ]
    return frames[-2:] + errors[-1:]


HEADER = (
    "run",
    "finished",
    "ok",
    "step_failed",
    "other errors",
    "dup tool msgs",
    "hung",
    "wall s",
    "history",
    "goal",
)


def cells(row: Row) -> tuple[str, ...]:
    return (
        row.scenario,
        f"{row.finished}/{row.expected}",
        str(row.ok),
        str(row.step_failed),
        str(row.other_errors),
        str(row.duplicates),
        str(row.hung),
        f"{row.wall_s:.1f}",
        "-" if row.verdict is None else row.verdict.word,
        row.goal,
    )


def print_table(rows: list[Row], notes: bool = True) -> None:
    table = [HEADER, *(cells(r) for r in rows)]
    widths = [max(len(line[i]) for line in table) for i in range(len(HEADER) - 1)]
    for line in table:
        print("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=False)) + "  " + line[-1])
    for row in rows if notes else []:
        print(f"\n{row.scenario}:")
        if row.verdict is not None:
            print(f"  {row.verdict.line()}")
        for note in row.notes:
            print(f"  {note}")
    sys.stdout.flush()
