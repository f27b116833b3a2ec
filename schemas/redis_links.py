"""How every Redis connection of cchatq (the workers' state and broker connections, the
producer's) notices that the network under it is gone, and how soon it tries again: the
numbers, once. Stdlib only: the worker's edges and the producer both read them.

Without them a connection cut silently (a partition, a host's link down: no FIN, no RST) is
noticed only when TCP gives up retransmitting (about 15 minutes, tcp_retries2), and a read
blocked on it waits that long. With them:

- a command waits at most SOCKET_TIMEOUT_S for its reply, a connect CONNECT_TIMEOUT_S;
- an idle connection is probed (TCP keepalive) after KEEPALIVE_IDLE_S, and the kernel closes
  one whose data or probes go unanswered for USER_TIMEOUT_MS (TCP_USER_TIMEOUT, Linux), so a
  socket waiting in an event loop (the broker's BLMOVE) errors too, not only a blocked read;
- a connection idle longer than HEALTH_CHECK_S is PINGed before its next command (redis-py),
  and kombu drops a BRPOP/BLMOVE or pub/sub connection whose reply is that much overdue;
- a blocking command (BLPOP, BLMOVE, XREAD BLOCK) blocks at most BLOCK_CAP_S on the server,
  well inside the socket timeout, and its caller loops;
- a worker that lost its broker tries again every BROKER_RETRY_S (at most), not kombu's
  growing 2, 4, 6 ... 30 s, so it serves again within seconds of the network's return.

None of it costs a command: the options are set once per connection (at connect), a health
check PING goes only on a connection that was idle past HEALTH_CHECK_S.
"""

from __future__ import annotations

import socket
from typing import Any

SOCKET_TIMEOUT_S = 6.0
CONNECT_TIMEOUT_S = 3.0
KEEPALIVE_IDLE_S = 5
KEEPALIVE_INTERVAL_S = 2
KEEPALIVE_COUNT = 3
USER_TIMEOUT_MS = 10_000
HEALTH_CHECK_S = 10
# the longest server-side block of a blocking command: the reply (even "nothing") comes back
# 2 s before the socket timeout would call the connection dead
BLOCK_CAP_S = 4.0
# a worker's broker reconnect: the first retry after this, then every BROKER_RETRY_S
BROKER_RETRY_FIRST_S = 1.0
BROKER_RETRY_S = 2.0
# ...for about as long as kombu's default policy took for its 100 tries (2, 4 ... 30 s):
# a Redis down for longer than that stops the worker (its supervisor starts it again)
BROKER_GIVE_UP_S = 3_000.0


def keepalive_options() -> dict[int, int]:
    """The TCP options (level IPPROTO_TCP) a keepalive socket gets: those this platform has
    (TCP_KEEPIDLE, TCP_KEEPINTVL, TCP_KEEPCNT, TCP_USER_TIMEOUT on Linux)."""
    wanted = {
        "TCP_KEEPIDLE": KEEPALIVE_IDLE_S,
        "TCP_KEEPINTVL": KEEPALIVE_INTERVAL_S,
        "TCP_KEEPCNT": KEEPALIVE_COUNT,
        "TCP_USER_TIMEOUT": USER_TIMEOUT_MS,
    }
    return {getattr(socket, name): value for name, value in wanted.items() if hasattr(socket, name)}


def client_options() -> dict[str, Any]:
    """redis-py connection (or pool) keyword arguments."""
    return {
        "socket_timeout": SOCKET_TIMEOUT_S,
        "socket_connect_timeout": CONNECT_TIMEOUT_S,
        "socket_keepalive": True,
        "socket_keepalive_options": keepalive_options(),
        "health_check_interval": HEALTH_CHECK_S,
    }


def broker_options() -> dict[str, Any]:
    """kombu Redis transport options (its Channel reads each of these names). No retry on a
    timeout: a publish that timed out may have been written, and sent again it would run its
    step twice; the caller's own retry (Celery's, a step's) decides."""
    return {**client_options(), "retry_on_timeout": False}


def block_s(wanted_s: float) -> float:
    """A blocking command's server-side timeout in seconds: `wanted_s`, at most BLOCK_CAP_S
    (0, Redis's "forever", too)."""
    return BLOCK_CAP_S if wanted_s <= 0 else min(wanted_s, BLOCK_CAP_S)


def block_ms(wanted_ms: int) -> int:
    """An XREAD BLOCK in milliseconds: `wanted_ms`, at most BLOCK_CAP_S (0 too)."""
    cap_ms = int(BLOCK_CAP_S * 1000)
    return cap_ms if wanted_ms <= 0 else min(wanted_ms, cap_ms)


def broker_max_retries() -> int:
    """Celery's broker_connection_max_retries for the BROKER_RETRY_S pace."""
    return int(BROKER_GIVE_UP_S / BROKER_RETRY_S)
