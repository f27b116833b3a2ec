"""The replay server's rate-limit mode: the bucket maths on a fake clock, then the headers, the
429s, the admin endpoints and the command line over real HTTP."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import requests

from fixtures.replay.rate_limit import KeyBuckets, RateLimits, limits_from_json
from fixtures.replay.rate_wire import api_key, go_duration, prompt_tokens, retry_after, rfc3339
from fixtures.replay.server import ReplayServer
from tests.test_replay_server import replay_process


class Clock:
    """A settable clock: `now` seconds, moved only by the test."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def buckets(rps: float, tpm: int | None = None, burst_s: float = 1.0) -> tuple[KeyBuckets, Clock]:
    """A limiter on a fake clock (and a fixed wall clock), and that clock."""
    clock = Clock()
    limiter = KeyBuckets(RateLimits(rps, tpm, burst_s), clock=clock, wall=lambda: 1.7e9)
    return limiter, clock


# --- the limits -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "field"),
    [((0,), "rps"), ((-1.0,), "rps"), ((1, 0), "tpm"), ((1, -5), "tpm"), ((1, None, 0), "burst_s")],
)
def test_limits_are_validated_naming_the_field(args: tuple[Any, ...], field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field} "):
        RateLimits(*args)


def test_limits_from_json_keeps_what_is_not_given() -> None:
    assert limits_from_json(None, {"rps": 10}) == RateLimits(10.0, None, 1.0)
    current = RateLimits(2, 600, 3)
    assert limits_from_json(current, {"burst_s": 1}) == RateLimits(2, 600, 1.0)
    assert limits_from_json(current, {"tpm": None}) == RateLimits(2, None, 3)
    assert limits_from_json(current, {}) == current
    for body, field in [
        ({"tpm": 60}, "rps"),  # off, and no rps
        ({"rps": True}, "rps"),
        ({"rps": 1, "tpm": 1.5}, "tpm"),
        ({"rps": 1, "burst_s": "2"}, "burst_s"),
        ({"rps": 1, "speed": 2}, "speed"),
    ]:
        with pytest.raises(ValueError, match=rf"^{field}\b"):
            limits_from_json(None, body)


# --- the bucket maths -----------------------------------------------------------------------


def test_requests_bucket_holds_a_burst_and_refills_at_rps() -> None:
    limiter, clock = buckets(rps=2, burst_s=2)  # capacity 4, starts full
    for left in (3, 2, 1, 0):
        admission = limiter.admit("k", 1)
        assert (admission.admitted, admission.remaining_requests) == (True, left)
        assert admission.limit_requests_per_min == 120 and admission.wait_s == 0
    assert admission.reset_requests_s == 2.0  # 4 requests at 2 per second
    refused = limiter.admit("k", 1)
    # the refusal costs a request too: level -1, so 1 request is 1 s away
    assert (refused.admitted, refused.reason, refused.wait_s) == (False, "requests", 1.0)
    assert (refused.remaining_requests, refused.reset_requests_s) == (0, 2.5)
    assert limiter.admit("other key", 1).remaining_requests == 3  # a bucket per key
    clock.advance(refused.wait_s)
    assert limiter.admit("k", 1).admitted
    clock.advance(60)
    admission = limiter.admit("k", 1)
    assert (admission.remaining_requests, admission.reset_requests_s) == (3, 0.5)


def test_refused_requests_count_down_to_minus_the_capacity() -> None:
    limiter, clock = buckets(rps=1)
    assert limiter.admit("k", 1).admitted
    waits = [limiter.admit("k", 1).wait_s for _ in range(5)]
    assert waits == [2.0] * 5  # the level stops at -1: a retry storm costs no more than that
    clock.advance(1.999)
    assert not limiter.admit("k", 1).admitted  # 0.999 short, and now at -1 again
    clock.advance(2.0)
    assert limiter.admit("k", 1).admitted


def test_bucket_smaller_than_one_request_admits_when_full() -> None:
    limiter, clock = buckets(rps=0.25, burst_s=2)  # holds half a request
    assert limiter.admit("k", 1).admitted
    refused = limiter.admit("k", 1)
    assert (refused.admitted, refused.wait_s) == (False, 4.0)  # from -0.5 to full at 0.25/s
    clock.advance(4.0)
    assert limiter.admit("k", 1).admitted


