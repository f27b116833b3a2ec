"""A run judged as a whole history, as Jepsen's queue checker judges one: valid only when
nothing the producer acknowledged is lost, no ending appears that nobody submitted, no session
ends twice and no tool call id is answered twice; and, as Temporal observes an activity, a
model call may be made more than once but a round completes once, so the model requests
beyond one a round are counted, each explained by an injected fault the replay server's log
shows or not, and the usage a result reports is held against what the server billed.

This module is pure: `judge` reads typed inputs (`History`) that bench/history_read.py
gathers from Redis and the replay server, so every check can be made to fail on a synthetic
history. `Verdict.line()` is a run's one-line form, `verdict_table` the table of several.
"""

from __future__ import annotations

import sys
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fixtures.replay.conversation import Usage
from fixtures.replay.request_log import LoggedRequest, conversation_id

EXAMPLES = 3  # spec ids named per failed check


# --- inputs -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Submitted:
    """A session the producer acknowledged: its spec id, and its first user message's text,
    by which the replay server keys its conversation (kept in memory only, never printed)."""

    spec_id: str
    first_user: str


@dataclass(frozen=True)
class StoredRecord:
    """A result record, reduced to what the checks read."""

    spec_id: str  # the id the record names
    call_ids: tuple[str, ...]  # the tool call ids of its assistant messages, call after call
    answer_ids: tuple[str, ...]  # the tool_call_id of each of its tool messages
    usage: Usage | None  # metrics.usage (prompt, completion tokens); None when it has none

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> StoredRecord:
        messages = [m for m in record.get("transcript") or [] if isinstance(m, Mapping)]
        calls = tuple(
            str(call.get("id"))
            for m in messages
            if m.get("role") == "assistant"
            for call in m.get("tool_calls") or []
        )
        answers = tuple(str(m.get("tool_call_id")) for m in messages if m.get("role") == "tool")
        raw = ((record.get("metrics") or {}).get("usage")) or {}
        prompt, completion = raw.get("prompt_tokens"), raw.get("completion_tokens")
        usage = (
            Usage(prompt, completion)
            if isinstance(prompt, int) and isinstance(completion, int)
            else None
        )
        return cls(str(record.get("id")), calls, answers, usage)


@dataclass(frozen=True)
class Run:
    """One run the history found: a submitted id's claim, or a member of the run's batches."""

    spec_id: str  # the id it runs (the claim's or the batch's)
    sk: str
    record: StoredRecord | None  # None while it has no result record
    finished_events: int  # session.finished events in its trace


@dataclass(frozen=True)
class History:
    """What a run left. `delivered`: the spec id of each result the producer handed out (None:
    not watched); `requests`: the replay server's log of the run (None: not read), and whether
    it still held every request of the run."""

    submitted: tuple[Submitted, ...]
    runs: tuple[Run, ...]
    delivered: tuple[str, ...] | None = None
    requests: tuple[LoggedRequest, ...] | None = None
    log_complete: bool = True


# --- the verdict ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    run: str
    submitted: int
    ended: int  # submitted ids with an ending (a record, or a result the producer handed out)
    lost: int  # submitted and acknowledged, no ending
    unexpected: int  # endings of ids nobody submitted, or records naming another id
    double_endings: int  # ids ended twice: two records, two results, two session.finished
    tool_calls: int  # tool call ids in the final transcripts
    tool_answered_twice: int
    tool_unanswered: int
    log_judged: bool  # the replay log was read and held the whole run: the counts below hold
    conversations: int = 0  # submitted sessions the log shows requests of
    model_calls: int = 0  # their requests
    rounds: int = 0  # the rounds those requests asked for (one call each, ideally)
    extra_explained: int = 0  # requests beyond one a round that an injected fault explains
    extra_unexplained: int = 0  # beyond one a round, no fault before them
    usage_checked: int = 0  # records whose usage was held against what the server billed
    usage_mismatches: int = 0
    examples: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def valid(self) -> bool:
        return not (self.lost or self.unexpected or self.double_endings or self.tool_answered_twice)

    @property
    def word(self) -> str:
        return "valid" if self.valid else "INVALID"

    def line(self) -> str:
        """The run's verdict on one line."""
        text = (
            f"{self.run}: history {self.word}: {self.ended}/{self.submitted} ended, lost "
            f"{self.lost}, unexpected {self.unexpected}, double endings {self.double_endings}; "
            f"tool call ids {self.tool_calls}: answered twice {self.tool_answered_twice}, "
            f"unanswered {self.tool_unanswered}; "
        )
        if not self.log_judged:
            return text + "model calls not judged (no complete replay log)"
        return text + (
            f"model calls {self.model_calls} for {self.rounds} rounds of {self.conversations} "
            f"sessions: extra {self.extra_explained} after a fault, {self.extra_unexplained} "
            f"unexplained; usage {self.usage_mismatches} of {self.usage_checked} mismatched"
        )


