"""Redis key layout shared by producer and worker. Every key gets a TTL when written.

A session is addressed by `sk`, a short key: its spec id's digest (ids may hold `/` and `:`,
which would make task ids and Flower URLs awkward) and the run's generation. Round r, tool
call i. Braces are written as they are: `{sk}` is the session's key in braces, Redis Cluster's
hash tag, so every key of a session (and every key of a batch, `{batch}`) is in one slot and a
step's scripts and transactions touch one node; the keys without one are fleet-wide:

    cq:id:<digest of namespace and id>
                            the sk of that spec id's latest run in its namespace, its spec's
                            digest and attempt (Claim); SET NX at submit = the idempotency claim
    cq:spec:{sk}            canonical spec JSON, with `submitted_ms` and `batch`
                            (keys.with_submitted)
    cq:meta:{sk}            hash: id, batch, submitted_ms, state, round, backend
    cq:out:{sk}:{r}:m       round r: the model reply (or its error) with the runs its plan made,
                            first writer wins
    cq:out:{sk}:{r}:t{i}    the outcome of call i of round r, first writer wins
    cq:step:{sk}.<step>     "lease" while a step runs (PX = its longest run), then "done" once
                            its continuation is published (EX = the TTL): one key, one SET
    cq:tries:{sk}.<step>    deliveries of a step (poison-step detection); none: one delivery
    cq:fail:{sk}            error body of a step that failed for good (dead-lettered)
    cq:cancel:{sk}          cancellation requested
    cq:resp:{sk}            the response fd: final body bytes, written once
    cq:record:{sk}          result record: status, body, transcript, metrics
    cq:watch:{sk}           the batches that joined this session after its meta's `batch`
    cq:done:{batch}         list of finished sks, pushed by finish (producers BLPOP it)
    cq:batch:{batch}:ids    the spec ids a batch submitted, in input order
    cq:batch:{batch}:runs   the run of each of them this batch ran or joined (Claim), in the
                            same order: a batch's results are these runs, whatever reruns follow
    cq:batch:{batch}:ns     the namespace its ids were claimed in (a retry claims there too)
    cq:batch:{batch}:ended  hash: each of its sessions that ended -> "<outcome> <finished_ms>"
    cq:batches              sorted set: batch -> when it was submitted (ms)
    cq:chunk:{batch}:{n}    sks admitted by one start task
    cq:module:<sha256>      WASM module bytes, content-addressed
    cq:fork:<sha256>        a program's memory snapshot at cchat_send (zlib), for its tool forks
    cq:fds:{sk}             a program run's fd table: hash fd -> entry JSON
    cq:mcp:{sk}             the MCP tools a spec session offers, listed by its first round
                            (first writer wins); read with its spec
    cq:us:{sk}:in           a program run's user streams, user -> program: a Redis stream of
                            open/data/close events (schemas/user_stream.py), auto ids
    cq:us:{sk}:out          the same, program -> user, with ids 0-1, 0-2, ... so a replayed
                            run's writes land once
    cq:partial:{sk}         the text of the round being streamed (for `cchatq status`)
    cq:trace:{sk}           a session's trace events, an entry a step (TRACE_FIELD)
    cq:trace                the fleet's, the same entries with the steps' fleet events
    cq:deadletter           stream of poison steps
    cq:finished             finished sessions by when they ended (CCHATQ_RESULTS_KEEP only)

The fleet's keys beside its sessions' (rate limits, the reconciler's, the broker's): fleet_keys.py.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from schemas import json_codec

PREFIX = "cq"
DEADLETTER = f"{PREFIX}:deadletter"
TRACE = f"{PREFIX}:trace"  # the fleet's trace events, capped (TRACE_FLEET_MAXLEN)
# sessions not finished yet, scored by their last sign of progress (ms): the reconciler's index
ACTIVE = f"{PREFIX}:active"
# finished sessions scored by when they ended (ms), kept only when results are kept by count
# (CCHATQ_RESULTS_KEEP): the reconciler deletes the oldest beyond it
FINISHED = f"{PREFIX}:finished"
TRACE_FIELD = "events"  # a trace entry's one field: the events of one step, a JSON array
GENERATION_BYTES = 4  # of a session key's 12 bytes (hex): the run's generation


def with_submitted(spec_body: bytes, submitted_ms: int, batch: str = "") -> bytes:
    """A spec's stored form with when it was submitted (`submitted_ms`) and in which batch
    (`batch`), beside its fields: a worker reads them with the spec it caches, not from the
    session's meta."""
    if not batch:
        return b'{"submitted_ms":%d,%s' % (submitted_ms, spec_body[1:])
    batch_json = json.dumps(batch).encode()
    return b'{"submitted_ms":%d,"batch":%s,%s' % (submitted_ms, batch_json, spec_body[1:])


