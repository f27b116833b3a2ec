"""Redis keys the fleet shares beside its sessions' (`schemas/keys.py`): the rate limits and
rate controllers every worker calling a backend reads and writes, the reconciler's turn, and the
broker's bookkeeping.

Braces are Redis Cluster hash tags, written as they are (schemas/keys.py):

    cq:rl:{backend}:req     rate limit: zset of recent requests (member -> time)
    cq:rl:{backend}:tok     rate limit: hash member -> tokens
    cq:rl:{backend}:sum     rate limit: the tokens of every entry in the window
    cq:rc:{id}              a rate controller's state (hash; id: backend, account digest, model)
    cq:rc:{id}:slots        its calls in flight: zset slot -> lease expiry (ms)
    cq:rc:{id}:room         its waiting room: zset waiting round -> the time it may come (ms)
    cq:rc                   hash: every rate controller's id -> when it was last used (ms)
    cq:reconciler           held by the one worker reconciling this round (PX: its turn)
    cq:trace:shard:{n}      on a Redis Cluster, the fleet's trace stream (keys.TRACE), n < 16
"""

from __future__ import annotations

import zlib

from schemas import keys
from schemas.keys import PREFIX

RECONCILER_LOCK = f"{PREFIX}:reconciler"  # held by the one worker reconciling this round


def rate_requests(backend: str) -> str:
    """A backend's rate limit keys share its hash tag: one script reads and writes them."""
    return f"{PREFIX}:rl:{{{backend}}}:req"


def rate_tokens(backend: str) -> str:
    return f"{PREFIX}:rl:{{{backend}}}:tok"


def rate_total(backend: str) -> str:
    """The tokens of every entry in the window, kept as they come and go (O(1) per acquire)."""
    return f"{PREFIX}:rl:{{{backend}}}:sum"


RATE_CONTROLLERS = f"{PREFIX}:rc"


def rate_controller(controller_id: str) -> str:
    """A rate controller's state; its slots and waiting room are beside it (same hash tag)."""
    return f"{PREFIX}:rc:{{{controller_id}}}"


def rate_slots(controller_id: str) -> str:
    return f"{rate_controller(controller_id)}:slots"


def rate_room(controller_id: str) -> str:
    return f"{rate_controller(controller_id)}:room"


# The broker's bookkeeping (worker/edges/broker.py), outside the session keyspace like kombu's
# own keys: no TTL, and bounded (emptied as messages are acked, consumers swept when dead).
BROKER_CONSUMERS = "_cchatq:broker:consumers"  # consumers that may hold unacked messages


def broker_unacked(consumer: str) -> str:
    """delivery tag -> [message, exchange, routing key], one hash per consumer (BRPOP)."""
    return f"_cchatq:broker:unacked:{consumer}"


def broker_taken(consumer: str) -> str:
    """The messages a consumer took with BLMOVE, as they were on their queue."""
    return f"_cchatq:broker:taken:{consumer}"


def broker_alive(consumer: str) -> str:
    """A consumer's heartbeat (EX a few seconds): the queues it takes from, comma-separated."""
    return f"_cchatq:broker:alive:{consumer}"


# The fleet's trace stream (keys.TRACE) on a Redis Cluster: TRACE_SHARDS streams, each its own
# hash tag, a session's entries in the one its key picks, so that no master takes every step's
# XADD. On one Redis it is the one stream.
TRACE_SHARDS = 16


def trace_shards(cluster: bool) -> list[str]:
    """Every stream of the fleet's trace."""
    if not cluster:
        return [keys.TRACE]
    return [f"{keys.TRACE}:shard:{{{n}}}" for n in range(TRACE_SHARDS)]


def trace_stream(sk: str, cluster: bool) -> str:
    """The stream of the fleet's trace that session `sk`'s entries go to (a fleet event's: the
    first)."""
    if not cluster:
        return keys.TRACE
    return trace_shards(True)[zlib.crc32(sk.encode()) % TRACE_SHARDS if sk else 0]
