"""A session's end in Redis, a part of RedisStore: what its ending reads (the failure a
dead-lettered step recorded, the cancel flag, when it was submitted), the dead letter, the
response fd and the record, written once, and the batches waiting for the session told that it
finished."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

from schemas import keys
from schemas.bodies import dump_body, outcome_code
from schemas.fleet_clock import FleetClock
from worker.edges.step_leases import translated
from worker.edges.store_retire import EndedRecords
from worker.session.store_ports import EndingInputs

# The response and the record set once (NX), and with them the end in the meta: the state,
# when, the outcome and the step that ended it (`ended_by`), the meta living as long as they
# do (a session whose meta expired or was lost gets one with a TTL, never one without).
# Returns {outcome, the batches waiting, 1 when the record written is ARGV[1]} to the writer,
# and {outcome, the batches waiting} to a later delivery of the step that wrote them; {'', {}}
# to anyone else. The batches waiting: the one that submitted the session
# (ARGV[8], from the spec this process read; the meta's `batch` when it read none) and the
# batches that joined it later (its watchers set). The session leaves the reconciler's index
# (KEYS[5]) in the same script on one Redis; on a cluster, where that index is in another slot,
# just after it.
WRITE_ONCE = """
local function waiting()
  local batches = redis.call('smembers', KEYS[4])
  local own = ARGV[8]
  if own == '' then own = redis.call('hget', KEYS[3], 'batch') or '' end
  if own ~= '' then table.insert(batches, own) end
  return batches
end
if redis.call('set', KEYS[2], ARGV[2], 'NX', 'EX', ARGV[3]) then
  local fresh = redis.call('set', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[3]) and 1 or 0
  redis.call('hset', KEYS[3], 'state', 'done', 'finished_ms', ARGV[4], 'outcome', ARGV[5],
             'ended_by', ARGV[6])
  redis.call('expire', KEYS[3], ARGV[3])
  if KEYS[5] then redis.call('zrem', KEYS[5], ARGV[7]) end
  return {ARGV[5], waiting(), fresh}
end
if ARGV[6] ~= '' and redis.call('hget', KEYS[3], 'ended_by') == ARGV[6] then
  return {redis.call('hget', KEYS[3], 'outcome') or '', waiting()}