def trace_events(fields: Mapping[bytes, bytes]) -> list[dict[str, Any]]:
    """The events of one trace stream entry, in the order the step made them."""
    raw = fields.get(TRACE_FIELD.encode())
    if raw is None:  # an entry of one event (`event`), as older workers wrote them
        single = fields.get(b"event")
        return [] if single is None else [dict(json_codec.loads(single))]
    return [dict(e) for e in json_codec.loads(raw)]


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:24]


DEFAULT_NAMESPACE = "default"
NAMESPACE_PATTERN = r"[A-Za-z0-9._-]{1,64}\Z"  # a user's namespace; `batch:...` is a batch's own
NAMESPACE_RULE = "must be 1-64 of A-Z a-z 0-9 . _ -"
BATCH_SCOPE_PREFIX = "batch:"


def batch_scope(batch: str) -> str:
    """The namespace of a batch whose ids are its own (an OpenAI Batch file's `custom_id`s, a
    `--resample`): no other batch's id is the same id."""
    return f"{BATCH_SCOPE_PREFIX}{batch}"


def _scoped(namespace: str, spec_id: str) -> str:
    return json.dumps([namespace, spec_id])  # no pair reads as another


def id_claim(namespace: str, spec_id: str) -> str:
    """The claim of a spec id in a namespace: SET NX at submit (the idempotency claim)."""
    return f"{PREFIX}:id:{_digest(_scoped(namespace, spec_id))}"


@dataclass(frozen=True)
class Claim:
    """What an id's claim holds: its run's session key, the digest of the spec that run was
    submitted with (a different spec under the same id is refused unless run again), and
    which attempt of that id the run is. Stored as "<sk> <content> <attempt>"."""

    sk: str
    content: str = "-"
    attempt: int = 1

    def encode(self) -> str:
        return f"{self.sk} {self.content} {self.attempt}"

    @classmethod
    def decode(cls, raw: bytes | str) -> Claim:
        text = raw.decode() if isinstance(raw, bytes) else raw
        sk, _, rest = text.partition(" ")
        content, _, attempt = rest.partition(" ")
        return cls(sk, content or "-", int(attempt) if attempt.isdigit() else 1)


def content_digest(stored_spec: bytes) -> str:
    """The digest of a spec's stored form (its modules by their sha256 included)."""
    return hashlib.sha256(stored_spec).hexdigest()[:16]


def new_generation() -> str:
    return secrets.token_hex(GENERATION_BYTES)


def run_session_key(namespace: str, spec_id: str, generation: str) -> str:
    """A run's session key: its scoped spec id's digest and the run's generation, drawn at submit.
    A resubmission after Redis lost its data is a new generation, so steps of the earlier
    run still in flight write markers the new run never reads."""
    return _digest(_scoped(namespace, spec_id))[: 24 - 2 * GENERATION_BYTES] + generation


CHAT_MARK = "#send"  # a program run's chat id: `<run id>#send<n>`


def chat_spec_id(run_id: str, send_no: int) -> str:
    """The spec id of a program run's `send_no`-th chat (`cchatq result '<run id>#send0'`)."""
    return f"{run_id}{CHAT_MARK}{send_no}"


