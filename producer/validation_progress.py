"""The progress line of a spec file's validation (`cchatq submit`): on a terminal, a transient
rich bar on stderr, "validating FILE  N lines  x MB/y MB", gone once the file is checked;
nothing when stderr is not a terminal (a log gets the outcome, not a bar). A file checked
before the first report is due (PROGRESS_EVERY_S) shows no bar at all.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn

from producer.specfile import ProgressHook


class ValidationProgress:
    """A ProgressHook drawing the bar, started at the first report that is not the last."""

    def __init__(self, path: str, stream: TextIO) -> None:
        self.path, self.stream = path, stream
        self._bar: Progress | None = None
        self._task: TaskID | None = None

    def __call__(self, lines: int, done: int, total: int) -> None:
        if self._bar is None and done >= total:
            return  # done already: no bar to flash
        sizes = f"{done / 1e6:.1f} MB/{total / 1e6:.1f} MB"
        if self._bar is None:
            self._start(lines, sizes)
        assert self._bar is not None and self._task is not None
        self._bar.update(
            self._task, completed=done, total=total or None, lines=lines, sizes=sizes, refresh=True
        )

    def _start(self, lines: int, sizes: str) -> None:
        self._bar = Progress(
            # markup off: a path may hold [brackets]
            TextColumn("validating {task.description}", markup=False),
            BarColumn(),
            TextColumn("{task.fields[lines]:,} lines  {task.fields[sizes]}", markup=False),
            console=Console(file=self.stream),
            transient=True,
        )
        self._task = self._bar.add_task(self.path, total=None, lines=lines, sizes=sizes)
        self._bar.start()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


@contextmanager
def validation_progress(path: str, stream: TextIO) -> Iterator[ProgressHook | None]:
    """`load_spec_file`'s on_progress for `path`: the bar on a terminal, else None."""
    if not stream.isatty():
        yield None
        return
    progress = ValidationProgress(path, stream)
    try:
        yield progress
    finally:
        progress.close()
