"""OpenAI Batch output and error lines out (`--format openai`), and a batch's results files in
either format; the request lines in are producer/openai_batch.py's.

The format followed, as OpenAI's API reference documents the request output object of the Batch
API (https://platform.openai.com/docs/api-reference/batch):

- output ("the per-line object of the batch output and error files"): `{"id": "batch_req_...",
  "custom_id", "response": {"status_code", "request_id", "body"} | null, "error": {"code",
  "message"} | null}`. Successful requests go to the output file (status_code 200, `body` a
  `chat.completion`), failed ones to a separate error file (the batch's `error_file_id`). A
  request whose model call was answered with an HTTP error has that status and the error as
  `response.body` (`{"error": {"message", "type", "param", "code"}}`) and `error: null`, as
  OpenAI's error files do (openai/openai-openapi issue 302); `error` is set, with `response:
  null`, for the failures that are no HTTP answer (the reference: "for requests that failed with
  a non-HTTP error").
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO

from producer.batch import result_line
from producer.openai_batch import CUSTOM_ID_KEY
from schemas.bodies import OK

BATCH_REQ_PREFIX = "batch_req_"
UPSTREAM_STATUS = re.compile(r"HTTP (\d{3}): (.*)\Z", re.DOTALL)  # worker/edges/provider_http.py
PROVIDER_CODES = ("provider_error", "provider_unavailable")
EXTENSION_KEY = "_cchatq"  # cchatq's own fields in an output line's body (as `_spear` is)


def request_line_id(sk: str) -> str:
    """`batch_req_...`: stable for a session's run (derived from its session key)."""
    return BATCH_REQ_PREFIX + hashlib.sha256(f"batch_req:{sk}".encode()).hexdigest()[:32]


def program_body(record: dict[str, Any]) -> dict[str, Any]:
    """A program run's `response.body`: its cchatq result line's fields (OpenAI defines none)."""
    return {k: v for k, v in result_line(record).items() if k not in ("id", "kind", "error")}


def output_line(
    sk: str, record: dict[str, Any], transcript: bool = False
) -> tuple[bool, dict[str, Any]]:
    """(failed, the session's OpenAI Batch output line). A chat session's `response.body` is its
    last reply without cchatq's `_spear`, its `usage` the session's total over all its rounds
    (what a cost sum needs), and cchatq's own fields under EXTENSION_KEY: the last round's
    usage, the rounds, and with `transcript` the rounds' messages and tool calls. A program
    run's body is `program_body(record)`. `request_id` is the provider's id of the reply,
    else the session key."""
    body = record.get("body") or {}
    custom_id = (record.get("metadata") or {}).get(CUSTOM_ID_KEY, record["id"])
    head = {"id": request_line_id(sk), "custom_id": custom_id}
    if record.get("status") == OK:
        if record.get("kind") == "program":
            answer = program_body(record)
        else:
            answer = {k: v for k, v in body.items() if k != "_spear"}
            answer.update(_session_usage(record, transcript))
        reply_id = body.get("id")
        request_id = reply_id if isinstance(reply_id, str) and reply_id else sk
        response = {"status_code": 200, "request_id": request_id, "body": answer}
        return False, {**head, "response": response, "error": None}
    said_error = body.get("error")
    error: dict[str, Any] = said_error if isinstance(said_error, dict) else {}
    code = str(error.get("code") or "internal_error")
    message = str(error.get("message") or code)
    upstream = UPSTREAM_STATUS.match(message) if code in PROVIDER_CODES else None
    if upstream is None:  # no HTTP answer: a limit, a cancel, a failed step, a timeout, ...
        return True, {**head, "response": None, "error": {"code": code, "message": message}}
    said = {"message": upstream.group(2), "type": code, "param": None, "code": code}
    response = {"status_code": int(upstream.group(1)), "request_id": sk, "body": {"error": said}}
    return True, {**head, "response": response, "error": None}


