"""Retry maths (Retry-After, x-should-retry, retried statuses, backoff with jitter): table
tests, no clock and no network."""

from __future__ import annotations

from email.utils import formatdate

import pytest

from worker.codecs.retry import RetryPolicy, backoff_s, parse_retry_after_s, should_retry_status
from worker.config import BackendConfig

NOW = 1_700_000_000.0


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({}, None),
        ({"Retry-After": "7"}, 7.0),
        ({"retry-after": "1.5"}, 1.5),
        ({"RETRY-AFTER": " 2 "}, 2.0),
        ({"Retry-After": "-3"}, 0.0),
        ({"retry-after-ms": "750"}, 0.75),
        ({"Retry-After-Ms": "750", "Retry-After": "9"}, 0.75),  # ms wins
        ({"retry-after-ms": "junk", "Retry-After": "9"}, 9.0),  # bad ms falls back
        ({"retry-after-ms": "-5"}, 0.0),
        ({"Retry-After": formatdate(NOW + 30, usegmt=True)}, 30.0),
        ({"Retry-After": formatdate(NOW - 30, usegmt=True)}, 0.0),  # date in the past
        ({"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"}, 0.0),
        ({"Retry-After": "soon"}, None),
        ({"Retry-After": "nan"}, None),
        ({"Retry-After": ""}, None),
    ],
)
def test_parse_retry_after_s(headers: dict[str, str], expected: float | None) -> None:
    assert parse_retry_after_s(headers, NOW) == expected


@pytest.mark.parametrize(
    ("status", "headers", "expected"),
    [
        (429, {}, True),
        (408, {}, True),
        (409, {}, True),
        (500, {}, True),
        (502, {}, True),
        (503, {}, True),
        (504, {}, True),
        (529, {}, True),
        (400, {}, False),
        (401, {}, False),
        (403, {}, False),
        (404, {}, False),
        (422, {}, False),
        (503, {"x-should-retry": "false"}, False),
        (429, {"X-Should-Retry": "False"}, False),
        (400, {"X-Should-Retry": "true"}, True),
        (500, {"x-should-retry": "maybe"}, True),  # unknown values are ignored
    ],
)
def test_should_retry_status(status: int, headers: dict[str, str], expected: bool) -> None:
    assert should_retry_status(status, headers) is expected


POLICY = RetryPolicy()


@pytest.mark.parametrize(
    ("attempt", "retry_after", "rand", "expected"),
    [
        (1, None, 0.0, 0.5),
        (2, None, 0.0, 1.0),
        (3, None, 0.0, 2.0),
        (4, None, 0.0, 4.0),
        (5, None, 0.0, 8.0),
        (6, None, 0.0, 8.0),  # capped at backoff_max_s
        (1000, None, 0.0, 8.0),  # no overflow
        (0, None, 0.0, 0.5),
        (1, None, 0.5, 0.625),  # jitter added after the cap
        (9, None, 0.999, 8.0 + 0.999 * 0.25),
        (1, 7.0, 0.9, 7.0),  # server delay used as is, no jitter
        (3, 0.0, 0.9, 0.0),
        (1, 600.0, 0.0, 60.0),  # capped at max_retry_after_s
    ],
)
def test_backoff_s(attempt: int, retry_after: float | None, rand: float, expected: float) -> None:
    assert backoff_s(attempt, POLICY, retry_after, rand) == pytest.approx(expected)


def test_policy_defaults_and_from_backend() -> None:
    defaults = RetryPolicy(
        max_attempts=4, backoff_base_s=0.5, backoff_max_s=8.0, max_retry_after_s=60.0, jitter_s=0.25
    )
    assert defaults == POLICY
    backend = BackendConfig(
        name="b", max_attempts=2, backoff_base_s=0.1, backoff_max_s=1.0, max_retry_after_s=5.0
    )
    assert RetryPolicy.from_backend(backend) == RetryPolicy(
        max_attempts=2, backoff_base_s=0.1, backoff_max_s=1.0, max_retry_after_s=5.0
    )
    assert RetryPolicy.from_backend(BackendConfig(name="b", max_attempts=0)).max_attempts == 1
    assert backoff_s(5, RetryPolicy.from_backend(backend), None, 0.0) == 1.0
