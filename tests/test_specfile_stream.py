"""A JSONL spec file is streamed: validation holds the specs it returns and one line, not the
file's text nor every parsed line at once."""

from __future__ import annotations

import io
import json
import tracemalloc
from pathlib import Path

import pytest

from bench.validation import generate
from producer import spec_json
from producer.specfile import SpecFileError, load_spec_file
from producer.validation_progress import validation_progress
from schemas.spec_types import Spec
from tests.test_spec_schema import spec

LINES = 2_000
PROMPT_BYTES = 10_000  # a 20 MB file


def test_memory_held_is_per_line_not_per_file(tmp_path: Path) -> None:
    path = tmp_path / "big.jsonl"
    with path.open("w") as out:
        for n in range(LINES):
            prompt = f"{n:08d}" + "x" * PROMPT_BYTES
            out.write(json.dumps(spec(id=f"s{n}", messages=[{"role": "user", "content": prompt}])))
            out.write("\n")
    size = path.stat().st_size

    def refuse_the_first(spec: Spec) -> list[tuple[str, str]]:
        # one issue early: from then on no spec is kept (none would be returned)
        return [("id", "refused")] if spec.id == "s0" else []

    tracemalloc.start()
    try:
        with pytest.raises(SpecFileError) as info:
            load_spec_file(path, check=refuse_the_first)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [(i.line, i.field) for i in info.value.issues] == [(1, "id")]
    assert peak < size / 10, f"peak {peak:,} bytes for a {size:,}-byte file"


# --- the progress line ---------------------------------------------------------------------


def write_lines(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps(spec(id=f"s{i}")) + "\n" for i in range(n)))
    return path


def test_progress_is_reported_while_reading_and_at_the_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_lines(tmp_path / "f.jsonl", 300)
    size = path.stat().st_size
    calls: list[tuple[int, int, int]] = []
    monkeypatch.setattr(spec_json, "PROGRESS_EVERY_S", 0.0)  # every 64 lines, then
    assert len(load_spec_file(path, on_progress=lambda *a: calls.append(a))) == 300
    assert [c[0] for c in calls] == [64, 128, 192, 256, 300]
    assert calls[-1] == (300, size, size)
    assert all(0 < c[1] <= size and c[2] == size for c in calls)
    assert [c[1] for c in calls] == sorted(c[1] for c in calls)


def test_a_quick_file_reports_only_its_end(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "f.jsonl", 100)
    calls: list[tuple[int, int, int]] = []
    load_spec_file(path, on_progress=lambda *a: calls.append(a))
    assert calls == [(100, path.stat().st_size, path.stat().st_size)]
    path = tmp_path / "f.json"
    path.write_text(json.dumps([spec(id="a"), spec(id="b")], indent=1))
    calls.clear()
    load_spec_file(path, on_progress=lambda *a: calls.append(a))
    size = path.stat().st_size
    assert calls == [(path.read_text().count("\n") + 1, size, size)]


def test_progress_reports_even_when_rejecting(tmp_path: Path) -> None:
    path = tmp_path / "f.jsonl"
    path.write_text("nope\n" * 10)
    calls: list[tuple[int, int, int]] = []
    with pytest.raises(SpecFileError):
        load_spec_file(path, on_progress=lambda *a: calls.append(a))
    assert calls == [(10, 50, 50)]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_bar_on_a_terminal() -> None:
    stream = Terminal()
    with validation_progress("specs/[big].jsonl", stream) as on_progress:
        assert on_progress is not None
        on_progress(64_000, 2_500_000, 10_000_000)
        on_progress(256_000, 10_000_000, 10_000_000)
    shown = stream.getvalue()
    assert "validating specs/[big].jsonl" in shown
    assert "64,000 lines  2.5 MB/10.0 MB" in shown


def test_no_bar_off_a_terminal_nor_for_a_quick_file() -> None:
    with validation_progress("f.jsonl", io.StringIO()) as on_progress:
        assert on_progress is None
    stream = Terminal()
    with validation_progress("f.jsonl", stream) as on_progress:
        assert on_progress is not None
        on_progress(10, 500, 500)  # the end, before any report was due
    assert stream.getvalue() == ""


def test_the_bench_file_is_valid_and_sized_as_the_testers(tmp_path: Path) -> None:
    """bench/validation.py's file: ~415-byte lines (50 MB for 120k sessions), all valid."""
    path = generate(tmp_path, 500)
    loaded = load_spec_file(path)
    assert len(loaded) == 500 and len({item.spec.id for item in loaded}) == 500
    assert 400 <= path.stat().st_size / 500 <= 450
