"""Waiting for a submitted batch: blocking reads of its done list, sessions whose done entry
or whole run Redis lost found and run again, stalled sessions nudged. A part of the Client
(producer/client.py). Key layout: `schemas/keys.py`."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

import redis

from producer.lookups import QUEUED
from producer.redis_room import refused_write
from producer.submitting import Submission, Submitting
from schemas import keys, redis_links, task_names

log = logging.getLogger("cchatq.producer")

STALL_S = 30.0  # no session of a batch moved for this long: nudge those that did not
NUDGE_MAX = 1000
STATE_SAMPLE = 10_000  # pending sessions whose state one look reads


class Waiting(Submitting):
    def wait(
        self,
        sub: Submission,
        timeout_s: float | None = None,
        poll_s: float = 0.5,
        stall_s: float = STALL_S,
        look_first: bool = False,
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """Yield (session key, record) as sessions finish, by blocking reads of the batch's
        done list. When no session of the batch has moved (finished, or changed state:
        `queued`, `round N`) for `stall_s`, those unchanged for that long are nudged: their
        next step is published again unless a worker holds it. A batch waiting on slow model
        calls moves from round to round, so it is not nudged because none of its sessions
        has finished yet; nor is a big batch whose sessions wait their turn in the queues.
        Raises TimeoutError naming how many are still running. `look_first`: first look for
        sessions already finished (a wait of this batch before took their done entries)."""
        pending = set(sub.order)
        ready = list(sub.done)  # finished before the submit
        if look_first:  # and those an earlier wait of this batch took from its done list
            ready.extend(self._finished(pending - sub.done))
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        done_key = keys.done_list(sub.batch)
        seen: dict[str, tuple[bytes | None, float]] = {}
        started = progress = time.monotonic()
        check_at = progress + stall_s / 2
        refused_since: float | None = None
        while pending:
            try:
                if time.monotonic() >= check_at:
                    # a session whose entry in the done list was lost (popped in a reply that
                    # a dropped connection never delivered, or by a Redis restart) is found here
                    ready.extend(self._finished(pending))
                    self._rerun_lost(sub, pending)
                    moved, stalled = self._stalled(pending, seen, stall_s, started)
                    if moved:
                        progress = time.monotonic()
                    elif stalled and time.monotonic() - progress >= stall_s:
                        self.nudge(stalled[:NUDGE_MAX])
                        progress = time.monotonic()
                    check_at = time.monotonic() + stall_s / 2
                if not ready:
                    item = self.redis.blpop([done_key], timeout=redis_links.block_s(poll_s))
                    if item is not None:
                        ready.append(item[1].decode())
                        more = self.redis.lpop(done_key, 1000) or []
                        ready.extend(m.decode() for m in more)
                refused_since = None
            except redis.RedisError as exc:
                # Redis refuses writes for now (BLPOP pops: refused when it cannot persist or
                # is a replica): the fleet waits it out too; the wait goes on, said once
                if not refused_write(exc):
                    raise
                if refused_since is None:
                    refused_since = time.monotonic()
                    log.warning("Redis refuses writes (%s): waiting", str(exc)[:120])
                time.sleep(poll_s)
            fresh = [sk for sk in dict.fromkeys(ready) if sk in pending]
            ready = []
            if fresh:
                for sk, record in zip(fresh, self.records(fresh), strict=True):
                    if record is not None:
                        pending.discard(sk)
                        progress = time.monotonic()
                        yield sk, record
            if deadline is not None and time.monotonic() > deadline and pending:
                noun = "session" if len(sub.order) == 1 else "sessions"
                raise TimeoutError(f"{len(pending)} of {len(sub.order)} {noun} still running")

    def _rerun_lost(self, sub: Submission, pending: set[str]) -> None:
        """Sessions Redis lost (their meta is gone: restarted without persistence, or a
        failover to a replica that had not seen the submit). Those whose id's claim is gone
        too are submitted again (a new generation: what steps of the lost run still write is
        never read); one claimed anew meanwhile (another producer submitted it again) is
        followed there. Each takes its place in `sub` and in the batch's runs under its new
        key. A session whose meta is there is this batch's run, whatever its id's claim says
        now: a later rerun of the id is another batch's."""
        sks = sorted(pending)[:STATE_SAMPLE]
        pipe = self.redis.pipeline(transaction=False)
        for sk in sks:  # a session that ended since is retired: its response stays
            pipe.exists(keys.meta(sk))
            pipe.exists(keys.response(sk))
        there = pipe.execute()
        gone = [sk for n, sk in enumerate(sks) if not there[2 * n] and not there[2 * n + 1]]
        if not gone:
            return
        claims = self.claims([sub.ids[sk] for sk in gone], sub.namespace)
        moved: dict[str, keys.Claim] = {}  # old sk -> the run its id names now
        lost: list[str] = []
        for sk, claim in zip(gone, claims, strict=True):
            if claim is None:
                if sk in sub.specs:
                    lost.append(sk)
            elif claim.sk != sk:
                moved[sk] = claim
        if lost:
            log.warning("%d sessions lost with Redis's data: submitted again", len(lost))
            again = self.enqueue(
                [sub.specs[sk] for sk in lost],
                sub.batch,
                sub.chunks,
                within=True,
                namespace=sub.namespace,
            )
            sub.chunks = again.chunks
            sub.programs |= again.programs
            moved.update((old, again.runs[new]) for old, new in zip(lost, again.order, strict=True))
        place = {sk: n for n, sk in enumerate(sub.order)}
        pipe = self.redis.pipeline(transaction=False)
        for old, run in moved.items():
            pending.discard(old)
            pending.add(run.sk)
            sub.order[place[old]] = run.sk
            sub.ids[run.sk] = sub.ids[old]
            sub.runs[run.sk] = run
            if old in sub.specs:
                sub.specs[run.sk] = sub.specs[old]
            pipe.lset(keys.batch_runs(sub.batch), place[old], run.encode())
        try:
            pipe.execute()
        except redis.ResponseError:  # the batch's lists were lost too: it keeps its own
            self._admit_names(sub)

    def _finished(self, pending: set[str]) -> list[str]:
        """Those of `pending` whose response fd is written."""
        sks = sorted(pending)[:STATE_SAMPLE]
        pipe = self.redis.pipeline(transaction=False)
        for sk in sks:
            pipe.exists(keys.response(sk))
        return [sk for sk, done in zip(sks, pipe.execute(), strict=True) if done]

    def _stalled(
        self,
        pending: set[str],
        seen: dict[str, tuple[bytes | None, float]],
        stall_s: float,
        started: float,
    ) -> tuple[bool, list[str]]:
        """Whether a pending session changed state since the last look, and those whose state
        has not changed for `stall_s`; `seen` keeps each session's last state and since when
        (a session seen for the first time counts as moved only if it left `queued`)."""
        sks = sorted(pending)[:STATE_SAMPLE]
        pipe = self.redis.pipeline(transaction=False)
        for sk in sks:
            pipe.hget(keys.meta(sk), "state")
        now = time.monotonic()
        moved, stalled = False, []
        for sk, state in zip(sks, pipe.execute(), strict=True):
            before = seen.get(sk, (QUEUED, started))
            if before[0] != state:
                moved = True
                seen[sk] = (state, now)
            elif now - before[1] >= stall_s:
                stalled.append(sk)
        return moved, stalled

    def nudge(self, sks: Sequence[str]) -> None:
        """Ask the fleet to publish the next step of these sessions again (StepRunner.nudge)."""
        stamp = int(time.time())
        for sk in sks:
            self.celery.send_task(
                task_names.NUDGE, args=[sk], task_id=f"{sk}.nudge.{stamp}",
                queue=task_names.ROUTES[task_names.NUDGE],
            )  # fmt: skip
