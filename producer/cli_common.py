"""What the `cchatq` commands share: where Redis is and reaching it, the exit codes, the
fleet's configuration, counts as they are printed."""

from __future__ import annotations

import os
import shlex
import socket
import sys
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode, urlsplit

import redis
from redis.sentinel import MasterNotFoundError

from producer.broker_queues import AmqpQueues
from producer.redis_connect import redis_client
from producer.redis_room import EvictingRedisError, RedisFullError, refused_write
from schemas import redis_url as urls
from schemas.amqp_broker import AmqpUrlError, check_amqp_url, is_amqp
from schemas.config import ConfigError, read_config
from schemas.fleet_config import FleetConfig
from schemas.fleet_urls import STATE_ON_AMQP, fleet_urls

if TYPE_CHECKING:
    from producer.client import Client

DEFAULT_FLOWER_URL = "http://127.0.0.1:5555"  # CCHATQ_FLOWER_URL: where session links point
REDIS_SCHEMES = urls.REDIS_SCHEMES
# The first contact with Redis: a command that cannot reach it says so within a few seconds,
# instead of riding out RECONNECT_S of retries meant for a restart mid-batch.
PROBE_TIMEOUT_S = 2.0


def redis_url() -> str:
    """The fleet's state: CCHATQ_STATE_URL, else REDIS_URL (schemas/fleet_urls.py)."""
    return fleet_urls(os.environ).state


def broker_url() -> str:
    """The fleet's broker: CCHATQ_BROKER_URL, else REDIS_URL."""
    return fleet_urls(os.environ).broker


def url_variable(url: str) -> str:
    """The variable that names `url`, as messages say what to change."""
    named = fleet_urls(os.environ)
    if url == named.state:
        return named.state_variable
    return named.broker_variable if url == named.broker else "REDIS_URL"


# `cchatq`'s exit codes (README: Exit codes)
EXIT_OK = 0  # every session ended ok
EXIT_FAILED = 1  # every session ended, some with an error body
EXIT_REJECTED = 2  # the input was rejected: nothing enqueued (stream: the run had ended)
EXIT_INTERRUPTED = 3  # Ctrl-C or --timeout-s: the sessions left keep running on the fleet
# Redis could not be reached (or REDIS_URL is not a Redis URL), has no room for the sessions,
# refuses writes, or may evict cchatq's keys: the infrastructure, not the input
EXIT_UNREACHABLE = 4


class RedisUnreachable(Exception):
    """Redis at `url` did not answer (or the URL is not one): the one line the CLI prints."""


def redacted(url: str) -> str:
    """A Redis URL without its password: what messages and pages show."""
    return urls.redacted(url)


def unreachable_message(url: str, exc: BaseException) -> str:
    """One line: which Redis could not be reached, why, and what to do about it."""
    shown, var = redacted(url), url_variable(url)
    local = 'or a whole local fleet with `eval "$(cchatq up)"`'
    reason, hint = _reason(exc), f"start one ({_start_hint(url)}), {local}, or set {var}"
    if isinstance(exc, MasterNotFoundError):
        reason = _no_master(url, exc)
        hint = f"check the sentinels' addresses and the master name in {var}"
    elif isinstance(exc.__context__, socket.gaierror):
        reason, hint = f"unknown host: {reason}", f"check the host name in {var}"
    elif isinstance(exc, redis.AuthenticationError | redis.ResponseError):
        hint = f"check the user and password in {var}"
    elif isinstance(exc, redis.exceptions.InvalidResponse):
        hint = f"point {var} at a Redis server"
    return f"cchatq: cannot reach Redis at {shown} ({reason}): {hint}"


def refused_message(url: str, exc: BaseException) -> str:
    """One line: Redis answers but refuses writes (full, failing to persist, a replica)."""
    text = str(exc).strip().split("\n")[0][:200]
    return (
        f"cchatq: Redis at {redacted(url)} refuses writes ({text}): free memory or raise"
        f" maxmemory, free its disk, or point {url_variable(url)} at the master, then run the"
        " command again"
    )


