"""cchatq's Prometheus metrics, from an exporter that reads the fleet's Redis: no
worker serves metrics or writes any of its own, so prefork pools need no multiprocess mode.

- gauges read at each scrape (producer/fleet_status.py): tasks waiting and tasks taken and not
  acknowledged yet (running), per queue, worker processes taking tasks, sessions not finished
  (the reconciler's index), dead letters;
- counters and histograms kept from the fleet's trace stream (`cq:trace`), followed from the
  moment the exporter starts: model calls by backend and outcome, tokens in and out by backend,
  tool calls by tool and outcome (ok or the error class), tool retries, background tasks,
  sessions finished by outcome, model and tool call latencies, how long steps ran by kind,
  rate-limit waits by backend (how many, and the seconds steps were put off), and the
  reconciler's passes and the sessions it nudged and forgot.

Ids, codes and counts only, as in the trace events themselves.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import redis
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from producer.broker_queues import broker_reader
from producer.fleet_status import FleetStatus, read_fleet_status
from producer.redis_connect import is_cluster, redis_client
from schemas import fleet_keys, keys, redis_links

log = logging.getLogger(__name__)
LATENCY_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 600)


class FleetGauges(Collector):
    """What the fleet holds right now, read from Redis at each scrape."""

    def __init__(self, client: Any, broker: Any = None) -> None:
        self.client = client
        self.broker = broker  # the broker's Redis or RabbitMQ queues, when not the state's

    def collect(self) -> Iterator[GaugeMetricFamily]:
        fleet = read_fleet_status(self.client, self.broker)
        waiting = GaugeMetricFamily(
            "cchatq_queue_depth", "Tasks waiting on each queue", labels=["queue"]
        )
        for queue, depth in fleet.queued.items():
            waiting.add_metric([queue], depth)
        yield waiting
        taken = GaugeMetricFamily(
            "cchatq_tasks_unacked",
            "Tasks taken by workers and not acknowledged yet (running), per queue",
            labels=["queue"],
        )
        for queue, count in fleet.taken.items():
            taken.add_metric([queue], count)
        yield taken
        yield GaugeMetricFamily(
            "cchatq_consumers", "Worker processes taking tasks (broker consumers beating)",
            fleet.consumers,
        )  # fmt: skip
        yield GaugeMetricFamily(
            "cchatq_sessions_active", "Sessions not finished yet", fleet.active_sessions
        )
        yield GaugeMetricFamily(
            "cchatq_dead_letters", "Steps dead-lettered (kept ones)", fleet.dead_letters
        )
        yield from _controller_gauges(fleet)


def _controller_gauges(fleet: FleetStatus) -> Iterator[GaugeMetricFamily]:
    """Each rate controller's state (label `controller`: backend/account digest/model)."""
    shown = {
        "window": ("cchatq_rate_window", "Calls a rate controller lets be in flight"),
        "pace_rps": ("cchatq_rate_pace_rps", "Requests a second a controller paces to (0: none)"),
        "in_flight": ("cchatq_rate_in_flight", "Calls in flight under a rate controller"),
        "utilisation": ("cchatq_rate_utilisation", "Granted rate over the pace (or window used)"),
        "rate_limited": ("cchatq_rate_429s", "429s a rate controller was told of"),
        "calls": ("cchatq_rate_calls", "Calls a rate controller let go"),
    }  # fmt: skip
    for attr, (name, doc) in shown.items():
        family = GaugeMetricFamily(name, doc, labels=["controller"])
        for c in fleet.rate_controllers:
            family.add_metric([c.id], float(getattr(c, attr)))
        yield family


