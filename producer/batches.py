"""Batches after their submit (`cchatq batch`): list them, count a batch's sessions by state
and outcome, collect its results, cancel what still runs. A batch names the spec ids it
submitted (keys.batch_ids) and the run of each that it ran or joined (keys.batch_runs): its
results are those runs, whatever later reruns of the same ids do.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from producer.batch_tally import BatchTally, Tally
from producer.state_reader import PIPELINE_SIZE
from schemas import keys
from schemas.bodies import CANCELLED, OK, is_error_body
from schemas.session_record import read_record
from schemas.spec_types import Spec, spec_from_json

if TYPE_CHECKING:
    from producer.submitting import Submitting

# A batch of more sessions than this is counted by its tally: its unfinished sessions' states
# are read exactly while this many or fewer are left, else from an even sample of this many.
SAMPLE = 1000
SAMPLE_WINDOWS = 50  # the sample's runs of consecutive members, spread over the batch


@dataclass(frozen=True)
class BatchMember:
    spec_id: str
    claim: keys.Claim | None  # the run this batch ran; None: not known (expired with Redis's data)


@dataclass(frozen=True)
class BatchSummary:
    batch: str
    submitted_ms: int
    sessions: int
    states: dict[str, int] = field(default_factory=dict)  # queued, running, done, gone
    outcomes: dict[str, int] = field(default_factory=dict)  # of the done: ok or error codes
    cancelling: int = 0  # of the unfinished, those asked to stop (cancel requested)
    last_finished_ms: int | None = None  # the latest time one of its sessions ended
    sampled: int = 0  # >0: queued, running and gone estimated from this many sessions' states

    @property
    def unfinished(self) -> int:
        return self.states.get("queued", 0) + self.states.get("running", 0)

    @property
    def completed_ms(self) -> int | None:
        """When its last session ended: None while any runs (or none ended)."""
        return None if self.unfinished else self.last_finished_ms

    @property
    def status(self) -> str:
        """Its status word, as an OpenAI Batch's (README: Batches)."""
        return batch_status(self)

    def to_json(self) -> dict[str, Any]:
        """`cchatq batch status B --json`: times ISO-8601 UTC (None until they happen)."""
        completed = self.completed_ms
        return {
            "batch": self.batch, "status": self.status, "sessions": self.sessions,
            "states": self.states, "outcomes": self.outcomes,
            "submitted_at": iso_utc(self.submitted_ms) if self.submitted_ms else None,
            "completed_at": None if completed is None else iso_utc(completed),
        } | ({"sampled": self.sampled} if self.sampled else {})  # fmt: skip


def batch_status(summary: BatchSummary) -> str:
    """validating: recorded, none of its sessions stored yet (its submit is enqueuing);
    in_progress: some queued or running; cancelling: some still run and were asked to stop;
    once none runs: expired if some are gone (their runs expired or were lost before their
    results could be read), cancelled if a cancel ended some, failed if every session ended
    with an error, else completed (some may have failed: see the outcomes)."""
    if summary.sessions == 0:
        return "validating"
    if summary.unfinished:
        return "cancelling" if summary.cancelling else "in_progress"
    if summary.states.get("gone"):
        return "expired"
    if summary.outcomes.get(CANCELLED):
        return "cancelled"
    if not summary.outcomes.get(OK):
        return "failed"
    return "completed"


