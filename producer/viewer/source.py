"""What the viewer reads through: the ViewSource protocol, implemented by FleetSource (a live
fleet's Redis) and FileSource (results files), and the facts of one session a source hands the
read model (producer/viewer/views.py makes its page of them)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from producer.viewer.model import BatchPage, BatchQuery, BatchRows, FrameView, RunRow
from schemas.partial import PartialCall


@dataclass(frozen=True)
class ChatFacts:
    """A program run's chat as a source found it."""

    spec_id: str
    state: str  # queued | running | done | gone
    record: dict[str, Any] | None = None  # its record once it ended
    body: dict[str, Any] | None = None  # its response body (a results file keeps only that)


@dataclass(frozen=True)
class SessionFacts:
    """What a source knows of one session or program run."""

    spec_id: str
    state: str  # queued | running | done | gone
    batch: str = ""
    attempt: int = 1
    state_text: str = ""  # the meta's state while it runs ("round 2")
    record: dict[str, Any] | None = None  # the result record once it ended
    events: list[dict[str, Any]] | None = None  # its trace events; None: no trace to read
    submitted_ms: int | None = None
    finished_ms: int | None = None
    partial_text: str | None = None  # the round being streamed
    partial_thinking: str | None = None  # its thinking so far
    partial_tool_calls: tuple[PartialCall, ...] = ()  # its tool calls' names and arguments so far
    spec: dict[str, Any] | None = None  # its stored spec while it runs (messages, model)
    program: bool = False
    chats: tuple[ChatFacts, ...] = ()
    frames: tuple[FrameView, ...] | None = None  # None: this source keeps no user streams
    flower: tuple[str, str] | None = None  # Flower's search and its tasks API link
    source: str = ""  # the results file it came from


class NotFound(LookupError):
    """No batch or session of that id in this source."""


class ViewSource(Protocol):
    """Where the viewer's pages come from."""

    @property
    def label(self) -> str:
        """What is shown: `fleet redis://...` or the results files' names."""

    @property
    def live(self) -> bool:
        """True for a fleet (pages refresh while something runs)."""

    def runs(self) -> list[RunRow]:
        """Batches newest first, each followed by its program runs."""

    def batch_rows(self, batch: str) -> BatchRows | None:
        """Every session of a batch, None for a batch this source does not know."""

    def batch_page(self, batch: str, query: BatchQuery) -> BatchPage | None:
        """One page of a batch's sessions under `query`, with its counts; None for a batch
        this source does not know."""

    def session(self, spec_id: str, batch: str | None = None) -> SessionFacts | None:
        """One session or program run (the run `batch` ran, else the id's latest), None when
        unknown."""

    def trace(self, spec_id: str, batch: str | None = None) -> Iterator[dict[str, Any]] | None:
        """A session's trace events in order, None when unknown or not kept."""

    def close(self) -> None: ...
