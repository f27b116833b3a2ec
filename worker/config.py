"""Worker settings: the only module of the worker that reads the environment.

Environment variables:
    REDIS_URL                 broker and state store (default redis://127.0.0.1:6379/0)
    CCHATQ_STATE_URL          the sessions' state, when not REDIS_URL's Redis
    CCHATQ_BROKER_URL         the broker, when not REDIS_URL's Redis (schemas/fleet_urls.py)
    CCHATQ_CONFIG             path of the fleet's JSON configuration (schemas/config.py: its
                              backends and tool defaults), shared with the producer
    CCHATQ_BACKENDS           the same JSON inline (wins over the file)
    CCHATQ_REPLAY_URL         base URL of the built-in `replay` backend (default http://127.0.0.1:8011/v1)
    CCHATQ_VISIBILITY_TIMEOUT_S   Redis transport visibility timeout (default 300)
    CCHATQ_RESULT_TTL_S       TTL of every session key (default 86400)
    CCHATQ_RESULTS_TTL_S      how long a finished session's record and response fd are kept
                              (default CCHATQ_RESULT_TTL_S)
    CCHATQ_RESULTS_KEEP       keep at most this many finished sessions' results, the latest
                              (default 0: all, for CCHATQ_RESULTS_TTL_S)
    CCHATQ_MODULE_CACHE_DIR   serialized compiled modules (default ~/.cache/cchatq/modules)
    CCHATQ_MAX_STEP_ATTEMPTS  deliveries of one step before it is dead-lettered (default 5)
    CCHATQ_TRACE              `off`: no trace events (default on)
    CCHATQ_RECONCILE_EVERY_S  how often a control worker looks for stalled sessions (10)
    CCHATQ_STALL_AFTER_S      a session with no progress this long is nudged (30)
    CCHATQ_SESSION_DEADLINE_S a session with no progress this long after its submit ends with
                              deadline_exceeded (default: half CCHATQ_RESULT_TTL_S, 43200)
    CCHATQ_STORE_WAIT_S       how long a step waits in its worker for a Redis that refuses
                              writes (full, failing to persist, a replica, loading) before it
                              is handed back to the queue; no try is spent (default 180)
    CCHATQ_ALLOW_EVICTION     1: start on a Redis whose maxmemory-policy may evict cchatq's
                              keys (refused otherwise), with a loud warning

OpenTelemetry spans (README "OpenTelemetry traces"), off unless asked for:
    OTEL_TRACES_EXPORTER      otlp and/or console (comma-separated): spans on; none: off
    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, OTEL_EXPORTER_OTLP_ENDPOINT
                              either set (and OTEL_TRACES_EXPORTER unset): spans on, OTLP/HTTP
    OTEL_SDK_DISABLED         true: spans off whatever else says
    OTEL_SERVICE_NAME         the spans' service.name (default cchatq-worker)
    OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT
                              true: spans carry messages, tool arguments and results
    OTEL_BSP_SCHEDULE_DELAY   how long the batch processor holds spans before it sends them
                              (default here 1000 ms, not the SDK's 5000: what a SIGKILLed
                              worker held is lost)
The exporter and the batch processor read the rest of OTEL_* themselves (endpoint, headers,
OTEL_BSP_SCHEDULE_DELAY when set, ...).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from schemas.config import ConfigError, read_config
from schemas.fleet_config import BackendConfig, FleetConfig
from schemas.fleet_urls import DEFAULT_REDIS_URL, FleetUrls, checked, fleet_urls
from schemas.redis_memory import allow_eviction

DEFAULT_SERVICE_NAME = "cchatq-worker"
# a worker's spans wait this long in the batch processor (the SDK's default is 5000 ms): a
# worker that is SIGKILLed loses what it holds, so it holds a second's worth at most
SPAN_SCHEDULE_DELAY_MS = 1_000
SPAN_EXPORTERS = ("otlp", "console")
__all__ = ["BackendConfig", "FleetConfig", "Settings", "load_settings"]


@dataclass(frozen=True)
class Settings:
    # where the sessions' state and the broker are (one Redis unless said)
    urls: FleetUrls = field(default_factory=lambda: FleetUrls(DEFAULT_REDIS_URL, DEFAULT_REDIS_URL))
    # the fleet's configuration: its backends, its default backend and its tools' defaults
    fleet: FleetConfig = field(default_factory=FleetConfig)
    visibility_timeout_s: int = 300  # the task time limit's backstop (wiring)
    # a worker that stops beating this long has its taken messages handed out again
    consumer_dead_after_s: int = 15
    result_ttl_s: int = 86_400
    results_ttl_s: int = 86_400  # a finished session's record and response fd
    results_keep: int = 0  # the latest finished sessions' results kept (0: all, by age)
    module_cache_dir: Path = Path.home() / ".cache" / "cchatq" / "modules"
    max_step_attempts: int = 5
    trace: bool = True  # trace events: the session's stream, the fleet's, log lines
    reconcile_every_s: float = 10.0  # how often the fleet's reconciler looks
    stall_after_ms: int = 30_000  # a session with no progress this long is nudged
    # a stalled session this old ends deadline_exceeded: before its keys expire, so every
    # session ends with a body
    session_deadline_ms: int = 43_200_000
    # OpenTelemetry: the span exporters asked for (otlp, console; none: spans off), the spans'
    # service name, and whether they carry content (messages, tool arguments and results)
    span_exporters: tuple[str, ...] = ()
    span_service: str = DEFAULT_SERVICE_NAME
    span_content: bool = False
    # the batch processor's schedule delay; None: OTEL_BSP_SCHEDULE_DELAY says, read by the SDK
    span_delay_ms: int | None = SPAN_SCHEDULE_DELAY_MS
    # a Redis refusing writes is waited out in the worker this long per delivery (guard.py);
    # under the prefork pool's hard time limit (the visibility timeout less 10 s)
    store_wait_s: float = 180.0
    allow_eviction: bool = False  # run on a Redis that may evict cchatq's keys


def load_settings(environ: Mapping[str, str] | None = None) -> Settings:
    env = os.environ if environ is None else environ
    return Settings(
        # a ConfigError stops the worker at start, naming each problem
        fleet=read_config(env),
        urls=redis_urls(env),
        visibility_timeout_s=int(env.get("CCHATQ_VISIBILITY_TIMEOUT_S", "300")),
        consumer_dead_after_s=int(env.get("CCHATQ_CONSUMER_DEAD_AFTER_S", "15")),
        result_ttl_s=int(env.get("CCHATQ_RESULT_TTL_S", "86400")),
        results_ttl_s=int(
            env.get("CCHATQ_RESULTS_TTL_S") or env.get("CCHATQ_RESULT_TTL_S", "86400")
        ),
        results_keep=int(env.get("CCHATQ_RESULTS_KEEP", "0")),
        module_cache_dir=Path(
            env.get("CCHATQ_MODULE_CACHE_DIR", str(Path.home() / ".cache" / "cchatq" / "modules"))
        ),
        max_step_attempts=int(env.get("CCHATQ_MAX_STEP_ATTEMPTS", "5")),
        trace=env.get("CCHATQ_TRACE", "on") != "off",
        reconcile_every_s=float(env.get("CCHATQ_RECONCILE_EVERY_S", "10")),
        stall_after_ms=int(float(env.get("CCHATQ_STALL_AFTER_S", "30")) * 1000),
        session_deadline_ms=int(
            float(
                env.get(
                    "CCHATQ_SESSION_DEADLINE_S",
                    int(env.get("CCHATQ_RESULT_TTL_S", "86400")) / 2,
                )
            )
            * 1000
        ),
        span_exporters=span_exporters(env),
        span_service=env.get("OTEL_SERVICE_NAME") or DEFAULT_SERVICE_NAME,
        span_content=_true(env.get("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT")),
        span_delay_ms=None if env.get("OTEL_BSP_SCHEDULE_DELAY") else SPAN_SCHEDULE_DELAY_MS,
        store_wait_s=float(env.get("CCHATQ_STORE_WAIT_S", "180")),
        allow_eviction=allow_eviction(env),
    )


def redis_urls(env: Mapping[str, str]) -> FleetUrls:
    """Where the state and the broker are, checked: a ConfigError (one line each, no password)
    naming the variable stops the worker at start."""
    urls = fleet_urls(env)
    problems = checked(urls)
    if problems:
        raise ConfigError("environment", problems)
    return urls


def span_exporters(env: Mapping[str, str]) -> tuple[str, ...]:
    """The span exporters the standard OTEL_* variables ask for; () when spans are off: the SDK
    disabled, OTEL_TRACES_EXPORTER naming none of ours, or nothing said at all."""
    if _true(env.get("OTEL_SDK_DISABLED")):
        return ()
    named = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if named:
        asked = (n.strip() for n in named.split(","))
        return tuple(dict.fromkeys(n for n in asked if n in SPAN_EXPORTERS))
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    return ("otlp",) if endpoint else ()


def _true(value: str | None) -> bool:
    return (value or "").strip().lower() == "true"