def test_tokens_bucket_refuses_and_says_when() -> None:
    limiter, clock = buckets(rps=100, tpm=600)  # tokens: 10 per second, capacity 10
    first = limiter.admit("k", 6)
    assert (first.admitted, first.limit_tokens_per_min, first.remaining_tokens) == (True, 600, 4)
    assert first.reset_tokens_s == pytest.approx(0.6)
    refused = limiter.admit("k", 5)
    assert (refused.admitted, refused.reason, refused.tokens) == (False, "tokens", 5)
    assert refused.wait_s == pytest.approx(0.1)  # 1 token short at 10 per second
    assert refused.remaining_requests == 98  # the refused request counted
    assert refused.remaining_tokens == 4  # no tokens taken
    clock.advance(refused.wait_s)
    assert limiter.admit("k", 5).admitted


def test_request_larger_than_the_tokens_bucket_passes_when_it_is_full() -> None:
    limiter, clock = buckets(rps=100, tpm=600)  # capacity 10 tokens
    big = limiter.admit("k", 25)
    assert (big.admitted, big.remaining_tokens, big.reset_tokens_s) == (True, 0, 2.5)
    again = limiter.admit("k", 25)
    assert (again.admitted, again.wait_s) == (False, 2.5)  # until full, not until 25
    clock.advance(2.4)
    assert not limiter.admit("k", 25).admitted
    clock.advance(0.1)
    assert limiter.admit("k", 25).admitted


def test_wait_is_the_later_of_the_two_buckets() -> None:
    limiter, _ = buckets(rps=1, tpm=60)  # 1 request, 1 token per second, capacity 1 each
    assert limiter.admit("k", 1).admitted
    both = limiter.admit("k", 1)
    assert (both.reason, both.wait_s) == ("requests", 2.0)  # requests -1 -> 1; tokens 0 -> 1
    limiter, _ = buckets(rps=10, tpm=60)
    assert limiter.admit("k", 1).admitted
    tokens = limiter.admit("k", 1)
    assert (tokens.reason, tokens.wait_s) == ("tokens", 1.0)


def test_set_limits_clamps_every_level_never_raises_it() -> None:
    limiter, clock = buckets(rps=10, tpm=600)
    assert limiter.admit("full", 1).remaining_requests == 9
    for _ in range(10):
        limiter.admit("empty", 1)
    limiter.set_limits(RateLimits(rps=2, tpm=60))
    clamped = limiter.admit("full", 1)
    assert (clamped.limit_requests_per_min, clamped.remaining_requests) == (120, 1)  # 2 -> 1
    assert (clamped.limit_tokens_per_min, clamped.remaining_tokens) == (60, 0)  # 1 -> 0
    limiter.set_limits(RateLimits(rps=100))
    still_empty = limiter.admit("empty", 1)  # level 0 (then -1): a higher limit adds nothing
    assert (still_empty.admitted, still_empty.wait_s) == (False, 0.02)
    assert still_empty.limit_tokens_per_min is None
    clock.advance(0.02)
    assert limiter.admit("empty", 1).admitted  # refilled at the new rate
    assert limiter.admit("new", 1).remaining_requests == 99


def test_counters_and_timeline_keep_the_last_hour() -> None:
    wall = [100.2]
    limiter = KeyBuckets(RateLimits(1), clock=Clock(), wall=lambda: wall[0])
    limiter.admit("k", 1)
    wall[0] = 100.7
    limiter.admit("k", 1)
    wall[0] = 101.1
    limiter.admit("other", 1)
    snapshot = limiter.snapshot()
    assert (snapshot["accepted"], snapshot["refused"]) == (2, 1)
    assert snapshot["timeline"] == [[100, 1, 1], [101, 1, 0]]
    assert (snapshot["rps"], snapshot["tpm"], snapshot["burst_s"]) == (1, None, 1.0)
    wall[0] = 3700.5  # seconds 101..3700 are the last 3600
    limiter.admit("third", 1)
    assert limiter.snapshot()["timeline"] == [[101, 1, 0], [3700, 1, 0]]
    limiter.reset()
    assert limiter.snapshot() == {  # the counters go, the limits stay
        "enabled": True,
        "rps": 1,
        "tpm": None,
        "burst_s": 1.0,
        "accepted": 0,
        "refused": 0,
        "timeline": [],
    }