def infrastructure_line(exc: BaseException) -> str | None:
    """The one line a command ends with (exit EXIT_UNREACHABLE) when Redis is the trouble:
    unreachable, no room for the sessions, refusing writes, or a policy that may evict its
    keys; None for any other error."""
    if isinstance(exc, RedisUnreachable | RedisFullError | EvictingRedisError):
        return str(exc)
    if isinstance(exc, redis.ConnectionError | redis.TimeoutError):  # lost past the retries
        return unreachable_message(redis_url(), exc)
    if isinstance(exc, redis.RedisError) and refused_write(exc):
        return refused_message(redis_url(), exc)
    return None


def check_redis_url(url: str) -> None:
    """A RedisUnreachable naming the URL and the accepted schemes unless it is a Redis URL,
    or what is wrong with a sentinel:// one."""
    scheme = url.partition("://")[0].lower() if "://" in url else ""
    if is_amqp(url):  # the state's URL: RabbitMQ can only be the broker
        raise RedisUnreachable(f"cchatq: {url_variable(url)} {redacted(url)!r} {STATE_ON_AMQP}")
    if scheme not in REDIS_SCHEMES:
        accepted = ", ".join(f"{s}://" for s in REDIS_SCHEMES)
        raise RedisUnreachable(
            f"cchatq: {url_variable(url)} {redacted(url)!r} is not a Redis URL (accepted"
            f" schemes: {accepted})"
        )
    try:
        urls.check_redis_url(url)
    except urls.RedisUrlError as exc:
        raise RedisUnreachable(
            f"cchatq: {url_variable(url)} {redacted(url)!r} is not valid: {exc}"
        ) from None


def redis_where(url: str, client: Any = None) -> str:
    """Where REDIS_URL points, as `config check` and `status` say it (never its password); a
    Sentinel's master where `client`'s sentinels say it is now."""
    sentinel = urls.check_redis_url(url)
    if sentinel is None:
        return redacted(url)
    count = plural(len(sentinel.sentinels), "sentinel")
    where = f"{sentinel.redacted()} (master {sentinel.master_name!r} named by {count})"
    if client is not None:
        try:
            host, port = client.connection_pool.get_master_address()
        except redis.RedisError as exc:
            return f"{where}, no master now: {type(exc).__name__}"
        where = f"{where}, now at {host}:{port}"
    return where


