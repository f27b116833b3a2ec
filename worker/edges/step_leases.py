"""Step leases in Redis, a part of RedisStore: a delivery's lease on its step, renewed while
it runs (LeaseKeeper) and taken over when its holder is gone (liveness), the published marker
that ends a step, and the try counter. Key layout: `schemas/keys.py`."""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any, ParamSpec, TypeVar

import redis

from schemas import keys
from schemas.fleet_clock import FleetClock
from worker.edges import liveness
from worker.edges.redis_errors import refusal, store_error
from worker.edges.redis_pool import is_cluster
from worker.session.refusals import RefusalNotice
from worker.session.store_ports import STEP_LEASE_MS, NextStep

P = ParamSpec("P")
T = TypeVar("T")

RENEW_RETRY_S = 1.0  # the next renewal after one that failed
log = logging.getLogger("worker.edges.store")


def translated(fn: Callable[P, T]) -> Callable[P, T]:
    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return fn(*args, **kwargs)
        except redis.RedisError as exc:  # a refusal: StoreUnavailableError (redis_errors.py)
            raise store_error(exc) from exc

    return wrapper


# renews every lease still held by the delivery that took it, one round trip for all of them;
# a lease that ran out while its holder could not reach Redis (a cut network) and that no one
# took since is its holder's again: its delivery still runs the step, and a stand-in that
# took the free lease would make the step's model call a second time. Not once its session has
# a record: the ending's commit deleted the step's state as the session retired (a renewal
# racing that commit would make it again, a key of a finished session). KEYS: each lease's
# step state, then its session's record; ARGV: the TTL, then each lease
_RENEW = """
local renewed = 0
for i = 1, #KEYS, 2 do
  local key, lease = KEYS[i], ARGV[(i + 1) / 2 + 1]
  local now = redis.call('get', key)
  if now == lease then
    redis.call('pexpire', key, ARGV[1])
    renewed = renewed + 1
  elseif not now and redis.call('exists', KEYS[i + 1]) == 0 then
    -- pcall: under OOM the SET is refused, and the renewals after it must still run
    if not redis.pcall('set', key, lease, 'PX', ARGV[1]).err then
      renewed = renewed + 1
    end
  end
end
return renewed
"""


# uncounts a deferred delivery's try, only while its counter is there (EVAL: it rides a
# pipeline, and survives a Redis that lost its scripts)
DECR_IF_THERE = """
if redis.call('exists', KEYS[1]) == 1 then return redis.call('decr', KEYS[1]) end
return 0
"""

# takes over a lease whose holder is gone, if it is still that holder's (compare and set)
TAKE_OVER = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  redis.call('set', KEYS[1], ARGV[2], 'PX', ARGV[3])
  return 1
