"""Session state in Redis: the worker's only redis importer. Key layout: `schemas/keys.py`.

Every write carries a TTL. Outputs are first-writer-wins (SET NX, then read back the winner),
so a step that runs twice never forks a transcript. Redis errors become StoreError here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import redis

from schemas import json_codec, keys
from schemas.bodies import dump_body
from schemas.fleet_clock import FleetClock, server_ms
from schemas.spec_types import (
    SessionSpec,
    Spec,
    ToolSpec,
    spec_from_json,
    tool_from_json,
    tool_to_json,
    with_builtins,
    with_mcp_tools,
)
from worker.codecs.reply import Reply
from worker.edges.commit_script import Claim
from worker.edges.redis_pool import NodeRouting, is_cluster, pooled_client
from worker.edges.step_leases import (
    TAKE_OVER,
    LeaseKeeper,
    StepLeases,
    translated,
)
from worker.edges.store_begin import StepBegin
from worker.edges.store_fleet import FleetQueries
from worker.edges.store_reads import GUESSED_CALLS, parsed_tool_inputs, round_keys, tool_keys
from worker.edges.store_results import WRITE_ONCE, ResultWrites
from worker.edges.store_retire import EndedRecords
from worker.edges.store_trace import TraceWrites
from worker.errors import SpecMissingError, StoreError
from worker.session.engine import ToolRun
from worker.session.outcomes import ToolOutcome
from worker.session.round_record import decode_round, encode_round
from worker.session.state import Round, Session
from worker.session.store_ports import PendingReply, ToolInputs

log = logging.getLogger(__name__)
SPEC_CACHE_SIZE = 4096
POOL_WAIT_S = 30  # longest wait for a free connection before the step fails (and is retried)


def _loads(raw: bytes | None) -> Any:
    return None if raw is None else json_codec.loads(raw)


class RedisStore(NodeRouting, StepLeases, StepBegin, TraceWrites, ResultWrites, FleetQueries):
    def __init__(
        self,
        client: redis.Redis,
        ttl_s: int,
        progress_after_ms: int = 15_000,
        results_ttl_s: int | None = None,
        results_keep: int = 0,
    ) -> None:
        # Any: redis-py annotates replies as bytes | str whatever decode_responses says;
        # this client never decodes, so replies are bytes.
        self.client: Any = client
        self.ttl_s = ttl_s
        # how long a finished session's record and response fd are kept (retired)
        self.results_ttl_s = ttl_s if results_ttl_s is None else results_ttl_s
        self.results_keep = results_keep  # > 0: the latest this many kept (FINISHED index)
        # a step of a session submitted longer ago than this marks its progress (the
        # reconciler looks at sessions with no mark for stall_after_ms: twice this, at least)
        self.progress_after_ms = progress_after_ms
        self._specs: dict[str, Spec] = {}
        self._submitted: dict[str, int] = {}  # sk -> when its producer submitted it (ms)
        self._batches: dict[str, str] = {}  # sk -> the batch it was submitted in
        self.ended_records = EndedRecords()  # written here, until their retirement
        # Redis's clock: what this process stamps for others to compare (marks of progress,
        # when a session ended) is on it, whatever this host's wall clock says
        self.clock = FleetClock(lambda: server_ms(self.client.time()))
        # on a Redis Cluster a session's pipelines go to the node holding its slot (on), and
        # the fleet-wide writes of a step to pipelines of their own (fleet_pipe)
        self.cluster = is_cluster(client)
        self._keeper = LeaseKeeper(self.client)
        self._take_over = self.client.register_script(TAKE_OVER)
        self._write_once = self.client.register_script(WRITE_ONCE)

    @classmethod
    def from_url(
        cls,
        url: str,
        ttl_s: int,
        max_connections: int = 100,
        progress_after_ms: int = 15_000,
        results_ttl_s: int | None = None,
        results_keep: int = 0,
    ) -> RedisStore:
        """A client whose pool holds `max_connections` (size it to the worker's concurrency):
        a thread finding none free waits for one instead of failing (redis-py's default
        pool raises MaxConnectionsError past 100). Its connections time out, keep alive and
        check their health as schemas/redis_links.py says, so a cut one errors within seconds;
        a `sentinel://` URL's pool follows the master its sentinels name (edges/redis_pool.py)."""
        client = pooled_client(url, max_connections, POOL_WAIT_S)
        return cls(client, ttl_s, progress_after_ms, results_ttl_s, results_keep)

    # reading a session ---------------------------------------------------------------------

    @translated
    def load_spec(self, sk: str) -> Spec:
        """A session's spec. Specs never change after submit, so each process keeps the
        recent ones and saves a round trip on every later step."""
        cached = self._specs.get(sk)
        if cached is not None:
            return cached
        raw = self.client.get(keys.spec(sk))
        return self._spec_of(sk, raw, lambda: self.client.get(keys.mcp_tools(sk)))

    def _spec_of(self, sk: str, raw: bytes | None, listed: Callable[[], bytes | None]) -> Spec:
        """A spec from its stored form, with its MCP tools' listing (`listed`: read when the
        spec names MCP servers), kept for the next steps of this process."""
        stored = _loads(raw)
        if stored is None:
            raise SpecMissingError(f"session {sk}: spec not found (expired or never submitted)")
        spec = with_builtins(spec_from_json(stored))
        if isinstance(spec, SessionSpec) and spec.mcp_servers:
            tools = listed()
            if tools is None:
                return spec  # not listed yet (its first round will): not kept
            spec = with_mcp_tools(spec, tuple(tool_from_json(t) for t in json_codec.loads(tools)))
        if len(self._specs) >= SPEC_CACHE_SIZE:
            evicted = next(iter(self._specs))
            self._specs.pop(evicted)
            self._submitted.pop(evicted, None)
            self._batches.pop(evicted, None)
        self._specs[sk] = spec
        if isinstance(stored.get("submitted_ms"), int):
            self._submitted[sk] = stored["submitted_ms"]
        if isinstance(stored.get("batch"), str):
            self._batches[sk] = stored["batch"]
        return spec

    def batch_of(self, sk: str) -> str:
        """From the spec this process read (read now when it has not)."""
        if sk not in self._specs:
            self.load_spec(sk)
        return self._batches.get(sk, "")

    @translated
    def store_mcp_tools(self, sk: str, tools: tuple[ToolSpec, ...]) -> None:
        listed = dump_body([tool_to_json(t) for t in tools])
        self.client.set(keys.mcp_tools(sk), listed, nx=True, ex=self.ttl_s)

    @translated
    def load_session(self, sk: str, backend: str, upto_round: int | None = None) -> Session:
        """The spec and every stored round (up to `upto_round` inclusive), usually in one
        round trip: one MGET reads the replies with the outcome keys of their first
        GUESSED_CALLS calls; only a round with more calls needs a second read."""
        spec = self._chat_spec(sk)
        last = spec.limits.max_iterations - 1 if upto_round is None else upto_round
        raw = self.on(sk).mget(round_keys(sk, last))
        return self._session_from(sk, spec, backend, last, raw)

    def _progress_due(self, sk: str) -> bool:
        """Whether a step starting now marks its session's progress for the reconciler: not
        while the mark its submit set is recent (within `progress_after_ms`), nor in a process
        that has not read its spec yet (which says when; the next steps mark it)."""
        if sk not in self._specs:
            return False
        submitted = self._submitted.get(sk)  # on Redis's clock, as the producer read it
        return submitted is None or self.clock.now_ms() - submitted >= self.progress_after_ms

    def _chat_spec(self, sk: str) -> SessionSpec:
        spec = self.load_spec(sk)
        if not isinstance(spec, SessionSpec):
            raise StoreError(f"session {sk} is a program run, not a chat")
        return spec

    def _session_from(
        self, sk: str, spec: SessionSpec, backend: str, last: int, raw: list[bytes | None]
    ) -> Session:
        guessed = [(r, i) for r in range(last + 1) for i in range(GUESSED_CALLS)]
        known = dict(zip(guessed, raw[last + 1 :], strict=True))
        replies: list[Reply] = []
        for value in raw[: last + 1]:
            if value is None:
                break
            replies.append(Reply.parse(decode_round(value).completion))
        rounds = self._with_outcomes(sk, replies, known)
        return Session(spec=spec, backend=spec.provider or backend, rounds=tuple(rounds))

    def _with_outcomes(
        self,
        sk: str,
        replies: list[Reply],
        known: dict[tuple[int, int], bytes | None],
    ) -> list[Round]:
        wanted: list[tuple[int, int]] = []
        for r, reply in enumerate(replies):
            wanted.extend((r, i) for i in range(reply.call_count))
        missing = [key for key in wanted if key not in known]
        if missing:  # a round with more calls than guessed
            fetched = self.on(sk).mget([keys.tool_out(sk, r, i) for r, i in missing])
            known = {**known, **dict(zip(missing, fetched, strict=True))}
        outcomes: list[dict[int, ToolOutcome]] = [{} for _ in replies]
        for r, i in wanted:
            value = known[(r, i)]
            if value is not None:
                outcomes[r][i] = ToolOutcome.from_json(json_codec.loads(value))
        return [Round(reply=reply, outcomes=outcomes[r]) for r, reply in enumerate(replies)]

    @translated
    def tool_inputs(self, sk: str, round_no: int, index: int) -> ToolInputs:
        """A tool step's round (reply and planned runs) and its own stored outcome, in one
        round trip."""
        return parsed_tool_inputs(self.on(sk).mget(tool_keys(sk, round_no, index)))

    # writing outputs (first writer wins) ---------------------------------------------------

    @translated
    def store_round(self, sk: str, round_no: int, reply: Reply, runs: Sequence[ToolRun]) -> Reply:
        claim = self.reply_claim(sk, PendingReply(round_no, reply, tuple(runs)))
        earlier = self.client.set(claim.key, claim.value, nx=True, ex=claim.ttl_s, get=True)
        return reply if earlier is None else Reply.parse(decode_round(earlier).completion)

    def reply_claim(self, sk: str, paid: PendingReply) -> Claim:
        """A round's reply as its step's commit claims it (first writer wins)."""
        value = encode_round(paid.reply, paid.runs)
        return Claim(keys.model_out(sk, paid.round_no), value, self.ttl_s)

    @translated
    def store_tool_outcomes(
        self, sk: str, round_no: int, outcomes: dict[int, ToolOutcome], calls: int
    ) -> int:
        """Store outcomes; how many of the round's `calls` calls have one. The outcome keys
        are the fan-in counter (one EXISTS over them), so there is no set to add to and
        expire. No MULTI: whichever step writes the last outcome counts after its own write,
        so at least one of them sees the round complete (a second sight only publishes the
        next round twice, which its guard absorbs)."""
        pipe = self.on(sk).pipeline(transaction=False)
        self.add_outcomes(pipe, sk, {(round_no, i): o for i, o in outcomes.items()})
        if calls:
            pipe.exists(*(keys.tool_out(sk, round_no, i) for i in range(calls)))
        replies = pipe.execute()
        return int(replies[-1]) if calls else 0

    def add_outcomes(
        self, client: Any, sk: str, outcomes: Mapping[tuple[int, int], ToolOutcome]
    ) -> None:
        """Tool outcomes by (round, call) stored by `client` (this store's, or a pipeline on
        it), first writer wins."""
        for (round_no, index), outcome in outcomes.items():
            client.set(
                keys.tool_out(sk, round_no, index),
                dump_body(outcome.to_json()),
                nx=True,
                ex=self.ttl_s,
            )

    # meta ----------------------------------------------------------------------------------

    @translated
    def meta(self, sk: str) -> dict[str, str]:
        raw = self.client.hgetall(keys.meta(sk))
        return {k.decode(): v.decode() for k, v in raw.items()}

    @translated
    def chunk_members(self, batch: str, chunk_no: int) -> list[keys.ChunkMember]:
        raw = self.client.lrange(keys.chunk(batch, chunk_no), 0, -1)
        return [keys.ChunkMember.decode(m.decode()) for m in raw]
