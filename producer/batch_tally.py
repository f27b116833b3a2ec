"""A batch's count of its ended sessions, from its ended index (keys.batch_ended: each session
that ended -> "<outcome> <finished_ms>", written by the workers as they tell the batch, and by
the submit for a run it joined that had ended before): one HVALS gives the counts by outcome,
the latest end and the recent ends, one HMGET (or HKEYS) which members ended. It reads only,
a few commands whatever the batch's size: `cchatq batch status` and the viewer alike.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from schemas import keys
from schemas.session_record import read_record

BUCKET_MS = 5_000  # the recent ends are counted in buckets this long (the viewer's rate)


@dataclass(frozen=True)
class Tally:
    """What a batch's ended index says: sessions ended, by outcome, the latest end."""

    done: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    last_finished_ms: int | None = None
    buckets: dict[int, int] = field(default_factory=dict)  # finished_ms // BUCKET_MS -> ends

    def ended_since(self, since_ms: int) -> int:
        """Sessions that ended in the buckets from `since_ms` on."""
        first = since_ms // BUCKET_MS
        return sum(n for bucket, n in self.buckets.items() if bucket >= first)


def ended_value(outcome: str, finished_ms: int | None) -> str:
    """A session's entry in an ended index, as the workers write it."""
    return f"{outcome} {finished_ms or 0}"


class BatchTally:
    def __init__(self, client: Any) -> None:
        self.redis = client  # redis-py's, replies as bytes

    def read(self, batch: str) -> Tally:
        """The batch's ended sessions counted (one HVALS)."""
        outcomes: Counter[bytes] = Counter()
        buckets: Counter[int] = Counter()
        last = 0
        values = self.redis.hvals(keys.batch_ended(batch))
        for value in values:
            outcome, _, finished = value.partition(b" ")
            outcomes[outcome] += 1
            if finished:
                ended = int(finished)
                buckets[ended // BUCKET_MS] += 1
                last = max(last, ended)
        return Tally(
            done=len(values),
            outcomes={code.decode(): n for code, n in outcomes.items()},
            last_finished_ms=last or None,
            buckets=dict(buckets),
        )

    def ended(self, batch: str, sks: Sequence[str]) -> list[bool]:
        """Whether each of these sessions is in the batch's ended index (one HMGET)."""
        if not sks:
            return []
        return [v is not None for v in self.redis.hmget(keys.batch_ended(batch), list(sks))]

    def ended_keys(self, batch: str) -> set[str]:
        """Every session in the batch's ended index (one HKEYS)."""
        return {sk.decode() for sk in self.redis.hkeys(keys.batch_ended(batch))}


def ended_before(client: Any, sks: Sequence[str]) -> dict[str, str]:
    """The ended-index entries of sessions that ended before a batch watched them (runs a
    submit joined): from their metas, else from their retired records."""
    pipe = client.pipeline(transaction=False)
    for sk in sks:
        pipe.hmget(keys.meta(sk), "outcome", "finished_ms")
    found: dict[str, str] = {}
    for sk, (outcome, finished) in zip(sks, pipe.execute() if sks else [], strict=True):
        if outcome is not None:
            found[sk] = ended_value(outcome.decode(), int(finished or 0))
    retired = [sk for sk in sks if sk not in found]
    raw = client.mget([keys.record(sk) for sk in retired]) if retired else []
    for sk, value in zip(retired, raw, strict=True):
        meta: Mapping[str, Any] = {} if value is None else read_record(value).meta
        if meta.get("outcome"):
            finished_ms = meta.get("finished_ms")
            found[sk] = ended_value(str(meta["outcome"]), int(finished_ms or 0))
    return found