end
return 0
"""


class LeaseKeeper:
    """A process's step leases, renewed while their steps run: a lease lasts STEP_LEASE_MS and
    is renewed every third of it, so a worker that dies frees its steps within STEP_LEASE_MS,
    whatever the model's timeout. One thread per process (a prefork child starts its own)."""

    def __init__(self, client: Any, lease_ms: int = STEP_LEASE_MS) -> None:
        self.client = client
        self.lease_ms = lease_ms
        self.held: dict[str, bytes] = {}  # step_state key -> the lease value this process holds
        self._ended: dict[str, str] = {}  # step_state key -> its session's record key
        self._lock = threading.Lock()
        self._pid = 0
        self._renew = client.register_script(_RENEW)
        self._by_slot = is_cluster(client)  # a script's keys must share a slot there
        # under OOM the renewal still runs (PEXPIRE needs no memory); refused otherwise (a
        # MISCONF, a replica), a lease may run out: a step's outputs are first writer wins
        self._refused = RefusalNotice("lease renewal", log)

    @contextmanager
    def hold(self, key: str, token: str, ended: str) -> Iterator[None]:
        """`ended`: the key of its session's record (the lease is not taken back once there)."""
        with self._lock:
            self.held[key] = keys.step_lease(token)
            self._ended[key] = ended
            if self._pid != os.getpid():  # first lease of this process: start its renewer
                self._pid = os.getpid()
                threading.Thread(target=self._loop, name="lease-keeper", daemon=True).start()
        try:
            yield
        finally:
            self.forget(key)
            liveness.retire(token)

    def forget(self, key: str) -> None:
        """A lease its delivery gives up before it ends (released, deferred): not renewed,
        nor taken back, any more."""
        with self._lock:
            self.held.pop(key, None)
            self._ended.pop(key, None)

    def _loop(self) -> None:
        pause_s = self.lease_ms / 3000
        while True:
            time.sleep(pause_s)
            pause_s = self.lease_ms / 3000
            with self._lock:
                held = [(key, lease, self._ended[key]) for key, lease in self.held.items()]
            if not held:
                continue
            try:
                self._renew_all(held)
            except redis.RedisError as exc:  # the next round tries again; a lost lease is
                reason = refusal(exc)  # taken over
                if reason is not None:
                    self._refused.refused(reason)
                else:
                    log.warning("lease renewal failed: %s", type(exc).__name__)
                # soon again: once the network is back, the leases that ran out are taken
                # back before a stand-in delivery takes them
                pause_s = RENEW_RETRY_S
                continue
            self._refused.accepted()

    def _renew_all(self, held: list[tuple[str, bytes, str]]) -> None:
        """(step state key, lease, record key) each: one script for all of them; on a cluster
        one a session (a step's state and its session's record share its slot; sessions'
        leases rarely share one), sent in one pipeline."""
        if not self._by_slot:
            pairs = [k for key, _, ended in held for k in (key, ended)]
            self._renew(keys=pairs, args=[self.lease_ms, *(lease for _, lease, _ in held)])
            return
        pipe = self.client.pipeline(transaction=False)
        for key, lease, ended in held:
            pipe.execute_command("EVAL", _RENEW, 2, key, ended, self.lease_ms, lease)
        pipe.execute()