def _session_usage(record: dict[str, Any], transcript: bool) -> dict[str, Any]:
    """A session's body fields for its output line: `usage` summed over its rounds (from its
    record's metrics; the reply's own when metrics were off) and EXTENSION_KEY."""
    body = record.get("body") or {}
    metrics = record.get("metrics") or {}
    extension: dict[str, Any] = {"round_usage": body.get("usage")}
    if "iterations" in metrics:
        extension["rounds"] = metrics["iterations"]
    if transcript:
        extension["transcript"] = record.get("transcript", [])
    fields: dict[str, Any] = {EXTENSION_KEY: extension}
    if metrics.get("usage"):
        fields["usage"] = metrics["usage"]
    return fields


def errors_path(out: Path) -> Path:
    """The default errors file beside `out`: results.jsonl -> results.errors.jsonl."""
    return out.with_name(out.name.removesuffix(".jsonl") + ".errors.jsonl")


# (sk, record, batch, attempt) -> (to the errors file, the line with its newline)
RecordLine = Callable[[str, dict[str, Any], str, int], tuple[bool, str]]
Row = tuple[str, dict[str, Any], str, int]  # (sk, record, batch, attempt)


def openai_lines(transcript: bool = False) -> RecordLine:
    """Output lines; `transcript`: each with its rounds' messages and tool calls."""

    def line(sk: str, record: dict[str, Any], batch: str, attempt: int) -> tuple[bool, str]:
        failed, obj = output_line(sk, record, transcript)
        return failed, json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n"

    return line


class ResultFiles:
    """A batch's results files: one (cchatq's format), or OpenAI's two (successful requests in
    `out`, failed ones in `errors`). Each line is written (and flushed) as its session finishes,
    so a producer that dies keeps what it had; `rewrite` writes them again in input order."""

    def __init__(self, out: Path, line: RecordLine, errors: Path | None = None) -> None:
        self.out, self.line, self.errors = out, line, errors
        self._open: list[BinaryIO] = []
        # sk -> (file, offset, length) of its line as written: `reorder` copies the lines
        # from there, so no record is kept until the end
        self._where: dict[str, tuple[int, int, int]] = {}

    @property
    def paths(self) -> list[Path]:
        return [self.out] if self.errors is None else [self.out, self.errors]

    def __str__(self) -> str:
        return str(self.out) + ("" if self.errors is None else f" (errors: {self.errors})")

    def __enter__(self) -> ResultFiles:
        for path in self.paths:
            self._open.append(path.open("wb"))
        self._where.clear()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for fh in self._open:
            fh.close()
        self._open = []

    def write(self, sk: str, record: dict[str, Any], batch: str, attempt: int) -> None:
        failed, text = self.line(sk, record, batch, attempt)
        which = 1 if failed and self.errors is not None else 0
        fh, data = self._open[which], text.encode()
        self._where[sk] = (which, fh.tell(), len(data))
        fh.write(data)
        fh.flush()

    def reorder(self, sks: Iterable[str]) -> None:
        """Every file again, the lines written (`write`) in the order of `sks`, copied from
        where they were written (each file replaced whole at the end); a session without a
        line is left out."""
        sorting = [path.with_name(path.name + ".sorting") for path in self.paths]
        written = [path.open("rb") for path in self.paths]
        handles = [path.open("wb") for path in sorting]
        try:
            for sk in sks:
                found = self._where.get(sk)
                if found is None:
                    continue
                which, offset, length = found
                written[which].seek(offset)
                handles[which].write(written[which].read(length))
        finally:
            for fh in (*written, *handles):
                fh.close()
        for path, final in zip(sorting, self.paths, strict=True):
            path.replace(final)

    def rewrite(self, rows: Iterable[Row]) -> None:
        """Every file again, its lines in the order of `rows` (each replaced whole at the end)."""
        sorting = [path.with_name(path.name + ".sorting") for path in self.paths]
        handles = [path.open("w") for path in sorting]
        try:
            for sk, record, batch, attempt in rows:
                failed, text = self.line(sk, record, batch, attempt)
                handles[1 if failed and self.errors is not None else 0].write(text)
        finally:
            for fh in handles:
                fh.close()
        for path, final in zip(sorting, self.paths, strict=True):
            path.replace(final)
