"""Submitting sessions and waiting for their response fds. Talks to Redis and sends tasks by
name; never imports the worker. Key layout: `schemas/keys.py`."""

from __future__ import annotations

import hashlib
import logging
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import redis
from celery import Celery
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from producer.backend_check import backend_check
from producer.lookups import QUEUED, SessionLookups
from producer.specfile import load_spec_from_objects
from schemas import keys, task_names
from schemas.bodies import dump_body
from schemas.config import FleetConfig, read_config
from schemas.spec_types import (
    ProgramDef,
    ProgramSpec,
    SessionSpec,
    Spec,
    ToolSpec,
    spec_to_json,
    stored,
)

if TYPE_CHECKING:
    from producer.batch import Batch

log = logging.getLogger("cchatq.producer")

CHUNK_SIZE = 256  # sessions admitted by one start task
PIPELINE_SIZE = 1000  # sessions per Redis round trip at submit
DEFAULT_TTL_S = 86_400
STALL_S = 30.0  # no session of a batch moved for this long: nudge those that did not
NUDGE_MAX = 1000
STATE_SAMPLE = 10_000  # pending sessions whose state one look reads
# A restart of Redis (or a failover) is ridden out: each command, pipeline or publish is tried
# again on a connection error for about this long before the error reaches the caller.
RECONNECT_S = 60.0
CLIENT_NAME = "cchatq-producer"  # its connections in Redis's CLIENT LIST
RECONNECT_BACKOFF_S = (0.05, 1.0)  # first and longest pause between two tries


@dataclass
class Submission:
    batch: str
    order: list[str]  # session keys in input order
    ids: dict[str, str]  # sk -> spec id
    new: set[str] = field(default_factory=set)  # enqueued by this submission
    done: set[str] = field(default_factory=set)  # already finished before it (resubmitted ids)
    programs: set[str] = field(default_factory=set)  # program runs among them
    specs: dict[str, Spec] = field(default_factory=dict)  # sk -> spec: to run again if lost
    attempts: dict[str, int] = field(default_factory=dict)  # sk -> which attempt of its id
    chunks: int = 0  # start tasks sent for this batch (a resubmission numbers on from here)


class SpecConflictError(Exception):
    """Ids already submitted with a different spec: nothing of the submission was enqueued."""

    def __init__(self, spec_ids: list[str]) -> None:
        super().__init__(f"{len(spec_ids)} ids already submitted with a different spec")
        self.spec_ids = spec_ids


class ModuleExpiredError(Exception):
    """Modules a stored spec names are no longer in Redis: submit its file again."""

    def __init__(self, shas: list[str]) -> None:
        super().__init__(f"{len(shas)} modules expired from Redis (submit the spec file again)")
        self.shas = shas


