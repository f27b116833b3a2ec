"""Where a fleet keeps its sessions' state and its broker's queues: one Redis by default, or
apart. Read here for the workers and the producer alike.

    REDIS_URL           both, unless one of the two below says otherwise
                        (default redis://127.0.0.1:6379/0)
    CCHATQ_STATE_URL    the sessions' state: specs, replies, leases, results, traces
    CCHATQ_BROKER_URL   the Celery broker's queues

When both are the same Redis, a step's messages and its state are written in one transaction;
apart, a step writes its state in one transaction, then its messages: a step that dies between
the two leaves its session with no next step in a queue, which the reconciler publishes again
once the session shows no progress for CCHATQ_STALL_AFTER_S (as for a message a broker lost).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from schemas.redis_url import RedisUrlError, check_redis_url

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
STATE_VARIABLE = "CCHATQ_STATE_URL"
BROKER_VARIABLE = "CCHATQ_BROKER_URL"


@dataclass(frozen=True)
class FleetUrls:
    state: str
    broker: str
    # the variables that named them (REDIS_URL unless their own was set): what errors name
    state_variable: str = "REDIS_URL"
    broker_variable: str = "REDIS_URL"

    @property
    def shared(self) -> bool:
        """Whether state and broker are the same Redis (one transaction a step)."""
        return self.state == self.broker


def fleet_urls(env: Mapping[str, str]) -> FleetUrls:
    """The state's and the broker's URLs as the environment names them (not checked)."""
    base = env.get("REDIS_URL") or DEFAULT_REDIS_URL
    state, broker = env.get(STATE_VARIABLE), env.get(BROKER_VARIABLE)
    return FleetUrls(
        state or base,
        broker or base,
        STATE_VARIABLE if state else "REDIS_URL",
        BROKER_VARIABLE if broker else "REDIS_URL",
    )


def checked(urls: FleetUrls) -> list[tuple[str, str]]:
    """Each URL that is no Redis URL, as (its variable, why): none when both are."""
    problems = []
    for variable, url in ((urls.state_variable, urls.state), (urls.broker_variable, urls.broker)):
        try:
            check_redis_url(url)
        except RedisUrlError as exc:
            if (variable, str(exc)) not in problems:
                problems.append((variable, str(exc)))
    return problems