def iso_utc(epoch_ms: int | float) -> str:
    """An epoch time in ms as ISO-8601 UTC to the second: 2025-01-31T12:00:00Z."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch_ms / 1000))


@dataclass(frozen=True)
class MemberState:
    """What a batch member's run says of itself: its meta's state, outcome and end, and
    whether a cancel was asked for it; all empty when its run is gone."""

    state: str | None = None
    outcome: str | None = None
    finished_ms: int | None = None
    cancel_requested: bool = False


@dataclass(frozen=True)
class FailedSession:
    """A session of a batch that ended with an error body: what `batch retry` chooses from."""

    spec_id: str
    sk: str
    code: str
    message: str  # its error body's message (a provider's says `HTTP 400: ...`)


class BatchCounts:
    """A batch's members and counts, read with Redis alone (`cchatq batch status`)."""

    def __init__(self, client: Any, tally: BatchTally) -> None:
        """`client`: redis-py's; `tally`: its batches' ended indexes."""
        self.redis = client
        self.tally = tally

    def recent(self, most: int = 50) -> list[tuple[str, int, int]]:
        """(batch, submitted_ms, sessions) of the latest batches, newest first."""
        found = self.redis.zrevrange(keys.BATCHES, 0, most - 1, withscores=True)
        pipe = self.redis.pipeline(transaction=False)
        for batch, _ in found:
            pipe.llen(keys.batch_ids(batch.decode()))
        sizes = pipe.execute()
        return [(b.decode(), int(ms), n) for (b, ms), n in zip(found, sizes, strict=True) if n]

    def members(self, batch: str) -> list[BatchMember]:
        pipe = self.redis.pipeline(transaction=False)
        pipe.lrange(keys.batch_ids(batch), 0, -1)
        pipe.lrange(keys.batch_runs(batch), 0, -1)
        ids, runs = pipe.execute()
        runs += [None] * (len(ids) - len(runs))
        return [
            BatchMember(i.decode(), None if run is None else keys.Claim.decode(run))
            for i, run in zip(ids, runs, strict=True)
        ]

    def summary(self, batch: str) -> BatchSummary | None:
        """Its sessions counted by state and outcome. A batch of more than SAMPLE sessions is
        counted by its tally (producer/batch_tally.py): its finished sessions exactly, with a
        few reads whatever its size; how many of the others are queued, running or gone is
        read exactly while SAMPLE or fewer are left, else estimated from an even sample of
        SAMPLE sessions (`sampled`)."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.zscore(keys.BATCHES, batch)
        pipe.llen(keys.batch_ids(batch))
        submitted, sessions = pipe.execute()
        if submitted is None and not sessions:
            return None
        if sessions <= SAMPLE:  # small: every member's state read
            return self._summary(batch, int(submitted or 0), self.members(batch))
        return self._tallied(batch, int(submitted or 0), sessions, self.tally.read(batch))

    def _summary(
        self, batch: str, submitted_ms: int, members: list[BatchMember], indexed: bool = True
    ) -> BatchSummary:
        """`members` counted by their states (`indexed`: those in the ended index from it)."""
        states: Counter[str] = Counter()
        outcomes: Counter[str] = Counter()
        cancelling, last_ms = 0, None
        for looked in self._states(members, batch if indexed else ""):
            if looked.state is None:
                states["gone"] += 1
            elif looked.outcome is not None:
                states["done"] += 1
                outcomes[looked.outcome] += 1
                if looked.finished_ms is not None:
                    last_ms = max(last_ms or 0, looked.finished_ms)
            else:
                states["queued" if looked.state == "queued" else "running"] += 1
                cancelling += looked.cancel_requested
        return BatchSummary(
            batch, submitted_ms, len(members), dict(states), dict(outcomes), cancelling, last_ms
        )

    def _tallied(self, batch: str, submitted_ms: int, sessions: int, tally: Tally) -> BatchSummary:
        """The ended index's sessions, and the others found among the members (every run
        read, against the index's keys) or, while more than SAMPLE are left, sampled."""
        done = min(tally.done, sessions)
        left = sessions - done
        sampled = self._sample(batch, sessions) if left > SAMPLE else []
        if left > SAMPLE:
            sks = [m.claim.sk for m in sampled if m.claim is not None]
            marks = dict(zip(sks, self.tally.ended(batch, sks), strict=True))
            rest = [m for m in sampled if m.claim is None or not marks[m.claim.sk]]
        else:
            rest = self._unended(batch, sessions) if left else []
        seen = self._summary(batch, submitted_ms, rest, indexed=False)
        outcomes = Counter(tally.outcomes)
        last_ms = tally.last_finished_ms
        states = Counter({"done": done})
        cancelling = seen.cancelling
        if left <= SAMPLE:  # exact: those found ended since the index was read are done too
            outcomes.update(seen.outcomes)
            states.update(seen.states)
            last_ms = max(filter(None, (last_ms, seen.last_finished_ms)), default=None)
        else:
            states.update(_estimated(seen.states, left))
            unfinished = seen.unfinished + seen.states.get("gone", 0)
            cancelling = round(left * seen.cancelling / unfinished) if unfinished else 0
        return BatchSummary(
            batch, submitted_ms, sessions, {s: n for s, n in states.items() if n},
            dict(outcomes), cancelling, last_ms, len(sampled),
        )  # fmt: skip

    def _unended(self, batch: str, sessions: int) -> list[BatchMember]:
        """The members not in the ended index: every run read (one LRANGE) against the index's
        keys (one HKEYS), only the others decoded; a member without a run is gone."""
        runs = self.redis.lrange(keys.batch_runs(batch), 0, -1)
        ended = self.tally.ended_keys(batch)
        rest = [
            BatchMember("", keys.Claim.decode(raw))
            for raw in runs
            if raw.partition(b" ")[0].decode() not in ended  # the sk, as Claim.decode reads it
        ]
        return rest + [BatchMember("", None)] * max(0, sessions - len(runs))

    def _sample(self, batch: str, sessions: int) -> list[BatchMember]:
        """SAMPLE members in SAMPLE_WINDOWS runs spread evenly over the batch."""
        size = SAMPLE // SAMPLE_WINDOWS
        step = sessions / SAMPLE_WINDOWS
        pipe = self.redis.pipeline(transaction=False)
        for window in range(SAMPLE_WINDOWS):
            start = int(window * step)
            pipe.lrange(keys.batch_runs(batch), start, start + size - 1)
        return [BatchMember("", keys.Claim.decode(raw)) for runs in pipe.execute() for raw in runs]

    def _states(self, members: list[BatchMember], batch: str = "") -> list[MemberState]:
        """Each member's state: how it ended, from `batch`'s ended index (one HMGET), else its
        meta and cancel flag (a pipeline over those not ended), else its retired record (one
        it joined that ended before); an empty MemberState when its run is gone."""
        sks = [m.claim.sk for m in members if m.claim is not None]
        ended: dict[str, MemberState] = {}
        found_ended = self.redis.hmget(keys.batch_ended(batch), sks) if batch and sks else []
        for sk, raw in zip(sks, found_ended, strict=False):
            if raw is not None:
                outcome, _, finished_ms = raw.decode().partition(" ")
                ended[sk] = MemberState("done", outcome, int(finished_ms or 0) or None)
        pipe = self.redis.pipeline(transaction=False)
        asked = [sk for sk in sks if sk not in ended]
        for sk in asked:
            pipe.hmget(keys.meta(sk), "state", "outcome", "finished_ms")
            pipe.exists(keys.cancel(sk))
        found = iter(pipe.execute() if asked else [])
        looked: dict[str, MemberState] = {}
        for sk in asked:
            (state, outcome, finished), cancel = next(found), next(found)
            looked[sk] = MemberState(
                None if state is None else state.decode(),
                None if outcome is None else outcome.decode(),
                None if finished is None else int(finished),
                bool(cancel),
            )
        gone = [sk for sk, state in looked.items() if state.state is None]
        raw_records = self.redis.mget([keys.record(sk) for sk in gone]) if gone else []
        for sk, raw in zip(gone, raw_records, strict=True):
            stored = None if raw is None else read_record(raw)
            if stored is not None and stored.retired:
                finished_ms = stored.meta.get("finished_ms")
                looked[sk] = MemberState(
                    "done", stored.meta.get("outcome"), int(finished_ms) if finished_ms else None
                )
        return [
            MemberState() if m.claim is None else ended.get(m.claim.sk) or looked[m.claim.sk]
            for m in members
        ]


