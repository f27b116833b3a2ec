"""Trace events and a streamed round's partial text in Redis, a part of RedisStore: a step's
events are one entry of the session's stream and one of the fleet's (`keys.TRACE_FIELD`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from schemas import fleet_keys, json_codec, keys
from schemas.fleet_clock import FleetClock
from schemas.partial import PartialRound
from worker.edges.step_leases import translated
from worker.edges.store_retire import TRACE_SESSION_MAXLEN, Retirement, RetireWrites
from worker.session.store_ports import TraceWrite

TRACE_FLEET_MAXLEN = 100_000  # entries kept for the fleet at most
# the fleet's stream keeps this long of events (its readers follow it live: the metrics, the
# chaos benches), so its memory levels off within minutes, not when it holds TRACE_FLEET_MAXLEN
TRACE_FLEET_KEEP_MS = 15 * 60_000


# an ending step's entry (ARGV[1]; ARGV[2] without its session.finished, "" for nothing), of a
# session that is not retired (store_retire.py: a chat is, a program run is not), while its meta
# is there (not retired, not expired), whole only while the session's meta names step ARGV[6]
# as its ender (the ending script,
# store_results.py, writes it with the ending) and no delivery said it yet (two deliveries of
# one step, a cut-off one and its stand-in, may both commit): one script with its checks, on
# two keys of its session. EVAL, not a registered script: one in a MULTI costs a SCRIPT
# EXISTS a commit.
_ENDING_ENTRY = """
local entry = ARGV[1]
if redis.call('hget', KEYS[1], 'ended_by') ~= ARGV[6]
   or redis.call('hsetnx', KEYS[1], 'finished_said', 1) == 0 then
  entry = ARGV[2]
end
if entry ~= '' and redis.call('exists', KEYS[1]) == 1 then
  redis.call('xadd', KEYS[2], 'MAXLEN', '~', ARGV[4], '*', ARGV[3], entry)
  redis.call('expire', KEYS[2], ARGV[5])
end
"""


class TraceWrites(RetireWrites):
    """A part of RedisStore (which sets `client`, `ttl_s`, and `on`, `fleet_pipe` and
    `flush_fleet`: where a session's pipelines go)."""

    client: Any
    ttl_s: int
    clock: FleetClock
    cluster: bool
    on: Callable[[str], Any]
    fleet_pipe: Callable[[Any], Any]
    flush_fleet: Callable[[Any, Any], None]

    @translated
    def trace(self, write: TraceWrite) -> None:
        pipe = (self.on(write.sk) if write.sk else self.client).pipeline(transaction=False)
        fleet = self.fleet_pipe(pipe) if write.sk else pipe
        self.add_trace(pipe, write, fleet)
        pipe.execute()
        self.flush_fleet(fleet, pipe)

    def add_trace(self, client: Any, write: TraceWrite, fleet: Any = None) -> None:
        """A step's trace events appended by `client` (this store's, or a pipeline on it): one
        entry to the session's stream and one to the fleet's, both capped (approximately:
        cheap trimming). An event of no session (a fleet event: for the metrics) goes to the
        fleet's stream only. The session's stream is made, with its TTL, only by the writes
        that set it (its first round's and its last); any other adds to it only while it is
        there (NOMKSTREAM), so a late step of a session whose keys expired or were lost makes
        no stream without a TTL. The fleet's is tended by the writes of fleet events that set
        `expire` (the reconciler's pass, every 10 s): its TTL, and its events older than
        TRACE_FLEET_KEEP_MS trimmed (no command of the sessions' for it). The fleet's
        stream is written by `fleet` (default `client`: on a cluster, a pipeline of its own)."""
        fleet = client if fleet is None else fleet
        every = [event.to_json() for event in write.events]
        entries = json_codec.dumps(every)
        own = [e for e, event in zip(every, write.events, strict=True) if event.session]
        retired: Retirement | None = None
        if write.ended_by:  # the session retires with its ending's events
            retired = self.retirement(write, own)
        if retired is not None:
            self.add_retire(client, write, own, retired)
            if self.results_keep:  # kept by count: the reconciler trims the oldest
                fleet.zadd(keys.FINISHED, {write.sk: self.clock.now_ms()})
                fleet.expire(keys.FINISHED, self.results_ttl_s)
        elif own and write.ended_by:
            self._add_ending(client, write, own)
        elif own:
            entry = entries if len(own) == len(every) else json_codec.dumps(own)
            client.xadd(
                keys.trace(write.sk),
                {keys.TRACE_FIELD: entry},
                maxlen=TRACE_SESSION_MAXLEN,
                approximate=True,
                nomkstream=not write.expire,
            )
        if every:  # on a cluster, the shard of the session's (fleet_keys.trace_stream)
            fleet.xadd(
                fleet_keys.trace_stream(write.sk, self.cluster), {keys.TRACE_FIELD: entries},
                maxlen=TRACE_FLEET_MAXLEN // len(fleet_keys.trace_shards(self.cluster)),
                approximate=True,
            )  # fmt: skip
        if write.expire and own and not write.ended_by:
            client.expire(keys.trace(write.sk), self.ttl_s)
        if write.expire and not write.sk:
            oldest_ms = self.clock.now_ms() - TRACE_FLEET_KEEP_MS
            for stream in fleet_keys.trace_shards(self.cluster):
                fleet.xtrim(stream, minid=f"{oldest_ms}-0", approximate=True)
                fleet.expire(stream, self.ttl_s)

    def _add_ending(self, client: Any, write: TraceWrite, own: list[dict[str, Any]]) -> None:
        """The entry of the step that ended the session: whole while the stored ending is
        its own, without its session.finished when not (a failover lost the ending, which the
        reconciler has written again, or will: its writer says session.finished)."""
        unended = [e for e in own if e.get("event") != "session.finished"]
        client.eval(
            _ENDING_ENTRY,
            2,
            keys.meta(write.sk),
            keys.trace(write.sk),
            json_codec.dumps(own),
            json_codec.dumps(unended) if unended else "",
            keys.TRACE_FIELD,
            TRACE_SESSION_MAXLEN,
            self.ttl_s,
            write.ended_by,
        )

    @translated
    def set_partial(self, sk: str, partial: PartialRound | None) -> None:
        if partial is None:
            self.client.delete(keys.partial(sk))
        else:
            self.client.set(keys.partial(sk), partial.encode(), ex=self.ttl_s)
