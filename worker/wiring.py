"""Builds the edges from settings, once per process (Celery prefork forks after import, so
connections, HTTP sessions and the wasmtime engine are created lazily in the child)."""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from celery import Celery
from celery._state import get_current_task
from celery.exceptions import Reject
from kombu.exceptions import OperationalError

from schemas import redis_links
from schemas.fleet_clock import FleetClock
from schemas.redis_memory import eviction_refused, eviction_warning
from schemas.redis_url import kombu_broker, redacted
from worker.codecs.registry import codec_for
from worker.config import BackendConfig, Settings, load_settings
from worker.edges import broker, broker_connection, broker_sentinel
from worker.edges.dispatch import CeleryDispatcher
from worker.edges.mcp_tools import McpTools
from worker.edges.provider_http import HttpProvider
from worker.edges.rate_control import RedisRateControl
from worker.edges.rate_limit import RedisRateLimiter
from worker.edges.redis_errors import REFUSED_TEXT, unanswered
from worker.edges.redis_pool import cluster_mode, pooled_client
from worker.edges.store import RedisStore
from worker.edges.store_programs import RedisProgramStore
from worker.edges.wasm_runtime import WasmToolRuntime
from worker.errors import StoreError, StoreUnavailableError
from worker.guest.step import ProgramSteps
from worker.session.mcp_offer import ToolRouter
from worker.session.ports import NoSpans, SpanSink
from worker.session.reconciler import Reconciler
from worker.session.refusals import RefusalNotice
from worker.session.steps import StepRunner


class Wiring:
    def __init__(self, app: Celery, settings: Settings) -> None:
        self.settings = settings
        # one connection per worker thread, plus a few for the blocking waits and publishes
        pool_size = max(worker_concurrency, 1) + POOL_HEADROOM
        self.store = RedisStore.from_url(
            settings.urls.state, settings.result_ttl_s, pool_size, settings.stall_after_ms // 2,
            settings.results_ttl_s, settings.results_keep,
        )  # fmt: skip
        # the broker's own Redis, when it is not the state's: the steps' messages go there
        broker_client = None
        if not settings.urls.shared:
            broker_client = pooled_client(settings.urls.broker, pool_size)
        self._pool_size = pool_size  # the HTTP pools' size too: a connection kept per thread
        self._providers: dict[str, HttpProvider] = {}
        self._runtime: WasmToolRuntime | None = None
        self._lock = threading.Lock()
        self.programs = RedisProgramStore(self.store)
        fleet = settings.fleet.tool_defaults
        # one session per server, started on first use (after a fork: the child's own)
        self.mcp = McpTools(fleet.mcp_servers, fleet.timeout_ms)
        self._tools = ToolRouter(self.runtime, self.mcp)  # WASM tools, or MCP servers' tools
        self.spans = span_sink(settings)
        self.runner = StepRunner(
            store=self.store,
            dispatch=CeleryDispatcher(app, self.store, broker_client),
            provider_for=self.provider_for,
            tools=lambda: self._tools,
            settings=settings,
            rate_limiter=RedisRateLimiter(self.store.client),
            rate_control=RedisRateControl(self.store.client),
            mcp=self.mcp,
            spans=self.spans,
        )
        self.program_steps = ProgramSteps(
            runner=self.runner, programs=self.programs, source=_LazySource(self)
        )

    def provider_for(self, backend: BackendConfig) -> HttpProvider:
        with self._lock:
            provider = self._providers.get(backend.name)
            if provider is None:
                provider = HttpProvider(
                    backend, codec_for(backend.protocol), max_connections=self._pool_size
                )
                self._providers[backend.name] = provider
            return provider

    def runtime(self) -> WasmToolRuntime:
        with self._lock:
            if self._runtime is None:
                self._runtime = WasmToolRuntime(
                    cache_dir=self.settings.module_cache_dir,
                    load_module_bytes=self.store.module_bytes,
                    load_fork_blob=self.programs.fork_blob,
                )
            return self._runtime


class _LazySource:
    """The tool runtime as a ModuleSource, built on first use (after a fork)."""

    def __init__(self, wiring: Wiring) -> None:
        self.wiring = wiring

    def compiled(self, sha256: str) -> tuple[Any, Any]:
        return self.wiring.runtime().compiled(sha256)

    def deadline_ticks(self, budget_ms: float) -> int:
        return self.wiring.runtime().deadline_ticks(budget_ms)


POOL_HEADROOM = 8
SENTINEL_HEALTH_CHECK_S = 5
BROKER_BEAT_S = 2  # a consumer's heartbeat, well inside consumer_dead_after_s
# The worker's concurrency (`-c`), recorded by the celeryd_init signal (worker.tasks) before
# any task runs; the Redis pool is sized to it.
worker_concurrency = 8


def set_worker_concurrency(concurrency: int | None) -> None:
    global worker_concurrency
    if concurrency:
        worker_concurrency = int(concurrency)