class StepLeases:
    """The lease half of RedisStore (which sets `client`, `ttl_s`, `_keeper`, `_take_over`)."""

    client: Any
    ttl_s: int
    clock: FleetClock
    _keeper: LeaseKeeper
    _take_over: Any
    on: Callable[[str], Any]  # RedisStore's: a session's node (or the one Redis)
    fleet_pipe: Callable[[Any], Any]
    flush_fleet: Callable[[Any, Any], None]

    def _abandoned(self, step: str, lease: bytes, token: str, lease_ms: int) -> bool:
        """Whether `lease` was held by a process that is gone (liveness), and this delivery
        took it over: a killed worker's step runs again at once, not after its lease's TTL."""
        if not lease.startswith(keys.STEP_LEASED + b":"):
            return False
        held = lease[len(keys.STEP_LEASED) + 1 :].decode(errors="replace")
        if not liveness.token_abandoned(held):
            return False
        taken = self._take_over(
            keys=[keys.step_state(step)], args=[lease, keys.step_lease(token), lease_ms]
        )
        if taken:
            log.warning("step %s: lease of a process that is gone taken over", step)
        return bool(taken)

    def hold(self, step: str, token: str) -> AbstractContextManager[None]:
        """Keep renewing this delivery's lease while the step runs (LeaseKeeper)."""
        return self._keeper.hold(keys.step_state(step), token, keys.record(keys.step_owner(step)))

    @translated
    def defer_step(self, step: str, sk: str, stored: bool, wait_ms: int) -> None:
        """One round trip: the lease released, the try uncounted, and the session shown as
        making progress until the delivery comes back (the reconciler leaves it be)."""
        self._keeper.forget(keys.step_state(step))
        pipe = self.on(keys.step_owner(step)).pipeline(transaction=False)
        fleet = self.fleet_pipe(pipe)
        pipe.delete(keys.step_state(step))
        if stored:  # a DECR of a counter that expired would make one with no TTL
            pipe.eval(DECR_IF_THERE, 1, keys.tries(step))
        else:  # a first try counted without a write: the next delivery counts from none
            pipe.set(keys.tries(step), 0, ex=self.ttl_s)
        if sk:
            fleet.zadd(keys.ACTIVE, {sk: self.clock.now_ms() + wait_ms}, xx=True)
        pipe.execute()
        self.flush_fleet(fleet, pipe)

    @translated
    def lease_left_ms(self, step: str) -> int:
        pipe = self.on(keys.step_owner(step)).pipeline(transaction=False)
        pipe.get(keys.step_state(step))
        pipe.pttl(keys.step_state(step))
        state, left_ms = pipe.execute()
        leased = state is not None and state.startswith(keys.STEP_LEASED)
        if not leased and keys.step_state(step) in self._keeper.held:
            return int(RENEW_RETRY_S * 1000)  # run here: its renewer takes the lease back
        return max(int(left_ms), 0) if leased else 0

    @translated
    def active_steps(self, steps: list[str]) -> set[str]:
        return {s for s, state in self._step_states(steps) if state is not None}

    @translated
    def published_steps(self, steps: list[str]) -> set[str]:
        return {s for s, state in self._step_states(steps) if published(state)}

    @translated
    def leased_steps(self, steps: list[str]) -> dict[str, int]:
        """One round trip; a lease whose holder is known gone (liveness) does not count: its
        step runs again, or is taken over, and waiting on it would only delay an end."""
        if not steps:
            return {}
        pipe = self.client.pipeline(transaction=False)
        for step in steps:
            pipe.get(keys.step_state(step))
            pipe.pttl(keys.step_state(step))
        replies = pipe.execute()
        leased: dict[str, int] = {}
        for n, step in enumerate(steps):
            state, left_ms = replies[2 * n], replies[2 * n + 1]
            if state is None or not state.startswith(keys.STEP_LEASED + b":"):
                continue
            held = state[len(keys.STEP_LEASED) + 1 :].decode(errors="replace")
            if not liveness.token_abandoned(held):
                leased[step] = max(int(left_ms), 0)
        return leased

    def _step_states(self, steps: list[str]) -> list[tuple[str, bytes | None]]:
        """Each step with its state (a lease, done, or None): one MGET."""
        if not steps:
            return []
        return list(zip(steps, self.client.mget([keys.step_state(s) for s in steps]), strict=True))

    @translated
    def end_step(self, step: str) -> None:
        """Mark the continuation published (after publishing it) and drop the lease."""
        self.mark_published(self.client, step)

    def mark_published(self, client: Any, step: str, unsent: Sequence[NextStep] = ()) -> None:
        """The published marker, written by `client` (this store's, or a pipeline on it), with
        the steps `unsent` when the broker is apart: written before they are sent, so that a
        delivery that finds the step published sends them again (StepStart.unsent)."""
        value = keys.STEP_DONE
        if unsent:
            listed = [[s.kind, list(s.args), s.shown_id] for s in unsent]
            value += b":" + json.dumps(listed, separators=(",", ":")).encode()
        client.set(keys.step_state(step), value, ex=self.ttl_s)

    @translated
    def release_lease(self, step: str) -> None:
        self._keeper.forget(keys.step_state(step))
        self.client.delete(keys.step_state(step))


def published(state: bytes | None) -> bool:
    """Whether a step_state value says published (`done`, with its steps when apart)."""
    return state is not None and state.startswith(keys.STEP_DONE)


def unsent_steps(state: bytes | None) -> tuple[NextStep, ...]:
    """The steps a published marker lists (none with the broker on the state's Redis)."""
    if state is None or not state.startswith(keys.STEP_DONE + b":"):
        return ()
    listed = json.loads(state[len(keys.STEP_DONE) + 1 :])
    return tuple(NextStep(kind, tuple(args), shown) for kind, args, shown in listed)
