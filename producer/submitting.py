"""Submitting sessions: the hand-off to validation, each module uploaded once, the ids' claims
(one run per spec id), the sessions' keys written and the start tasks sent. A part of the
Client (producer/client.py). Key layout: `schemas/keys.py`."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import redis

from producer.backend_check import backend_check
from producer.batch_tally import ended_before
from producer.lookups import SessionLookups
from producer.redis_connect import is_cluster
from producer.redis_room import (
    JOINED_BYTES,
    RedisFullError,
    check_policy,
    fitting,
    read_memory,
    refused_write,
    session_bytes,
)
from producer.specfile import load_spec_from_objects
from producer.state_reader import PIPELINE_SIZE as PIPELINE_SIZE  # sessions a round trip
from producer.stored_specs import ModuleChangedError, StoredSpec, compact, module_uploads
from schemas import keys, task_names
from schemas.fleet_config import FleetConfig
from schemas.spec_types import (
    ProgramSpec,
    SessionSpec,
    Spec,
    spec_to_json,
)

# which ids already submitted in the namespace run again: none (a changed spec is refused),
# those whose spec changed, or all of them (each as its next attempt)
Rerun = Literal["none", "changed", "all"]
RERUN_MODES: tuple[Rerun, ...] = ("none", "changed", "all")
BATCH_SCOPE = "@batch"  # enqueue's namespace for ids scoped to the batch (keys.batch_scope)

log = logging.getLogger(__name__)
CHUNK_SIZE = 256  # sessions admitted by one start task
# On a Sentinel-managed Redis a submit returns once a replica holds it, or after this long
REPLICA_WAIT_MS = 2000


@dataclass
class Submission:
    batch: str
    namespace: str  # where its ids were claimed (keys.batch_scope(batch) for its own)
    order: list[str]  # session keys in input order
    ids: dict[str, str]  # sk -> spec id
    new: set[str] = field(default_factory=set)  # enqueued by this submission
    done: set[str] = field(default_factory=set)  # already finished before it (resubmitted ids)
    programs: set[str] = field(default_factory=set)  # program runs among them
    specs: dict[str, StoredSpec] = field(default_factory=dict)  # sk -> spec: to run again if lost
    runs: dict[str, keys.Claim] = field(default_factory=dict)  # sk -> its run (the claim)
    chunks: int = 0  # start tasks sent for this batch (a resubmission numbers on from here)
    warning: str = ""  # said before it runs: Redis may evict its keys (allowed by the operator)


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


# a session's claim, taken back when Redis refused the writes of the part it was claimed in
_UNCLAIM = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""


class Submitting(SessionLookups):
    config: FleetConfig  # the Client's: the backends specs are checked against
    namespace: str  # the Client's: where ids are claimed unless a submit names another
    shown_url: str  # the Client's Redis, as messages show it (no password)
    # replicas that must hold a submission before enqueue returns (1 on a sentinel:// URL):
    # replication is asynchronous, and a session whose keys a failover lost is beyond the
    # reconciler's reach (its place in the reconciler's index went with them)
    replicas_to_wait = 0

    def _validate(
        self, specs: Iterable[Mapping[str, Any] | Spec], check_keys: bool, base_dir: Path | None
    ) -> list[Spec]:
        """Spec objects or Spec values through a spec file's validation (Client.submit)."""
        objects = [
            spec_to_json(s) if isinstance(s, SessionSpec | ProgramSpec) else s for s in specs
        ]
        check = backend_check(self.config, check_keys=check_keys)
        return load_spec_from_objects(objects, base_dir, check, shown="<specs>")

    def upload_modules(self, specs: Sequence[Spec | StoredSpec]) -> dict[str, str]:
        """Each module the specs name, once, content-addressed. A module a spec names by its
        sha256 already (read back from the store: `cchatq batch retry`) must still be in
        Redis; a file's module is kept alive there when it is (one EXPIRE, its bytes not
        sent again), else uploaded, its file hashing still as it did when its spec was made
        compact (ModuleChangedError). Returns each file's sha256: path -> sha256."""
        files, hashed = module_uploads(compact(specs))
        kept = self.redis.pipeline(transaction=False)
        for sha in (*hashed, *(sha for sha, _ in files)):
            kept.expire(keys.module(sha), self.ttl_s)
        alive = kept.execute() if len(kept) else []
        gone = [sha for sha, ok in zip(hashed, alive[: len(hashed)], strict=True) if not ok]
        if gone:
            raise ModuleExpiredError(gone)
        pipe = self.redis.pipeline(transaction=False)
        for (sha, path), stored in zip(files, alive[len(hashed) :], strict=True):
            if stored:
                continue
            data = Path(path).read_bytes()
            if hashlib.sha256(data).hexdigest() != sha:
                raise ModuleChangedError(path)
            pipe.set(keys.module(sha), data, nx=True, ex=self.ttl_s)
        if len(pipe):
            pipe.execute()
        return {path: sha for sha, path in files}

    def enqueue(
        self,
        given: Sequence[Spec | StoredSpec],
        batch: str | None = None,
        first_chunk: int = 0,
        rerun: Rerun = "none",
        within: bool = False,
        namespace: str | None = None,
    ) -> Submission:
        """Enqueue validated canonical specs. Idempotent by spec id within a namespace
        (`namespace`, default the client's; BATCH_SCOPE: the batch's own): an id already
        submitted there with the same spec is not run again; this batch joins its run instead.
        An id already submitted with a different spec raises SpecConflictError, with nothing
        enqueued, unless `rerun` says which ids already submitted run again ("changed": those
        whose spec changed, "all": every one), each as its next attempt. A new run gets a
        session key of a new generation (keys.run_session_key). `within`: these sessions join
        `batch` (submitted again after a loss) rather than name it."""
        specs = compact(given)  # each kept as the bytes it is stored as
        batch = batch or uuid.uuid4().hex[:12]
        scope = keys.batch_scope(batch) if namespace == BATCH_SCOPE else namespace
        scope = scope or self.namespace
        memory = read_memory(self.redis)
        warning = check_policy(memory, self.shown_url, dict(os.environ)) or ""
        self.upload_modules(specs)
        held = self.claims([spec.id for spec in specs], scope)
        if rerun == "none":
            conflicts = [
                spec.id
                for spec, claim in zip(specs, held, strict=True)
                if claim is not None and claim.content != spec.content
            ]
            if conflicts:
                raise SpecConflictError(conflicts)
        total = len(specs)
        pipeline_bytes = 2 * sum(s.size for s in specs[:PIPELINE_SIZE])
        room = fitting(memory, _costs(specs, held, rerun), pipeline_bytes)
        short = RedisFullError(self.shown_url, memory, room, total) if room < total else None
        if room == 0 and short is not None:
            raise short
        specs, held = specs[:room], held[:room]
        sub = Submission(batch=batch, namespace=scope, order=[], ids={}, chunks=first_chunk)
        sub.warning = warning
        try:
            self._write_sessions(sub, specs, held, rerun, scope)
        except redis.RedisError as exc:
            if not refused_write(exc):
                raise
            short = RedisFullError(
                self.shown_url, read_memory(self.redis), len(sub.order), total, midway=True
            )
            if not sub.order:
                raise short from None
        try:
            self._admit(sub, within)
        except redis.RedisError as exc:  # its sessions are in the fleet's reconciler's sight:
            if short is None or not refused_write(exc):  # it starts them once Redis takes
                raise  # writes again
        if short is not None:
            short.submission = sub
            raise short
        return sub

    def _write_sessions(
        self,
        sub: Submission,
        specs: Sequence[StoredSpec],
        held: Sequence[keys.Claim | None],
        rerun: Rerun,
        scope: str,
    ) -> None:
        """Claim each id and write its session's keys, PIPELINE_SIZE sessions a round trip.
        A part whose keys Redis refuses (one MULTI/EXEC: all of them) gives its new claims
        back and ends the loop with a RedisError: the parts before it are in `sub`."""
        now_ms = self.clock.now_ms()  # Redis's: the reconciler reckons the session's age on it
        for start in range(0, len(specs), PIPELINE_SIZE):
            end = start + PIPELINE_SIZE
            part = list(zip(specs[start:end], held[start:end], strict=True))
            pipe = self.redis.pipeline(transaction=False)
            claims: list[tuple[keys.Claim, bool]] = []
            for spec, before in part:
                again = before is not None and (
                    rerun == "all" or (rerun == "changed" and before.content != spec.content)
                )
                claim = keys.Claim(
                    keys.run_session_key(scope, spec.id, keys.new_generation()),
                    spec.content,
                    before.attempt + 1 if again and before is not None else 1,
                )
                claims.append((claim, again))
                # the claim answers the run this id already has (None: ours is new); a rerun
                # takes the claim over
                pipe.set(
                    keys.id_claim(scope, spec.id),
                    claim.encode(),
                    nx=not again,
                    get=True,
                    ex=self.ttl_s,
                )
            runs: list[tuple[keys.Claim, bool]] = []
            for (claim, again), found in zip(claims, pipe.execute(), strict=True):
                # a claim found holding our own fresh claim was ours: its pipeline was sent
                # again after a reconnect, once Redis had already run it
                if again or found is None or found.decode() == claim.encode():
                    runs.append((claim, True))
                else:
                    runs.append((keys.Claim.decode(found), False))
            try:
                self._write_part(sub, part, runs, now_ms)
            except redis.RedisError:
                unclaim = self.redis.register_script(_UNCLAIM)
                for (spec, _), (run, won) in zip(part, runs, strict=True):
                    if won:  # under OOM a DEL is still taken (it frees memory)
                        with contextlib.suppress(redis.RedisError):
                            unclaim(keys=[keys.id_claim(scope, spec.id)], args=[run.encode()])
                raise

    def _write_part(
        self,
        sub: Submission,
        part: list[tuple[StoredSpec, keys.Claim | None]],
        runs: list[tuple[keys.Claim, bool]],
        now_ms: int,
    ) -> None:
        # one MULTI/EXEC on one Redis (all or nothing); on a cluster, whose transactions
        # stay within a slot, a pipeline: a part refused midway leaves sessions with their
        # keys and no start task, which expire (their claims are given back)
        pipe = self.redis.pipeline(transaction=not is_cluster(self.redis))
        active: dict[str, int] = {}  # the fleet's reconciler watches them: one ZADD a part
        for (spec, _), (run, won) in zip(part, runs, strict=True):
            sk = run.sk
            if won:
                stored_form = keys.with_submitted(spec.body, now_ms, sub.batch)
                pipe.set(keys.spec(sk), stored_form, ex=self.ttl_s)
                meta = {
                    "id": spec.id,
                    "batch": sub.batch,
                    "submitted_ms": now_ms,
                    "state": "queued",
                }
                pipe.hset(keys.meta(sk), mapping=meta)
                pipe.expire(keys.meta(sk), self.ttl_s)
                active[sk] = now_ms
            else:  # its submitter's batch is told from its meta; a batch that joins, here
                pipe.sadd(keys.watchers(sk), sub.batch)
                pipe.expire(keys.watchers(sk), self.ttl_s)
                pipe.exists(keys.response(sk))
        if active:
            pipe.zadd(keys.ACTIVE, active)
        results = iter(pipe.execute())
        for (spec, _), (run, won) in zip(part, runs, strict=True):
            sk = run.sk
            sub.order.append(sk)
            sub.ids[sk] = spec.id
            sub.specs[sk] = spec
            sub.runs[sk] = run
            if spec.program:
                sub.programs.add(sk)
            if won:
                sub.new.add(sk)
                next(results), next(results), next(results)  # SET spec, HSET + EXPIRE meta
                continue
            next(results), next(results)  # SADD + EXPIRE of its watchers
            if next(results):  # its response is there
                sub.done.add(sk)

    def claims(
        self, spec_ids: Sequence[str], namespace: str | None = None
    ) -> list[keys.Claim | None]:
        """Each id's claim in `namespace` (default the client's): its latest run, None for an
        id never submitted there or expired."""
        scope = namespace or self.namespace
        found: list[bytes | None] = []
        for start in range(0, len(spec_ids), PIPELINE_SIZE):
            part = spec_ids[start : start + PIPELINE_SIZE]
            found.extend(self.redis.mget([keys.id_claim(scope, i) for i in part]))
        return [None if raw is None else keys.Claim.decode(raw) for raw in found]

    def _admit(self, sub: Submission, within: bool) -> None:
        if not within:  # a new batch names its ids and their runs (`cchatq batch`)
            self._admit_names(sub)
        fresh = [
            keys.ChunkMember(sk, program=sk in sub.programs, spec_id=sub.ids[sk]).encode()
            for sk in sub.order
            if sk in sub.new
        ]
        chunks = [fresh[i : i + CHUNK_SIZE] for i in range(0, len(fresh), CHUNK_SIZE)]
        numbers = range(sub.chunks, sub.chunks + len(chunks))
        sub.chunks += len(chunks)
        pipe = self.redis.pipeline(transaction=False)
        # runs it joined that had ended: no worker tells this batch, so its ended index
        # (what its status counts) is told here
        told = ended_before(self.redis, [sk for sk in sub.order if sk in sub.done])
        if told:
            pipe.hset(keys.batch_ended(sub.batch), mapping=told)
            pipe.expire(keys.batch_ended(sub.batch), self.ttl_s)
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
                headers={task_names.SENT_HEADER: self.clock.now_ms()},
            )
        self._replicated(sub)

    def _replicated(self, sub: Submission) -> None:
        """Wait until `replicas_to_wait` replicas hold what this submission wrote: a write on
        this connection after the start messages were sent, then WAIT for it (replication is
        in order, so a replica that has it has everything before). If none confirms within
        REPLICA_WAIT_MS, say so: a failover now could lose the batch (submitting it again is
        safe: an id already submitted joins its run)."""
        if not self.replicas_to_wait:
            return
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(keys.batch_namespace(sub.batch), sub.namespace, ex=self.ttl_s)
        pipe.wait(self.replicas_to_wait, REPLICA_WAIT_MS)
        acked = pipe.execute()[-1]
        if acked < self.replicas_to_wait:
            log.warning(
                "batch %s: no replica confirmed its submission within %d ms; a failover "
                "now could lose it (submitting it again is safe)", sub.batch, REPLICA_WAIT_MS
            )  # fmt: skip

    def _admit_names(self, sub: Submission) -> None:
        """The batch's ids, their runs and its namespace, in input order, and the batch among
        the fleet's batches (written whole: a pipeline sent again writes them once)."""
        pipe = self.redis.pipeline(transaction=False)
        ids = [sub.ids[sk] for sk in sub.order]
        runs = [sub.runs[sk].encode() for sk in sub.order]
        for key in (keys.batch_ids(sub.batch), keys.batch_runs(sub.batch)):
            pipe.delete(key)  # one at a time: a cluster's pipeline takes no DEL of two
        for start in range(0, len(ids), PIPELINE_SIZE):
            pipe.rpush(keys.batch_ids(sub.batch), *ids[start : start + PIPELINE_SIZE])
            pipe.rpush(keys.batch_runs(sub.batch), *runs[start : start + PIPELINE_SIZE])
        pipe.set(keys.batch_namespace(sub.batch), sub.namespace, ex=self.ttl_s)
        for key in (keys.batch_ids(sub.batch), keys.batch_runs(sub.batch)):
            pipe.expire(key, self.ttl_s)
        pipe.zadd(keys.BATCHES, {sub.batch: self.clock.now_ms()})
        pipe.expire(keys.BATCHES, self.ttl_s)
        pipe.execute()


def _costs(
    specs: Sequence[StoredSpec], held: Sequence[keys.Claim | None], rerun: Rerun
) -> list[int]:
    """What each session needs in Redis until it ends (producer/redis_room.py); one that
    joins a run already there, only its watcher entry."""
    costs = []
    for spec, claim in zip(specs, held, strict=True):
        joins = claim is not None and (
            rerun == "none" or (rerun == "changed" and claim.content == spec.content)
        )
        costs.append(JOINED_BYTES if joins else session_bytes(spec.size, spec.tools))
    return costs