# --- formats --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (0.027, "27ms"),
        (0.0001, "1ms"),  # rounded up: a client never retries early
        (0.999, "999ms"),
        (1, "1s"),
        (1.5, "1.5s"),
        (1.2345, "1.235s"),
        (59.9999, "1m0s"),
        (60, "1m0s"),
        (150.5, "2m30.5s"),
        (3600, "1h0m0s"),
    ],
)
def test_go_durations(seconds: float, text: str) -> None:
    assert go_duration(seconds) == text


def test_rfc3339_and_retry_after() -> None:
    assert rfc3339(0) == "1970-01-01T00:00:00.000Z"
    assert rfc3339(1_700_000_000.5) == "2023-11-14T22:13:20.500Z"
    assert rfc3339(1_700_000_000.1234) == "2023-11-14T22:13:20.124Z"
    assert [retry_after(w) for w in (0.2, 1.0, 2.0, 2.1)] == ["1", "1", "2", "3"]


def test_api_key_as_each_wire_sends_it() -> None:
    assert api_key({"authorization": "Bearer sk-1"}, {}) == "sk-1"
    assert api_key({"x-api-key": "ant"}, {}) == "ant"
    assert api_key({"x-goog-api-key": "goog"}, {}) == "goog"
    assert api_key({}, {"key": ["q"]}) == "q"
    assert api_key({"authorization": "Basic xyz"}, {}) == "anonymous"


# --- over HTTP ------------------------------------------------------------------------------

PROTOCOLS = ["openai", "tags", "anthropic", "gemini"]
GO_DURATION = re.compile(r"^(?:\d+h)?(?:\d+m)?(?:\d+(?:\.\d{1,3})?s|\d+ms)$")
RFC3339 = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