def chat_of(spec_id: str) -> tuple[str, int] | None:
    """The run id and send number a chat's spec id names (`chat_spec_id`'s inverse); None for
    an id that names no program run's chat."""
    run_id, mark, number = spec_id.rpartition(CHAT_MARK)
    return (run_id, int(number)) if mark and run_id and number.isdigit() else None


def chat_session_key(run_sk: str, send_no: int) -> str:
    """The session key of a program run's `send_no`-th chat: the same for every replay of
    that run, and new with the run's generation."""
    return _digest(f"{run_sk}#send{send_no}")


def _tag(owner: str) -> str:
    """A session's (or a batch's) hash tag: every key of one session hashes to one Redis
    Cluster slot, so a step's scripts and transactions run on one node. A program run's
    batch (`run-<sk>`, run_batch) is tagged with its run's key: its user streams and the done
    list that wakes it are written together."""
    if owner.startswith(RUN_BATCH_PREFIX):
        return RUN_BATCH_PREFIX + "{" + owner[len(RUN_BATCH_PREFIX) :] + "}"
    return "{" + owner + "}"


def step_owner(step: str) -> str:
    """The session key a step id starts with (a start step's: its batch's; step ids below)."""
    return step.partition(".")[0]


def _step_tagged(step: str) -> str:
    """A step id with its session's hash tag."""
    owner, dot, rest = step.partition(".")
    return _tag(owner) + dot + rest


def spec(sk: str) -> str:
    return f"{PREFIX}:spec:{_tag(sk)}"


def meta(sk: str) -> str:
    return f"{PREFIX}:meta:{_tag(sk)}"


def model_out(sk: str, round_no: int) -> str:
    return f"{PREFIX}:out:{_tag(sk)}:{round_no}:m"


def tool_out(sk: str, round_no: int, index: int) -> str:
    return f"{PREFIX}:out:{_tag(sk)}:{round_no}:t{index}"


def trace(sk: str) -> str:
    """A session's trace events (a stream, `cchatq trace`)."""
    return f"{PREFIX}:trace:{_tag(sk)}"


def task(sk: str, task_id: str) -> str:
    """An async background task's state (a hash: status, percent, message, outcome)."""
    return f"{PREFIX}:task:{_tag(sk)}:{task_id}"


def tool_queued(sk: str, round_no: int, index: int) -> str:
    """Set when a call is published under max_parallel: it holds a place in the window."""
    return f"{PREFIX}:queued:{_tag(sk)}:{round_no}:t{index}"


def step_state(step: str) -> str:
    return f"{PREFIX}:step:{_step_tagged(step)}"


# step_state while a delivery runs the step: `lease:<token>`, PX a few seconds, renewed by the
# worker holding it while it lives (so a dead worker's step is free again within seconds)
STEP_LEASED = b"lease"


def step_lease(token: str) -> bytes:
    """The step_state value of the lease a delivery took with `token`."""
    return STEP_LEASED + b":" + token.encode()


STEP_DONE = b"done"  # step_state once published (EX = the TTL); apart: `done:<its steps>`


def tries(step: str) -> str:
    return f"{PREFIX}:tries:{_step_tagged(step)}"


def tries_count(raw: bytes | None) -> int:
    """A step's deliveries counted so far, from its `tries` key: a first delivery the broker
    vouched for writes none (1)."""
    return 1 if raw is None else int(raw)


def failure(sk: str) -> str:
    return f"{PREFIX}:fail:{_tag(sk)}"


def cancel(sk: str) -> str:
    return f"{PREFIX}:cancel:{_tag(sk)}"


def response(sk: str) -> str:
    return f"{PREFIX}:resp:{_tag(sk)}"


def record(sk: str) -> str:
    return f"{PREFIX}:record:{_tag(sk)}"


def watchers(sk: str) -> str:
    return f"{PREFIX}:watch:{_tag(sk)}"


