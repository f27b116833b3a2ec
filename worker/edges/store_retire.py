"""A chat session retired as it ends, a part of RedisStore: its trace, its meta and (when it
ended with an error) its spec are folded into its record, compressed (schemas/session_record.py),
and every other key it wrote is deleted, so a finished session keeps that record, its response
fd and its id's claim: its memory is what the work in flight holds, not the batch.

The ending step's trace entry is written this way, in its commit (or at once for an ending
written outside a step's commit): one script that retires the session while the stored ending
is that step's and no delivery said it yet (two deliveries of one step may both commit across a
partition), and otherwise adds the step's events without its session.finished to the stream,
while the session is there (a failover lost the ending, which the reconciler writes again)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from schemas import json_codec, keys
from schemas.session_record import read_record, retired_value
from worker.session.store_ports import TraceWrite

TRACE_SESSION_MAXLEN = 2_000  # entries kept per session

# KEYS: meta, record, response, trace, then every other key of the session; ARGV: the ending
# step, the retired record, the result's TTL, the step's entry without its session.finished
# ("" for none), the trace field, the stream's cap
RETIRE = """
if redis.call('hget', KEYS[1], 'ended_by') == ARGV[1]
   and redis.call('hsetnx', KEYS[1], 'finished_said', 1) == 1 then
  redis.call('set', KEYS[2], ARGV[2], 'EX', ARGV[3])
  redis.call('expire', KEYS[3], ARGV[3])
  redis.call('del', KEYS[1], unpack(KEYS, 4))
  return 1
end
if ARGV[4] ~= '' and redis.call('exists', KEYS[1]) == 1 then
  redis.call('xadd', KEYS[4], 'MAXLEN', '~', ARGV[6], '*', ARGV[5], ARGV[4])
  redis.call('expire', KEYS[4], ARGV[3])
end
return 0
"""


class EndedRecords:
    """The records this process wrote as sessions ended (WRITE_ONCE), by session, until the
    ending step's commit retires them: that retirement reads neither the record nor, for a
    chat that ended ok, the spec. Bounded: an ending whose commit never came is forgotten."""

    LIMIT = 1024

    def __init__(self) -> None:
        self._records: dict[str, dict[str, Any]] = {}

    def remember(self, sk: str, record: dict[str, Any]) -> None:
        if len(self._records) >= self.LIMIT:
            self._records.pop(next(iter(self._records)))
        self._records[sk] = record

    def take(self, sk: str) -> dict[str, Any] | None:
        return self._records.pop(sk, None)


def _keeps_spec(record: dict[str, Any], batch: str) -> bool:
    """Whether a retired session keeps its spec: when it ended with an error (batch retry
    submits it again) or is a program run's chat (the program wrote it: no spec file holds it)."""
    return record.get("status") == "error" or keys.run_of_batch(batch) is not None


@dataclass(frozen=True)
class Retirement:
    """What the ending's script is given: the retired record and the keys it deletes."""

    value: bytes
    deleted: list[str]


def _compact(events: list[dict[str, Any]]) -> str:
    return json_codec.dumps(events).decode()


def session_keys(sk: str, rounds: int, calls: list[int], kept: set[tuple[int, int]]) -> list[str]:
    """Every key a chat session of `rounds` rounds (with `calls[r]` calls in round r) may have
    written but its record and response: what its retirement deletes (a key it never wrote
    costs nothing). `kept`: the (round, call) outputs kept whole (the model read an excerpt:
    `cchatq result --tool-output` prints them)."""
    names = [keys.spec(sk), keys.watchers(sk), keys.mcp_tools(sk), keys.partial(sk),
             keys.cancel(sk), keys.failure(sk)]  # fmt: skip
    steps = [keys.finish_step(sk), keys.round_step(sk, rounds)]
    for r in range(rounds):
        names.append(keys.model_out(sk, r))
        steps.append(keys.round_step(sk, r))
        for i in range(calls[r] if r < len(calls) else 0):
            if (r, i) not in kept:
                names.append(keys.tool_out(sk, r, i))
            names.append(keys.tool_queued(sk, r, i))
            steps += [keys.tool_step(sk, r, i), keys.background_step(sk, r, i)]
    return names + [keys.step_state(s) for s in steps] + [keys.tries(s) for s in steps]


