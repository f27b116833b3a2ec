"""What one tool call produced, and the tool message the model reads of it.

The result envelope (`{ok, data, error, metrics}`) is how spec sessions answer the
model by default; SPEAR programs see the raw output (`flags.tool_result_envelope`). Both are
rendered from the same stored outcome, so the flag changes nothing that is stored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from schemas import json_codec
from worker.codecs.openai_chat import tool_message_content
from worker.errors import ToolError
from worker.session.tool_logs import ToolLogLine


@dataclass(frozen=True)
class ToolFailure:
    """Why a call failed: its error class (worker.errors, a ToolError code) and message."""

    code: str
    message: str


@dataclass(frozen=True)
class ToolOutcome:
    """One tool call's outcome: its output text or its failure, with its metrics.

    `ran` says whether a tool was executed for it (what max_total_tool_calls counts): a call
    answered without running anything (unknown tool, invalid arguments, denied) did not."""

    ok: bool
    output: str | None = None  # the tool's text, when ok
    failure: ToolFailure | None = None  # when not ok
    latency_ms: int = 0
    retries: int = 0
    ran: bool = False
    fallback: str | None = None  # the tool that answered instead, after the call failed
    summary: str | None = None  # a long output as a model summed it up (limits.compress)
    logs: tuple[ToolLogLine, ...] = ()  # what the tool wrote for its user (tool_logs.py)
    dropped_logs: int = 0  # its lines past the bound, counted only

    @classmethod
    def success(cls, output: str, **metrics: Any) -> ToolOutcome:
        return cls(ok=True, output=output, ran=True, **metrics)

    @classmethod
    def error(cls, error: ToolError, **metrics: Any) -> ToolOutcome:
        """A failed call; `ran` comes from the error unless the metrics say otherwise."""
        metrics.setdefault("ran", error.ran)
        return cls(ok=False, failure=ToolFailure(error.code, error.message), **metrics)

    @property
    def code(self) -> str | None:
        return None if self.failure is None else self.failure.code

    @property
    def output_bytes(self) -> int:
        return len((self.output or "").encode())

    # the tool message --------------------------------------------------------------------

    def message(self, envelope: bool, excerpt_over: int | None = None, ref: str = "") -> str:
        """The tool message content: the envelope, or the raw output (an error body when
        the call failed, as before envelopes). In the envelope, an output over
        `excerpt_over` bytes is a head-and-tail excerpt that says it was cut, how long the
        whole is and how to ask for it (`ref`, the call id: the store keeps it whole)."""
        if envelope:
            body = self.envelope()
            size = self.output_bytes
            if excerpt_over is not None and size > excerpt_over:
                body["data"] = self.summary or excerpt(self.output or "", excerpt_over)
                body.update(truncated=True, bytes=size, ref=ref)
                if self.summary is not None:
                    body["summarized"] = True
            return json_codec.dumps(body).decode()
        if self.failure is not None:
            error = {"code": self.failure.code, "message": self.failure.message}
            return tool_message_content({"error": error})
        return tool_message_content(self.output)

    def envelope(self) -> dict[str, Any]:
        metrics: dict[str, Any] = {"latency_ms": self.latency_ms, "retries": self.retries}
        if self.fallback is not None:
            metrics["fallback"] = self.fallback
        error = None
        if self.failure is not None:
            error = {"code": self.failure.code, "message": self.failure.message}
        return {"ok": self.ok, "data": _data(self.output), "error": error, "metrics": metrics}

    # stored form ---------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "ok": self.ok,
            "output": self.output,
            "latency_ms": self.latency_ms,
            "retries": self.retries,
            "ran": self.ran,
        }
        if self.failure is not None:
            out["error"] = {"code": self.failure.code, "message": self.failure.message}
        if self.fallback is not None:
            out["fallback"] = self.fallback
        if self.summary is not None:
            out["summary"] = self.summary
        if self.logs:
            out["logs"] = [line.to_json() for line in self.logs]
        if self.dropped_logs:
            out["dropped_logs"] = self.dropped_logs
        return out

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> ToolOutcome:
        if "content" in raw:  # stored before envelopes: the message text itself
            return _legacy(str(raw["content"]), bool(raw["ok"]))
        error = raw.get("error")
        return cls(
            ok=bool(raw["ok"]),
            output=raw.get("output"),
            failure=None
            if error is None
            else ToolFailure(str(error["code"]), str(error["message"])),
            latency_ms=int(raw.get("latency_ms", 0)),
            retries=int(raw.get("retries", 0)),
            ran=bool(raw.get("ran", False)),
            fallback=raw.get("fallback"),
            summary=raw.get("summary"),
            logs=tuple(ToolLogLine.from_json(line) for line in raw.get("logs") or ()),
            dropped_logs=int(raw.get("dropped_logs", 0)),
        )


EXCERPT_GAP = "\n[... {omitted} bytes omitted ...]\n"


def excerpt(text: str, budget_bytes: int) -> str:
    """The head (two thirds) and the tail (one third) of `text` in about `budget_bytes` of
    UTF-8, cut on character boundaries, with the size of what was left out between."""
    raw = text.encode()
    head_end = budget_bytes * 2 // 3
    tail_start = len(raw) - (budget_bytes - head_end)
    head = raw[:head_end].decode(errors="ignore")
    tail = raw[tail_start:].decode(errors="ignore")
    omitted = len(raw) - len(head.encode()) - len(tail.encode())
    return head + EXCERPT_GAP.format(omitted=omitted) + tail


def _data(output: str | None) -> Any:
    """The envelope's `data`: the output parsed when it is JSON, else the text."""
    if output is None:
        return None
    try:
        return json_codec.loads(output)
    except ValueError:
        return output


def _legacy(content: str, ok: bool) -> ToolOutcome:
    if ok:
        return ToolOutcome(ok=True, output=content, ran=True)
    try:
        error = json_codec.loads(content)["error"]
        failure = ToolFailure(str(error["code"]), str(error["message"]))
    except (ValueError, KeyError, TypeError):
        failure = ToolFailure("RUNTIME_ERROR", content)
    return ToolOutcome(ok=False, failure=failure, ran=True)