def post(
    server: ReplayServer, protocol: str, key: str, text: str = "hi", scenario: str = "plain"
) -> requests.Response:
    """One request of `scenario` on `protocol` with API key `key` (Gemini's in the query)."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": text}]
    if protocol in ("openai", "tags"):
        prefix = "replay/" if protocol == "openai" else "replay-tags/"
        body: dict[str, Any] = {"model": prefix + scenario, "messages": messages}
        auth = {"authorization": f"Bearer {key}"}
        return requests.post(f"{server.url}/chat/completions", json=body, headers=auth, timeout=10)
    if protocol == "anthropic":
        body = {"model": f"replay/{scenario}", "max_tokens": 64, "messages": messages}
        headers = {"anthropic-version": "2023-06-01", "x-api-key": key}
        return requests.post(f"{server.root}/v1/messages", json=body, headers=headers, timeout=10)
    url = f"{server.root}/v1beta/models/replay-{scenario}:generateContent?key={key}"
    body = {"contents": [{"role": "user", "parts": [{"text": text}]}]}
    return requests.post(url, json=body, timeout=10)


def rate_headers(response: requests.Response) -> dict[str, str]:
    return {
        k.lower(): v
        for k, v in response.headers.items()
        if "ratelimit" in k.lower() or k.lower() == "retry-after"
    }


def seconds_of(duration: str) -> float:
    """A Go-style duration as seconds ("3.996s", "27ms", "1m2s")."""
    if duration.endswith("ms"):
        return int(duration[:-2]) / 1000
    match = re.fullmatch(r"(?:(\d+)m)?([\d.]+)s", duration)
    assert match, duration
    return int(match[1] or 0) * 60 + float(match[2])


@pytest.fixture(scope="module")
def limited() -> Iterator[ReplayServer]:
    # a bucket of one request, refilled every 2 s: the second request at once is refused
    srv = ReplayServer(port=0, rate_limits=RateLimits(rps=0.5, tpm=100_000, burst_s=2)).start()
    yield srv
    srv.stop()


def set_limits(server: ReplayServer, **limits: Any) -> None:
    response = requests.post(f"{server.root}/admin/limits", json=limits, timeout=5)
    assert response.status_code == 200, response.text


@pytest.fixture()
def server(limited: ReplayServer) -> ReplayServer:
    set_limits(limited, rps=0.5, tpm=100_000, burst_s=2)
    limited.reset()  # every bucket full again
    return limited


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_rate_limit_headers_on_a_success(server: ReplayServer, protocol: str) -> None:
    response = post(server, protocol, "key-1")
    assert response.status_code == 200, response.text
    got = rate_headers(response)
    if protocol == "gemini":
        assert got == {}  # the real API sends none
        return
    if protocol == "anthropic":
        for kind, limit in [("requests", "30"), ("tokens", "100000"), ("input-tokens", "100000")]:
            assert got[f"anthropic-ratelimit-{kind}-limit"] == limit
            assert RFC3339.match(got[f"anthropic-ratelimit-{kind}-reset"])
        assert got["anthropic-ratelimit-requests-remaining"] == "0"
        remaining = int(got["anthropic-ratelimit-tokens-remaining"])
        assert got["anthropic-ratelimit-input-tokens-remaining"] == str(remaining)
        assert 3000 < remaining < 100_000 // 60 * 2  # the bucket less this prompt
        assert len(got) == 9
        return
    assert got["x-ratelimit-limit-requests"] == "30"
    assert got["x-ratelimit-remaining-requests"] == "0"
    assert got["x-ratelimit-limit-tokens"] == "100000"
    assert 3000 < int(got["x-ratelimit-remaining-tokens"]) < 3334
    for name in ("x-ratelimit-reset-requests", "x-ratelimit-reset-tokens"):
        assert GO_DURATION.match(got[name]), got[name]
    assert 0 < seconds_of(got["x-ratelimit-reset-requests"]) <= 2
    assert len(got) == 6


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_429_once_the_bucket_is_empty(server: ReplayServer, protocol: str) -> None:
    assert post(server, protocol, "key-2").status_code == 200
    refused = post(server, protocol, "key-2")
    assert refused.status_code == 429
    assert refused.headers["Content-Type"] == "application/json"
    body, got = refused.json(), rate_headers(refused)
    # the bucket was at ~0, the refusal took it to ~-1: ~4 s until one request is back
    if protocol == "gemini":
        assert got == {}
        delay = body["error"]["details"][0]["retryDelay"]
        assert re.fullmatch(r"\d+(\.\d{1,3})?s", delay) and 2 < float(delay[:-1]) <= 4
        body["error"]["details"][0]["retryDelay"] = "*"
        assert body == {
            "error": {
                "code": 429,
                "message": "Resource has been exhausted (e.g. check quota).",
                "status": "RESOURCE_EXHAUSTED",
                "details": [
                    {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "*"}
                ],
            }
        }
        return
    assert got["retry-after"] in ("3", "4")
    if protocol == "anthropic":
        assert body == {
            "type": "error",
            "error": {
                "type": "rate_limit_error",
                "message": "This request would exceed the rate limit for your organization "
                "of 30 requests per minute. Please try again later.",
            },
        }
        assert got["anthropic-ratelimit-requests-remaining"] == "0"
        return
    message = body["error"].pop("message")
    assert body == {"error": {"type": "requests", "param": None, "code": "rate_limit_exceeded"}}
    match = re.fullmatch(
        r"Rate limit reached for requests in organization org-replay on requests per min "
        r"\(RPM\): Limit 30, Used 30, Requested 1\. Please try again in (\S+)\.",
        message,
    )
    assert match, message
    assert 2 < seconds_of(match[1]) <= 4
    assert got["x-ratelimit-remaining-requests"] == "0"


def test_tokens_refusal_on_openai(server: ReplayServer) -> None:
    # 60 tokens per minute in a 1 s bucket: 1 token; the first prompt passes (the bucket is
    # full) and leaves it N - 1 in debt, so the next waits up to N s, until it is full again
    set_limits(server, rps=100, tpm=60, burst_s=1)
    assert post(server, "openai", "key-3").status_code == 200
    refused = post(server, "openai", "key-3")
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert (error["type"], error["code"]) == ("tokens", "rate_limit_exceeded")
    match = re.search(
        r"on tokens per min \(TPM\): Limit 60, Used 60, Requested (\d+)\. "
        r"Please try again in (\S+)\.$",
        error["message"],
    )
    assert match, error["message"]
    tokens, sent = int(match[1]), refused.request.body
    assert isinstance(sent, bytes) and tokens == prompt_tokens(sent) > 10
    assert 0 < seconds_of(match[2]) <= tokens  # the requests bucket alone: 10 ms
    assert 1 <= int(refused.headers["retry-after"]) <= tokens
    assert refused.headers["x-ratelimit-remaining-tokens"] == "0"


def test_refused_request_never_reaches_its_scenario(server: ReplayServer) -> None:
    faults_before = server.faults()
    assert post(server, "openai", "a").status_code == 200
    refused = post(server, "openai", "a", scenario="rate_limited")
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    stats = server.stats()
    assert (stats["requests"], stats["by_scenario"]) == (1, {"plain": 1})
    assert server.faults() == faults_before
    # another key: the scenario's one-time 429 is still to come, so the refusal did not use it
    scripted = post(server, "openai", "b", scenario="rate_limited")
    assert scripted.status_code == 429
    assert scripted.json() == {"error": {"type": "rate_limit_error", "message": "slow down"}}
    answered = post(server, "openai", "c", scenario="rate_limited")
    assert answered.json()["choices"][0]["message"]["content"] == "Echo: hi"
    assert server.stats()["by_scenario"] == {"plain": 1, "rate_limited": 2}
    assert (server.limits()["accepted"], server.limits()["refused"]) == (3, 1)


def test_admin_endpoint_turns_on_and_changes_limits_live() -> None:
    with ReplayServer(port=0) as srv, requests.Session() as session:
        limits_url, admin_url = f"{srv.root}/limits", f"{srv.root}/admin/limits"
        assert session.get(limits_url, timeout=5).json() == {
            "enabled": False,
            "rps": None,
            "tpm": None,
            "burst_s": None,
            "accepted": 0,
            "refused": 0,
            "timeline": [],
        }
        assert rate_headers(post(srv, "openai", "k")) == {}  # off: no headers

        on = session.post(admin_url, json={"rps": 0.5, "burst_s": 2}, timeout=5)
        assert (on.status_code, on.json()) == (200, {"rps": 0.5, "tpm": None, "burst_s": 2.0})
        first = post(srv, "openai", "k")
        assert first.headers["x-ratelimit-limit-requests"] == "30"
        assert "x-ratelimit-limit-tokens" not in first.headers
        assert post(srv, "openai", "k").status_code == 429

        changed = session.post(admin_url, json={"rps": 2, "tpm": 6000}, timeout=5)
        assert changed.json() == {"rps": 2.0, "tpm": 6000, "burst_s": 2.0}
        fresh = post(srv, "anthropic", "new key")  # a full bucket of 4 at the new limits
        assert fresh.headers["anthropic-ratelimit-requests-limit"] == "120"
        assert fresh.headers["anthropic-ratelimit-requests-remaining"] == "3"
        assert fresh.headers["anthropic-ratelimit-tokens-limit"] == "6000"

        for body, field in [
            ({"rps": 0}, "rps"),
            ({"burst_s": "x"}, "burst_s"),
            ({"tpm": -5}, "tpm"),
            ({"rate": 1}, "rate"),
        ]:
            bad = session.post(admin_url, json=body, timeout=5)
            assert bad.status_code == 400
            error = bad.json()["error"]
            assert error.startswith(field) and "\n" not in error
        assert session.post(admin_url, data=b"{nope", timeout=5).status_code == 400

        report = session.get(limits_url, timeout=5).json()
        assert (report["rps"], report["tpm"], report["burst_s"]) == (2.0, 6000, 2.0)
        assert (report["enabled"], report["accepted"], report["refused"]) == (True, 2, 1)
        assert [sum(row[i] for row in report["timeline"]) for i in (1, 2)] == [2, 1]

        session.post(f"{srv.root}/reset", timeout=5).raise_for_status()
        report = session.get(limits_url, timeout=5).json()
        assert (report["accepted"], report["refused"], report["timeline"]) == (0, 0, [])
        assert report["rps"] == 2.0  # the limits stay


def test_rate_limits_from_the_command_line() -> None:
    args = ("--rate-rps", "0.5", "--rate-burst-s", "2", "--rate-tpm", "1000")
    with replay_process(*args) as url:
        body = {"model": "replay/plain", "messages": [{"role": "user", "content": "hi"}]}
        first = requests.post(f"{url}/chat/completions", json=body, timeout=5)
        assert first.headers["x-ratelimit-limit-tokens"] == "1000"
        assert requests.post(f"{url}/chat/completions", json=body, timeout=5).status_code == 429
        report = requests.get(url.removesuffix("/v1") + "/limits", timeout=5).json()
        assert (report["rps"], report["tpm"], report["burst_s"]) == (0.5, 1000, 2.0)
        assert (report["accepted"], report["refused"]) == (1, 1)
