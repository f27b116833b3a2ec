"""The viewer's Starlette app: the runs page, a batch's page, a session's page (a program run's
too), their JSON twins under /api, a session's trace as JSONL, and /healthz. Pages are Jinja
templates with autoescape on: whatever a prompt, an output or an id holds shows as text.

Ids travel URL-quoted (`urllib.parse.quote(id, safe="")`): a spec id may hold `/` and `#`. A
route reads its id back from the raw path, so an id that ends in `/trace` is not taken for
the trace route."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator, Collection, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlencode

import jinja2
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from producer.report import clock_text, rate_text
from producer.viewer.auth import Gate
from producer.viewer.model import SORTS, STATUSES
from producer.viewer.rows import parse_query
from producer.viewer.source import ViewSource
from producer.viewer.views import session_view

HERE = Path(__file__).resolve().parent


def quoted(value: str) -> str:
    return quote(value, safe="")


def ms_text(value: int | None) -> str:
    """A duration for people: 850 ms, 1.25 s, 2m 05s."""
    if value is None:
        return ""
    if value < 1000:
        return f"{value} ms"
    if value < 60_000:
        return f"{value / 1000:.2f} s"
    minutes, seconds = divmod(value // 1000, 60)
    return f"{minutes}m {seconds:02d}s"


def when_text(value: int | None) -> str:
    if not value:
        return ""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(value / 1000))


def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(HERE / "templates"),
        autoescape=True,  # every template, whatever its name
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(
        q=quoted,
        ms=ms_text,
        when=when_text,
        rate=lambda r: "" if r is None else rate_text(r),
        clock=lambda s: "" if s is None else clock_text(s),
        num=lambda v: "" if v is None else v,
    )
    env.globals.update(STATUSES=STATUSES, SORTS=SORTS, urlencode=urlencode)
    return env


def path_tail(request: Request, prefix: str) -> str:
    """What follows `prefix` in the request's path, as sent (then unquoted)."""
    raw = request.scope.get("raw_path")
    path = raw.decode("latin-1") if isinstance(raw, bytes) else quote(request.url.path)
    path = path.split("?", 1)[0]
    return path[len(prefix) :] if path.startswith(prefix) else ""


class Viewer:
    """The routes, over one ViewSource."""

    def __init__(self, source: ViewSource) -> None:
        self.source = source
        self.templates = Jinja2Templates(env=environment())

    def page(self, request: Request, name: str, status: int = 200, **context: Any) -> Response:
        context.update(source=self.source.label, live_source=self.source.live)
        return self.templates.TemplateResponse(request, name, context, status_code=status)

    def not_found(self, request: Request, what: str, key: str, api: bool = False) -> Response:
        message = f"No {what} {key} in {self.source.label}."
        if api:
            return JSONResponse({"error": message}, status_code=404)
        return self.page(request, "not_found.html", 404, message=message, title="Not found")

    # pages -----------------------------------------------------------------------------------

    def runs(self, request: Request) -> Response:
        runs = self.source.runs()
        name = "_runs.html" if request.query_params.get("fragment") else "runs.html"
        return self.page(request, name, runs=runs, live=any(not r.finished for r in runs))

    def batch(self, request: Request) -> Response:
        batch = unquote(path_tail(request, "/batch/"))
        page = self.source.batch_page(batch, parse_query(request.query_params))
        if page is None:
            return self.not_found(request, "batch", batch)
        name = "_batch.html" if request.query_params.get("fragment") else "batch.html"
        return self.page(request, name, page=page, live=self.source.live and not page.run.finished)

    def session(self, request: Request) -> Response:
        spec_id = unquote(path_tail(request, "/session/"))
        facts = self.source.session(spec_id, request.query_params.get("batch"))
        if facts is None:
            return self.not_found(request, "session", spec_id)
        view = session_view(facts)
        name = "_session.html" if request.query_params.get("fragment") else "session.html"
        return self.page(request, name, view=view, live=self.source.live and view.live)

    def healthz(self, request: Request) -> Response:
        return PlainTextResponse("ok")

    # JSON twins ------------------------------------------------------------------------------

    def api_runs(self, request: Request) -> Response:
        return JSONResponse(
            {"source": self.source.label, "runs": [r.json() for r in self.source.runs()]}
        )

    def api_batch(self, request: Request) -> Response:
        batch = unquote(path_tail(request, "/api/batch/"))
        page = self.source.batch_page(batch, parse_query(request.query_params))
        if page is None:
            return self.not_found(request, "batch", batch, api=True)
        return JSONResponse(page.json())

    def api_session(self, request: Request) -> Response:
        tail = path_tail(request, "/api/session/")
        if tail.endswith("/trace"):  # a quoted id holds no `/`: this is the trace route
            return self.api_trace(request, unquote(tail.removesuffix("/trace")))
        spec_id = unquote(tail)
        facts = self.source.session(spec_id, request.query_params.get("batch"))
        if facts is None:
            return self.not_found(request, "session", spec_id, api=True)
        return JSONResponse(session_view(facts).json())

    def api_trace(self, request: Request, spec_id: str) -> Response:
        events = self.source.trace(spec_id, request.query_params.get("batch"))
        if events is None:
            why = "session" if self.source.live else "trace (results files keep none) of session"
            return self.not_found(request, why, spec_id, api=True)

        def lines(found: Iterator[dict[str, Any]]) -> Iterator[str]:
            for event in found:
                yield json.dumps(event, separators=(",", ":")) + "\n"

        return StreamingResponse(lines(events), media_type="application/x-ndjson")


def create_app(
    source: ViewSource, token: str | None = None, hosts: Collection[str] | None = None
) -> Starlette:
    """The app over `source`; `token`: every request must carry it; `hosts`: the Host names
    accepted (None: any)."""
    viewer = Viewer(source)
    routes = [
        Route("/", viewer.runs),
        Route("/healthz", viewer.healthz),
        Route("/batch/{batch:path}", viewer.batch),
        Route("/session/{spec_id:path}", viewer.session),
        Route("/api/runs", viewer.api_runs),
        Route("/api/batch/{batch:path}", viewer.api_batch),
        Route("/api/session/{spec_id:path}", viewer.api_session),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            source.close()

    def unknown(request: Request, exc: Exception) -> Response:
        message = f"No page at {request.url.path}."
        return viewer.page(request, "not_found.html", 404, message=message, title="Not found")

    def failed(request: Request, exc: Exception) -> Response:
        """A source that failed (Redis gone): said on a page; the server logs the traceback."""
        message = f"{source.label} could not be read ({type(exc).__name__}): try again."
        if request.url.path.startswith("/api/"):
            return JSONResponse({"error": message}, status_code=503)
        return viewer.page(request, "not_found.html", 503, message=message, title="Unavailable")

    return Starlette(
        routes=routes,
        middleware=[Middleware(Gate, token=token, hosts=hosts)],
        exception_handlers={404: unknown, Exception: failed},
        lifespan=lifespan,
    )
