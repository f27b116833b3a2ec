"""A step id's kind, read from its last part (schemas/keys.py names every step): what trace
events and metrics say a step was."""

from __future__ import annotations

_STEP_SUFFIXES = {"bg": "background", "fin": "finish", "prog": "program"}
_STEP_PREFIXES = {"r": "round", "t": "tool", "c": "start"}


def step_kind(step: str) -> str:
    """A step id's kind, read from its last part (the ids above): round, tool, background,
    finish, program or start ("?" for none of them)."""
    last = step.rsplit(".", 1)[-1]
    if last in _STEP_SUFFIXES:
        return _STEP_SUFFIXES[last]
    if len(last) > 1 and last[1:].isdigit() and "." in step:
        return _STEP_PREFIXES.get(last[0], "?")
    return "?"
