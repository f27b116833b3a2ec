"""OpenTelemetry GenAI spans of a session (semantic conventions v1.41), built from the trace
events a step committed: plain values (ids, names, times, attributes) that
worker.edges.otel_spans turns into SDK spans. Nothing here imports opentelemetry.

One trace per session run, its id derived from the session key (a program run's chats sit in
the run's trace). Every span id is derived from the session key, what the span is and the
step's delivery, so a redelivered step's spans land in the same trace beside the first
delivery's, each with its `cchatq.attempt`, and a child names its parent without asking
anyone: the session's `invoke_agent` span, exported last when its session.finished is
committed, is every other span's parent.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any, Literal
from urllib.parse import urlsplit

from schemas import keys
from schemas.protocols import PROTOCOLS
from schemas.spec_types import ProgramSpec, SessionSpec, Spec
from worker.config import BackendConfig
from worker.session.trace import TraceEvent

AttrValue = str | bool | int | float | tuple[str, ...]
SpanKind = Literal["internal", "client"]
AGENT_NAME = "cchatq"  # the agent a spec session is; a program run is its program
MODEL_CALL_ENDED = ("model.call.finished", "model.call.failed")
TOOL_CALL_ENDED = ("tool.call.finished", "tool.call.failed")
DEFAULT_PORTS = {"https": 443, "http": 80}


@dataclass(frozen=True)
class SpanEventValue:
    name: str
    ts_ms: int
    attributes: Mapping[str, AttrValue] = field(default_factory=dict)


@dataclass(frozen=True)
class SpanValue:
    """One finished span: ids as integers (128-bit trace, 64-bit span), times in ms since the
    epoch, and `error` (its error.type) for a span whose status is ERROR."""

    name: str
    kind: SpanKind
    trace_id: int
    span_id: int
    parent_id: int | None
    start_ms: int
    end_ms: int
    attributes: Mapping[str, AttrValue]
    events: tuple[SpanEventValue, ...] = ()
    error: str | None = None


@dataclass(frozen=True)
class SpanSession:
    """The session a step's spans belong to: its key, its spec (None when it could not be read)
    and the batch it was submitted in ("" when its stored spec does not say)."""

    sk: str
    spec: Spec | None
    batch: str = ""

    @property
    def run_sk(self) -> str | None:
        """The program run whose chat this session is (its trace holds it), if one is."""
        return keys.run_of_batch(self.batch)

    @property
    def agent(self) -> str:
        if isinstance(self.spec, ProgramSpec):
            module = self.spec.program.module.rsplit("/", 1)[-1]
            return module.removesuffix(".wasm") or AGENT_NAME
        return AGENT_NAME


def _digest(text: str, size: int) -> int:
    # an id of all zeros is invalid in OpenTelemetry: never drawn in practice, mapped to 1
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:size], "big") or 1


def trace_id(sk: str) -> int:
    """The trace of a session run (for a program run's chat: pass the run's key)."""
    return _digest(f"trace {sk}", 16)


def span_id(sk: str, what: str, delivery: int = 0) -> int:
    """The span of `what` in session `sk`, made by its step's `delivery`."""
    return _digest(f"{sk} {what} {delivery}", 8)


def agent_span_id(sk: str) -> int:
    """A session's invoke_agent span: the parent of its other spans."""
    return span_id(sk, "invoke_agent")


@dataclass(frozen=True)
class _Step:
    """What every span of one step shares: its ids and where it ran."""

    session: SpanSession
    step: str
    delivery: int
    worker: str | None
    queue_ms: int | None
    backends: Mapping[str, BackendConfig]
    content: bool

    @property
    def trace(self) -> int:
        return trace_id(self.session.run_sk or self.session.sk)

    def ids(self, spec_id: str) -> dict[str, AttrValue]:
        attrs: dict[str, AttrValue] = {"cchatq.session.id": spec_id}
        if self.session.batch:
            attrs["cchatq.batch.id"] = self.session.batch
        attrs["cchatq.step"] = self.step
        attrs["cchatq.attempt"] = self.delivery
        if self.worker:
            attrs["cchatq.worker"] = self.worker
        return attrs

    def span(
        self, name: str, kind: SpanKind, what: str, start_ms: int, end_ms: int, **rest: Any
    ) -> SpanValue:
        sk = self.session.sk
        return SpanValue(
            name=name,
            kind=kind,
            trace_id=self.trace,
            span_id=span_id(sk, what, self.delivery),
            parent_id=agent_span_id(sk),
            start_ms=start_ms,
            end_ms=max(end_ms, start_ms),
            **rest,
        )


