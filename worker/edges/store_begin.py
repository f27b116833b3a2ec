"""A step's start in Redis, a part of RedisStore: one delivery's lease, try count, cancel flag
and what its body reads, in one round trip (docs/architecture.md section 2)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from schemas import keys
from schemas.fleet_clock import FleetClock
from schemas.spec_types import SessionSpec, Spec
from worker.edges import liveness
from worker.edges.step_leases import LeaseKeeper, published, translated, unsent_steps
from worker.edges.store_reads import parsed_tool_inputs, round_keys, tool_keys
from worker.session.state import Session
from worker.session.store_ports import RoundReads, StepStart, ToolReads

# A delivery's start, one script (atomic, and refused whole by a Redis that refuses writes:
# the shebang makes a full Redis refuse it before it runs). KEYS: the step's state, its try
# counter, then the keys it reads (MGET), then the session's meta. ARGV: whether the broker
# vouched for a first delivery ("1": its try is not written), whether this process runs the step
# already ("1": read its lease, never take it), the lease's value and ms, the TTL, how many keys
# are read, then the meta's fields. The meta is written only while it is there: a late step of
# a session whose keys expired or were lost with Redis's data must not make a meta with no TTL
# (a producer takes a missing meta for a lost session, and submits it again). EVAL, not EVALSHA:
# it rides a pipeline, and a Redis that lost its data lost its scripts too.
# -> {the state before (the lease's, "done", or nil), the try counter before (nil), the reads}
BEGIN = """#!lua
local before
if ARGV[2] == '1' then
  before = redis.call('GET', KEYS[1])
else
  before = redis.call('SET', KEYS[1], ARGV[3], 'NX', 'PX', ARGV[4], 'GET')
end
local counted = false
if ARGV[1] ~= '1' then counted = redis.call('SET', KEYS[2], 1, 'NX', 'EX', ARGV[5], 'GET') end
local n = tonumber(ARGV[6])
local read = {}
if n > 0 then read = redis.call('MGET', unpack(KEYS, 3, 2 + n)) end
if #ARGV > 6 and redis.call('EXISTS', KEYS[3 + n]) == 1 then
  redis.call('HSET', KEYS[3 + n], unpack(ARGV, 7))
