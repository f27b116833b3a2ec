"""A step's commit where the dispatcher does not write it with the steps it publishes (the
in-memory twins): its writes one after another, in the order that keeps a redelivery whole
(the reply and tool outcomes before the steps that read them, the published marker after the
steps, the trace last)."""

from __future__ import annotations

from collections.abc import Sequence

from worker.errors import ReplyTaken
from worker.session.outcomes import ToolOutcome
from worker.session.ports import Dispatcher
from worker.session.store_ports import Commit, NextStep, SessionStore


def commit_apart(
    store: SessionStore, dispatch: Dispatcher, step: str, steps: Sequence[NextStep], commit: Commit
) -> None:
    sk = commit.sk
    if commit.reply is not None:  # first writer wins: another delivery's stored, write nothing
        paid = commit.reply
        if store.store_round(sk, paid.round_no, paid.reply, paid.runs) is not paid.reply:
            raise ReplyTaken(step)
    by_round: dict[int, dict[int, ToolOutcome]] = {}
    for (round_no, index), outcome in commit.outcomes.items():
        by_round.setdefault(round_no, {})[index] = outcome
    for round_no, outcomes in by_round.items():  # before the steps that read them
        store.store_tool_outcomes(sk, round_no, outcomes, 0)
    dispatch.publish(steps)
    if commit.notify:
        store.notify(sk, commit.notify)
    store.end_step(step)
    if commit.trace is not None:
        store.trace(commit.trace)
