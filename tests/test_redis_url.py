"""REDIS_URL's `sentinel://` form (schemas/redis_url.py): parsed into a typed value, refused with
one line naming what is wrong (never the password), turned into kombu's broker form for the
workers and the producer, and checked by the CLI and the workers before anything connects.
No Redis: the Sentinel fleet test is tests/test_failover_fleet.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from producer.cli_common import RedisUnreachable, check_redis_url, redis_where
from schemas.config import ConfigError
from schemas.redis_url import (
    SENTINEL_PORT,
    RedisUrlError,
    SentinelUrl,
    kombu_broker,
    parse_sentinel_url,
    redacted,
)
from worker.config import load_settings
from worker.edges import broker, broker_sentinel
from worker.edges.redis_pool import FollowingConnection
from worker.wiring import celery_config

THREE = "sentinel://:s3cret@h1:26380,h2,[::1]:26381/mymaster/3"


def test_a_sentinel_url_names_its_sentinels_master_db_and_password() -> None:
    url = parse_sentinel_url(THREE)
    assert url == SentinelUrl(
        sentinels=(("h1", 26380), ("h2", SENTINEL_PORT), ("::1", 26381)),
        master_name="mymaster",
        db=3,
        password="s3cret",
    )
    assert parse_sentinel_url("sentinel://h/m") == SentinelUrl((("h", 26379),), "m")
    user = parse_sentinel_url("sentinel://app:p%40ss%3A@h:1/m")  # percent-encoded
    assert (user.username, user.password) == ("app", "p@ss:")


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("sentinel://h1:26379", "no master name after the sentinels"),
        ("sentinel://h1/", "no master name after the sentinels"),
        ("sentinel://h1:26379;sentinel://h2:26379", "comma-separated in one URL"),
        ("sentinel://h1:x/m", "sentinel h1: port 'x' is not a port number"),
        ("sentinel://h1:70000/m", "port '70000' is not a port number"),
        ("sentinel://h1,,h2/m", "an empty sentinel address"),
        ("sentinel:///m", "an empty sentinel address"),
        ("sentinel://h!/m", "sentinel address 'h!' is not host[:port]"),
        ("sentinel://h/m/zero", "database 'zero' is not a number"),
        ("sentinel://h/m/0/1", "too many path parts"),
        ("sentinel://h/m?master_name=x", "takes no query"),
        ("sentinel://h/my%20master", "master name 'my master' is not a Sentinel master name"),
    ],
)
def test_a_malformed_sentinel_url_is_refused_in_one_line(url: str, says: str) -> None:
    with pytest.raises(RedisUrlError) as refused:
        parse_sentinel_url(url)
    assert says in str(refused.value)
    assert "\n" not in str(refused.value)


def test_the_password_is_never_shown() -> None:
    assert redacted(THREE) == "sentinel://:***@h1:26380,h2:26379,[::1]:26381/mymaster/3"
    assert redacted("redis://u:s3cret@h:6379/0") == "redis://u:***@h:6379/0"
    assert "s3cret" not in redacted("sentinel://:s3cret@h:x/m")  # malformed: still hidden
    with pytest.raises(RedisUnreachable) as refused:
        check_redis_url("sentinel://:s3cret@h/m/x")
    assert "s3cret" not in str(refused.value)
    assert "database 'x' is not a number" in str(refused.value)


def test_kombu_gets_its_own_form_and_the_master_name() -> None:
    url, options = kombu_broker(THREE)
    assert url == (
        "sentinel://:s3cret@h1:26380/3;sentinel://:s3cret@h2:26379/3;sentinel://:s3cret@[::1]:26381/3"
    )
    assert options == {"master_name": "mymaster"}  # its timeouts: every connection's
    assert kombu_broker("redis://h:6379/0") == ("redis://h:6379/0", {})


def test_the_workers_broker_is_our_channel_on_sentinel() -> None:
    settings = load_settings({"REDIS_URL": "sentinel://h1,h2/mymaster/2"})
    config = celery_config(settings)
    assert config["broker_url"] == "sentinel://h1:26379/2;sentinel://h2:26379/2"
    assert config["broker_transport"] == broker_sentinel.SENTINEL_TRANSPORT
    options = config["broker_transport_options"]
    assert options["master_name"] == "mymaster"
    assert options["socket_timeout"] > 0  # a paused master: a publish gives up
    channel = broker_sentinel.SentinelChannel
    assert {"master_name", "consumer_dead_after_s"} <= set(channel.from_transport_options)
    assert channel.connection_class is FollowingConnection
    assert issubclass(channel, broker.Channel)  # BLMOVE, per-consumer taken lists
    plain = celery_config(load_settings({"REDIS_URL": "redis://h:6379/0"}))
    assert plain["broker_transport"] == broker.TRANSPORT
    assert "master_name" not in plain["broker_transport_options"]


def test_a_worker_refuses_a_malformed_url_at_start() -> None:
    with pytest.raises(ConfigError) as refused:
        load_settings({"REDIS_URL": "sentinel://:s3cret@h1:26379;sentinel://h2/m"})
    assert "REDIS_URL" in str(refused.value) and "comma-separated" in str(refused.value)
    assert "s3cret" not in str(refused.value)


def test_config_check_says_where_redis_is_or_what_is_wrong() -> None:
    def check(url: str) -> subprocess.CompletedProcess[str]:
        env = {"REDIS_URL": url, "PATH": "/usr/bin:/bin"}
        cmd = [sys.executable, "-m", "producer.cli", "config", "check"]
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)

    shown = check("sentinel://:s3cret@h1,h2:26380/mymaster/1")
    assert shown.returncode == 0, shown.stderr
    assert (
        "redis: sentinel://:***@h1:26379,h2:26380/mymaster/1 (master 'mymaster' named by "
        "2 sentinels)"
    ) in shown.stdout
    assert "s3cret" not in shown.stdout
    refused = check("sentinel://h1/mymaster/x")
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        "cchatq: REDIS_URL 'sentinel://h1/mymaster/x' is not valid: database 'x' is not a number"
    ]
    assert redis_where("redis://h:6379/0") == "redis://h:6379/0"