def judge(run: str, history: History) -> Verdict:
    """The verdict of a run's history."""
    ids = {s.spec_id for s in history.submitted}
    examples: dict[str, list[str]] = defaultdict(list)
    unexpected = 0
    records: Counter[str] = Counter()
    finished: Counter[str] = Counter()
    mine: dict[str, StoredRecord] = {}  # a submitted id's record (its first, if several)
    for r in history.runs:
        finished[r.spec_id] = max(finished[r.spec_id], r.finished_events)
        if r.record is None:
            continue
        if r.spec_id not in ids or r.record.spec_id != r.spec_id:
            unexpected += 1
            examples["unexpected"].append(r.record.spec_id)
            continue
        records[r.spec_id] += 1
        mine.setdefault(r.spec_id, r.record)
    delivered = Counter(history.delivered or ())
    for spec_id, n in delivered.items():
        if spec_id not in ids:
            unexpected += n
            examples["unexpected"].append(spec_id)
    ended = lost = double = 0
    for spec_id in sorted(ids):
        if records[spec_id] or delivered[spec_id]:
            ended += 1
        else:
            lost += 1
            examples["lost"].append(spec_id)
        if max(records[spec_id], delivered[spec_id], finished[spec_id]) > 1:
            double += 1
            examples["double endings"].append(spec_id)
    calls = twice = unanswered = 0
    for spec_id, record in sorted(mine.items()):
        made, answered = Counter(record.call_ids), Counter(record.answer_ids)
        calls += len(made)
        over = sum(1 for c, n in made.items() if answered[c] > n)
        short = sum(1 for c, n in made.items() if answered[c] < n)
        twice, unanswered = twice + over, unanswered + short
        if over:
            examples["tool answered twice"].append(spec_id)
        if short:
            examples["tool unanswered"].append(spec_id)
    counts: dict[str, Any] = {}
    if history.requests is not None and history.log_complete:
        counts = _model_calls(history.submitted, history.requests, mine, examples)
    return Verdict(
        run, len(ids), ended, lost, unexpected, double, calls, twice, unanswered,
        log_judged=bool(counts), **counts,
        examples={k: tuple(v[:EXAMPLES]) for k, v in examples.items()},
    )  # fmt: skip


def _model_calls(
    submitted: Sequence[Submitted],
    requests: Sequence[LoggedRequest],
    records: Mapping[str, StoredRecord],
    examples: dict[str, list[str]],
) -> dict[str, Any]:
    """Per submitted session, its requests in the log by round: one a round is the rule, any
    more after a request a fault answered is explained, the rest are not; and its record's
    usage against the sum the server billed its conversation."""
    by_conversation: dict[str, list[LoggedRequest]] = defaultdict(list)
    for q in requests:
        if q.conversation:
            by_conversation[q.conversation].append(q)
    wires = sorted({(q.protocol, q.scenario) for q in requests if q.conversation})
    out = dict.fromkeys(
        ("conversations", "model_calls", "rounds", "extra_explained", "extra_unexplained",
         "usage_checked", "usage_mismatches"), 0,
    )  # fmt: skip
    for s in submitted:
        found = [
            q
            for wire, scenario in wires
            for q in by_conversation.get(conversation_id(wire, scenario, s.first_user), [])
        ]
        if not found:
            continue
        out["conversations"] += 1
        out["model_calls"] += len(found)
        by_round: dict[int, list[LoggedRequest]] = defaultdict(list)
        for q in found:
            by_round[q.round].append(q)
        out["rounds"] += len(by_round)
        for asked in by_round.values():
            answered = sum(1 for q in asked if q.fault is None)
            unexplained = max(0, answered - 1)
            out["extra_unexplained"] += unexplained
            out["extra_explained"] += len(asked) - 1 - unexplained
            if unexplained:
                examples["extra model calls"].append(s.spec_id)
        record = records.get(s.spec_id)
        if record is not None and record.usage is not None:
            billed = Usage(
                sum(q.usage.input_tokens for q in found), sum(q.usage.output_tokens for q in found)
            )
            out["usage_checked"] += 1
            if record.usage != billed:
                out["usage_mismatches"] += 1
                examples["usage mismatch"].append(s.spec_id)
    return out


# --- printing ---------------------------------------------------------------------------------

HEADER = (
    "run", "history", "ended", "lost", "unexpected", "2 endings", "tool 2x", "tool 0x",
    "model calls/rounds", "extra fault/other", "usage bad",
)  # fmt: skip


def _cells(v: Verdict) -> tuple[str, ...]:
    judged = v.log_judged
    return (
        v.run, v.word, f"{v.ended}/{v.submitted}", str(v.lost), str(v.unexpected),
        str(v.double_endings), str(v.tool_answered_twice), str(v.tool_unanswered),
        f"{v.model_calls}/{v.rounds}" if judged else "-",
        f"{v.extra_explained}/{v.extra_unexplained}" if judged else "-",
        f"{v.usage_mismatches}/{v.usage_checked}" if judged else "-",
    )  # fmt: skip


def verdict_table(verdicts: Sequence[Verdict]) -> list[str]:
    """The verdicts as a table, then the spec ids that failed a check (a few per check)."""
    table = [HEADER, *(_cells(v) for v in verdicts)]
    widths = [max(len(row[i]) for row in table) for i in range(len(HEADER))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in table]
    for v in verdicts:
        lines.extend(f"  {v.run}: {check}: {', '.join(ids)}" for check, ids in v.examples.items())
    return lines


def print_verdicts(verdicts: Sequence[Verdict]) -> None:
    for line in verdict_table(verdicts):
        print(line)
    sys.stdout.flush()
