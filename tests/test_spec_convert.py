"""load_spec_file's `convert`: each parsed object made a spec before validation, its issues on
its physical line and named in the object's own terms (pure: no Redis, no workers)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from producer.specfile import Conversion, SpecFileError, load_spec_file


def wrapped(obj: Any) -> Conversion:
    """`{"wrapped": spec}` objects are unwrapped (their fields named `wrapped.*`), objects
    with `refuse` are refused by the conversion itself, the rest pass as they are."""
    if isinstance(obj, dict) and "refuse" in obj:
        return Conversion(problems=[("refuse", "refused"), ("id", "as given")])
    if isinstance(obj, dict) and "wrapped" in obj:
        return Conversion(obj["wrapped"], field_name=lambda f: f"wrapped.{f}")
    return Conversion(obj)


def spec(spec_id: str, **fields: Any) -> dict[str, Any]:
    return {"id": spec_id, "model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


def test_a_conversion_names_its_issues_on_their_lines(tmp_path: Path) -> None:
    path = tmp_path / "batch.json"
    objects = [
        {"wrapped": spec("a")},
        {"wrapped": spec("b", model="")},
        spec("c", model=""),
        {"refuse": True},
        {"wrapped": spec("a")},
    ]
    # the last three share a line: each keeps its own names
    text = "[\n" + ",\n".join(json.dumps(o) for o in objects[:2]) + ",\n"
    text += ", ".join(json.dumps(o) for o in objects[2:]) + "\n]\n"
    path.write_text(text)
    with pytest.raises(SpecFileError) as caught:
        load_spec_file(path, convert=wrapped)
    assert [str(i).removeprefix(f"{path}:") for i in caught.value.issues] == [
        "3: wrapped.model: Shorter than minimum length 1.",
        "4: model: Shorter than minimum length 1.",
        "4: refuse: refused",
        "4: id: as given",
        "4: wrapped.id: duplicate of line 2",
    ]
    path.write_text(json.dumps([{"wrapped": spec("a")}, spec("b")]))
    assert [s.spec.id for s in load_spec_file(path, convert=wrapped)] == ["a", "b"]