def batch_ids(batch: str) -> str:
    """The spec ids a batch submitted, in input order (a list), beside their runs
    (batch_runs)."""
    return f"{PREFIX}:batch:{_tag(batch)}:ids"


def batch_runs(batch: str) -> str:
    """The run (Claim) of each id of a batch, in input order: what `cchatq batch results`
    reads, so a batch's results stay those of the runs it ran."""
    return f"{PREFIX}:batch:{_tag(batch)}:runs"


def batch_ended(batch: str) -> str:
    """The batch's sessions that ended: sk -> "<outcome> <finished_ms>" (a hash), written as
    each is told; `cchatq batch status` counts from it."""
    return f"{PREFIX}:batch:{_tag(batch)}:ended"


def batch_namespace(batch: str) -> str:
    return f"{PREFIX}:batch:{_tag(batch)}:ns"


BATCHES = f"{PREFIX}:batches"  # batch -> when it was submitted (ms), a sorted set


def done_list(batch: str) -> str:
    return f"{PREFIX}:done:{_tag(batch)}"


@dataclass(frozen=True)
class ChunkMember:
    """A session admitted by a start task, whether it is a program run (its task runs on the
    programs queue), and its spec id (shown with its first step's task). Stored as "<sk>" or
    "p:<sk>", then a space and the id, in the chunk list."""

    sk: str
    program: bool = False
    spec_id: str = ""

    def encode(self) -> str:
        return (f"p:{self.sk}" if self.program else self.sk) + f" {self.spec_id}"

    @classmethod
    def decode(cls, raw: str) -> ChunkMember:
        sk, _, spec_id = raw.partition(" ")  # a spec id holds no space (schemas/spec.py)
        if sk.startswith("p:"):
            return cls(sk[2:], program=True, spec_id=spec_id)
        return cls(sk, spec_id=spec_id)


def chunk(batch: str, chunk_no: int) -> str:
    return f"{PREFIX}:chunk:{_tag(batch)}:{chunk_no}"


def module(sha256: str) -> str:
    return f"{PREFIX}:module:{sha256}"


def fork(sha256: str) -> str:
    return f"{PREFIX}:fork:{sha256}"


def fds(sk: str) -> str:
    return f"{PREFIX}:fds:{_tag(sk)}"


def mcp_tools(sk: str) -> str:
    return f"{PREFIX}:mcp:{_tag(sk)}"


def user_in(sk: str) -> str:
    return f"{PREFIX}:us:{_tag(sk)}:in"


def user_out(sk: str) -> str:
    return f"{PREFIX}:us:{_tag(sk)}:out"


USER_WAKE = "ustream"  # pushed on a run's done list when its user sends: its waits wake


def partial(sk: str) -> str:
    return f"{PREFIX}:partial:{_tag(sk)}"


RUN_BATCH_PREFIX = "run-"


def run_batch(sk: str) -> str:
    """The batch a program run's chats notify when they finish."""
    return f"{RUN_BATCH_PREFIX}{sk}"


def run_of_batch(batch: str) -> str | None:
    """The program run whose chats a batch holds (`run_batch`'s inverse); None for a batch a
    producer submitted."""
    return batch.removeprefix(RUN_BATCH_PREFIX) if batch.startswith(RUN_BATCH_PREFIX) else None


# Step ids name one unit of at-least-once work; task ids are derived from them.
def round_step(sk: str, round_no: int) -> str:
    return f"{sk}.r{round_no}"


def tool_step(sk: str, round_no: int, index: int) -> str:
    return f"{sk}.r{round_no}.t{index}"


def finish_step(sk: str) -> str:
    return f"{sk}.fin"


def start_step(batch: str, chunk_no: int) -> str:
    return f"{batch}.c{chunk_no}"


def background_step(sk: str, round_no: int, index: int) -> str:
    """A background tool's call, run on the background queue after its tool step handed it
    over (a step of its own: the tool step is published once it has handed over)."""
    return f"{tool_step(sk, round_no, index)}.bg"


def program_step(sk: str) -> str:
    return f"{sk}.prog"