class Batches(BatchCounts):
    """A batch's counts, results, failed sessions, cancel: through a producer's client."""

    def __init__(self, client: Submitting) -> None:
        super().__init__(client.redis, BatchTally(client.redis))
        self.client = client

    def namespace(self, batch: str) -> str:
        """The namespace a batch's ids were claimed in (the client's if it is not known)."""
        raw = self.redis.get(keys.batch_namespace(batch))
        return self.client.namespace if raw is None else str(raw.decode())

    def results(self, batch: str) -> Iterator[tuple[BatchMember, dict[str, Any] | None]]:
        """Each member with its record (None while it runs, or when its run is gone)."""
        members = self.members(batch)
        for start in range(0, len(members), PIPELINE_SIZE):
            part = members[start : start + PIPELINE_SIZE]
            known = [m.claim.sk for m in part if m.claim is not None]
            records = iter(self.client.records(known) if known else [])
            for member in part:
                yield member, None if member.claim is None else next(records)

    def failed_sessions(self, batch: str) -> list[FailedSession]:
        """The batch's sessions that ended with an error body, each with its code and its
        body's message (what `cchatq batch retry` selects by)."""
        members = self.members(batch)
        failed = [
            (m.spec_id, m.claim.sk, looked.outcome)
            for m, looked in zip(members, self._states(members, batch), strict=True)
            if m.claim is not None and looked.outcome is not None and looked.outcome != OK
        ]
        out: list[FailedSession] = []
        for start in range(0, len(failed), PIPELINE_SIZE):
            part = failed[start : start + PIPELINE_SIZE]
            bodies = self.redis.mget([keys.response(sk) for _, sk, _ in part])
            for (spec_id, sk, outcome), raw in zip(part, bodies, strict=True):
                body: Any = json.loads(raw) if raw is not None else None
                message = str(body["error"].get("message", "")) if is_error_body(body) else ""
                out.append(FailedSession(spec_id, sk, outcome, message))
        return out

    def specs_of(self, sks: list[str]) -> list[Spec]:
        """The stored specs of these sessions (those still stored: a session that ended with
        an error keeps its spec in its record), to run again."""
        raw = self.redis.mget([keys.spec(sk) for sk in sks]) if sks else []
        retired = [sk for sk, r in zip(sks, raw, strict=True) if r is None]
        records = zip(retired, self.client.stored_records(retired), strict=True)
        kept = {sk: s.spec for sk, s in records if s is not None and s.spec is not None}
        specs = [
            json.loads(r) if r is not None else kept.get(sk) for sk, r in zip(sks, raw, strict=True)
        ]
        return [spec_from_json(s) for s in specs if s is not None]

    def cancel(self, batch: str) -> int:
        """Ask every session of the batch that has not finished to stop: how many."""
        members = self.members(batch)
        running = [
            m.claim.sk
            for m, looked in zip(members, self._states(members, batch), strict=True)
            if m.claim is not None and looked.state is not None and looked.outcome is None
        ]
        return sum(self.client.cancel_run(sk) for sk in running)


def _estimated(seen: dict[str, int], left: int) -> dict[str, int]:
    """`left` unfinished sessions shared out as queued, running and gone as a sample's
    unfinished ones are (all running when the sample found none unfinished: they are ending)."""
    queued, running, gone = (seen.get(s, 0) for s in ("queued", "running", "gone"))
    sampled = queued + running + gone
    if not sampled:
        return {"running": left}
    gone_n = round(left * gone / sampled)
    queued_n = min(left - gone_n, round(left * queued / sampled))
    return {"queued": queued_n, "running": left - gone_n - queued_n, "gone": gone_n}
