"""Batches after their submit (`cchatq batch`): list them, count a batch's sessions by state
and outcome, collect its results, cancel what still runs. A batch names the spec ids it
submitted (keys.batch_ids) and the run of each that it ran or joined (keys.batch_runs): its
results are those runs, whatever later reruns of the same ids do.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from producer.submitting import PIPELINE_SIZE, Submitting
from schemas import keys
from schemas.bodies import OK
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

    @property
    def unfinished(self) -> int:
        return self.states.get("queued", 0) + self.states.get("running", 0)

    def to_json(self) -> dict[str, Any]:
        return {
            "batch": self.batch, "submitted_ms": self.submitted_ms, "sessions": self.sessions,
            "states": self.states, "outcomes": self.outcomes,
        }  # fmt: skip


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
        for member, (state, outcome) in zip(members, self._states(members), strict=True):
            if member.claim is None or state is None:
                states["gone"] += 1
            elif outcome is not None:
                states["done"] += 1
                outcomes[outcome] += 1
            else:
                states["queued" if state == "queued" else "running"] += 1
        return BatchSummary(batch, int(submitted or 0), len(members), dict(states), dict(outcomes))

    def results(self, batch: str) -> Iterator[tuple[BatchMember, dict[str, Any] | None]]:
        """Each member with its record (None while it runs, or when its run is gone)."""
        members = self.members(batch)
        for start in range(0, len(members), PIPELINE_SIZE):
            part = members[start : start + PIPELINE_SIZE]
            known = [m.claim.sk for m in part if m.claim is not None]
            records = iter(self.client.records(known) if known else [])
            for member in part:
                yield member, None if member.claim is None else next(records)

    def failed_specs(self, batch: str) -> list[Spec]:
        """The stored specs of the batch's sessions that ended with an error body: to run
        again (`cchatq batch retry B --failed`), as their ids' next attempts."""
        members = self.members(batch)
        failed = [
            m.claim.sk
            for m, (_, outcome) in zip(members, self._states(members), strict=True)
            if m.claim is not None and outcome not in (None, OK)
        ]
        raw = self.redis.mget([keys.spec(sk) for sk in failed]) if failed else []
        return [spec_from_json(json.loads(r)) for r in raw if r is not None]

    def cancel(self, batch: str) -> int:
        """Ask every session of the batch that has not finished to stop: how many."""
        summary_states = self._states(members := self.members(batch))
        running = [
            m.claim.sk
            for m, (state, outcome) in zip(members, summary_states, strict=True)
            if m.claim is not None and state is not None and outcome is None
        ]
        return sum(self.client.cancel_run(sk) for sk in running)

    def _states(self, members: list[BatchMember]) -> list[tuple[str | None, str | None]]:
        """Each member's (state, outcome) from its meta; (None, None) when its run is gone."""
        pipe = self.redis.pipeline(transaction=False)
        for member in members:
            if member.claim is not None:
                pipe.hmget(keys.meta(member.claim.sk), "state", "outcome")
        found = iter(pipe.execute())
        states: list[tuple[str | None, str | None]] = []
        for member in members:
            state, outcome = next(found) if member.claim is not None else (None, None)
            states.append(
                (
                    None if state is None else state.decode(),
                    None if outcome is None else outcome.decode(),
                )
            )
        return states
