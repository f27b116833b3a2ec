"""FileSource: the viewer over results files (`cchatq submit --out`, `cchatq batch results
--out`), with no Redis. A batch is the records' `batch` field (a file's name when a line has
none); a program run's chats are its response bodies. Files are read again when they change
(a submit still writing its lines), keeping what was read when a new read fails."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from producer.viewer.model import OK, PROGRAM_ROWS, BatchPage, BatchQuery, BatchRows, RunRow
from producer.viewer.progress import Member, run_row
from producer.viewer.rows import as_int, batch_page, error_of, record_row
from producer.viewer.source import ChatFacts, SessionFacts
from schemas import keys

log = logging.getLogger(__name__)


class ResultsFileError(ValueError):
    """A results file that cannot be read: its path and line, and why."""


def read_results(path: Path) -> list[dict[str, Any]]:
    """The result lines of a file, in order: a line that is not a JSON object with an `id`
    and a `status` is an error naming `file:line`."""
    out: list[dict[str, Any]] = []
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ResultsFileError(f"{path}: cannot be read: {exc}") from None
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            parsed = json.loads(line)
        except ValueError as exc:
            raise ResultsFileError(f"{path}:{number}: not a JSON line: {exc}") from None
        if not isinstance(parsed, dict) or not isinstance(parsed.get("id"), str):
            raise ResultsFileError(f"{path}:{number}: not a result line (no string `id`)")
        if parsed.get("status") not in ("ok", "error"):
            raise ResultsFileError(f"{path}:{number}: not a result line (`status` ok or error)")
        out.append(parsed)
    return out


def line_record(line: Mapping[str, Any]) -> dict[str, Any]:
    """A results line as a record: its response is the record's body."""
    record = dict(line)
    if "response" in line:
        record["body"] = line["response"]
    elif line.get("error"):
        record["body"] = {"error": line["error"]}
    elif line.get("kind") == "program":
        record["body"] = {"exit_code": line.get("exit_code")}
    return record


def chat_record(chat_id: str, body: Mapping[str, Any]) -> dict[str, Any]:
    """A program's chat as a record, from its response body alone (no transcript kept)."""
    choices = body.get("choices") or []
    message = choices[0].get("message") if choices and isinstance(choices[0], dict) else None
    error = body.get("error")
    return {
        "id": chat_id,
        "status": "error" if error else OK,
        "body": dict(body),
        "transcript": [message] if isinstance(message, dict) else [],
        "metrics": {"usage": body.get("usage") or {}},
    }


@dataclass
class _Batch:
    name: str
    source: str
    mtime_ms: int
    ids: list[str] = field(default_factory=list)


