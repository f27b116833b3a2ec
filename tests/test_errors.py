"""The error tree is the source of every code: the README lists each one, and no code is
spelled as a string literal where bodies or tool messages are made."""

from __future__ import annotations

import re
from pathlib import Path

from schemas.bodies import CANCELLED, SESSION_ERROR_CODES
from worker.errors import CancelledError, CchatqError, RunAborted, StepFailedError, body_codes

ROOT = Path(__file__).resolve().parent.parent


def test_the_readme_lists_every_code_with_its_reason() -> None:
    readme = (ROOT / "README.md").read_text()
    rows = dict(re.findall(r"^\| `([A-Za-z_]+)` \| (.+) \|$", readme, re.MULTILINE))
    assert {code: rows.get(code) for code in body_codes()} == body_codes()


def test_no_code_is_a_string_literal_where_errors_are_made() -> None:
    literal = re.compile(r"(error_obj|ToolOutcome\.error|_abort)\(\s*\"")
    offenders = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in sorted((ROOT / "worker").rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if literal.search(line)
    ]
    assert offenders == []


def test_every_error_carries_its_code_into_its_body() -> None:
    error = StepFailedError("step x failed for good")
    assert error.body() == {"error": {"code": "step_failed", "message": "step x failed for good"}}
    aborted = RunAborted(StepFailedError("gone"))
    assert isinstance(aborted, CchatqError) and aborted.code == "step_failed"


def test_the_producer_knows_every_code_a_session_can_end_with() -> None:
    """schemas/bodies.py's list (what `cchatq batch retry --codes` accepts) is the tree's
    session-ending codes: the lower-case ones (a tool's error classes are upper-case)."""
    assert {code for code in body_codes() if code.islower()} == SESSION_ERROR_CODES
    assert CancelledError.code == CANCELLED