log = logging.getLogger(__name__)
_wiring: tuple[int, Wiring] | None = None
_wiring_lock = threading.Lock()


def _current(app: Celery) -> Wiring:
    """The process's wiring, rebuilt after a fork."""
    global _wiring
    with _wiring_lock:
        if _wiring is None or _wiring[0] != os.getpid():
            _wiring = (os.getpid(), Wiring(app, load_settings()))
        return _wiring[1]


def runner(app: Celery) -> StepRunner:
    return _current(app).runner


def fleet_clock(app: Celery) -> FleetClock:
    """Redis's clock as this process reads it (its store's): what a step's message says of
    when it was sent or falls due is stamped and compared on it."""
    return _current(app).store.clock


SPANS_MISSING = (
    "OpenTelemetry spans are asked for (OTEL_*) but the otel extra is not installed "
    "(pip install 'cchatq[otel]'): spans off"
)


def span_sink(settings: Settings) -> SpanSink:
    """OpenTelemetry's SDK when the OTEL_* variables ask for spans and the otel extra is
    installed; otherwise nothing, and opentelemetry is never imported."""
    if not settings.span_exporters:
        return NoSpans()
    try:
        from worker.edges.otel_spans import OtelSpans
    except ImportError:  # said once at the worker's start (check_spans)
        return NoSpans()
    return OtelSpans(settings.span_exporters, settings.span_service, settings.span_delay_ms)


def check_spans(settings: Settings) -> None:
    """At a worker's start: one warning when spans are asked for and cannot be made. The SDK
    is imported here then, once, before a prefork pool forks; its exporters are made by each
    process's wiring."""
    if not settings.span_exporters:
        return
    try:
        import worker.edges.otel_spans  # noqa: F401
    except ImportError:
        log.warning(SPANS_MISSING)


def flush_spans() -> None:
    """Send the spans this process holds (its worker is stopping); builds nothing."""
    built = _wiring
    if built is not None and built[0] == os.getpid():
        built[1].spans.flush()


def close_mcp() -> None:
    """Close this process's MCP sessions, stopping its stdio servers (its worker is
    stopping); builds nothing."""
    built = _wiring
    if built is not None and built[0] == os.getpid():
        built[1].mcp.close()


def program_steps(app: Celery) -> ProgramSteps:
    return _current(app).program_steps


class StepContext(logging.Filter):
    """Every worker log line names the step it was written in (`step=<id>`: the step id holds
    the session key, as in `<session>.r<round>.t<call>`), or `-` outside any step."""

    def filter(self, record: logging.LogRecord) -> bool:
        task = get_current_task()
        task_id = getattr(getattr(task, "request", None), "id", None) if task else None
        record.step = f"step={task_id}" if task_id else "-"
        return True


STEP_LOG_FORMAT = "[%(asctime)s: %(levelname)s/%(processName)s] %(step)s %(name)s: %(message)s"


def add_step_context(handlers: list[logging.Handler]) -> None:
    """Give a worker's log handlers the step of each line (after Celery set them up)."""
    for handler in handlers:
        handler.addFilter(StepContext())
        handler.setFormatter(logging.Formatter(STEP_LOG_FORMAT))
    logging.getLogger("celery.app.trace").addFilter(HandedBackLine())


# what a broker that does not answer raises beside redis-py's errors: kombu's wrapping of them,
# the socket's own (OSError: ConnectionError, TimeoutError)
UNANSWERED = (OperationalError, OSError)


class HandedBackLine(logging.Filter):
    """A step handed back to its queue because Redis refuses writes or does not answer
    (tasks._retry's Reject: a partition, a failover) is one warning line, Celery's own ("Task
    ... reject requeue=True: MISCONF ..."): not a traceback, which Celery adds to every
    Reject."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, Reject) and (
            REFUSED_TEXT.search(str(exc.reason))
            or unanswered(exc.reason)
            or isinstance(exc.reason, UNANSWERED)
        ):
            record.exc_info, record.exc_text = None, None
        return True


class EvictingRedis(Exception):
    """The worker's Redis may evict cchatq's keys: the worker does not start (the one line)."""


class BrokerOnCluster(EvictingRedis):
    """The broker's URL names a Redis Cluster: the worker does not start (the one line)."""


STATE_WAIT_S = 60.0  # a worker starting waits this long for its state's Redis to answer


def check_state(settings: Settings) -> None:
    """At a worker's start: whether the state's Redis runs in cluster mode, asked once here
    and inherited by the pool's children (edges/redis_pool.py); a Redis that does not answer
    yet is waited for up to STATE_WAIT_S (a child asks again later). A broker on a Redis
    Cluster is refused with BrokerOnCluster: Celery's Redis transport cannot use one."""
    deadline = time.monotonic() + STATE_WAIT_S
    while True:
        try:
            clustered = cluster_mode(settings.urls.state)
            broker_clustered = (
                clustered if settings.urls.shared else cluster_mode(settings.urls.broker)
            )
            break
        except Exception as exc:  # not answering yet: Celery waits for its broker as well
            if time.monotonic() > deadline:
                log.warning("the state's Redis did not answer: %s", type(exc).__name__)
                return
            time.sleep(1.0)
    if broker_clustered:
        raise BrokerOnCluster(
            f"{settings.urls.broker_variable} {redacted(settings.urls.broker)} is a Redis Cluster,"
            " which cannot be the broker: keep the state there (CCHATQ_STATE_URL) and point"
            " CCHATQ_BROKER_URL at a plain Redis, a Sentinel or RabbitMQ"
        )
    if clustered:
        log.info("state on the Redis Cluster at %s", redacted(settings.urls.state))


