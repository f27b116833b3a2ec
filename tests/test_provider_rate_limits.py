"""What the HTTP client makes of the providers' rate limits, against the replay server's
rate-limit mode (real HTTP, each protocol's headers and 429s): every answer's headers reach the
caller as a RateSignal, and under adaptive control a 429 is raised at once, with the wait the
response gives as precisely as it gives it (not Retry-After's whole second)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from fixtures.replay import ReplayServer
from fixtures.replay.rate_limit import RateLimits
from producer.fleet import replay_backends
from worker.codecs import registry
from worker.codecs.protocol import ChatRequest
from worker.config import BackendConfig
from worker.edges.provider_http import HttpProvider
from worker.errors import ProviderRateLimitedError, ProviderRetryableError

MODELS = {"openai": "replay/plain", "anthropic": "replay/plain", "gemini": "replay-plain"}


@pytest.fixture(scope="module")
def replay() -> Iterator[ReplayServer]:
    # a bucket of two calls, one more every 4 s: the third call at once is refused
    server = ReplayServer(rate_limits=RateLimits(rps=0.25, burst_s=8)).start()
    yield server
    server.stop()


def provider(replay: ReplayServer, protocol: str, adaptive: bool, key: str) -> HttpProvider:
    raw = replay_backends(replay.url)[f"replay-{protocol}"]
    backend = BackendConfig(
        name=protocol, protocol=protocol, base_url=str(raw["base_url"]),
        api_key_env="KEY", adaptive=adaptive, max_attempts=2,
    )  # fmt: skip
    # a key of its own: each case has its own bucket
    return HttpProvider(
        backend, registry.codec_for(protocol), environ={"KEY": key}, sleep=lambda s: None
    )


def chat(protocol: str) -> ChatRequest:
    return ChatRequest(
        model=MODELS[protocol], messages=[{"role": "user", "content": "hi"}], tools=[], params={}
    )


@pytest.mark.parametrize("protocol", ["openai", "anthropic", "gemini"])
def test_a_429_under_adaptive_control_is_raised_at_once_with_its_precise_wait(
    replay: ReplayServer, protocol: str
) -> None:
    client = provider(replay, protocol, adaptive=True, key=f"k-adaptive-{protocol}")
    first = client.complete(chat(protocol))
    if protocol == "gemini":  # Gemini says nothing of its limits on an answer
        assert first.rate is None or first.rate.empty
    else:
        assert first.rate is not None and first.rate.requests_per_min == 15
        assert first.rate.requests_left == 1
    client.complete(chat(protocol))
    refused_before = replay.limits()["refused"]
    with pytest.raises(ProviderRateLimitedError) as caught:
        client.complete(chat(protocol))
    assert replay.limits()["refused"] == refused_before + 1  # one attempt, no retry
    wait = caught.value.retry_after_s
    # refused calls count against the limit too: the bucket is a call in debt, 8 s from room
    assert wait is not None and 7 < wait <= 8
    if protocol != "anthropic":  # its reset is when the bucket is whole: Retry-After is all
        assert wait != int(wait)  # the body's or RetryInfo's figure, to the millisecond
    client.close()


def test_without_adaptive_control_a_429_is_retried_in_the_call(replay: ReplayServer) -> None:
    client = provider(replay, "openai", adaptive=False, key="k-static")
    client.complete(chat("openai"))
    client.complete(chat("openai"))
    refused_before = replay.limits()["refused"]
    with pytest.raises(ProviderRetryableError) as caught:  # sleeps skipped: refused again
        client.complete(chat("openai"))
    assert not isinstance(caught.value, ProviderRateLimitedError)
    assert replay.limits()["refused"] == refused_before + 2  # max_attempts
    client.close()
