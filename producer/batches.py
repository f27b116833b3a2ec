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
from typing import Any

from producer.submitting import PIPELINE_SIZE, Submitting
from schemas import keys
from schemas.bodies import CANCELLED, OK, is_error_body
from schemas.spec_types import Spec, spec_from_json


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
        }  # fmt: skip


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


class Batches:
    def __init__(self, client: Submitting) -> None:
        self.client = client
        self.redis = client.redis

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

    def namespace(self, batch: str) -> str:
        """The namespace a batch's ids were claimed in (the client's if it is not known)."""
        raw = self.redis.get(keys.batch_namespace(batch))
        return self.client.namespace if raw is None else str(raw.decode())

    def summary(self, batch: str) -> BatchSummary | None:
        submitted = self.redis.zscore(keys.BATCHES, batch)
        members = self.members(batch)
        if submitted is None and not members:
            return None
        states: Counter[str] = Counter()
        outcomes: Counter[str] = Counter()
        cancelling, last_ms = 0, None
        for looked in self._states(members, batch):
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
            batch, int(submitted or 0), len(members), dict(states), dict(outcomes),
            cancelling, last_ms,
        )  # fmt: skip

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

    def _states(self, members: list[BatchMember], batch: str = "") -> list[MemberState]:
        """Each member's state: how it ended, from `batch`'s ended index (one read), else its
        meta and cancel flag (a pipeline over those not ended), else its retired record (one
        it joined that ended before); an empty MemberState when its run is gone."""
        ended = self._ended(batch, members)
        pipe = self.redis.pipeline(transaction=False)
        asked = [m.claim.sk for m in members if m.claim is not None and m.claim.sk not in ended]
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
        for sk, stored in zip(gone, self.client.stored_records(gone), strict=True):
            if stored is not None and stored.retired:
                meta = stored.meta
                finished_ms = meta.get("finished_ms")
                looked[sk] = MemberState(
                    "done", meta.get("outcome"), int(finished_ms) if finished_ms else None
                )
        return [
            MemberState() if m.claim is None else ended.get(m.claim.sk) or looked[m.claim.sk]
            for m in members
        ]

    def _ended(self, batch: str, members: list[BatchMember]) -> dict[str, MemberState]:
        """The members `batch`'s ended index holds, as it holds them."""
        if not batch:
            return {}
        ended: dict[str, MemberState] = {}
        for sk, raw in self.redis.hgetall(keys.batch_ended(batch)).items():
            outcome, _, finished_ms = raw.decode().partition(" ")
            ended[sk.decode()] = MemberState("done", outcome, int(finished_ms or 0) or None)
        return ended
