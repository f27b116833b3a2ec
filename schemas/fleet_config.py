"""The fleet's configuration as values: its backends (named LLM endpoints), the four every fleet
has, and the whole FleetConfig with its model aliases and tool defaults. Read and validated from
the configuration's JSON in schemas/config.py.

Four backends exist without any configuration, as the provider SDKs and LiteLLM name them:
`openai`, `anthropic` and `gemini` are the real APIs with their conventional key variables (the
hosted API of each protocol declared in schemas/protocols.py), and `replay` is the local
scripted server (`CCHATQ_REPLAY_URL`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from schemas.fleet import ToolDefaults
from schemas.keys import DEFAULT_NAMESPACE
from schemas.model_routes import ModelAlias
from schemas.protocols import PROTOCOLS

DEFAULT_REPLAY_URL = "http://127.0.0.1:8011/v1"


@dataclass(frozen=True)
class BackendConfig:
    """One named LLM endpoint. The API key is read from `api_key_env` at call time, never stored."""

    name: str
    protocol: str = "openai"
    base_url: str = DEFAULT_REPLAY_URL
    api_key_env: str | None = None
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 60.0
    total_timeout_s: float = 120.0
    stream_idle_timeout_s: float = 60.0  # a stream with no content this long (pings aside): retried
    max_attempts: int = 4
    backoff_base_s: float = 0.5
    backoff_max_s: float = 8.0
    max_retry_after_s: float = 60.0
    stream: bool = False  # SSE replies; partial text shows in `cchatq status` while a round runs
    thinking_budget_tokens: int | None = None  # None: thinking off
    # the fleet's calls held at the account's rate limit, learned from the provider's headers
    # and 429s (worker.session.rate_control); the two limits below are then its ceilings
    adaptive: bool = True
    # a limit shared by every worker of the fleet (in Redis); None: no limit
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    rate_window_s: float = 60.0  # the window the two limits count over

    def api_key(self, environ: Mapping[str, str] | None = None) -> str | None:
        if not self.api_key_env:
            return None
        return (environ if environ is not None else os.environ).get(self.api_key_env)


def builtin_backends(replay_url: str = DEFAULT_REPLAY_URL) -> dict[str, BackendConfig]:
    """The backends every fleet has: the real APIs under the names and key variables their SDKs
    use, and the local replay server."""
    backends = {
        p.name: BackendConfig(p.name, p.name, p.hosted.base_url, p.hosted.api_key_env)
        for p in PROTOCOLS.values()
        if p.hosted is not None
    }
    backends["replay"] = BackendConfig("replay", "openai", replay_url)
    return backends


@dataclass(frozen=True)
class FleetConfig:
    backends: Mapping[str, BackendConfig] = field(default_factory=builtin_backends)
    default_backend: str = "replay"
    namespace: str = DEFAULT_NAMESPACE  # where a submit claims its spec ids (schemas/keys.py)
    models: Mapping[str, ModelAlias] = field(default_factory=dict)  # model aliases, by name
    tool_defaults: ToolDefaults = field(default_factory=ToolDefaults)
    source: str = "built-in defaults"  # where it was read: the file, or CCHATQ_BACKENDS
