"""Trace events and a streamed round's partial text in Redis, a part of RedisStore: a step's
events are one entry of the session's stream and one of the fleet's (`keys.TRACE_FIELD`)."""

from __future__ import annotations

import json
from typing import Any

from schemas import keys
from schemas.partial import PartialRound
from worker.edges.step_leases import translated
from worker.session.store_ports import TraceWrite

TRACE_SESSION_MAXLEN = 2_000  # entries kept per session
TRACE_FLEET_MAXLEN = 100_000  # entries kept for the fleet


class TraceWrites:
    """A part of RedisStore (which sets `client` and `ttl_s`)."""

    client: Any
    ttl_s: int

    @translated
    def trace(self, write: TraceWrite) -> None:
        pipe = self.client.pipeline(transaction=False)
        self.add_trace(pipe, write)
        pipe.execute()

    def add_trace(self, client: Any, write: TraceWrite) -> None:
        """A step's trace events appended by `client` (this store's, or a pipeline on it): one
        entry to the session's stream and one to the fleet's, both capped (approximately:
        cheap trimming). An event of no session (a fleet event: for the metrics) goes to the
        fleet's stream only. The session's stream is made, with its TTL, only by the writes
        that set it (its first round's and its last); any other adds to it only while it is
        there (NOMKSTREAM), so a late step of a session whose keys expired or were lost makes
        no stream without a TTL. The fleet's gets its TTL with them (it lives while sessions
        come and go)."""
        every = [event.to_json() for event in write.events]
        fleet = json.dumps(every, separators=(",", ":"))
        own = [e for e, event in zip(every, write.events, strict=True) if event.session]
        if own:
            entry = fleet if len(own) == len(every) else json.dumps(own, separators=(",", ":"))
            client.xadd(
                keys.trace(write.sk),
                {keys.TRACE_FIELD: entry},
                maxlen=TRACE_SESSION_MAXLEN,
                approximate=True,
                nomkstream=not write.expire,
            )
        client.xadd(
            keys.TRACE, {keys.TRACE_FIELD: fleet}, maxlen=TRACE_FLEET_MAXLEN, approximate=True
        )
        if write.expire and own:
            client.expire(keys.trace(write.sk), self.ttl_s)
        if write.expire:
            client.expire(keys.TRACE, self.ttl_s)

    @translated
    def set_partial(self, sk: str, partial: PartialRound | None) -> None:
        if partial is None:
            self.client.delete(keys.partial(sk))
        else:
            self.client.set(keys.partial(sk), partial.encode(), ex=self.ttl_s)