def step_spans(
    session: SpanSession,
    step: str,
    events: Sequence[TraceEvent],
    backends: Mapping[str, BackendConfig],
    content: bool = False,
) -> list[SpanValue]:
    """The spans of the events one step committed (or of a rate_limit.waited written as its
    step was put off): a chat span per model call, an execute_tool span per tool call, a
    rate_limit wait span per wait, and the session's invoke_agent span, last, when the
    session finished. The step's own fields (delivery, worker, queue wait) ride its last
    event; the queue wait becomes a `cchatq.queue_wait` event of its first chat or tool span.
    Content attributes only with `content`, and only from events that carry it."""
    if not events:
        return []
    last = events[-1]
    at = _Step(session, step, last.delivery or 1, last.worker, last.queue_ms, backends, content)
    retried: dict[str | None, list[TraceEvent]] = {}
    spans: list[SpanValue] = []
    first_call: int | None = None  # the step's first chat or tool span: its queue wait's
    for e in events:
        if e.event in MODEL_CALL_ENDED or e.event in TOOL_CALL_ENDED:
            first_call = len(spans) if first_call is None else first_call
            if e.event in MODEL_CALL_ENDED:
                spans.append(_chat(at, e))
            else:
                spans.append(_tool(at, e, retried.pop(e.call_id, [])))
        elif e.event == "tool.call.retried":
            retried.setdefault(e.call_id, []).append(e)
        elif e.event == "rate_limit.waited":
            spans.append(_rate_limit_wait(at, e))
        elif e.event == "session.finished":  # the step's last event: its span goes last
            first_call = len(spans) if first_call is None else first_call
            spans.append(_invoke_agent(session, e))
    if at.queue_ms is not None and first_call is not None:
        spans[first_call] = _queue_waited(spans[first_call], last, at.queue_ms)
    return spans


def _queue_waited(span: SpanValue, last: TraceEvent, queue_ms: int) -> SpanValue:
    """The span with a `cchatq.queue_wait` event at the moment its step's body began."""
    began = last.ts_ms - (last.step_ms or 0)
    waited = SpanEventValue("cchatq.queue_wait", min(began, span.end_ms), {"wait_ms": queue_ms})
    return replace(span, events=(waited, *span.events))


def _chat(at: _Step, e: TraceEvent) -> SpanValue:
    attrs: dict[str, AttrValue] = {"gen_ai.operation.name": "chat"}
    backend = at.backends.get(e.backend or "")
    if backend is not None:
        attrs.update(_server(backend.protocol, backend.base_url))
    _put(attrs, "gen_ai.request.model", e.model)
    _put(attrs, "gen_ai.response.model", e.response_model)
    _put(attrs, "gen_ai.response.id", e.request_id)
    _put(attrs, "gen_ai.usage.input_tokens", e.tokens_in)
    _put(attrs, "gen_ai.usage.output_tokens", e.tokens_out)
    if e.finish_reason:
        attrs["gen_ai.response.finish_reasons"] = (e.finish_reason,)
    _put(attrs, "error.type", e.error)
    _put(attrs, "cchatq.backend", e.backend)
    attrs.update(at.ids(e.session))
    if at.content and e.content is not None:
        attrs["gen_ai.input.messages"] = _json(genai_messages(e.content.get("input") or ()))
        output = e.content.get("output")
        if output:
            attrs["gen_ai.output.messages"] = _json(
                genai_messages([output], e.finish_reason or "stop")
            )
    start = e.ts_ms - (e.latency_ms or 0)
    name = f"chat {e.model}" if e.model else "chat"
    return at.span(
        name, "client", f"chat r{e.round}", start, e.ts_ms, attributes=attrs, error=e.error
    )


def _tool(at: _Step, e: TraceEvent, retried: Iterable[TraceEvent]) -> SpanValue:
    name = e.tool or "?"
    attrs: dict[str, AttrValue] = {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": name,
        "gen_ai.tool.type": _tool_type(at.session.spec, name),
    }
    _put(attrs, "gen_ai.tool.call.id", e.call_id)
    _put(attrs, "error.type", e.error)
    if e.attempt:
        attrs["cchatq.tool.retries"] = e.attempt
    attrs.update(at.ids(e.session))
    if at.content and e.content is not None:
        _put(attrs, "gen_ai.tool.call.arguments", e.content.get("arguments"))
        _put(attrs, "gen_ai.tool.call.result", e.content.get("result"))
    events = tuple(
        SpanEventValue(
            "cchatq.tool.retried",
            r.ts_ms,
            {k: v for k, v in (("attempt", r.attempt), ("error.type", r.error)) if v is not None},
        )
        for r in retried
    )
    start = e.ts_ms - (e.latency_ms or 0)
    what = f"execute_tool r{e.round} {e.call_id}"
    return at.span(
        f"execute_tool {name}", "internal", what, start, e.ts_ms,
        attributes=attrs, events=events, error=e.error,
    )  # fmt: skip