def _shape(record: dict[str, Any]) -> tuple[list[int], set[tuple[int, int]]]:
    """From a record's transcript: each round's calls, and the outputs the model read an
    excerpt of (their envelope says truncated), by (round, call)."""
    calls: list[int] = []
    where: dict[str, tuple[int, int]] = {}
    kept: set[tuple[int, int]] = set()
    for message in record.get("transcript") or []:
        if message.get("role") == "assistant":
            tool_calls = message.get("tool_calls") or []
            for i, call in enumerate(tool_calls):
                where[str(call.get("id"))] = (len(calls), i)
            calls.append(len(tool_calls))
        elif message.get("role") == "tool":
            content = message.get("content")
            if isinstance(content, str) and '"truncated":true' in content.replace(" ", ""):
                found = where.get(str(message.get("tool_call_id")))
                if found is not None:
                    kept.add(found)
    return calls, kept


class RetireWrites:
    """A part of RedisStore (which sets `client`, `ttl_s`, `results_ttl_s`, `results_keep`
    and `on`)."""

    client: Any
    ttl_s: int
    results_ttl_s: int
    results_keep: int
    on: Callable[[str], Any]
    ended_records: EndedRecords
    _batches: dict[str, str]

    def retirement(self, write: TraceWrite, own: list[dict[str, Any]]) -> Retirement | None:
        """The session's retired record with `own` (its ending step's events) folded in, and
        its keys to delete: one round trip of reads (the record and the spec only when this
        process did not write the one, or may keep the other). None for a program run (its
        streams and fd table are read after its end) or a record not written (nothing to
        fold)."""
        sk = write.sk
        written = self.ended_records.take(sk)
        batch = self._batches.get(sk)
        plain = written is not None and batch is not None and not _keeps_spec(written, batch)
        pipe = self.on(sk).pipeline(transaction=False)
        if written is None:
            pipe.get(keys.record(sk))
        pipe.hgetall(keys.meta(sk))
        pipe.xrange(keys.trace(sk))
        if not plain:
            pipe.get(keys.spec(sk))
        replies = pipe.execute()
        if written is None:
            raw = replies.pop(0)
            stored = None if raw is None else read_record(raw)
            if stored is None or stored.retired:
                return None
            written = stored.record
        record: dict[str, Any] = written
        meta, entries = replies[0], replies[1]
        spec: bytes | None = None if plain else replies[2]
        if record.get("kind") == "program":
            return None
        events = [e for _, fields in entries for e in keys.trace_events(fields)] + own
        fields = {k.decode(): v.decode() for k, v in meta.items() if k != b"finished_said"}
        kept = None
        if spec is not None and _keeps_spec(record, fields.get("batch", "")):
            kept = json_codec.loads(spec)
        value = retired_value(record, events, fields, kept)
        rounds = max(int(fields.get("round", "0") or 0) + 1, 1)
        calls, whole = _shape(record)
        return Retirement(value, session_keys(sk, max(rounds, len(calls)), calls, whole))

    def add_retire(
        self, client: Any, write: TraceWrite, own: list[dict[str, Any]], retired: Retirement
    ) -> None:
        """The ending step's script (see the module's docstring), by `client` (this store's,
        or a pipeline on the session's node)."""
        unended = [e for e in own if e.get("event") != "session.finished"]
        sk = write.sk
        client.eval(
            RETIRE,
            4 + len(retired.deleted),
            keys.meta(sk), keys.record(sk), keys.response(sk), keys.trace(sk), *retired.deleted,
            write.ended_by, retired.value, self.results_ttl_s,
            _compact(unended) if unended else "", keys.TRACE_FIELD, TRACE_SESSION_MAXLEN,
        )  # fmt: skip
