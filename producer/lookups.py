"""Reading and steering one session by its spec id (or a batch's sessions by key): its run's
key through the id's claim, its state and outcome, response, record, a tool call's whole
output, its trace events, cancelling it, and a program run's user streams. A part of the
Client (producer/client.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

from celery import Celery

from producer.user_stream import RunEnded, UserStream
from schemas import keys, redis_links, task_names
from schemas.fleet_clock import FleetClock
from schemas.partial import PartialRound
from schemas.session_record import StoredRecord, read_record
from schemas.spec_types import ProgramSpec, Spec, spec_from_json

QUEUED = b"queued"  # a session's state from submit until its first round


class SessionLookups:
    redis: Any  # the Client's: redis-py, replies as bytes
    clock: FleetClock  # the Client's: Redis's clock (what a task's sent stamp is on)
    celery: Celery
    ttl_s: int
    namespace: str  # where an id is looked up (its claim) unless `lookup_batch` names a batch
    lookup_batch: str | None  # an id is the run this batch ran (`--batch B`)

    def records(self, sks: Sequence[str]) -> list[dict[str, Any] | None]:
        return [None if r is None else r.record for r in self.stored_records(sks)]

    def stored_records(self, sks: Sequence[str]) -> list[StoredRecord | None]:
        """Each session's record, with what its retirement folded in (schemas/session_record)."""
        raw = self.redis.mget([keys.record(sk) for sk in sks]) if sks else []
        return [None if r is None else read_record(r) for r in raw]

    def state_counts(self, sks: Sequence[str]) -> tuple[int, int]:
        """How many of these sessions are queued (not yet in their first round) and how many
        are running (any other state: a round, a tool call, finishing): one pipeline."""
        pipe = self.redis.pipeline(transaction=False)
        for sk in sks:
            pipe.hget(keys.meta(sk), "state")
        queued = sum(1 for state in pipe.execute() if state == QUEUED)
        return queued, len(sks) - queued

    # one session ---------------------------------------------------------------------------

    def session_key(self, spec_id: str) -> str | None:
        """The session key of a spec id's run: the one `lookup_batch` ran, else its latest in
        the namespace; a program run's chat (`<run id>#send<n>`) through its run. None if
        that id was never submitted there (or its run expired)."""
        if self.lookup_batch is not None:
            sk = self.batch_run(self.lookup_batch, spec_id)
        else:
            raw = self.redis.get(keys.id_claim(self.namespace, spec_id))
            sk = None if raw is None else keys.Claim.decode(raw).sk
        chat = keys.chat_of(spec_id) if sk is None else None
        if chat is None:
            return sk
        run_sk = self.session_key(chat[0])
        return None if run_sk is None else keys.chat_session_key(run_sk, chat[1])

    def batch_run(self, batch: str, spec_id: str) -> str | None:
        """The session key of the run of `spec_id` that `batch` ran."""
        at = self.redis.lpos(keys.batch_ids(batch), spec_id)
        raw = None if at is None else self.redis.lindex(keys.batch_runs(batch), at)
        return None if raw is None else keys.Claim.decode(raw).sk

    def status(self, spec_id: str) -> dict[str, Any] | None:
        sk = self.session_key(spec_id)
        if sk is None:
            return None
        meta = {k.decode(): v.decode() for k, v in self.redis.hgetall(keys.meta(sk)).items()}
        if not meta:  # a retired session keeps its meta in its record
            stored = self.stored_records([sk])[0]
            if stored is None or not stored.retired:
                return None
            meta = dict(stored.meta)
        meta.pop("finished_said", None)  # the workers' own: its trace said session.finished
        pipe = self.redis.pipeline(transaction=False)
        pipe.exists(keys.response(sk))
        pipe.exists(keys.cancel(sk))
        pipe.get(keys.partial(sk))
        finished, cancelled, partial = pipe.execute()
        meta["finished"] = bool(finished)
        meta["cancel_requested"] = bool(cancelled)
        if finished and "outcome" in meta:  # written with the result: a late step's state
            meta["state"] = "cancelled" if meta["outcome"] == "cancelled" else "done"
        if partial is not None:  # the round being streamed: its text, thinking and tool calls
            meta.update(PartialRound.decode(partial).status_fields())
        return meta

    def response(self, spec_id: str) -> bytes | None:
        sk = self.session_key(spec_id)
        value = None if sk is None else self.redis.get(keys.response(sk))
        return None if value is None else bytes(value)

    def record(self, spec_id: str) -> dict[str, Any] | None:
        sk = self.session_key(spec_id)
        return None if sk is None else self.records([sk])[0]

    def tool_output(self, spec_id: str, call_id: str) -> str | None:
        """A finished session's tool call output, whole (the model may have read an excerpt),
        found by its call id; None if no call of that id produced one."""
        sk = self.session_key(spec_id)
        record = None if sk is None else self.records([sk])[0]
        rounds = [m for m in (record or {}).get("transcript", []) if m.get("role") == "assistant"]
        for round_no, message in enumerate(rounds):
            for index, call in enumerate(message.get("tool_calls") or []):
                if call.get("id") == call_id:
                    raw = self.redis.get(keys.tool_out(str(sk), round_no, index))
                    output = None if raw is None else json.loads(raw).get("output")
                    return output if isinstance(output, str) else None
        return None

    def trace(
        self, spec_id: str, follow: bool = False, block_ms: int = 1000
    ) -> Iterator[dict[str, Any]]:
        """A session's trace events in time order; with `follow`, waits for more until its
        session.finished event (or until the session is gone). A step appends its events when
        it ends, so steps running side by side append theirs out of time order: without
        `follow` every event is read, then sorted by its time; with it, each read is."""
        stream_sk = self.session_key(spec_id)
        if stream_sk is not None:
            yield from self.run_trace(stream_sk, follow, block_ms)

    def run_trace(
        self, stream_sk: str, follow: bool = False, block_ms: int = 1000
    ) -> Iterator[dict[str, Any]]:
        """`trace`, of a run known by its session key."""
        stream, last, said = keys.trace(stream_sk), "0-0", 0
        if not follow:
            events = [
                e for _, fields in self.redis.xrange(stream) for e in keys.trace_events(fields)
            ]
            yield from in_time_order(events or self._retired_trace(stream_sk))
            return
        while True:
            read = self.redis.xread(
                {stream: last}, count=1000, block=redis_links.block_ms(block_ms)
            )
            entries = read[0][1] if read else []
            events = []
            for entry_id, fields in entries:
                last = entry_id
                events.extend(keys.trace_events(fields))
            said += len(events)
            yield from in_time_order(events)
            if any(e.get("event") == "session.finished" for e in events):
                return  # the session's last event: its end waited for its running steps
            if not entries and not self.redis.exists(keys.meta(stream_sk)):
                # retired (its stream folded into its record, the events not read yet from
                # it follow), or gone
                yield from in_time_order(self._retired_trace(stream_sk)[said:])
                return

    def _retired_trace(self, sk: str) -> list[dict[str, Any]]:
        """A retired session's trace events, in the order they were written (none when it is
        not retired)."""
        stored = self.stored_records([sk])[0]
        return stored.trace if stored is not None else []

    def cancel(self, spec_id: str) -> bool:
        """Ask a session to stop; every step checks at its boundary. False if unknown."""
        sk = self.session_key(spec_id)
        return sk is not None and self.cancel_run(sk)

    def cancel_run(self, sk: str) -> bool:
        """`cancel`, of a run known by its session key."""
        spec = self._stored_spec(sk)
        if spec is None:
            return False
        self.redis.set(keys.cancel(sk), "1", ex=self.ttl_s)
        if isinstance(spec, ProgramSpec):
            return True  # a program run checks the flag at its hostcalls and waits
        self.celery.send_task(
            task_names.FINISH,
            args=[sk],
            task_id=keys.finish_step(sk),
            queue=task_names.ROUTES[task_names.FINISH],
            headers={task_names.SENT_HEADER: self.clock.now_ms()},
        )
        return True

    def stream(self, spec_id: str, stream_id: int = 1) -> UserStream:
        """Attach to user stream `stream_id` of a program run (SPEAR's user streams): what it
        `send`s the program reads with user_stream_read, what the program writes comes out of
        `lines()`. LookupError if the id names no program run (or it expired), RunEnded if
        the run already ended (nothing is sent to it then)."""
        sk = self.session_key(spec_id)
        spec = None if sk is None else self._stored_spec(sk)
        if sk is None or spec is None:
            raise LookupError(f"unknown session id: {spec_id}")
        if not isinstance(spec, ProgramSpec):
            raise LookupError(f"not a program run: {spec_id}")
        stream = UserStream(self.redis, sk, stream_id, self.ttl_s)
        ending = stream.ending()
        if ending is not None:
            raise RunEnded(spec_id, ending)
        stream.open()
        return stream

    def spec_json(self, sk: str) -> dict[str, Any] | None:
        """A session's stored spec as JSON: its own key, or what its retired record kept (a
        session that ended with an error, a program run's chat); None otherwise."""
        raw = self.redis.get(keys.spec(sk))
        if raw is not None:
            return dict(json.loads(raw))
        stored = self.stored_records([sk])[0]
        return None if stored is None or stored.spec is None else dict(stored.spec)

    def _stored_spec(self, sk: str) -> Spec | None:
        """The spec a run was submitted with, None once it expired (or its session retired)."""
        raw = self.redis.get(keys.spec(sk))
        return None if raw is None else spec_from_json(json.loads(raw))


def in_time_order(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Events by their time (`ts_ms`); events of one time keep the order they were made in."""
    return sorted(events, key=lambda e: int(e.get("ts_ms") or 0))
