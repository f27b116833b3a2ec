"""Rate-limit headers and precise 429 waits: each provider's real header sets and error
bodies, table tests, no clock and no network."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from worker.codecs.rate_headers import (
    RateSignal,
    parse_go_duration,
    precise_retry_s,
    read_rate_signal,
)
from worker.codecs.retry import parse_retry_after_s

NOW = datetime(2026, 11, 26, 20, 0, 0, tzinfo=UTC).timestamp()

OPENAI_OK = {
    "Date": "Thu, 26 Nov 2026 20:00:00 GMT",
    "Content-Type": "application/json",
    "x-request-id": "req_7f3c2a9b1d4e",
    "openai-processing-ms": "412",
    "x-ratelimit-limit-requests": "5000",
    "x-ratelimit-limit-tokens": "800000",
    "x-ratelimit-remaining-requests": "4999",
    "x-ratelimit-remaining-tokens": "799412",
    "x-ratelimit-reset-requests": "12ms",
    "x-ratelimit-reset-tokens": "44ms",
}
ANTHROPIC_OK = {
    "content-type": "application/json",
    "request-id": "req_011CSLsW7mFqvHHnzrKdKjAE",
    "anthropic-ratelimit-requests-limit": "1000",
    "anthropic-ratelimit-requests-remaining": "999",
    "anthropic-ratelimit-requests-reset": "2026-11-26T20:00:00.060Z",
    "anthropic-ratelimit-tokens-limit": "96000",
    "anthropic-ratelimit-tokens-remaining": "95000",
    "anthropic-ratelimit-tokens-reset": "2026-11-26T20:00:01.250Z",
    "anthropic-ratelimit-input-tokens-limit": "80000",
    "anthropic-ratelimit-input-tokens-remaining": "79000",
    "anthropic-ratelimit-input-tokens-reset": "2026-11-26T20:00:01+00:00",
    "anthropic-ratelimit-output-tokens-limit": "16000",
    "anthropic-ratelimit-output-tokens-remaining": "16000",
    "anthropic-ratelimit-output-tokens-reset": "2026-11-26T20:00:00Z",
}
GEMINI_OK = {
    "Content-Type": "application/json; charset=UTF-8",
    "Vary": "Origin, X-Origin, Referer",
    "Server": "scaffolding on HTTPServer2",
    "Server-Timing": "gfet4t7; dur=612",
    "X-Content-Type-Options": "nosniff",
}
QUOTA_METRIC = "generativelanguage.googleapis.com/generate_content_free_tier_requests"


def _openai_429(message: str) -> dict[str, object]:
    return {
        "error": {
            "message": message,
            "type": "requests",
            "param": None,
            "code": "rate_limit_exceeded",
        }
    }


def _gemini_429(delay: object) -> dict[str, object]:
    return {
        "error": {
            "code": 429,
            "message": "You exceeded your current quota, please check your plan and billing.",
            "status": "RESOURCE_EXHAUSTED",
            "details": [
                {
                    "@type": "type.googleapis.com/google.rpc.QuotaFailure",
                    "violations": [
                        {
                            "quotaMetric": QUOTA_METRIC,
                            "quotaId": "GenerateRequestsPerMinutePerProjectPerModel-FreeTier",
                        }
                    ],
                },
                {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": delay},
            ],
        }
    }


# ---------------------------------------------------------------------------------------------
# read_rate_signal


def test_openai_success_headers() -> None:
    assert read_rate_signal(OPENAI_OK, NOW) == RateSignal(
        requests_per_min=5000.0,
        requests_left=4999.0,
        requests_reset_s=0.012,
        tokens_per_min=800000.0,
        tokens_left=799412.0,
        tokens_reset_s=0.044,
    )


def test_openai_header_names_are_case_insensitive() -> None:
    upper = {k.upper(): v for k, v in OPENAI_OK.items()}
    assert read_rate_signal(upper, NOW) == read_rate_signal(OPENAI_OK, NOW)


def test_anthropic_prefers_the_combined_token_budget() -> None:
    signal = read_rate_signal(ANTHROPIC_OK, NOW)
    assert signal.requests_reset_s == pytest.approx(0.06)
    assert signal == RateSignal(
        requests_per_min=1000.0,
        requests_left=999.0,
        requests_reset_s=signal.requests_reset_s,
        tokens_per_min=96000.0,
        tokens_left=95000.0,
        tokens_reset_s=1.25,
    )


def test_anthropic_input_tokens_without_the_combined_budget() -> None:
    headers = {k: v for k, v in ANTHROPIC_OK.items() if "-ratelimit-tokens-" not in k}
    signal = read_rate_signal(headers, NOW)
    assert (signal.tokens_per_min, signal.tokens_left, signal.tokens_reset_s) == (
        80000.0,
        79000.0,
        1.0,
    )


def test_gemini_says_nothing() -> None:
    signal = read_rate_signal(GEMINI_OK, NOW)
    assert signal == RateSignal()
    assert signal.empty
    assert not read_rate_signal(OPENAI_OK, NOW).empty
    assert not RateSignal(tokens_left=0.0).empty


@pytest.mark.parametrize(
    ("reset", "expected"),
    [
        ("2026-11-26T20:00:01.250Z", 1.25),
        ("2026-11-26T20:00:01.250+00:00", 1.25),
        ("2026-11-26T21:00:01.250+01:00", 1.25),  # another zone, same instant
        ("2026-11-26T20:00:30Z", 30.0),
        ("2026-11-26T20:00:00Z", 0.0),
        ("2026-11-26T19:59:58Z", 0.0),  # already past: never negative
        ("2026-11-26T20:00:01", None),  # no zone: not RFC 3339
        ("tomorrow", None),
        ("", None),
    ],
)
def test_anthropic_reset_times(reset: str, expected: float | None) -> None:
    headers = {"anthropic-ratelimit-requests-reset": reset}
    assert read_rate_signal(headers, NOW).requests_reset_s == expected


@pytest.mark.parametrize(
    "headers",
    [
        {"x-ratelimit-limit-requests": "many"},
        {"x-ratelimit-remaining-tokens": "nan"},
        {"x-ratelimit-remaining-tokens": "-1"},  # Azure's "not limited"
        {"x-ratelimit-reset-requests": "soon"},
        {"x-ratelimit-reset-tokens": "-1s"},
        {"anthropic-ratelimit-requests-limit": ""},
        {"anthropic-ratelimit-tokens-remaining": "inf"},
        {"anthropic-ratelimit-tokens-reset": "2026-13-40T25:00:00Z"},
    ],
)
def test_bad_values_are_not_said(headers: dict[str, str]) -> None:
    assert read_rate_signal(headers, NOW).empty


def test_one_bad_value_leaves_the_others() -> None:
    headers = dict(OPENAI_OK, **{"x-ratelimit-reset-tokens": "later"})
    signal = read_rate_signal(headers, NOW)
    assert signal.tokens_reset_s is None
    assert signal.tokens_left == 799412.0


# ---------------------------------------------------------------------------------------------
# parse_go_duration


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("27ms", 0.027),
        ("1.5s", 1.5),
        ("1m0s", 60.0),
        ("6m0s", 360.0),
        ("2m30.5s", 150.5),
        ("1h2m3s", 3723.0),
        ("0s", 0.0),
        ("500us", 0.0005),
        ("250µs", 0.00025),
        ("1500ns", 1.5e-6),
        ("1m", 60.0),
        (" 34s ", 34.0),
        ("7", 7.0),  # a bare number is seconds
        ("0.25", 0.25),
        ("", None),
        ("s", None),
        ("1.5", 1.5),
        ("-1s", None),
        ("1d", None),
        ("1s junk", None),
        ("1 s", None),
        ("nan", None),
        ("inf", None),
    ],
)
def test_parse_go_duration(text: str, expected: float | None) -> None:
    result = parse_go_duration(text)
    if expected is None:
        assert result is None
    else:
        assert result == pytest.approx(expected)


# ---------------------------------------------------------------------------------------------
# precise_retry_s


def _wait(headers: dict[str, str], body: object = None) -> float | None:
    return precise_retry_s(headers, body, NOW, parse_retry_after_s(headers, NOW))


TPM_MESSAGE = (
    "Rate limit reached for gpt-4o-mini in organization org-Xk2 on tokens per min (TPM): "
    "Limit 200000, Used 199870, Requested 412. Please try again in {}. Visit "
    "https://platform.openai.com/account/rate-limits to learn more."
)


@pytest.mark.parametrize(
    ("headers", "body", "expected"),
    [
        # the body's figure refines a rounded-up Retry-After
        ({"retry-after": "1"}, _openai_429(TPM_MESSAGE.format("27ms")), 0.027),
        ({"Retry-After": "2"}, _openai_429(TPM_MESSAGE.format("1.5s")), 1.5),
        ({"retry-after": "63"}, _openai_429(TPM_MESSAGE.format("1m2.5s")), 62.5),
        # the reset of the exhausted budget
        (
            {
                "retry-after": "1",
                "x-ratelimit-remaining-requests": "0",
                "x-ratelimit-reset-requests": "27ms",
                "x-ratelimit-remaining-tokens": "150000",
                "x-ratelimit-reset-tokens": "19.3s",
            },
            None,
            0.027,
        ),
        (
            {
                "retry-after": "2",
                "anthropic-ratelimit-requests-remaining": "12",
                "anthropic-ratelimit-requests-reset": "2026-11-26T20:00:00.500Z",
                "anthropic-ratelimit-input-tokens-remaining": "0",
                "anthropic-ratelimit-input-tokens-reset": "2026-11-26T20:00:01.250Z",
            },
            None,
            1.25,
        ),
        # a precise figure inconsistent with Retry-After is not believed
        ({"retry-after": "2"}, _openai_429(TPM_MESSAGE.format("27ms")), 2.0),
        ({"retry-after": "2"}, _gemini_429("0.027s"), 2.0),
        ({"retry-after": "1"}, _openai_429(TPM_MESSAGE.format("1.5s")), 1.0),
        # the first consistent figure wins: the body's 5s is not, the header's reset is
        (
            {
                "retry-after": "1",
                "x-ratelimit-remaining-tokens": "0",
                "x-ratelimit-reset-tokens": "300ms",
            },
            _openai_429(TPM_MESSAGE.format("5s")),
            0.3,
        ),
        # retry-after-ms is precise already
        ({"retry-after-ms": "250"}, None, 0.25),
        ({"retry-after-ms": "250", "retry-after": "1"}, _gemini_429("0.027s"), 0.25),
        # no Retry-After: the first precise figure
        ({}, _gemini_429("0.027s"), 0.027),
        ({}, _gemini_429("7s"), 7.0),
        ({}, _openai_429(TPM_MESSAGE.format("480ms")), 0.48),
        (
            {"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "1m0s"},
            None,
            60.0,
        ),
        # both budgets out: wait for the later reset
        (
            {
                "x-ratelimit-remaining-requests": "0",
                "x-ratelimit-reset-requests": "2s",
                "x-ratelimit-remaining-tokens": "0",
                "x-ratelimit-reset-tokens": "6s",
            },
            None,
            6.0,
        ),
        # nothing said
        ({}, None, None),
        ({}, {"error": "rate limited"}, None),
        ({}, _openai_429("You exceeded your current quota."), None),
        ({"x-ratelimit-remaining-requests": "3", "x-ratelimit-reset-requests": "2s"}, None, None),
        ({"retry-after": "3"}, None, 3.0),
        ({"retry-after": "0"}, None, 0.0),
        ({}, _gemini_429({"seconds": 2, "nanos": 500000000}), 2.5),
        ({}, _gemini_429("soon"), None),
    ],
)
def test_precise_retry_s(headers: dict[str, str], body: object, expected: float | None) -> None:
    result = _wait(headers, body)
    if expected is None:
        assert result is None
    else:
        assert result == pytest.approx(expected)


def test_precise_retry_s_uses_the_retry_after_it_is_given() -> None:
    body = _openai_429(TPM_MESSAGE.format("27ms"))
    assert precise_retry_s({}, body, NOW, 1.0) == pytest.approx(0.027)
    assert precise_retry_s({}, body, NOW, None) == pytest.approx(0.027)
    assert precise_retry_s({}, None, NOW, 4.0) == 4.0
    assert precise_retry_s({}, None, NOW, -2.0) == 0.0
