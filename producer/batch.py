"""The Python API's handle on a submitted batch (`Client.submit` returns one): its results as
they finish, its status, cancelling it. Sessions and program runs alike.

    from producer.client import Client

    client = Client("redis://127.0.0.1:6379/0")
    batch = client.submit([{"id": "q/1", "messages": [{"role": "user", "content": "Hi"}]}])
    for result in batch.results(timeout_s=60):
        print(result.id, result.status, result.error_code)
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from producer.batches import Batches, BatchSummary
from schemas.bodies import OK, dump_text, outcome_code

if TYPE_CHECKING:
    from producer.submitting import Submission
    from producer.waiting import Waiting

PROGRAM_FIELDS = ("exit_code", "stdout", "stderr", "logs", "responses", "metrics")


def result_line(record: dict[str, Any]) -> dict[str, Any]:
    """A finished session's record as a results file shows it."""
    body = record.get("body") or {}
    if record.get("kind") == "program":
        line = {"id": record["id"], "kind": "program", "status": record["status"]}
        line.update({k: record.get(k) for k in PROGRAM_FIELDS})
        line["error"] = body.get("error")
        return line
    line = {
        "id": record["id"],
        "status": record["status"],
        "response": body,
        "transcript": record.get("transcript", []),
        "metrics": record.get("metrics", {}),
        "error": body.get("error"),
    }
    if record.get("metadata"):  # the spec's metadata, given back
        line["metadata"] = record["metadata"]
    if record.get("tool_logs"):  # what its tools wrote, each line marked with its call
        line["tool_logs"] = record["tool_logs"]
    return line


def batch_line(record: dict[str, Any], batch: str, attempt: int) -> str:
    """A results file's line: the session's result, its batch and which attempt of its id."""
    return dump_text({**result_line(record), "batch": batch, "attempt": attempt}) + "\n"


@dataclass(frozen=True)
class Result:
    """One finished session (or program run) of a batch."""

    id: str  # the spec's id
    status: str  # "ok" or "error"
    batch: str
    attempt: int  # which attempt of its id (1, then one more per --rerun / retry)
    record: dict[str, Any]  # the whole record: body, transcript, metrics (or a program's output)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def body(self) -> dict[str, Any]:
        """The response fd's body: the last chat.completion, or {"error": {...}}."""
        body: dict[str, Any] = self.record.get("body") or {}
        return body

    @property
    def error_code(self) -> str | None:
        code = outcome_code(self.body)
        return None if code == OK else code

    @property
    def text(self) -> str | None:
        """The final answer's text, None for an error or a program run."""
        choices = self.body.get("choices") or [{}]
        content = (choices[0].get("message") or {}).get("content")
        return content if isinstance(content, str) else None

    def line(self) -> str:
        """The JSON line `cchatq submit` writes for it."""
        return batch_line(self.record, self.batch, self.attempt)


class Batch:
    """A submitted batch. Its sessions run on the fleet whether or not anyone waits."""

    def __init__(self, client: Waiting, submission: Submission) -> None:
        self.client = client
        self.submission = submission
        self._waited = False

    @property
    def id(self) -> str:
        return self.submission.batch

    def __len__(self) -> int:
        return len(self.submission.order)

    @property
    def enqueued(self) -> int:
        """Sessions this submit started; the others were submitted before (same id and spec)."""
        return len(self.submission.new)

    def results(self, timeout_s: float | None = None) -> Iterator[Result]:
        """Each session's result as it finishes (already finished ones first). Raises
        TimeoutError after `timeout_s` with sessions still running; they keep running, and
        another call (or `cchatq batch results ID`) collects them."""
        sub = self.submission
        again, self._waited = self._waited, True  # an earlier wait took entries of the done list
        for sk, record in self.client.wait(sub, timeout_s=timeout_s, look_first=again):
            status = str(record.get("status"))
            yield Result(sub.ids[sk], status, sub.batch, sub.runs[sk].attempt, record)

    def status(self) -> BatchSummary:
        """Counts of its sessions by state (queued, running, done, gone) and outcome."""
        summary = Batches(self.client).summary(self.id)
        assert summary is not None  # submitted by us, so named in Redis for its TTL
        return summary

    def cancel(self) -> int:
        """Ask every session of the batch still running to stop: how many were asked."""
        return Batches(self.client).cancel(self.id)
