"""FleetSource: the viewer over a live fleet's Redis, through producer.client.Client (Batches,
SessionLookups) and the key layout (schemas/keys.py). Reads only, in pipelines.

The fleet's Redis is shared with its workers, so the viewer reads little and seldom. What never
changes is read once: a run's outcome and finish time, and its row (a record is written once;
a rerun is another run, of another session key), and which members of a batch are program runs
(its chunk lists). A batch's members (its ids' claims) are read again every MEMBERS_TTL_S; a
batch's progress is read again at most every second per 20,000 sessions while it runs, and
every DONE_TTL_S once it has finished (a rerun of one of its ids makes it run again)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

from producer.batches import SAMPLE, Batches, BatchMember
from producer.cli_common import flower_links, redacted
from producer.client import Client
from producer.submitting import CHUNK_SIZE, PIPELINE_SIZE
from producer.viewer.fleet_programs import chat_claims, read_frames
from producer.viewer.model import (
    ERROR,
    GONE,
    OK,
    PAGE_ROWS,
    PROGRAM_ROWS,
    QUEUED,
    RUNNING,
    BatchPage,
    BatchQuery,
    BatchRows,
    RunRow,
    SessionRow,
)
from producer.viewer.progress import RECENT_S, Member, run_row, summary_row
from producer.viewer.rows import batch_page, pending_row, record_row
from producer.viewer.source import ChatFacts, SessionFacts
from schemas import keys
from schemas.partial import PartialRound
from schemas.session_record import read_record

RECENT_BATCHES = 30  # batches on the runs page
DONE_TTL_S = 15.0  # a finished batch's row is read again after this long
RUNNING_SESSIONS_PER_S = 20_000  # a running batch's row is read again after sessions/this s
MEMBERS_TTL_S = 10.0  # a batch's ids and their claims are read again after this long
MAX_CACHED_ROWS = 200_000  # finished sessions' rows and states kept (then they start over)
# how a program run's chunk member starts ("p:"): the others are skipped undecoded
PROGRAM_MARK = keys.ChunkMember("", program=True).encode().strip().encode()

# (state, outcome, finished_ms, submitted_ms) of a session's meta; all None when it is gone
MetaState = tuple[str | None, str | None, int | None, int | None]


def _text(raw: Any) -> str | None:
    return None if raw is None else bytes(raw).decode(errors="replace")


def _digits(text: str | None) -> int | None:
    return int(text) if text is not None and text.isdigit() else None


def _number(raw: Any) -> int | None:
    """A meta's number: bytes from Redis, or str from a retired record's meta."""
    return _digits(raw if isinstance(raw, str) else _text(raw))


class FleetSource:
    """The viewer's source over a fleet's Redis."""

    def __init__(self, client: Client, redis_url: str = "", most: int = RECENT_BATCHES) -> None:
        self.client = client
        self.redis = client.redis
        self.batches = Batches(client)
        self._tally = self.batches.tally
        self.url = redacted(redis_url)
        self.most = most
        self._rows: dict[str, SessionRow] = {}  # sk -> SessionRow of a finished session
        self._ended: dict[str, MetaState] = {}  # sk -> its meta once it has an outcome
        self._programs: dict[str, frozenset[str]] = {}  # batch -> its program runs' spec ids
        self._members_at: dict[str, tuple[float, list[BatchMember]]] = {}  # batch -> members
        self._runs_at: dict[str, tuple[float, RunRow]] = {}  # run rows, by key, when read

    @property
    def label(self) -> str:
        return f"fleet {self.url}".strip()

    @property
    def live(self) -> bool:
        return True

    # reads ---------------------------------------------------------------------------------

    def _states(self, sks: Sequence[str | None]) -> list[MetaState]:
        """Each session's (state, outcome, finished_ms, submitted_ms), all None when it is
        gone; only those without an outcome yet are read, in pipelines."""
        ask = list(dict.fromkeys(sk for sk in sks if sk is not None and sk not in self._ended))
        if len(self._ended) + len(ask) > MAX_CACHED_ROWS:
            self._ended.clear()
        found: dict[str, MetaState] = {}
        for start in range(0, len(ask), PIPELINE_SIZE):
            part = ask[start : start + PIPELINE_SIZE]
            pipe = self.redis.pipeline(transaction=False)
            for sk in part:
                pipe.hmget(keys.meta(sk), "state", "outcome", "finished_ms", "submitted_ms")
            for sk, (state, outcome, finished, submitted) in zip(part, pipe.execute(), strict=True):
                meta = (_text(state), _text(outcome), _number(finished), _number(submitted))
                found[sk] = meta
                if meta[1] is not None:
                    self._ended[sk] = meta
            found.update(self._retired_states([sk for sk in part if found[sk][0] is None]))
        gone: MetaState = (None, None, None, None)
        return [gone if sk is None else self._ended.get(sk) or found[sk] for sk in sks]

    def _retired_states(self, sks: list[str]) -> dict[str, MetaState]:
        """The states of sessions with no meta that are retired (from their records)."""
        found: dict[str, MetaState] = {}
        for sk, stored in zip(sks, self.client.stored_records(sks), strict=True):
            if stored is not None and stored.retired:
                meta = stored.meta
                found[sk] = self._ended[sk] = (
                    "done", meta.get("outcome"), _number(meta.get("finished_ms")),
                    _number(meta.get("submitted_ms")),
                )  # fmt: skip
        return found

    def _batch_members(self, batch: str) -> list[BatchMember]:
        at = self._members_at.get(batch)
        if at is not None and time.monotonic() - at[0] < MEMBERS_TTL_S:
            return at[1]
        members = self.batches.members(batch)
        self._members_at[batch] = (time.monotonic(), members)
        return members

    def _program_ids(self, batch: str, sessions: int) -> frozenset[str]:
        """The batch's program runs, from its chunk lists (`p:` members): read once."""
        known = self._programs.get(batch)
        if known is not None:
            return known
        chunks = -(-sessions // CHUNK_SIZE) + 1
        pipe = self.redis.pipeline(transaction=False)
        for n in range(chunks):
            pipe.lrange(keys.chunk(batch, n), 0, -1)
        ids = set()
        for members in pipe.execute():
            for raw in members:
                if not raw.startswith(PROGRAM_MARK):  # most are not: none decoded
                    continue
                member = keys.ChunkMember.decode(raw.decode())
                if member.program:
                    ids.add(member.spec_id)
        self._programs[batch] = frozenset(ids)
        return self._programs[batch]

    def _members(self, states: Sequence[MetaState]) -> list[Member]:
        out = []
        for state, outcome, finished, _ in states:
            if state is None:
                out.append(Member(GONE))
            elif outcome is not None:
                status = OK if outcome == OK else ERROR
                out.append(Member(status, None if status == OK else outcome, finished))
            else:
                out.append(Member(QUEUED if state == QUEUED else RUNNING))
        return out

    def _cached(self, key: str) -> RunRow | None:
        """A run's row read lately enough: a running batch's within a second per
        RUNNING_SESSIONS_PER_S sessions, a finished run's within DONE_TTL_S."""
        found = self._runs_at.get(key)
        if found is None:
            return None
        at, row = found
        ttl = DONE_TTL_S if row.finished else row.sessions / RUNNING_SESSIONS_PER_S
        return row if time.monotonic() - at < ttl else None

    def _keep(self, row: RunRow) -> RunRow:
        self._runs_at[row.key] = (time.monotonic(), row)
        return row

    def _batch_run(
        self, batch: str, submitted_ms: int, members: Sequence[BatchMember] | None = None
    ) -> tuple[RunRow, list[MetaState]]:
        members = self._batch_members(batch) if members is None else members
        states = self._states([m.claim.sk if m.claim else None for m in members])
        row = run_row(
            "batch", batch, batch, submitted_ms, self._members(states), self.client.clock.now_ms()
        )
        return self._keep(row), states

    # ViewSource ----------------------------------------------------------------------------

    def runs(self) -> list[RunRow]:
        out: list[RunRow] = []
        for batch, submitted_ms, sessions in self.batches.recent(self.most):
            row = self._cached(batch)
            if row is None and sessions > SAMPLE:
                row = self._tallied_run(batch)
            row = row or self._batch_run(batch, submitted_ms)[0]
            out.append(row)
            for run_id in sorted(self._program_ids(batch, sessions))[:PROGRAM_ROWS]:
                program = self._cached(run_id) or self._program_run(run_id, batch)
                if program is not None:
                    out.append(program)
        return out

    def _program_run(self, run_id: str, batch: str) -> RunRow | None:
        claim = self.client.claims([run_id])[0]
        if claim is None:
            return None
        (state, outcome, _, submitted_ms), *_ = self._states([claim.sk])
        chats = chat_claims(self.client, run_id)
        members = self._members(self._states([c.sk for _, c in chats]))
        row = run_row(
            "program",
            run_id,
            batch,
            submitted_ms or 0,
            members,
            self.client.clock.now_ms(),  # Redis's: what submits and ends are stamped on
            finished=outcome is not None or state is None,
        )
        return self._keep(row)

    def _tallied_run(self, batch: str) -> RunRow | None:
        """A big batch's row from its ended index and a sample (Batches.summary), not from
        each of its sessions."""
        now_ms = self.client.clock.now_ms()
        tally = self._tally.read(batch, since_ms=now_ms - int(RECENT_S * 1000))
        summary = self.batches.summary(batch)
        if summary is None:
            return None
        return self._keep(summary_row(summary, tally.recent, now_ms))

    def batch_page(self, batch: str, query: BatchQuery) -> BatchPage | None:
        """A big batch's page without a filter or a sort: its counts from its ended index, and only
        the sessions of the page read. Any other, from every session's row (batch_rows)."""
        if query == BatchQuery(page=query.page):
            sessions = self.redis.llen(keys.batch_ids(batch))
            run = self._tallied_run(batch) if sessions > SAMPLE else None
            if run is not None:
                return self._page(batch, query, run)
        found = self.batch_rows(batch)
        return None if found is None else batch_page(found, query)

    def _page(self, batch: str, query: BatchQuery, run: RunRow) -> BatchPage:
        pages = max(1, -(-run.sessions // PAGE_ROWS))
        page = min(query.page, pages)
        start = (page - 1) * PAGE_ROWS
        pipe = self.redis.pipeline(transaction=False)
        pipe.lrange(keys.batch_ids(batch), start, start + PAGE_ROWS - 1)
        pipe.lrange(keys.batch_runs(batch), start, start + PAGE_ROWS - 1)
        ids, runs = pipe.execute()
        runs += [None] * (len(ids) - len(runs))
        members = [
            BatchMember(i.decode(), None if r is None else keys.Claim.decode(r))
            for i, r in zip(ids, runs, strict=True)
        ]
        rows = self._rows_of(batch, members, self._program_ids(batch, run.sessions))
        failures = run.failures
        outcomes = {OK: run.ok} if run.ok else {}
        states = {QUEUED: run.queued, RUNNING: run.running, GONE: run.gone}
        return BatchPage(
            batch=batch,
            run=run,
            outcomes=outcomes | dict(sorted(failures.items())),
            states={s: n for s, n in states.items() if n},
            codes=tuple(sorted(failures)),
            tools=tuple(sorted({tool for row in rows for tool in row.tools})),  # the page's
            query=replace(query, page=page),
            matched=run.sessions,
            rows=tuple(rows),
            pages=pages,
        )

    def batch_rows(self, batch: str) -> BatchRows | None:
        submitted = self.redis.zscore(keys.BATCHES, batch)
        members = self._batch_members(batch)
        if not members:
            return None
        run, states = self._batch_run(batch, int(submitted or 0), members)
        programs = self._program_ids(batch, len(members))
        return BatchRows(batch, run, tuple(self._rows_of(batch, members, programs, states)))

    def _rows_of(
        self,
        batch: str,
        members: Sequence[BatchMember],
        programs: frozenset[str],
        states: list[MetaState] | None = None,
    ) -> list[SessionRow]:
        """The rows of these members: a finished one's from its record (read once)."""
        if states is None:
            states = self._states([m.claim.sk if m.claim else None for m in members])
        done = [
            m.claim.sk
            for m, (_, outcome, _, _) in zip(members, states, strict=True)
            if m.claim is not None and outcome is not None and m.claim.sk not in self._rows
        ]
        self._read_rows(done, {m.claim.sk: m for m in members if m.claim is not None})
        rows = []
        for member, (state, outcome, _, _) in zip(members, states, strict=True):
            sk = member.claim.sk if member.claim else None
            attempt = member.claim.attempt if member.claim else 1
            if sk is not None and outcome is not None and sk in self._rows:
                rows.append(self._rows[sk])
            else:
                rows.append(pending_row(member.spec_id, state, member.spec_id in programs, attempt))
        return rows

    def _read_rows(self, sks: list[str], members: dict[str, BatchMember]) -> None:
        """The rows of finished sessions not read yet, from their records, in pipelines."""
        if len(self._rows) + len(sks) > MAX_CACHED_ROWS:
            self._rows.clear()
        for start in range(0, len(sks), PIPELINE_SIZE):
            part = sks[start : start + PIPELINE_SIZE]
            for sk, record in zip(part, self.client.records(part), strict=True):
                if record is not None:
                    member = members[sk]
                    attempt = member.claim.attempt if member.claim else 1
                    self._rows[sk] = record_row(member.spec_id, record, attempt)

    def session(self, spec_id: str, batch: str | None = None) -> SessionFacts | None:
        claim = self._run_of(spec_id, batch)
        if claim is None:
            return None
        sk = claim.sk
        pipe = self.redis.pipeline(transaction=False)
        pipe.hgetall(keys.meta(sk))
        pipe.get(keys.record(sk))
        pipe.get(keys.spec(sk))
        pipe.get(keys.partial(sk))
        raw_meta, raw_record, raw_spec, partial = pipe.execute()
        meta = {k.decode(): v.decode(errors="replace") for k, v in raw_meta.items()}
        stored = None if raw_record is None else read_record(raw_record)
        record = None if stored is None else stored.record
        if not meta and record is None:
            return None
        spec = None if raw_spec is None else json.loads(raw_spec)
        if stored is not None and stored.retired:  # its meta and spec folded into its record
            meta, spec = {**stored.meta, **meta}, spec or stored.spec
        program = (record or {}).get("kind") == "program" or "program" in (spec or {})
        shown = None if partial is None else PartialRound.decode(partial)
        state = "done" if record is not None else meta.get("state", "gone")
        return SessionFacts(
            spec_id=spec_id,
            state=state if state in ("done", QUEUED, "gone") else RUNNING,
            batch=meta.get("batch", ""),
            attempt=claim.attempt,
            state_text=state,
            record=record,
            events=list(self.client.run_trace(sk)),
            submitted_ms=_digits(meta.get("submitted_ms")),
            finished_ms=_digits(meta.get("finished_ms")),
            partial_text=None if shown is None else shown.text,
            partial_thinking=None if shown is None else shown.thinking,
            partial_tool_calls=() if shown is None else shown.tool_calls,
            spec=spec,
            program=program,
            chats=self._chats(spec_id) if program else (),
            frames=read_frames(self.redis, sk) if program else None,
            flower=flower_links(spec_id),
        )

    def _chats(self, run_id: str) -> tuple[ChatFacts, ...]:
        chats = chat_claims(self.client, run_id)
        states = self._states([c.sk for _, c in chats])
        records = self.client.records([c.sk for _, c in chats]) if chats else []
        out = []
        for (chat_id, _), (state, _, _, _), record in zip(chats, states, records, strict=True):
            seen = "done" if record is not None else state or "gone"
            out.append(ChatFacts(chat_id, seen, record=record))
        return tuple(out)

    def trace(self, spec_id: str, batch: str | None = None) -> Iterator[dict[str, Any]] | None:
        claim = self._run_of(spec_id, batch)
        return None if claim is None else self.client.run_trace(claim.sk)

    def _run_of(self, spec_id: str, batch: str | None) -> keys.Claim | None:
        """The run of an id that `batch` ran (its members), else the id's latest (its claim;
        a program run's chat through its run)."""
        if batch is not None:
            found = [m.claim for m in self._batch_members(batch) if m.spec_id == spec_id]
            return found[0] if found else None
        claim = self.client.claims([spec_id])[0]
        if claim is None and keys.chat_of(spec_id) is not None:
            sk = self.client.session_key(spec_id)
            claim = None if sk is None else keys.Claim(sk)
        return claim

    def close(self) -> None:
        self.client.close()