def check_redis_memory(settings: Settings) -> None:
    """At a worker's start: a Redis whose maxmemory-policy may evict cchatq's keys (any but
    noeviction, under a maxmemory) is refused with EvictingRedis, unless
    CCHATQ_ALLOW_EVICTION says to run on it: then one loud warning. A Redis that cannot be
    asked now is the broker connection's business (Celery retries it)."""
    store = RedisStore.from_url(settings.urls.state, settings.result_ttl_s, max_connections=2)
    try:
        memory = store.memory()
    except StoreError as exc:
        log.warning("Redis's memory policy not checked: %s", exc.code)
        return
    finally:
        store.client.close()
    where = redacted(settings.urls.state)
    if memory.evicts and not settings.allow_eviction:
        raise EvictingRedis(eviction_refused(memory, where, "cchatq worker"))
    if memory.evicts:
        log.warning(eviction_warning(memory, where))


# Celery's messaging class with the broker's reconnect pace: Celery(amqp=BROKER_AMQP)
BROKER_AMQP = broker_connection.AMQP


def start_reconciler(app: Celery) -> threading.Thread:
    """The reconciler's loop, in a control worker (one of them reconciles at a time)."""
    settings = load_settings()

    def loop() -> None:
        wiring = _current(app)
        reconciler = Reconciler(
            wiring.runner,
            wiring.store,
            every_s=settings.reconcile_every_s,
            quiet_ms=settings.stall_after_ms,
            deadline_ms=settings.session_deadline_ms,
            results_keep=settings.results_keep,
        )
        refused = RefusalNotice("reconciler", log)
        while True:
            time.sleep(settings.reconcile_every_s)
            try:
                reconciler.turn()
            except StoreUnavailableError as exc:  # said once, not every turn
                refused.refused(exc.reason)
                continue
            except Exception as exc:  # Redis away: the next turn tries again
                log.warning("reconciler turn failed: %s", type(exc).__name__)
                continue
            refused.accepted()

    thread = threading.Thread(target=loop, name="cchatq-reconciler", daemon=True)
    thread.start()
    return thread


def celery_config(settings: Settings) -> dict[str, Any]:
    """Reliability settings of docs/architecture.md section 4."""
    from schemas.task_names import ROUTES

    # a sentinel:// URL: kombu's form of it, its master's name, and our channel on Sentinel
    url, sentinel = kombu_broker(settings.urls.broker)
    transport = broker_sentinel.SENTINEL_TRANSPORT if sentinel else broker.TRANSPORT
    sentinel_options: dict[str, Any] = dict(sentinel)
    if sentinel:  # a take from a paused master is dropped after brpop_timeout + this
        sentinel_options["health_check_interval"] = SENTINEL_HEALTH_CHECK_S
    return {
        "broker_url": url,
        "broker_transport": transport,  # kombu's Redis transport, one client a channel
        "broker_connection_retry_on_startup": True,
        # a lost broker is tried again every few seconds (broker_connection.py): as many tries
        # as cover about as long as kombu's default 100 growing ones did
        "broker_connection_max_retries": redis_links.broker_max_retries(),
        "broker_transport_options": {
            # timeouts, keepalive and health checks: a silently cut link errors in seconds
            **redis_links.broker_options(),
            "visibility_timeout": settings.visibility_timeout_s,
            # the consumer loop's timer: each tick beats for the worker's consumers and gives
            # back the messages of consumers that stopped beating (edges/broker.py)
            "unacked_restore_interval": BROKER_BEAT_S,
            "unacked_restore_throttle": 1,
            "consumer_dead_after_s": max(settings.consumer_dead_after_s, 2 * BROKER_BEAT_S + 1),
            **sentinel_options,
        },
        "task_serializer": "json",
        "accept_content": ["json"],
        "result_serializer": "json",
        "task_ignore_result": True,
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "task_routes": {name: {"queue": queue} for name, queue in ROUTES.items()},
        "task_default_queue": "control",
        # the backstop only: deadlines inside WASM are epoch interruptions
        "task_time_limit": max(settings.visibility_timeout_s - 10, 60),
        # Task events cost a hop ~2 ms more (measured: bench/); Flower switches them on
        # (enable_events) while it runs, so a watched fleet still shows every step.
        "worker_send_task_events": False,
        "worker_hijack_root_logger": False,
    }