end
return {'', {}}
"""


class ResultWrites:
    """A part of RedisStore (which sets `client`, `ttl_s`, `clock`, `_submitted` (sk -> when
    submitted, from the specs it read), `_write_once`: WRITE_ONCE, and `cluster`, `on`,
    `fleet_pipe` and `flush_fleet`: where a session's pipelines go)."""

    client: Any
    ttl_s: int
    clock: FleetClock
    cluster: bool
    _submitted: dict[str, int]
    _batches: dict[str, str]
    _write_once: Any
    ended_records: EndedRecords
    on: Callable[[str], Any]
    fleet_pipe: Callable[[Any], Any]
    flush_fleet: Callable[[Any, Any], None]

    # cancellation and failure --------------------------------------------------------------

    @translated
    def is_cancelled(self, sk: str) -> bool:
        return bool(self.client.exists(keys.cancel(sk)))

    @translated
    def failure(self, sk: str) -> dict[str, Any] | None:
        value = _loads(self.client.get(keys.failure(sk)))
        return None if value is None else dict(value)

    @translated
    def ending_inputs(self, sk: str) -> EndingInputs:
        submitted = self._submitted.get(sk)  # in the spec this process read, when it says
        pipe = self.on(sk).pipeline(transaction=False)
        pipe.get(keys.failure(sk))
        pipe.exists(keys.cancel(sk))
        if submitted is None:
            pipe.hget(keys.meta(sk), "submitted_ms")
        failure, cancelled, *rest = pipe.execute()
        failed = _loads(failure)
        return EndingInputs(
            None if failed is None else dict(failed),
            bool(cancelled),
            submitted if submitted is not None else int(rest[0] or 0),
            self.clock.now_ms(),
        )

    @translated
    def dead_letter(self, step: str, sk: str, body: dict[str, Any], reason: str) -> None:
        pipe = self.on(sk).pipeline(transaction=True)
        fleet = self.fleet_pipe(pipe)
        pipe.set(keys.failure(sk), dump_body(body), nx=True, ex=self.ttl_s)
        fleet.xadd(keys.DEADLETTER, {"step": step, "reason": reason[:500]}, maxlen=100_000)
        fleet.expire(keys.DEADLETTER, self.ttl_s)
        pipe.execute()
        self.flush_fleet(fleet, pipe)

    # the result ----------------------------------------------------------------------------

    @translated
    def has_result(self, sk: str) -> bool:
        return bool(self.client.exists(keys.response(sk)))

    @translated
    def write_result(
        self,
        sk: str,
        body: bytes,
        record: dict[str, Any],
        notify_later: list[str] | None = None,
        ender: str = "",
    ) -> str | None:
        """Write the response fd once, with the session's end in its meta, then tell every
        waiting batch (or add them to `notify_later`). The outcome code of the ending written
        if this call ended the session (or step `ender`, which this is a delivery of, had)."""
        # One script, so the end is decided once: the meta's state, outcome and ended_by are
        # the winner's, and a later writer (a cancel's finish racing the round that ended
        # the session) changes nothing. The watchers are read with the write: a batch that
        # starts watching later finds the response.
        own = [keys.record(sk), keys.response(sk), keys.meta(sk), keys.watchers(sk)]
        code, batches, *fresh = self._write_once(
            keys=own if self.cluster else [*own, keys.ACTIVE],
            args=[dump_body(record), body, self.ttl_s, self.clock.now_ms(),
                  outcome_code(record.get("body")), ender, sk, self._batches.get(sk, "")],
        )  # fmt: skip
        if not code:
            return None
        if fresh == [1]:  # the retirement in this step's commit folds it without reading it
            self.ended_records.remember(sk, record)
        if self.cluster:  # a session this call ended (or its step had) leaves the index
            self.client.zrem(keys.ACTIVE, sk)
        watchers = list(dict.fromkeys(b.decode() for b in batches))
        outcome = bytes(code).decode()
        if notify_later is not None:
            notify_later.extend(watchers)
        else:
            self.notify(sk, watchers, outcome)
        return outcome

    @translated
    def watcher_batches(self, sk: str) -> list[str]:
        """The batches waiting for a session: the one that submitted it (its meta's `batch`)
        and those that joined it later (its watchers set)."""
        pipe = self.on(sk).pipeline(transaction=False)
        pipe.hget(keys.meta(sk), "batch")
        pipe.smembers(keys.watchers(sk))
        own, joined = pipe.execute()
        return list(dict.fromkeys(b.decode() for b in [*([own] if own else []), *joined]))

    @translated
    def notify(self, sk: str, batches: Iterable[str], outcome: str = "") -> None:
        pipe = self.client.pipeline(transaction=False)
        self.add_notify(pipe, sk, batches, outcome)
        pipe.execute()

    def add_notify(self, client: Any, sk: str, batches: Iterable[str], outcome: str = "") -> None:
        """Tell `batches` that session `sk` finished, by `client` (this store, or a pipeline):
        on each one's done list (its waiting producers), and, with its `outcome`, in each
        one's ended index (`cchatq batch status` counts from it, whatever was retired)."""
        ended = f"{outcome} {self.clock.now_ms()}" if outcome else ""
        for batch in batches:
            client.rpush(keys.done_list(batch), sk)
            client.expire(keys.done_list(batch), self.ttl_s)
            if ended:
                client.hset(keys.batch_ended(batch), sk, ended)
                client.expire(keys.batch_ended(batch), self.ttl_s)


def _loads(raw: bytes | None) -> Any:
    return None if raw is None else json.loads(raw)