class Client(SessionLookups):
    def __init__(
        self, redis_url: str, ttl_s: int = DEFAULT_TTL_S, config: FleetConfig | None = None
    ) -> None:
        """`config`: the fleet's configuration (its backends), which `submit` checks specs
        against; by default the one this process's environment names, as the workers read it
        (CCHATQ_CONFIG / CCHATQ_BACKENDS). A ConfigError if that is wrong."""
        # Any: redis-py annotates replies as bytes | str; this client never decodes (bytes).
        self.redis: Any = redis.Redis.from_url(redis_url, client_name=CLIENT_NAME, **reconnecting())
        self.ttl_s = ttl_s
        self.config = config if config is not None else read_config()
        self.celery = Celery("cchatq-producer", broker=redis_url)
        first_s, longest_s = RECONNECT_BACKOFF_S
        self.celery.conf.update(
            task_serializer="json",
            accept_content=["json"],
            task_ignore_result=True,
            task_publish_retry_policy={
                "max_retries": int(RECONNECT_S / longest_s),
                "interval_start": first_s,
                "interval_step": first_s,
                "interval_max": longest_s,
            },
        )

    def close(self) -> None:
        self.redis.close()

    # submit --------------------------------------------------------------------------------

    def upload_modules(self, specs: Sequence[Spec]) -> dict[str, str]:
        """Each referenced module once, content-addressed: path -> sha256. A module a spec
        names by its sha256 already (read back from the store: `cchatq batch retry`) must still
        be in Redis, and is kept alive there."""
        modules: list[ToolSpec | ProgramDef] = [
            *(t for s in specs if isinstance(s, SessionSpec) for t in s.tools),
            *(s.program for s in specs if isinstance(s, ProgramSpec)),
        ]
        named = [m for m in modules if not m.module_sha256]
        hashed = sorted({m.module_sha256 for m in modules if m.module_sha256})
        if hashed:
            kept = self.redis.pipeline(transaction=False)
            for sha in hashed:
                kept.expire(keys.module(sha), self.ttl_s)
            gone = [sha for sha, alive in zip(hashed, kept.execute(), strict=True) if not alive]
            if gone:
                raise ModuleExpiredError(gone)
        paths = sorted({m.module for m in named})
        shas: dict[str, str] = {}
        pipe = self.redis.pipeline(transaction=False)
        for path in paths:
            data = Path(path).read_bytes()
            sha = shas[path] = hashlib.sha256(data).hexdigest()
            pipe.set(keys.module(sha), data, nx=True, ex=self.ttl_s)
            pipe.expire(keys.module(sha), self.ttl_s)  # a resubmission keeps it alive
        pipe.execute()
        return shas

    def submit(
        self,
        specs: Iterable[Mapping[str, Any] | Spec],
        rerun: bool = False,
        check_keys: bool = True,
        base_dir: Path | None = None,
    ) -> Batch:
        """Validate and enqueue sessions and program runs (spec objects as a spec file's lines
        are, or Spec values), exactly as `cchatq submit` does: a SpecFileError lists every
        problem (`<specs>:N: field: message`, N counting from 1) and nothing is enqueued; a
        SpecConflictError names ids already submitted with another spec (unless `rerun`).
        `check_keys`: refuse a backend whose API key variable is unset here. Module paths are
        relative to `base_dir` (default: the working directory)."""
        from producer.batch import Batch  # the handle builds on this client

        objects = [
            spec_to_json(s) if isinstance(s, SessionSpec | ProgramSpec) else s for s in specs
        ]
        check = backend_check(self.config, check_keys=check_keys)
        loaded = load_spec_from_objects(objects, base_dir, check, shown="<specs>")
        return Batch(self, self.enqueue(loaded, rerun=rerun))

    def enqueue(
        self,
        specs: Sequence[Spec],
        batch: str | None = None,
        first_chunk: int = 0,
        rerun: bool = False,
        within: bool = False,
    ) -> Submission:
        """Enqueue validated canonical specs. Idempotent by spec id: an id already submitted
        with the same spec is not run again; this batch waits for (or reads) its stored result
        instead. An id already submitted with a different spec raises SpecConflictError, with
        nothing enqueued. `rerun`: every id already submitted runs again, as its next attempt.
        A new run gets a session key of a new generation (keys.run_session_key). `within`:
        these sessions join `batch` (submitted again after a loss) rather than name it."""
        shas = self.upload_modules(specs)
        bodies = [dump_body(spec_to_json(stored(spec, shas))) for spec in specs]
        contents = [keys.content_digest(body) for body in bodies]
        held = self.claims([spec.id for spec in specs])
        if not rerun:
            conflicts = [
                spec.id
                for spec, claim, content in zip(specs, held, contents, strict=True)
                if claim is not None and claim.content != content
            ]
            if conflicts:
                raise SpecConflictError(conflicts)
        sub = Submission(batch=batch or uuid.uuid4().hex[:12], order=[], ids={}, chunks=first_chunk)
        now_ms = int(time.time() * 1000)
        for start in range(0, len(specs), PIPELINE_SIZE):
            end = start + PIPELINE_SIZE
            part = list(zip(specs[start:end], bodies[start:end], held[start:end], strict=True))
            pipe = self.redis.pipeline(transaction=False)
            claims: list[tuple[keys.Claim, bool]] = []
            for (spec, _, before), content in zip(part, contents[start:end], strict=True):
                again = rerun and before is not None
                claim = keys.Claim(
                    keys.run_session_key(spec.id, keys.new_generation()),
                    content,
                    before.attempt + 1 if again and before is not None else 1,
                )
                claims.append((claim, again))
                # the claim answers the run this id already has (None: ours is new); a rerun
                # takes the claim over
                pipe.set(
                    keys.id_claim(spec.id), claim.encode(), nx=not again, get=True, ex=self.ttl_s
                )
            runs: list[tuple[str, bool]] = []
            for (claim, again), found in zip(claims, pipe.execute(), strict=True):
                # a claim found holding our own fresh claim was ours: its pipeline was sent
                # again after a reconnect, once Redis had already run it
                if again or found is None or found.decode() == claim.encode():
                    runs.append((claim.sk, True))
                    sub.attempts[claim.sk] = claim.attempt
                else:
                    theirs = keys.Claim.decode(found)
                    runs.append((theirs.sk, False))
                    sub.attempts[theirs.sk] = theirs.attempt
            pipe = self.redis.pipeline(transaction=False)
            for (spec, body, _), (sk, won) in zip(part, runs, strict=True):
                sub.order.append(sk)
                sub.ids[sk] = spec.id
                sub.specs[sk] = spec
                if isinstance(spec, ProgramSpec):
                    sub.programs.add(sk)
                pipe.sadd(keys.watchers(sk), sub.batch)
                pipe.expire(keys.watchers(sk), self.ttl_s)
                if won:
                    sub.new.add(sk)
                    pipe.set(keys.spec(sk), body, ex=self.ttl_s)
                    meta = {
                        "id": spec.id,
                        "batch": sub.batch,
                        "submitted_ms": now_ms,
                        "state": "queued",
                    }
                    pipe.hset(keys.meta(sk), mapping=meta)
                    pipe.expire(keys.meta(sk), self.ttl_s)
                    pipe.zadd(keys.ACTIVE, {sk: now_ms})  # the fleet's reconciler watches it
                else:
                    pipe.exists(keys.response(sk))
            results = iter(pipe.execute())
            for sk, won in runs:
                next(results), next(results)
                if won:
                    next(results), next(results), next(results), next(results)
                elif next(results):
                    sub.done.add(sk)
        self._admit(sub, within)
        return sub

    def claims(self, spec_ids: Sequence[str]) -> list[keys.Claim | None]:
        """Each id's claim (its latest run), None for an id never submitted or expired."""
        found: list[bytes | None] = []
        for start in range(0, len(spec_ids), PIPELINE_SIZE):
            part = spec_ids[start : start + PIPELINE_SIZE]
            found.extend(self.redis.mget([keys.id_claim(i) for i in part]))
        return [None if raw is None else keys.Claim.decode(raw) for raw in found]

    def _admit(self, sub: Submission, within: bool) -> None:
        if not within:  # a new batch names its ids (`cchatq batch`)
            pipe = self.redis.pipeline(transaction=False)
            ids = [sub.ids[sk] for sk in sub.order]
            for start in range(0, len(ids), PIPELINE_SIZE):
                pipe.rpush(keys.batch_ids(sub.batch), *ids[start : start + PIPELINE_SIZE])
            pipe.expire(keys.batch_ids(sub.batch), self.ttl_s)
            pipe.zadd(keys.BATCHES, {sub.batch: int(time.time() * 1000)})
            pipe.expire(keys.BATCHES, self.ttl_s)
            pipe.execute()
        fresh = [
            keys.ChunkMember(sk, program=sk in sub.programs, spec_id=sub.ids[sk]).encode()
            for sk in sub.order
            if sk in sub.new
        ]
        chunks = [fresh[i : i + CHUNK_SIZE] for i in range(0, len(fresh), CHUNK_SIZE)]
        numbers = range(sub.chunks, sub.chunks + len(chunks))
        sub.chunks += len(chunks)
        pipe = self.redis.pipeline(transaction=False)
        for n, members in zip(numbers, chunks, strict=True):
            pipe.delete(keys.chunk(sub.batch, n))  # a pipeline sent again writes it once
            pipe.rpush(keys.chunk(sub.batch, n), *members)
            pipe.expire(keys.chunk(sub.batch, n), self.ttl_s)
        pipe.expire(keys.ACTIVE, self.ttl_s)
        pipe.execute()
        for n in numbers:
            self.celery.send_task(
                task_names.START,
                args=[sub.batch, n],
                task_id=keys.start_step(sub.batch, n),
                queue=task_names.ROUTES[task_names.START],
            )

    # wait ----------------------------------------------------------------------------------

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
        while pending:
            if time.monotonic() >= check_at:
                # a session whose entry in the done list was lost (popped in a reply that a
                # dropped connection never delivered, or by a Redis restart) is found here
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
                item = self.redis.blpop([done_key], timeout=poll_s)
                if item is not None:
                    ready.append(item[1].decode())
                    more = self.redis.lpop(done_key, 1000) or []
                    ready.extend(m.decode() for m in more)
            fresh = [sk for sk in dict.fromkeys(ready) if sk in pending]
            ready = []
            if fresh:
                for sk, record in zip(fresh, self.records(fresh), strict=True):
                    if record is not None:
                        pending.discard(sk)
                        progress = time.monotonic()
                        yield sk, record
            if deadline is not None and time.monotonic() > deadline and pending:
                raise TimeoutError(f"{len(pending)} of {len(sub.order)} sessions still running")

    def _rerun_lost(self, sub: Submission, pending: set[str]) -> None:
        """Sessions whose id's claim no longer names them: Redis lost its data (restarted
        without persistence, or a failover to a replica that had not seen the submit). Those
        whose claim is gone are submitted again (a new generation: what steps of the lost run
        still write is never read); one claimed anew elsewhere is followed there. Each takes
        its place in `sub` under its new key."""
        sks = sorted(pending)[:STATE_SAMPLE]
        claims = self.claims([sub.ids[sk] for sk in sks])
        moved: dict[str, str] = {}  # old sk -> the sk its id names now
        lost: list[str] = []
        for sk, claim in zip(sks, claims, strict=True):
            if claim is None:
                if sk in sub.specs:
                    lost.append(sk)
            elif claim.sk != sk:
                moved[sk] = claim.sk
        if lost:
            log.warning("%d sessions lost with Redis's data: submitted again", len(lost))
            again = self.enqueue([sub.specs[sk] for sk in lost], sub.batch, sub.chunks, within=True)
            sub.chunks = again.chunks
            sub.attempts.update(again.attempts)
            moved.update(zip(lost, again.order, strict=True))
            sub.programs |= again.programs
        place = {sk: n for n, sk in enumerate(sub.order)}
        for old, new in moved.items():
            pending.discard(old)
            pending.add(new)
            sub.order[place[old]] = new
            sub.ids[new] = sub.ids[old]
            if old in sub.specs:
                sub.specs[new] = sub.specs[old]

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


def reconnecting() -> dict[str, Any]:
    """redis-py client options that try a command again on a connection error, with backoff,
    for about RECONNECT_S: a client from `from_url` otherwise does not retry at all."""
    first_s, longest_s = RECONNECT_BACKOFF_S
    return {
        "retry": Retry(
            ExponentialBackoff(cap=longest_s, base=first_s), int(RECONNECT_S / longest_s)
        ),
        "retry_on_error": [redis.ConnectionError, redis.TimeoutError],
    }