class FileSource:
    """The viewer's source over results files."""

    def __init__(self, paths: Sequence[Path]) -> None:
        self.paths = [Path(p) for p in paths]
        self._stamps: dict[Path, float] = {}
        self._batches: dict[str, _Batch] = {}
        self._records: dict[str, tuple[dict[str, Any], str, int]] = {}  # record, batch, attempt
        self._load()  # raises ResultsFileError: the command says which line

    @property
    def label(self) -> str:
        return "files " + ", ".join(p.name for p in self.paths)

    @property
    def live(self) -> bool:
        return False

    def _stat(self) -> dict[Path, float]:
        stamps = {}
        for path in self.paths:
            try:
                stamps[path] = path.stat().st_mtime
            except OSError:
                stamps[path] = -1.0
        return stamps

    def _load(self) -> None:
        stamps = self._stat()
        batches: dict[str, _Batch] = {}
        records: dict[str, tuple[dict[str, Any], str, int]] = {}
        for path in self.paths:
            for line in read_results(path):
                name = str(line.get("batch") or path.name)
                batch = batches.setdefault(name, _Batch(name, path.name, int(stamps[path] * 1000)))
                spec_id = line["id"]
                attempt = as_int(line.get("attempt")) or 1
                before = records.get(spec_id)
                if before is not None and before[2] > attempt:
                    continue  # an earlier attempt listed after a later one
                if spec_id not in batch.ids:
                    batch.ids.append(spec_id)
                records[spec_id] = (line_record(line), name, attempt)
        self._stamps, self._batches, self._records = stamps, batches, records

    def _fresh(self) -> None:
        """Read the files again when one changed; a read that fails keeps the last one."""
        if self._stat() != self._stamps:
            try:
                self._load()
            except ResultsFileError as exc:
                log.warning("keeping the last read of the results files: %s", exc)

    # ViewSource ---------------------------------------------------------------------------

    def runs(self) -> list[RunRow]:
        self._fresh()
        out: list[RunRow] = []
        ordered = sorted(self._batches.values(), key=lambda b: -b.mtime_ms)
        for batch in ordered:
            out.append(self._run(batch))
            programs = [
                self._records[spec_id][0]
                for spec_id in batch.ids
                if self._records[spec_id][0].get("kind") == "program"
            ]
            out.extend(self._program_run(batch, record) for record in programs[:PROGRAM_ROWS])
        return out

    def _run(self, batch: _Batch) -> RunRow:
        members = []
        for spec_id in batch.ids:
            record = self._records[spec_id][0]
            row = record_row(spec_id, record)
            members.append(Member(row.status, row.code, latency_ms=row.latency_ms))
        return run_row(
            "batch", batch.name, batch.name, batch.mtime_ms, members, None, source=batch.source
        )

    def _program_run(self, batch: _Batch, record: Mapping[str, Any]) -> RunRow:
        members = []
        for body in record.get("responses") or []:
            error = error_of({"body": body})
            code = None if error is None else str(error.get("code"))
            members.append(Member(OK if error is None else "error", code))
        row = run_row(
            "program", record["id"], batch.name, batch.mtime_ms, members, None, True, batch.source
        )
        latency = as_int((record.get("metrics") or {}).get("latency_ms"))
        return row if latency is None else _with_elapsed(row, latency)

    def batch_rows(self, batch: str) -> BatchRows | None:
        self._fresh()
        found = self._batches.get(batch)
        if found is None:
            return None
        rows = tuple(
            record_row(spec_id, self._records[spec_id][0], self._records[spec_id][2])
            for spec_id in found.ids
        )
        return BatchRows(batch, self._run(found), rows)

    def batch_page(self, batch: str, query: BatchQuery) -> BatchPage | None:
        found = self.batch_rows(batch)
        return None if found is None else batch_page(found, query)

    def session(self, spec_id: str, batch: str | None = None) -> SessionFacts | None:
        self._fresh()
        found = self._records.get(spec_id)
        if found is None:
            return self._chat(spec_id)
        record, batch, attempt = found
        program = record.get("kind") == "program"
        chats: tuple[ChatFacts, ...] = ()
        if program:
            chats = tuple(
                ChatFacts(keys.chat_spec_id(spec_id, n), "done", body=body)
                for n, body in enumerate(record.get("responses") or [])
                if isinstance(body, dict)
            )
        return SessionFacts(
            spec_id=spec_id,
            state="done",
            batch=batch,
            attempt=attempt,
            record=record,
            program=program,
            chats=chats,
            source=self._batches[batch].source,
        )

    def _chat(self, chat_id: str) -> SessionFacts | None:
        """A program run's chat, from the body its run's line keeps."""
        chat = keys.chat_of(chat_id)
        found = self._records.get(chat[0]) if chat else None
        responses = (found[0].get("responses") or []) if found else []
        if chat is None or found is None or chat[1] >= len(responses):
            return None
        return SessionFacts(
            spec_id=chat_id,
            state="done",
            batch=found[1],
            record=chat_record(chat_id, responses[chat[1]]),
            source=self._batches[found[1]].source,
        )

    def trace(self, spec_id: str, batch: str | None = None) -> Iterator[dict[str, Any]] | None:
        return None  # a results file keeps no trace events

    def close(self) -> None:
        pass


def _with_elapsed(row: RunRow, latency_ms: int) -> RunRow:
    return replace(row, elapsed_s=latency_ms / 1000)