class TraceCounters:
    """Counters kept from the trace events the fleet writes, as they come."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def counter(name: str, doc: str, labels: list[str]) -> Counter:
            return Counter(name, doc, labels, registry=registry)

        self.model_calls = counter("cchatq_model_calls", "Model calls", ["backend", "outcome"])
        self.tokens = counter("cchatq_tokens", "Tokens by backend", ["backend", "direction"])
        self.tool_calls = counter("cchatq_tool_calls", "Tool calls", ["tool", "outcome"])
        self.retries = counter("cchatq_tool_retries", "Tool calls tried again", ["tool"])
        self.tasks = counter("cchatq_background_tasks", "Background tasks", ["event"])
        self.sessions = counter("cchatq_sessions_finished", "Sessions finished", ["outcome"])
        self.rate_limit_waits = counter(
            "cchatq_rate_limit_waits", "Steps put off for a backend's rate limit", ["backend"]
        )
        self.rate_limit_seconds = counter(
            "cchatq_rate_limit_wait_seconds",
            "Seconds steps were put off for a backend's rate limit (the waits asked for)",
            ["backend"],
        )
        self.reconciler = counter(
            "cchatq_reconciler_actions",
            "The reconciler's passes and the sessions it nudged and forgot",
            ["action"],
        )
        self.step_seconds = Histogram(
            "cchatq_step_seconds", "How long a step's body ran, by kind", ["kind"],
            buckets=LATENCY_BUCKETS_S, registry=registry,
        )  # fmt: skip
        self.model_seconds = Histogram(
            "cchatq_model_call_seconds", "Model call latency", ["backend"],
            buckets=LATENCY_BUCKETS_S, registry=registry,
        )  # fmt: skip
        self.tool_seconds = Histogram(
            "cchatq_tool_call_seconds", "Tool call latency", ["tool"],
            buckets=LATENCY_BUCKETS_S, registry=registry,
        )  # fmt: skip

    def count(self, event: dict[str, Any]) -> None:
        name = event.get("event", "")
        seconds = float(event.get("latency_ms") or 0) / 1000
        if "step_ms" in event:  # rides a step's last event (or a step.finished of its own)
            kind = str(event.get("kind") or "?")
            self.step_seconds.labels(kind).observe(float(event["step_ms"]) / 1000)
        if name.startswith("model.call.") and name != "model.call.started":
            backend = str(event.get("backend") or "?")
            self.model_calls.labels(backend, name.rsplit(".", 1)[1]).inc()
            self.model_seconds.labels(backend).observe(seconds)
            for direction in ("in", "out"):
                tokens = event.get(f"tokens_{direction}")
                if isinstance(tokens, int):
                    self.tokens.labels(backend, direction).inc(tokens)
        elif name in ("tool.call.finished", "tool.call.failed"):
            tool = str(event.get("tool") or "?")
            self.tool_calls.labels(tool, str(event.get("error") or "ok")).inc()
            if "latency_ms" in event:
                self.tool_seconds.labels(tool).observe(seconds)
        elif name == "tool.call.retried":
            self.retries.labels(str(event.get("tool") or "?")).inc()
        elif name.startswith("task."):
            self.tasks.labels(name.split(".", 1)[1]).inc()
        elif name == "session.finished":
            self.sessions.labels(str(event.get("error") or "ok")).inc()
        elif name == "rate_limit.waited":
            backend = str(event.get("backend") or "?")
            self.rate_limit_waits.labels(backend).inc()
            self.rate_limit_seconds.labels(backend).inc(float(event.get("wait_ms") or 0) / 1000)
        elif name == "reconciler.pass":
            self.reconciler.labels("pass").inc()
            for action in ("nudged", "forgotten", "overdue"):
                self.reconciler.labels(action).inc(int(event.get(action) or 0))

    def follow(
        self, client: Any, stop: threading.Event, block_ms: int = 1000, since: str = "$"
    ) -> None:
        """Count the fleet's events from now on (`since` "0": from the oldest kept), until
        `stop` is set: its stream, or on a Redis Cluster its shards (fleet_keys.trace_shards),
        each read in turn."""
        streams = fleet_keys.trace_shards(is_cluster(client))
        last = dict.fromkeys(streams, since)
        wait_ms = redis_links.block_ms(block_ms // len(streams) or 1)
        while not stop.is_set():
            for stream in streams:
                try:
                    read = client.xread({stream: last[stream]}, count=1000, block=wait_ms)
                except redis.RedisError as exc:  # Redis away: try again (a gap in the counts)
                    log.warning("metrics: reading the trace failed: %s", type(exc).__name__)
                    stop.wait(1.0)
                    continue
                for entry_id, fields in read[0][1] if read else []:
                    last[stream] = entry_id
                    for event in keys.trace_events(fields):
                        self.count(event)


class Exporter:
    """The gauges and counters on one registry, the stream followed in a thread."""

    def __init__(self, redis_url: str, broker_url: str | None = None) -> None:
        self.client = redis_client(redis_url, **redis_links.client_options())
        self.broker = None  # the broker's queues, when not on the state's Redis
        if broker_url and broker_url != redis_url:
            self.broker = broker_reader(
                broker_url, lambda url: redis_client(url, **redis_links.client_options())
            )
        self.registry = CollectorRegistry()
        self.registry.register(FleetGauges(self.client, self.broker))
        self.counters = TraceCounters(self.registry)
        self._stop = threading.Event()
        self._follower = threading.Thread(
            target=self.counters.follow, args=(self.client, self._stop), daemon=True
        )
        self._follower.start()

    def serve(self, port: int, address: str = "0.0.0.0") -> None:
        start_http_server(port, addr=address, registry=self.registry)

    def close(self) -> None:
        self._stop.set()
        self._follower.join(timeout=5)
        self.client.close()
        if self.broker is not None:
            self.broker.close()
