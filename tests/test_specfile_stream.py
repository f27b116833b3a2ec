"""A JSONL spec file is streamed: validation holds the specs it returns and one line, not the
file's text nor every parsed line at once."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import pytest

from producer.specfile import SpecFileError, load_spec_file
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
