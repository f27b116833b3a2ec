"""A batch page's rows: a session's row from its record (or its state while it runs), and the
page's filter, sort and paging over every row of the batch."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from producer.viewer.model import (
    ERROR,
    GONE,
    OK,
    PAGE_ROWS,
    QUEUED,
    RUNNING,
    SORTS,
    STATUSES,
    BatchPage,
    BatchQuery,
    BatchRows,
    SessionRow,
)

PREVIEW_CHARS = 160


def as_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def error_of(record: Mapping[str, Any]) -> dict[str, Any] | None:
    """A record's (or results line's) error object, None when it ended ok."""
    body = record.get("body")
    if body is None:
        body = record.get("response")
    error = (body or {}).get("error") if isinstance(body, Mapping) else None
    if error is None:
        error = record.get("error")
    return error if isinstance(error, dict) else None


def answer_text(body: Mapping[str, Any] | None) -> str | None:
    """A chat.completion body's answer text, None when it holds none."""
    choices = (body or {}).get("choices") or [{}]
    first = choices[0] if isinstance(choices, list) and choices else {}
    message = first.get("message") if isinstance(first, Mapping) else None
    content = (message or {}).get("content") if isinstance(message, Mapping) else None
    return content if isinstance(content, str) else None


def preview(text: str) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= PREVIEW_CHARS else flat[: PREVIEW_CHARS - 1] + "…"


def tools_called(transcript: Sequence[Mapping[str, Any]]) -> tuple[str, ...]:
    names: dict[str, None] = {}
    for message in transcript:
        for call in message.get("tool_calls") or []:
            name = (call.get("function") or {}).get("name")
            if isinstance(name, str):
                names[name] = None
    return tuple(names)


def usage_tokens(usage: Mapping[str, Any]) -> int | None:
    total = as_int(usage.get("total_tokens"))
    if total is not None:
        return total
    parts = [as_int(usage.get(k)) for k in ("prompt_tokens", "completion_tokens")]
    known = [p for p in parts if p is not None]
    return sum(known) if known else None


def record_row(spec_id: str, record: Mapping[str, Any], attempt: int = 1) -> SessionRow:
    """The row of a session (or program run) that ended, from its record or results line."""
    metrics = record.get("metrics") or {}
    error = error_of(record)
    status = OK if record.get("status") == OK and error is None else ERROR
    code = None if status == OK else str((error or {}).get("code") or "error")
    if record.get("kind") == "program":
        responses = record.get("responses") or []
        tokens = [usage_tokens(b.get("usage") or {}) for b in responses if isinstance(b, dict)]
        known = [t for t in tokens if t is not None]
        text = record.get("stdout") or ""
        return SessionRow(
            spec_id=spec_id,
            kind="program",
            status=status,
            code=code,
            latency_ms=as_int(metrics.get("latency_ms")),
            tokens=sum(known) if known else None,
            rounds=as_int(metrics.get("chats")),
            attempt=attempt,
            preview=preview(str((error or {}).get("message") or text)),
        )
    transcript = record.get("transcript") or []
    body = record.get("body") if "body" in record else record.get("response")
    text = answer_text(body if isinstance(body, Mapping) else None)
    return SessionRow(
        spec_id=spec_id,
        kind="session",
        status=status,
        code=code,
        latency_ms=as_int(metrics.get("latency_ms")),
        tokens=usage_tokens(metrics.get("usage") or {}),
        rounds=as_int(metrics.get("iterations")),
        tools=tools_called(transcript),
        tool_calls=as_int(metrics.get("tool_calls")) or 0,
        tool_failures=as_int(metrics.get("tool_failures")) or 0,
        attempt=attempt,
        preview=preview(str((error or {}).get("message") or text or "")),
    )


def pending_row(spec_id: str, state: str | None, program: bool, attempt: int = 1) -> SessionRow:
    """The row of a session not ended: queued, running (its meta's state), or gone."""
    status = GONE if state is None else QUEUED if state == QUEUED else RUNNING
    return SessionRow(
        spec_id=spec_id,
        kind="program" if program else "session",
        status=status,
        attempt=attempt,
        state=state or "expired",
    )


def parse_query(params: Mapping[str, str]) -> BatchQuery:
    """The batch page's query from its URL's parameters; unknown values are dropped."""
    status = params.get("status", "")
    sort = params.get("sort", "")
    try:
        page = max(1, int(params.get("page", "1")))
    except ValueError:
        page = 1
    return BatchQuery(
        status=status if status in STATUSES else "",
        code=params.get("code", "").strip(),
        tool=params.get("tool", "").strip(),
        q=params.get("q", "").strip(),
        sort=sort if sort in SORTS else "",
        page=page,
    )


def matches(row: SessionRow, query: BatchQuery) -> bool:
    if query.status and row.status != query.status:
        return False
    if query.code and row.code != query.code:
        return False
    if query.tool and query.tool not in row.tools:
        return False
    return not query.q or query.q.lower() in row.spec_id.lower()


def sort_key(sort: str) -> Any:
    """Largest first; rows without the value last."""
    field = "latency_ms" if sort == "latency" else "tokens"

    def key(row: SessionRow) -> tuple[bool, int]:
        value = getattr(row, field)
        return (value is None, -(value or 0))

    return key


def batch_page(found: BatchRows, query: BatchQuery, page_rows: int = PAGE_ROWS) -> BatchPage:
    """One page of a batch's sessions under `query`, with the batch's counts."""
    outcomes: Counter[str] = Counter()
    states: Counter[str] = Counter()
    codes: dict[str, None] = {}
    tools: dict[str, None] = {}
    for row in found.rows:
        if row.status == OK:
            outcomes[OK] += 1
        elif row.status == ERROR:
            outcomes[row.code or ERROR] += 1
            codes[row.code or ERROR] = None
        else:
            states[row.status] += 1
        for tool in row.tools:
            tools[tool] = None
    kept = [row for row in found.rows if matches(row, query)]
    if query.sort:
        kept.sort(key=sort_key(query.sort))
    pages = max(1, -(-len(kept) // page_rows))
    page = min(query.page, pages)
    if page != query.page:
        query = replace(query, page=page)
    start = (page - 1) * page_rows
    return BatchPage(
        batch=found.batch,
        run=found.run,
        outcomes=dict(sorted(outcomes.items(), key=lambda kv: (kv[0] != OK, kv[0]))),
        states={s: states[s] for s in (QUEUED, RUNNING, GONE) if states[s]},
        codes=tuple(sorted(codes)),
        tools=tuple(sorted(tools)),
        query=query,
        matched=len(kept),
        rows=tuple(kept[start : start + page_rows]),
        pages=pages,
    )