def _rate_limit_wait(at: _Step, e: TraceEvent) -> SpanValue:
    """The time a step was put off for its backend's rate limit, from when it was put off."""
    attrs: dict[str, AttrValue] = {"cchatq.rate_limit.wait_ms": e.wait_ms or 0}
    _put(attrs, "cchatq.rate_limit.reason", e.reason)
    _put(attrs, "cchatq.backend", e.backend)
    attrs.update(at.ids(e.session))
    end = e.ts_ms + (e.wait_ms or 0)
    what = f"rate_limit {at.step} {e.ts_ms}"  # a step may be put off many times per delivery
    return at.span("rate_limit wait", "internal", what, e.ts_ms, end, attributes=attrs)


def _invoke_agent(session: SpanSession, e: TraceEvent) -> SpanValue:
    """The session from its submit (session.finished's latency counts from it) to its end."""
    agent = session.agent
    attrs: dict[str, AttrValue] = {
        "gen_ai.operation.name": "invoke_agent",
        "gen_ai.agent.name": agent,
        "cchatq.session.id": e.session,
    }
    if session.batch:
        attrs["cchatq.batch.id"] = session.batch
    attrs["cchatq.outcome"] = e.error or "ok"
    _put(attrs, "error.type", e.error)
    run = session.run_sk
    return SpanValue(
        name=f"invoke_agent {agent}",
        kind="internal",
        trace_id=trace_id(run or session.sk),
        span_id=agent_span_id(session.sk),
        parent_id=agent_span_id(run) if run else None,
        start_ms=e.ts_ms - (e.latency_ms or 0),
        end_ms=e.ts_ms,
        attributes=attrs,
        error=e.error,
    )


def _tool_type(spec: Spec | None, name: str) -> str:
    """function, or extension for an MCP server's tool."""
    tool = spec.tool(name) if isinstance(spec, SessionSpec) else None
    return "extension" if tool is not None and tool.mcp is not None else "function"


@lru_cache(maxsize=256)
def _server(protocol: str, base_url: str) -> tuple[tuple[str, AttrValue], ...]:
    """gen_ai.provider.name (the protocol's), server.address and server.port of a backend."""
    out: list[tuple[str, AttrValue]] = []
    declared = PROTOCOLS.get(protocol)
    if declared is not None:
        out.append(("gen_ai.provider.name", declared.genai_provider))
    try:
        url = urlsplit(base_url)
        port = url.port or DEFAULT_PORTS.get(url.scheme)
    except ValueError:  # a base URL the HTTP client would refuse too
        return tuple(out)
    if url.hostname:
        out.append(("server.address", url.hostname))
    if port:
        out.append(("server.port", port))
    return tuple(out)


def genai_messages(
    messages: Iterable[Mapping[str, Any]], finish_reason: str | None = None
) -> list[dict[str, Any]]:
    """Chat-completion messages in the GenAI conventions' shape: a role and its parts (text,
    tool calls, tool call responses); with `finish_reason`, output messages."""
    out: list[dict[str, Any]] = []
    for message in messages:
        role, content = message.get("role"), message.get("content")
        parts: list[dict[str, Any]] = []
        if role == "tool":
            response = {"type": "tool_call_response", "response": content}
            parts.append({**response, "id": message.get("tool_call_id")})
        elif isinstance(content, str):
            if content:
                parts.append({"type": "text", "content": content})
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and part.get("type") == "text":
                    parts.append({"type": "text", "content": part.get("text")})
                elif isinstance(part, dict):
                    parts.append({"type": str(part.get("type"))})
        for call in message.get("tool_calls") or ():
            function = call.get("function") or {}
            parts.append({
                "type": "tool_call", "id": call.get("id"), "name": function.get("name"),
                "arguments": function.get("arguments"),
            })  # fmt: skip
        shaped: dict[str, Any] = {"role": role, "parts": parts}
        if finish_reason is not None:
            shaped["finish_reason"] = finish_reason
        out.append(shaped)
    return out


def _put(attrs: dict[str, AttrValue], key: str, value: AttrValue | None) -> None:
    if value is not None:
        attrs[key] = value


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