def reach_redis(url: str) -> None:
    """PING Redis at `url` once, without retries: a RedisUnreachable (one line) if it does
    not answer within PROBE_TIMEOUT_S to connect and again to reply."""
    check_redis_url(url)
    timeout_s = PROBE_TIMEOUT_S
    try:
        probe = redis_client(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
    except ValueError as exc:
        raise RedisUnreachable(
            f"cchatq: {url_variable(url)} {redacted(url)!r} is not valid: {exc}"
        ) from None
    try:
        probe.ping()
    except (redis.RedisError, OSError) as exc:
        raise RedisUnreachable(unreachable_message(url, exc)) from None
    finally:
        probe.close()


def reach_broker(url: str) -> None:
    """reach_redis for a Redis broker; RabbitMQ's is connected to once (no retries): a
    RedisUnreachable (one line, naming its variable) when it cannot be."""
    if not is_amqp(url):
        reach_redis(url)
        return
    try:
        check_amqp_url(url)
    except AmqpUrlError as exc:
        raise RedisUnreachable(
            f"cchatq: {url_variable(url)} {redacted(url)!r} is not valid: {exc}"
        ) from None
    probe = AmqpQueues(url)
    try:
        probe.ping()
    except Exception as exc:
        raise RedisUnreachable(
            f"cchatq: cannot reach RabbitMQ at {redacted(url)} ({_reason(exc)}): start it, or"
            f" set {url_variable(url)}"
        ) from None
    finally:
        probe.close()


def broker_where(url: str, client: Any = None) -> str:
    """Where the broker is, as `status` says it (never its password)."""
    return redacted(url) if is_amqp(url) else redis_where(url, client)


def connect(
    config: FleetConfig | None = None,
    namespace: str | None = None,
    lookup_batch: str | None = None,
) -> Client:
    """The CLI's client of the fleet at REDIS_URL, once Redis answered (reach_redis). Later
    connection errors are ridden out for the Client's RECONNECT_S, then end the command in
    one line (producer/cli.py main). Ids are claimed and looked up in `namespace` (default: the
    configuration's), or as `lookup_batch` ran them."""
    from producer.client import Client  # the Celery app: only for commands that connect

    url, broker = redis_url(), broker_url()
    reach_redis(url)
    if broker != url:
        reach_broker(broker)
    if config is None:
        try:  # only its namespace is read here: a configuration the workers would refuse
            config = read_config()  # still lets a session be looked up
        except ConfigError:
            config = FleetConfig()
    return Client(
        url, config=config, namespace=namespace, lookup_batch=lookup_batch, broker_url=broker
    )


def _reason(exc: BaseException) -> str:
    cause = exc.__context__ if exc.__context__ is not None else exc
    if isinstance(cause, TimeoutError) or isinstance(exc, redis.TimeoutError):
        return f"no answer within {PROBE_TIMEOUT_S:g} s"
    if isinstance(cause, OSError) and cause.strerror:
        return cause.strerror
    if isinstance(exc, redis.exceptions.InvalidResponse):
        return "not a Redis server"
    return str(exc).strip().rstrip(".") or type(exc).__name__


def _no_master(url: str, exc: MasterNotFoundError) -> str:
    """Why no master was found: no sentinel answered, or those that did name none by the URL's
    master name (or only one they think down)."""
    sentinel = urls.parse_sentinel_url(url)
    failed = str(exc).count(")> - ")  # redis-py lists each sentinel it could not ask so
    if failed >= len(sentinel.sentinels):
        return f"none of its {plural(len(sentinel.sentinels), 'sentinel')} answered"
    return f"no sentinel names a live master {sentinel.master_name!r}"


def _start_hint(url: str) -> str:
    if urls.is_sentinel(url):
        return "the master its sentinels name, or wait for their failover"
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return f"redis-server --unixsocket {parts.path}"
    return f"redis-server --port {parts.port or 6379}"


def fleet_config() -> FleetConfig | None:
    """The configuration shared with the workers, or None after saying what is wrong with it."""

    try:
        return read_config()
    except ConfigError as exc:
        print(f"rejected, nothing enqueued:\n{exc}", file=sys.stderr)
        return None


def flower_links(spec_id: str) -> tuple[str, str]:
    """Flower's search for a session's step tasks and its tasks API link: every step task of
    the session shows its spec id as kwargs (worker/edges/dispatch.py). `cchatq status ID`
    prints both, and `cchatq view` links them."""
    search = f"kwargs:session={spec_id}"
    flower = os.environ.get("CCHATQ_FLOWER_URL", DEFAULT_FLOWER_URL).rstrip("/")
    return search, f"{flower}/api/tasks?{urlencode({'search': search})}"


def flower_curl(tasks_url: str) -> str:
    """The shell line that fetches a Flower API link: with the credentials of
    FLOWER_BASIC_AUTH when it is set, named by the variable (a secret is never printed)."""
    auth = '-u "$FLOWER_BASIC_AUTH" ' if os.environ.get("FLOWER_BASIC_AUTH", "").strip() else ""
    return f"curl {auth}{shlex.quote(tasks_url)}"


def plural(count: int, noun: str, many: str | None = None) -> str:
    """`1 session`, `2 sessions` (`many`: a plural not made with -s): counts as printed."""
    return f"{count} {noun if count == 1 else many or noun + 's'}"
