"""A batch's tally: its finished sessions counted once, so that its status and the viewer's
counts read a few fields instead of every session's state.

At submit every session is watched under the batch's tally watcher too (keys.tally_watcher),
so the workers push each session that ends on the tally list as they push it on the batch's
done list; no producer pops the tally list. Whoever reads the batch (`cchatq batch status`, the
viewer, a waiting submit) brings the tally up to date: it reads the list from where the tally
stopped, each new session's outcome and end from its meta, and adds them to the tally hash
(keys.batch_tally) in one MULTI under WATCH, so two readers never count an entry twice. A
session is marked in the hash once counted (`s:<sk>`): an ending told twice (a redelivered
step, a nudge of a finished session) counts once, and the marks say which members are done.
The cost is what ended since the last read: one meta read per session, ever.

A reader that must not write (the viewer: it reads and never writes) counts what the tally
has not counted yet in its own memory, on top of what the tally hash says (`writes=False`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from producer.redis_connect import is_cluster
from schemas import keys

CURSOR, DONE, LAST_MS, CODES = "cursor", "done", "last_ms", "codes"
OUTCOME_PREFIX = "o:"  # o:<outcome code> -> sessions that ended with it
COUNTED_PREFIX = "s:"  # s:<sk> -> "1" once the session is counted
BUCKET_PREFIX = "m:"  # m:<finished_ms // BUCKET_MS> -> sessions that ended then (the rate)
BUCKET_MS = 5_000
READ_MOST = 10_000  # tally list entries read a round
ENDS_PART = 1_000  # sessions whose ends one ENDS call reads
# Sessions' outcomes and ends, from their metas (KEYS), in one command: outcome, finished_ms
# (nil when missing) for each.
ENDS = """
local out = {}
for _, key in ipairs(KEYS) do
  local found = redis.call('hmget', key, 'outcome', 'finished_ms')
  out[#out + 1] = found[1]
  out[#out + 1] = found[2]
end
return out
"""
WATCH_TRIES = 20  # another reader counted meanwhile: read again


@dataclass
class _Overlay:
    """What a reader that does not write counted past the tally hash's cursor `base`."""

    base: int
    cursor: int
    done: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    buckets: Counter[int] = field(default_factory=Counter)
    last_ms: int | None = None
    counted: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class Tally:
    """What a batch's tally says: sessions counted done, by outcome, the latest end."""

    done: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    last_finished_ms: int | None = None
    buckets: dict[int, int] = field(default_factory=dict)  # the recent ends, BUCKET_MS apart

    def ended_since(self, since_ms: int) -> int:
        """Sessions that ended in the buckets from `since_ms` on."""
        first = since_ms // BUCKET_MS
        return sum(n for bucket, n in self.buckets.items() if bucket >= first)


def counted_field(sk: str) -> str:
    return f"{COUNTED_PREFIX}{sk}"


class BatchTally:
    def __init__(self, client: Any, ttl_s: int, writes: bool = True) -> None:
        self.redis, self.ttl_s, self.writes = client, ttl_s, writes
        self._overlays: dict[str, _Overlay] = {}  # batch -> what this reader counted itself
        self._ends_script: Any = None

    @staticmethod
    def start(pipe: Any, batch: str, ttl_s: int) -> None:
        """At submit, in the submit's pipeline: the batch has a tally from its first session."""
        pipe.hsetnx(keys.batch_tally(batch), CURSOR, 0)
        pipe.expire(keys.batch_tally(batch), ttl_s)

    def refresh(self, batch: str, recent_buckets: int = 0, now_ms: int = 0) -> Tally | None:
        """The tally brought up to date; None for a batch without one (submitted before
        tallies, or expired). `recent_buckets`: the latest BUCKET_MS buckets up to `now_ms`
        (Redis's clock, as the ends are) to give back."""
        if not self.writes:
            return self._peek(batch, recent_buckets, now_ms)
        key = keys.batch_tally(batch)
        log = keys.done_list(keys.tally_watcher(batch))
        tries = 0
        while True:
            with self.redis.pipeline(transaction=True) as pipe:
                try:
                    pipe.watch(key)
                    cursor, last, codes = pipe.hmget(key, CURSOR, LAST_MS, CODES)
                    if cursor is None:
                        return None
                    start = int(cursor)
                    # not on `pipe`: on a cluster the list is in another slot than the tally
                    entries = self.redis.lrange(log, start, start + READ_MOST - 1)
                    if not entries:
                        return self._read(pipe, key, codes, recent_buckets, now_ms)
                    self._count(pipe, key, start, entries, last, codes)
                    if len(entries) < READ_MOST:
                        return self._read(self.redis, key, None, recent_buckets, now_ms)
                except redis.WatchError:
                    tries += 1
                    if tries >= WATCH_TRIES:
                        raise

    def _count(
        self, pipe: Any, key: str, start: int, entries: Sequence[bytes], last: Any, codes: Any
    ) -> None:
        """Count the sessions of `entries` not counted yet, and move the cursor past them."""
        sks = list(dict.fromkeys(e.decode() for e in entries))
        marks = pipe.hmget(key, [counted_field(sk) for sk in sks])
        fresh = [sk for sk, mark in zip(sks, marks, strict=True) if mark is None]
        found = self._ended(fresh, _Overlay(start, start), int(last) if last is not None else None)
        outcomes, buckets, last_ms = found.outcomes, found.buckets, found.last_ms
        counted = {counted_field(sk): 1 for sk in found.counted}
        known = set(_codes(codes))
        pipe.multi()
        pipe.hset(key, CURSOR, start + len(entries))
        if counted:
            pipe.hset(key, mapping=counted)
            pipe.hincrby(key, DONE, len(counted))
            for code, n in outcomes.items():
                pipe.hincrby(key, OUTCOME_PREFIX + code, n)
            for bucket, n in buckets.items():
                pipe.hincrby(key, f"{BUCKET_PREFIX}{bucket}", n)
            if last_ms is not None:
                pipe.hset(key, LAST_MS, last_ms)
            if not known.issuperset(outcomes):
                pipe.hset(key, CODES, " ".join(sorted(known | set(outcomes))))
        pipe.expire(key, self.ttl_s)
        pipe.execute()

    def _read(self, client: Any, key: str, codes: Any, recent_buckets: int, now_ms: int) -> Tally:
        """The tally's counts (`codes`: its codes field when read already)."""
        if codes is None:
            codes = client.hget(key, CODES)
        names = _codes(codes)
        fields = [DONE, LAST_MS] + [OUTCOME_PREFIX + c for c in names]
        buckets: list[int] = []
        if recent_buckets:
            now_bucket = now_ms // BUCKET_MS
            buckets = list(range(now_bucket - recent_buckets + 1, now_bucket + 1))
            fields += [f"{BUCKET_PREFIX}{b}" for b in buckets]
        done, last, *rest = client.hmget(key, fields)
        found = rest[: len(names)]
        return Tally(
            done=int(done or 0),
            outcomes={c: int(n) for c, n in zip(names, found, strict=True) if n},
            last_finished_ms=None if last is None else int(last),
            buckets={b: int(n) for b, n in zip(buckets, rest[len(names) :], strict=True) if n},
        )

    def counted(self, batch: str, sks: Sequence[str]) -> list[bool]:
        """Whether each of these sessions is counted done (one HMGET)."""
        if not sks:
            return []
        marks = self.redis.hmget(keys.batch_tally(batch), [counted_field(sk) for sk in sks])
        own = self._overlays[batch].counted if batch in self._overlays else set()
        return [mark is not None or sk in own for sk, mark in zip(sks, marks, strict=True)]

    def _ended(self, sks: Sequence[str], into: _Overlay, last_ms: int | None) -> _Overlay:
        """The outcomes and ends of these sessions (their metas, one pipeline) added to
        `into`; one whose meta is gone (lost with Redis's data) is not counted."""
        into.last_ms = last_ms if into.last_ms is None else into.last_ms
        for sk, (outcome, finished) in zip(sks, self._ends(sks), strict=True):
            if outcome is None:
                continue
            into.counted.add(sk)
            into.done += 1
            into.outcomes[outcome.decode()] += 1
            if finished is not None:
                ended = int(finished)
                into.buckets[ended // BUCKET_MS] += 1
                into.last_ms = ended if into.last_ms is None else max(into.last_ms, ended)
        return into

    def _ends(self, sks: Sequence[str]) -> list[tuple[Any, Any]]:
        """Each session's (outcome, finished_ms) from its meta: ENDS_PART sessions a command on
        one Redis; on a cluster, whose scripts touch one slot, an HMGET each in a pipeline."""
        reads = self.redis.pipeline(transaction=False)
        if is_cluster(self.redis):
            for sk in sks:
                reads.hmget(keys.meta(sk), "outcome", "finished_ms")
            return [tuple(found) for found in reads.execute()] if sks else []
        if self._ends_script is None:
            self._ends_script = self.redis.register_script(ENDS)
        for start in range(0, len(sks), ENDS_PART):
            part = [keys.meta(sk) for sk in sks[start : start + ENDS_PART]]
            self._ends_script(keys=part, client=reads)
        flat = [value for found in reads.execute() for value in found] if sks else []
        return list(zip(flat[0::2], flat[1::2], strict=True))

    def _peek(self, batch: str, recent_buckets: int, now_ms: int) -> Tally | None:
        """`refresh` for a reader that does not write: the tally hash, and in this reader's
        memory what was told past its cursor (counted again from the hash's cursor whenever
        it moved)."""
        key = keys.batch_tally(batch)
        log = keys.done_list(keys.tally_watcher(batch))
        base = self.redis.hget(key, CURSOR)
        if base is None:
            self._overlays.pop(batch, None)
            return None
        saved = self._read(self.redis, key, None, recent_buckets, now_ms)
        overlay = self._overlays.get(batch)
        if overlay is None or overlay.base != int(base):
            overlay = self._overlays[batch] = _Overlay(int(base), int(base))
        while True:
            entries = self.redis.lrange(log, overlay.cursor, overlay.cursor + READ_MOST - 1)
            sks = [sk for sk in dict.fromkeys(e.decode() for e in entries)
                   if sk not in overlay.counted]  # fmt: skip
            marks = self.redis.hmget(key, [counted_field(sk) for sk in sks]) if sks else []
            self._ended([sk for sk, m in zip(sks, marks, strict=True) if m is None], overlay, None)
            overlay.cursor += len(entries)
            if len(entries) < READ_MOST:
                break
        outcomes = Counter(saved.outcomes) + overlay.outcomes
        buckets = Counter(saved.buckets) + (overlay.buckets if recent_buckets else Counter())
        ends = [m for m in (saved.last_finished_ms, overlay.last_ms) if m is not None]
        return Tally(saved.done + overlay.done, dict(outcomes), max(ends, default=None),
                     dict(buckets))  # fmt: skip


def _codes(raw: Any) -> list[str]:
    return [] if raw is None else bytes(raw).decode().split()
