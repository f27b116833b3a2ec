"""Rate controllers in Redis (worker.session.rate_control's port), shared by every worker of
the fleet: the control law is two Lua scripts (worker.edges.rate_control_lua), each one atomic
round trip; this module passes them what a call needs and learned, and keeps the slots of this
process's running calls alive (a lease renewed every third of it, so a worker that dies gives
its slots back within SLOT_LEASE_MS).

A round that finds no room waits without its worker thread (the caller raises RateLimited):
with a ticket in the controller's waiting room when its turn is near, spaced by the pace so the
waiting rounds come back one by one; otherwise at a time drawn between the room's end and
MAX_WAIT_MS, so that thousands of waiting rounds neither come back as one crowd nor poll.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import redis

from schemas import fleet_keys
from worker.codecs.rate_headers import RateSignal
from worker.config import BackendConfig
from worker.edges.rate_control_lua import ACQUIRE, RENEW, REPORT
from worker.edges.rate_permits import PermitBlocks
from worker.edges.redis_errors import refusal, store_error
from worker.edges.redis_pool import is_cluster
from worker.errors import StoreError
from worker.session.rate_control import (
    CallReport,
    Change,
    ControlKey,
    Slot,
    Wait,
    backend_ceilings,
)
from worker.session.refusals import RefusalNotice

log = logging.getLogger(__name__)

SLOT_LEASE_MS = 10_000
ROOM_MS = 10_000  # how far ahead the waiting room gives tickets
MAX_WAIT_MS = 30_000  # the latest a waiting round comes back (well inside the broker's visibility)
INDEX_EVERY_S = 60.0  # on a cluster: how often a process writes a controller into the index
TTL_S = 3_600  # a controller unused this long is forgotten (the next starts from slow start)
FULL_EVERY = 16  # of the calls with nothing to teach but their latency, one in this reports it
BLOCK = 16  # the most slots a process keeps at once, far from the limit (0: one a call)


class RedisRateControl:
    def __init__(
        self,
        client: redis.Redis,
        clock_ms: Callable[[], float] | None = None,
        rand: Callable[[], float] = random.random,
        lease_ms: int = SLOT_LEASE_MS,
        full_every: int = FULL_EVERY,
        block: int = BLOCK,
        blocks: PermitBlocks | None = None,
    ) -> None:
        self.client: Any = client
        self._clock_ms = clock_ms  # None: Redis's clock (the tests pass a fake one)
        self._rand = rand
        self.lease_ms = lease_ms
        self.block = block
        self._blocks = blocks or PermitBlocks()
        self._acquire = self.client.register_script(ACQUIRE)
        self._report = self.client.register_script(REPORT)
        self._renew = self.client.register_script(RENEW)
        self._held: dict[str, str] = {}  # slot member -> its slots key
        self._lock = threading.Lock()
        self._pid = 0
        self._tokens_paced: set[str] = set()  # controllers whose calls need a token estimate
        self._quiet = 0  # calls that had nothing to teach but their latency
        self._timed: set[str] = set()  # controllers a call of this process told its latency
        self._full_every = full_every
        self._refused = RefusalNotice("slot leases", log)
        # on a Redis Cluster the controllers' index (another slot than a controller's keys)
        # is written apart, once an INDEX_EVERY_S per controller and process
        self._cluster = is_cluster(client)
        self._indexed: dict[str, float] = {}

    def _now(self) -> str:
        return "" if self._clock_ms is None else repr(float(self._clock_ms()))

    def acquire(
        self, key: ControlKey, waiter: str, estimated_tokens: int, backend: BackendConfig
    ) -> Slot | Wait:
        if self.block <= 0 or self.paces_tokens(key, backend):
            return self._ask(key, waiter, estimated_tokens, backend, blocks=False)
        kept = self._blocks.take(key.id)
        if kept is not None:  # far from the limit: a slot of this process's block
            return Slot(key, kept, 0, kept=True)
        if not self._blocks.granting(key.id):
            return self._ask(key, waiter, estimated_tokens, backend, blocks=True)
        # while the controller grants blocks, one thread of the process asks at a time and
        # the others take from what it got: threads asking together would each hold room
        with self._blocks.asking(key.id):
            kept = self._blocks.take(key.id)
            if kept is not None:
                return Slot(key, kept, 0, kept=True)
            return self._ask(key, waiter, estimated_tokens, backend, blocks=True)

    def _ask(
        self, key: ControlKey, waiter: str, estimated_tokens: int, backend: BackendConfig,
        blocks: bool,
    ) -> Slot | Wait:  # fmt: skip
        """The acquire script: a slot, a block of them (`blocks`, far from the limit), or a wait."""
        if blocks:
            self._give_back(key.id, self._blocks.stale(key.id))  # before asking for another
        rps, tps = backend_ceilings(backend)
        member = uuid.uuid4().hex
        try:
            self._index(key)
            answer = self._acquire(
                keys=self._keys(key),
                args=[self._now(), key.id, member, waiter, max(estimated_tokens, 0),
                      self.lease_ms, rps, tps, ROOM_MS, TTL_S, self.block if blocks else 0],
            )  # fmt: skip
        except redis.RedisError as exc:
            raise store_error(exc, "rate control") from exc
        kind = _text(answer[0])
        _log_change(key, answer[1] if kind == "ok" else answer[-1])
        granted = int(answer[2]) if kind == "ok" else 0
        if blocks:
            self._blocks.granted(key.id, granted > 0)
        if kind == "ok":
            if not granted:
                return Slot(key, member, max(estimated_tokens, 0))
            free = [f"{member}.{n}" for n in range(2, granted + 1)]
            self._give_back(key.id, self._blocks.keep(key.id, member, free))
            return Slot(key, member, 0, kept=True)
        wait_ms, reason = float(_text(answer[1])), _text(answer[2])
        if kind == "far":  # drawn between the room's end and MAX_WAIT_MS
            wait_ms += self._rand() * (MAX_WAIT_MS - wait_ms)
        return Wait(max(wait_ms, 1.0) / 1000, reason)

    def report(self, slot: Slot, report: CallReport, backend: BackendConfig) -> Change | None:
        said = report.signal or RateSignal()
        if slot.kept:
            return self._report_kept(slot, report, said, backend)
        if report.kind == "ok" and said.empty and not self.paces_tokens(slot.key, backend):
            # nothing to learn but the latency: most such calls only give their slot back
            # (one command, not a script's eight); every FULL_EVERY-th still reports it, and a
            # controller's first in this process (a latency known lets it grant blocks)
            self._quiet += 1
            if self._quiet % self._full_every and slot.key.id in self._timed:
                try:
                    self.client.zrem(fleet_keys.rate_slots(slot.key.id), slot.member)
                except redis.RedisError as exc:
                    raise store_error(exc, "rate control") from exc
                return None
        self._timed.add(slot.key.id)
        return self._learn(slot, slot.member, report, said, backend)

    def _report_kept(
        self, slot: Slot, report: CallReport, said: RateSignal, backend: BackendConfig
    ) -> Change | None:
        """A call of a kept slot: back into its block when it has nothing to teach (one in
        `full_every` of them tells its latency and the block's calls first); anything else
        (a 429, headers, a token pace) drops the block and reports as a call of its own."""
        cid = slot.key.id
        quiet = said.empty and not self.paces_tokens(slot.key, backend)
        if quiet and report.kind != "rate_limited":
            change = None
            untold = self._blocks.sample_due(cid, self._full_every) if report.kind == "ok" else None
            if untold is not None:
                change = self._learn(slot, "", report, said, backend, untold)
            if not self._blocks.give_back(cid, slot.member):
                self._give_back(cid, [slot.member])
            return change
        self._give_back(cid, self._blocks.drop(cid))
        return self._learn(slot, slot.member, report, said, backend, self._blocks.untold(cid))

    def _learn(
        self,
        slot: Slot,
        member: str,
        report: CallReport,
        said: RateSignal,
        backend: BackendConfig,
        untold: int = 0,
    ) -> Change | None:
        """The REPORT script: `member` given back ("": kept in its block), and `untold` calls
        its blocks served counted."""
        rps, tps = backend_ceilings(backend)
        try:
            answer = self._report(
                keys=self._keys(slot.key),
                args=[self._now(), slot.key.id, member, report.kind, report.used_tokens,
                      slot.estimated_tokens, report.latency_ms, rps, tps, TTL_S,
                      _said(said.requests_per_min), _said(said.requests_left),
                      _said_ms(said.requests_reset_s), _said(said.tokens_per_min),
                      _said(said.tokens_left), _said_ms(said.tokens_reset_s), untold],
            )  # fmt: skip
        except redis.RedisError as exc:
            raise store_error(exc, "rate control") from exc
        if int(answer[1]):
            self._tokens_paced.add(slot.key.id)
        else:
            self._tokens_paced.discard(slot.key.id)
        return _log_change(slot.key, answer[0])

    def paces_tokens(self, key: ControlKey, backend: BackendConfig) -> bool:
        return bool(backend.tokens_per_minute) or key.id in self._tokens_paced

    @contextmanager
    def held(self, slot: Slot) -> Iterator[None]:
        with self._lock:
            self._held[slot.member] = fleet_keys.rate_slots(slot.key.id)
            if self._pid != os.getpid():  # this process's first slot: start its renewer
                self._pid = os.getpid()
                threading.Thread(
                    target=self._renew_forever, name="slot-leases", daemon=True
                ).start()
        try:
            yield
        finally:
            with self._lock:
                self._held.pop(slot.member, None)

    def _renew_forever(self) -> None:
        pid = os.getpid()
        while self._pid == pid:
            time.sleep(self.lease_ms / 3000)
            self.renew()
            try:
                for cid, free in self._blocks.aged().items():
                    self._give_back(cid, free)
            except StoreError:  # their leases run out on their own
                pass

    def _give_back(self, cid: str, slots: list[str]) -> None:
        """Slots this process kept, given back to their controller, with the calls its blocks
        served that it has not heard of yet (its `n`, which the status shows): one round trip."""
        if not slots:
            return
        untold = self._blocks.untold(cid)
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.zrem(fleet_keys.rate_slots(cid), *slots)
            if untold:
                pipe.hincrby(fleet_keys.rate_controller(cid), "n", untold)
            pipe.execute()
        except redis.RedisError as exc:
            raise store_error(exc, "rate control") from exc

    def renew(self) -> int:
        """Renew every slot this process holds, in one round trip: how many were still held."""
        with self._lock:
            held = list(self._held.items())
        if not held:
            return 0
        try:
            if not self._cluster:
                keys = [k for _, k in held]
                return int(self._renew(keys=keys, args=[self.lease_ms, *[m for m, _ in held]]))
            pipe = self.client.pipeline(transaction=False)  # one script a slot there
            for member, key in held:
                pipe.execute_command("EVAL", RENEW, 1, key, self.lease_ms, member)
            return sum(int(n) for n in pipe.execute())
        except redis.RedisError as exc:  # the next turn tries again, within the lease
            reason = refusal(exc)
            if reason is not None:  # said once, not every turn
                self._refused.refused(reason)
            else:
                log.warning("slot leases not renewed: %s", type(exc).__name__)
            return 0

    def _keys(self, key: ControlKey) -> list[str]:
        """A controller's keys (one hash tag), and the index of controllers but on a cluster."""
        cid = key.id
        own = [
            fleet_keys.rate_controller(cid),
            fleet_keys.rate_slots(cid),
            fleet_keys.rate_room(cid),
        ]
        return own if self._cluster else [*own, fleet_keys.RATE_CONTROLLERS]

    def _index(self, key: ControlKey) -> None:
        """On a cluster, the controller in the index of controllers (`cchatq status` lists
        them from it), once an INDEX_EVERY_S."""
        now_s = time.monotonic()
        if not self._cluster or now_s - self._indexed.get(key.id, -INDEX_EVERY_S) < INDEX_EVERY_S:
            return
        pipe = self.client.pipeline(transaction=False)
        pipe.hset(fleet_keys.RATE_CONTROLLERS, key.id, int(time.time() * 1000))
        pipe.expire(fleet_keys.RATE_CONTROLLERS, TTL_S)
        pipe.execute()
        self._indexed[key.id] = now_s


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _said(value: float | None) -> str:
    return "" if value is None else repr(float(value))


def _said_ms(seconds: float | None) -> str:
    return "" if seconds is None else repr(float(seconds) * 1000)


def _log_change(key: ControlKey, raw: Any) -> Change | None:
    """The change a script made (logged here, once: only its maker sees it), or None."""
    if not raw:
        return None
    reason, window, pace = _text(raw[0]), float(_text(raw[1])), float(_text(raw[2]))
    change = Change(reason, window, pace)
    log.info(
        "rate control %s: %s, window %.1f, pace %s",
        key.id, reason, window, f"{pace:.2f} req/s" if pace else "none",
    )  # fmt: skip
    return change
