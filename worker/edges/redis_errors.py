"""Redis's errors, translated once for the Redis edges (the store, the rate limits, the broker):
a Redis that refuses writes for now is a StoreUnavailableError, one that does not answer (its
connection failed or timed out) a StoreUnreachableError, anything else a StoreError.

Refusals are Redis's own error words: OOM (used memory over maxmemory under noeviction),
MISCONF (it cannot persist: a full disk for its AOF or RDB, with stop-writes-on-bgsave-error),
READONLY (a replica: the master failed over), LOADING (a restart still reading its data). None
of them is the step's fault, and each passes by itself (memory freed, disk space freed, a
client pointed at the new master, the load done), so they are waited out, never counted.
"""

from __future__ import annotations

import re

import redis

from worker.errors import StoreError, StoreUnavailableError, StoreUnreachableError

REFUSED_BY_CLASS: tuple[tuple[type[redis.RedisError], str], ...] = (
    (redis.exceptions.OutOfMemoryError, "OOM"),
    (redis.exceptions.ReadOnlyError, "READONLY"),
    (redis.exceptions.BusyLoadingError, "LOADING"),
)
# Redis's word opens its error; redis-py prefixes an error in a pipeline with the command
# ("Command # 1 (SET ...) of pipeline caused error: MISCONF ...")
REFUSED_WORD = re.compile(r"(?:^|caused error: )(OOM|MISCONF|READONLY|LOADING)\b")
# the same in any text (an error another library wrapped, whose word redis-py had stripped)
REFUSED_TEXT = re.compile(
    r"\b(OOM|MISCONF|READONLY|LOADING)\b|used memory > 'maxmemory'|read only replica"
    r"|loading the dataset"
)


def refusal(exc: BaseException) -> str | None:
    """Redis's word for a refusal (OOM, MISCONF, READONLY, LOADING), or None for any other
    error. redis-py has classes for three; MISCONF comes as a ResponseError with its word."""
    for cls, reason in REFUSED_BY_CLASS:
        if isinstance(exc, cls):
            return reason
    if isinstance(exc, redis.exceptions.ResponseError):
        said = REFUSED_WORD.search(str(exc))
        if said is not None:
            return said.group(1)
    return None


def refused_or_unanswered(exc: BaseException) -> bool:
    """Whether a Redis error is a refusal or an unanswered command, the causes of a MULTI
    Redis discarded (EXECABORT) included: what is logged in one line, without a traceback."""
    while exc is not None:
        if refusal(exc) is not None or unanswered(exc):
            return True
        if not isinstance(exc, redis.exceptions.ExecAbortError):
            return False
        exc = exc.__context__  # type: ignore[assignment]
    return False


def unanswered(exc: BaseException) -> bool:
    """Whether Redis did not answer: the connection failed or timed out (a cut network, a
    restart, a paused primary), not a refusal (redis-py's LOADING is a ConnectionError too)."""
    return isinstance(exc, (redis.ConnectionError, redis.TimeoutError)) and refusal(exc) is None


def store_error(exc: redis.RedisError, what: str = "redis") -> StoreError:
    """The error tree's class for a Redis error: ids and Redis's own text only."""
    reason = refusal(exc)
    if reason is not None:
        return StoreUnavailableError(reason, f"{what}: Redis refuses writes: {reason}: {exc}")
    if unanswered(exc):
        return StoreUnreachableError(f"{what}: {type(exc).__name__}: {exc}")
    return StoreError(f"{what}: {type(exc).__name__}: {exc}")