end
return {before, counted, read}
"""


class StepBegin:
    """A part of RedisStore (which sets what is declared here)."""

    client: Any
    ttl_s: int
    clock: FleetClock
    _keeper: LeaseKeeper
    _specs: Any
    on: Callable[[str], Any]
    fleet_pipe: Callable[[Any], Any]
    flush_fleet: Callable[[Any, Any], None]

    def _abandoned(self, step: str, lease: bytes, token: str, lease_ms: int) -> bool:
        raise NotImplementedError  # StepLeases', before this in RedisStore's bases

    def _progress_due(self, sk: str) -> bool:
        raise NotImplementedError  # RedisStore's

    def _spec_of(self, sk: str, raw: bytes | None, listed: Callable[[], bytes | None]) -> Spec:
        raise NotImplementedError  # RedisStore's

    def _chat_spec(self, sk: str) -> SessionSpec:
        raise NotImplementedError  # RedisStore's

    def _session_from(
        self, sk: str, spec: SessionSpec, backend: str, last: int, raw: list[bytes | None]
    ) -> Session:
        raise NotImplementedError  # RedisStore's

    @translated
    def begin_step(
        self,
        step: str,
        lease_ms: int,
        meta: dict[str, str | int] | None = None,
        sk: str = "",
        reads: RoundReads | ToolReads | None = None,
        first: bool | None = None,
    ) -> StepStart:
        """Everything one delivery of a step needs to know before it works, and what its
        body reads (`reads`, with its spec when this process has not read it yet), in one
        round trip that also records the session's state for `cchatq status`."""
        # One script (BEGIN): a Redis that refuses writes (OOM, MISCONF, a replica) refuses all
        # of it, never the lease without the try count. The lease is one SET ... NX GET
        # (Redis >= 7.0) whose old value says published ("done"), leased elsewhere, or free.
        # The try counter: a first delivery the broker vouches for (`first`, the usual case)
        # is try 1 and writes nothing; any other starts it as SET 1 NX EX GET and INCRs it
        # when it finds it set, or when it is a redelivery whose first try wrote nothing.
        # The cancel flag is read in the MGET of what the body reads: no command of its own.
        read_keys: list[str] = []
        if isinstance(reads, RoundReads):
            read_keys = round_keys(sk, reads.round_no)
        elif isinstance(reads, ToolReads):
            read_keys = tool_keys(sk, reads.round_no, reads.index)
        spec_keys: list[str] = []
        if sk and reads is not None and sk not in self._specs:
            spec_keys = [keys.spec(sk), keys.mcp_tools(sk)]
        pipe = self.on(sk or keys.step_owner(step)).pipeline(transaction=False)
        token = liveness.new_token(uuid.uuid4().hex)
        try:
            wanted = [*read_keys, *spec_keys]
            begun = self._begin(step, lease_ms, meta, sk, first, pipe, token, wanted)
        except Exception:
            # its lease, if it was taken before the INCR failed, is this process's and no
            # delivery's: the next try takes it over at once (liveness)
            liveness.retire(token)
            raise
        return self._with_reads(sk, reads, begun, read_keys, spec_keys)

    def _begin(
        self,
        step: str,
        lease_ms: int,
        meta: dict[str, str | int] | None,
        sk: str,
        first: bool | None,
        pipe: Any,
        token: str,
        wanted: list[str],
    ) -> tuple[StepStart, list[bytes | None]]:
        """The lease, the try count and the `wanted` keys (with the response, then the
        cancel flag, last)."""
        # a delivery of a step this process runs already (the broker gave it again after a
        # cut) must not take the lease that ran out in the cut: its renewer takes it back
        here = self._keeper.held.get(keys.step_state(step))
        read_keys = [*wanted, keys.response(sk), keys.cancel(sk)] if sk else []
        fields = [str(x) for pair in (meta or {}).items() for x in pair] if sk else []
        script_keys = [keys.step_state(step), keys.tries(step), *read_keys]
        if fields:  # a round or a program run starting
            script_keys.append(keys.meta(sk))
        pipe.eval(
            BEGIN, len(script_keys), *script_keys, "1" if first is True else "",
            "" if here is None else "1", keys.step_lease(token), lease_ms, self.ttl_s,
            len(read_keys), *fields,
        )  # fmt: skip
        fleet = self.fleet_pipe(pipe)
        if fields and self._progress_due(sk):  # a sign of progress for the reconciler
            fleet.zadd(keys.ACTIVE, {sk: self.clock.now_ms()}, xx=True)
        before, counted, replies = pipe.execute()[0]
        self.flush_fleet(fleet, pipe)
        before = before if here is None else (before or here)
        if before is not None and self._abandoned(step, before, token, lease_ms):
            before = None  # taken over: this delivery holds the lease now
        if before is not None:
            liveness.retire(token)
        # a delivery counts only when it runs the step: one that finds it leased by another
        # (which waits for that lease) or published (which does nothing) spends no try
        if first is True or (counted is None and first is None):
            tries = 1
        elif before is None:
            tries = int(self.client.incr(keys.tries(step)))
        else:
            tries = int(counted or 1)
        read: list[bytes | None] = replies if sk else [None, None]
        start = StepStart(
            published(before), before is None, tries, read[-1] is not None,
            lease=token if before is None else "", tries_stored=first is not True,
            ended=sk != "" and read[-2] is not None, unsent=unsent_steps(before),
        )  # fmt: skip
        return start, read

    def _with_reads(
        self,
        sk: str,
        reads: RoundReads | ToolReads | None,
        begun: tuple[StepStart, list[bytes | None]],
        read_keys: list[str],
        spec_keys: list[str],
    ) -> StepStart:
        """The StepStart with what its body asked to read, parsed (what cannot be, the body
        reads again under the guard)."""
        start, read = begun
        values = read[: len(read_keys)]
        try:
            if spec_keys:  # a missing spec fails in the body, where it counts as a try
                spec_raw, listed = read[len(read_keys) : -2]
                self._spec_of(sk, spec_raw, lambda: listed)
            if isinstance(reads, RoundReads):
                spec = self._chat_spec(sk)
                session = self._session_from(sk, spec, reads.backend, reads.round_no, values)
                return replace(start, session=session)
            if isinstance(reads, ToolReads):
                return replace(start, tool_inputs=parsed_tool_inputs(values))
        except Exception:  # what cannot be read here, the body reads again under the guard
            return start
        return start
