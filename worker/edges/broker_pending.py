"""The broker's writes that a Redis refusing writes (OOM, MISCONF, READONLY, LOADING) turned
down, or that one that did not answer could not take (acks and give-backs), kept in this process
and written on the consumer's next beats (worker/edges/broker.py):
a hold (a message BRPOP took, into its consumer's hash), a forget (an ack), a give-back (a
message handed back to its queue). Until then a forgotten or given-back message is still held
in Redis, where a sweeper can hand it out again: a step run again, never a message lost."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from worker.edges.redis_errors import refusal, unanswered
from worker.session.refusals import RefusalNotice

log = logging.getLogger("worker.edges.broker")

# Writes Redis refused (OOM, MISCONF, READONLY, LOADING), written on the next beats, in this
# order: holds (a BRPOP'd message into its consumer's hash), forgets (acks), give-backs.
PENDING_LOCK = threading.Lock()
PENDING_HOLDS: dict[str, tuple[str, bytes]] = {}  # delivery tag -> (its hash, its entry)
PENDING_FORGETS: list[Callable[[Any], None]] = []  # each issues its command on a pipeline
PENDING_RESTORES: dict[str, Any] = {}  # delivery tag -> (channel, message) to give back
REFUSED = RefusalNotice("broker", log)
TAKE_PAUSES_S = (0.5, 1.0, 2.0, 4.0)  # the take's backoff while Redis refuses it
SHUTDOWN_RESTORE_S = 10.0  # how long a stopping consumer tries to give its messages back


def refused(exc: BaseException) -> bool:
    """Whether Redis refused a write for now (said once, in one line), not a failure."""
    reason = refusal(exc)
    if reason is not None:
        REFUSED.refused(reason)
    return reason is not None


def later(exc: BaseException) -> bool:
    """Whether a write that failed with `exc` is kept and written on the next beats: Redis
    refused it, or did not answer (for an ack or a give-back the message stays held in Redis
    meanwhile)."""
    return refused(exc) or unanswered(exc)


def write_acks(client: Any, acks: deque[Callable[[Any], None]]) -> None:
    """The acks a consumer queued (each a forget, issued on a pipeline), in one pipeline: the
    consumer loop writes them once a tick, not one round trip each. What Redis refuses or
    does not take is kept and written on the next beats."""
    forgets: list[Callable[[Any], None]] = []
    while acks:
        forgets.append(acks.popleft())
    if not forgets:
        return
    try:
        pipe = client.pipeline(transaction=False)
        for forget in forgets:
            forget(pipe)
        pipe.execute()
    except Exception as exc:
        if not later(exc):
            log.warning("acks failed (%s): written on the next beats", type(exc).__name__)
        with PENDING_LOCK:  # the steps are done: a sweep meanwhile only runs them again
            PENDING_FORGETS.extend(forgets)


def write_pending(client: Any) -> None:
    """Write the holds, acks and give-backs Redis refused before (each kept until written)."""
    with PENDING_LOCK:
        holds, forgets = dict(PENDING_HOLDS), list(PENDING_FORGETS)
        restores = dict(PENDING_RESTORES)
    if holds or forgets:
        pipe = client.pipeline(transaction=False)
        for held, entry in holds.values():
            pipe.hset(held, mapping={tag: entry for tag, (h, entry) in holds.items() if h == held})
        for forget in forgets:
            forget(pipe)
        pipe.execute()
        with PENDING_LOCK:
            for tag in holds:
                PENDING_HOLDS.pop(tag, None)
            del PENDING_FORGETS[: len(forgets)]
    for tag, (channel, message) in restores.items():
        try:
            channel._restore(message, leftmost=True)
        except Exception as exc:
            if later(exc):
                return  # the next beats try again
            # its channel closed since (a lost connection): the message is still held in
            # Redis, under a consumer no longer live, which a sweep hands out again
            log.warning("give-back %s failed (%s): left to a sweep", tag, type(exc).__name__)
        with PENDING_LOCK:
            PENDING_RESTORES.pop(tag, None)


def give_back_all(
    restore: Callable[[Any], None], messages: list[Any], acked: set[str], consumer: str
) -> list[tuple[BaseException, Any]]:
    """A stopping consumer's messages back on their queues (`restore`: Channel._restore),
    trying a Redis that refuses writes for SHUTDOWN_RESTORE_S. What it still refuses, or what
    a Redis that does not answer (a lost connection) could not take, stays held in Redis,
    where a sweeper hands it out again once the consumer's heartbeat runs out: not an error,
    so kombu writes no emergency dump for it. The errors returned (kombu dumps those) are only
    messages whose hold Redis never took (in this process alone) or that failed otherwise."""
    errors: list[tuple[BaseException, Any]] = []
    deadline, held, pauses = time.monotonic() + SHUTDOWN_RESTORE_S, 0, iter(TAKE_PAUSES_S)
    down: BaseException | None = None  # Redis did not answer: the rest are not tried
    for message in messages:
        while True:
            try:
                if down is not None:
                    raise down
                restore(message)
                break
            except Exception as exc:
                if refused(exc) and time.monotonic() < deadline:
                    time.sleep(next(pauses, TAKE_PAUSES_S[-1]))
                    continue
                with PENDING_LOCK:
                    only_here = message.delivery_tag in PENDING_HOLDS
                down = exc if unanswered(exc) else down
                if later(exc) and not only_here:
                    held += 1
                elif message.delivery_tag not in acked:
                    errors.append((exc, message))
                break
    if held:
        log.warning(
            "consumer %s: %d messages left held in Redis (it refuses writes or does not answer):"
            " handed out again once its heartbeat runs out", consumer, held,
        )  # fmt: skip
    return errors
