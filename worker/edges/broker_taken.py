"""The messages this process's consumers took with BLMOVE (worker/edges/broker.py), by delivery
tag, and the acks that steps' commits write themselves.

A step that runs on a thread of the process that took its message (the llm and control
workers' thread pools) removes the message from its consumer's list in its own commit script
(an LREM beside its writes, when the broker is the state's Redis): the ack that follows, on the
consumer loop's thread, then writes nothing. One round trip a step fewer, and the message is
taken off exactly when the step's work is written. A prefork child does not hold its message
(its parent does): its parent acks it as before."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Taken:
    """A message BLMOVE moved: its delivery tag, the list it is held in and its bytes there
    (an LREM of these bytes removes it), and its task's id."""

    tag: str
    held_in: str
    raw: bytes
    task_id: str


TAKEN: dict[str, Taken] = {}  # delivery tag -> the message as it was taken
_TAGS: dict[str, str] = {}  # task id -> delivery tag, while its message is held here
_SETTLED: set[str] = set()  # delivery tags whose message a commit removed


def took(taken: Taken) -> None:
    TAKEN[taken.tag] = taken
    _TAGS[taken.task_id] = taken.tag


def release(tag: str) -> Taken | None:
    """Forget a message (acked or given back): how it was held, or None if it was not."""
    taken = TAKEN.pop(tag, None)
    if taken is not None and _TAGS.get(taken.task_id) == tag:
        del _TAGS[taken.task_id]
    return taken


def held_for(task_id: str) -> Taken | None:
    """The message of a task this process holds, if it does."""
    tag = _TAGS.get(task_id)
    return None if tag is None else TAKEN.get(tag)


def settle(tag: str) -> None:
    """A commit removed this message: its ack writes nothing."""
    if release(tag) is not None:
        _SETTLED.add(tag)


def settled(tag: str) -> bool:
    """Whether a commit removed this message (asked once, by its ack)."""
    if tag in _SETTLED:
        _SETTLED.discard(tag)
        return True
    return False
