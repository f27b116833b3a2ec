"""RabbitMQ as the fleet's broker (`CCHATQ_BROKER_URL=amqp://...`), read here for the workers
and the producer alike: its URL forms, and the type and arguments its queues are declared
with. Both sides declare the fleet's queues, and RabbitMQ refuses a declaration whose
arguments differ from the queue's (PRECONDITION_FAILED), so both build them here.

    amqp://[user[:password]@]host[:port][/vhost]     (port 5672; `/vhost` percent-encoded)
    amqps://...                                        the same over TLS (port 5671)

    CCHATQ_QUEUE_TYPE   classic (default) or quorum: the type of every queue of the fleet
"""

from __future__ import annotations

from collections.abc import Mapping
from urllib.parse import urlsplit

AMQP_SCHEMES = ("amqp", "amqps")
QUEUE_TYPE_VARIABLE = "CCHATQ_QUEUE_TYPE"
CLASSIC = "classic"
QUORUM = "quorum"
QUEUE_TYPES = (CLASSIC, QUORUM)
# AMQP heartbeats both ways: a worker whose connection died silently is noticed within about
# two of them, and RabbitMQ hands out again at once what that worker had taken
HEARTBEAT_S = 10


class AmqpUrlError(ValueError):
    """A broker URL or queue type this module does not read: one line, naming what."""


def is_amqp(url: str) -> bool:
    """Whether `url` names RabbitMQ (amqp://, amqps://) rather than a Redis."""
    return url.partition("://")[0].lower() in AMQP_SCHEMES and "://" in url


def check_amqp_url(url: str) -> None:
    """An AmqpUrlError (one line, never the password) unless `url` is an amqp:// or amqps://
    URL with a readable host and port."""
    if not is_amqp(url):
        raise AmqpUrlError("not an AMQP URL (accepted schemes: amqp://, amqps://)")
    parts = urlsplit(url)
    try:
        parts.port  # noqa: B018 (a port that is no number raises here)
    except ValueError:
        raise AmqpUrlError("its port is not a port number") from None
    if not parts.hostname:
        raise AmqpUrlError("no host (expected amqp://[user[:password]@]host[:port][/vhost])")
    if parts.query or parts.fragment:
        raise AmqpUrlError("an amqp:// URL of cchatq takes no query or fragment")


def queue_type(env: Mapping[str, str]) -> str:
    """CCHATQ_QUEUE_TYPE: classic unless said; an AmqpUrlError naming the types otherwise."""
    named = env.get(QUEUE_TYPE_VARIABLE, "").strip().lower() or CLASSIC
    if named not in QUEUE_TYPES:
        raise AmqpUrlError(f"{named!r} is no queue type (classic or quorum)")
    return named


def queue_arguments(kind: str) -> dict[str, str]:
    """The arguments every queue of the fleet is declared with."""
    return {"x-queue-type": kind}
