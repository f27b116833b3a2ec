"""`python -m bench.otel` (or `make bench-otel`): what OpenTelemetry spans cost the workers.

The same batch (replay/two_rounds: 3 model calls and 2 WASM tool calls a session, zero model
latency) runs on a fleet with spans off and on a fleet exporting them over OTLP/HTTP to a
receiver in this process (fixtures/otlp.py), in turns, PAIRS times. A run with spans on ends
once every span arrived (6 a session), so the exporting's CPU is counted. Printed: worker CPU
per session (all worker processes, pool children included) with spans off and on, the
difference, and the spans received.

    python -m bench.otel [--sessions 500] [--pairs 4] [--content] [--delay-ms 5000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid

from bench.cost import Cost, measured
from bench.goals import run_batch, workload
from fixtures.otlp import OtlpReceiver
from producer.client import Client
from producer.fleet import Fleet

SPANS_PER_SESSION = 6  # 3 chat, 2 execute_tool, 1 invoke_agent
WARM = 30


def _run(base: Fleet, db: int, env: dict[str, str], n: int, receiver: OtlpReceiver | None) -> Cost:
    """One batch of `n` sessions on fresh workers of database `db`: the workers' CPU."""
    url = base.redis_url.rsplit("/", 1)[0] + f"/{db}"
    workers = Fleet(
        redis_url=url, replay_url=base.replay_url, workdir=base.workdir / f"db{db}", env=base.env
    )
    workers.workdir.mkdir(exist_ok=True)
    client = Client(url, config=workers.config())
    client.redis.flushdb()
    try:
        workers.start_workers(extra_env=env)
        workers.wait_served()
        run_batch(client, workload(f"warm-{uuid.uuid4().hex[:6]}", WARM))  # compile, connect
        if receiver is not None:  # the warm-up's spans are not counted
            receiver.wait_for(lambda s: len(s) >= WARM * SPANS_PER_SESSION, timeout_s=60)
            receiver.clear()
        kinds: dict[str, list[int]] = {}
        for name, proc in workers.workers.items():
            kinds.setdefault(name.split("-")[0], []).append(proc.pid)
        specs = workload(f"otel-{uuid.uuid4().hex[:6]}", n)
        with measured(kinds, None) as cost:
            ok = run_batch(client, specs)
            if receiver is not None:
                receiver.wait_for(lambda s: len(s) >= n * SPANS_PER_SESSION, timeout_s=120)
        if ok != n:
            raise RuntimeError(f"{n - ok} of {n} sessions did not end ok (see {workers.workdir})")
        return cost
    finally:
        workers.stop()
        client.redis.flushdb()
        client.close()


def sdk_ms_per_span(reps: int = 2_000) -> float:
    """CPU (this process's) of the SDK's part of one span: a chat span as the builder makes
    it, turned into an SDK span and encoded as OTLP protobuf; steadier than the fleet's pairs,
    which this machine's drift swamps."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    from worker.edges.otel_spans import OtelSpans
    from worker.session.spans import SpanEventValue, SpanValue

    attributes: dict[str, str | int | tuple[str, ...]] = {
        "gen_ai.operation.name": "chat", "gen_ai.provider.name": "openai",
        "gen_ai.request.model": "replay/two_rounds", "gen_ai.response.model": "replay/two_rounds",
        "gen_ai.response.id": "chatcmpl-0123456789", "gen_ai.usage.input_tokens": 30,
        "gen_ai.usage.output_tokens": 5, "gen_ai.response.finish_reasons": ("tool_calls",),
        "server.address": "127.0.0.1", "server.port": 8011, "cchatq.session.id": "eval/0042",
        "cchatq.batch.id": "0123456789ab", "cchatq.step": "0123456789abcdef01234567.r1",
        "cchatq.attempt": 1, "cchatq.worker": "llm-1@host",
    }  # fmt: skip
    wait = SpanEventValue("cchatq.queue_wait", 1_000, {"wait_ms": 3})
    span = SpanValue("chat replay/two_rounds", "client", 1 << 100, 1 << 50, 1 << 40, 1_000,
                     1_013, attributes, (wait,))  # fmt: skip
    sink = OtelSpans((), "bench")  # no exporter: the conversion and the encoding alone
    started = time.process_time()
    for _ in range(reps):
        encode_spans([sink.readable(span)]).SerializeToString()
    return (time.process_time() - started) * 1000 / reps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.otel", description=__doc__)
    parser.add_argument("--sessions", type=int, default=500)
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--content", action="store_true", help="spans capture content too")
    parser.add_argument(
        "--delay-ms", type=int, default=None, help="OTEL_BSP_SCHEDULE_DELAY (default: 5000)"
    )
    args = parser.parse_args(argv)
    n = args.sessions
    off: list[Cost] = []
    on: list[Cost] = []
    received = 0
    with Fleet() as base, OtlpReceiver() as receiver:
        base.ensure_redis(private=True)
        base.start_replay()
        # the batch processor's own defaults (an export every 5 s, or of 512 spans)
        spans_env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.url}
        if args.delay_ms is not None:
            spans_env["OTEL_BSP_SCHEDULE_DELAY"] = str(args.delay_ms)
        if args.content:
            spans_env["OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"] = "true"
        for pair in range(args.pairs):  # in turns, each first in every other pair: this
            # machine's speed drifts between runs, and a pair's second run finds it warmer
            runs = [("off", 12, {}, None), ("on", 13, spans_env, receiver)]
            for label, db, env, sink in runs if pair % 2 == 0 else reversed(runs):
                (off if label == "off" else on).append(_run(base, db, env, n, sink))
            received = len(receiver.spans())
            receiver.clear()
            print(f"pair {pair + 1}: off {_ms(off[-1], n)}; on {_ms(on[-1], n)}", file=sys.stderr)
    off_ms = statistics.median(c.cpu_total_s * 1000 / n for c in off)
    on_ms = statistics.median(c.cpu_total_s * 1000 / n for c in on)
    rows = [
        (f"{n} sessions (3 model calls, 2 tool calls each), pairs", str(args.pairs)),
        ("worker CPU per session, spans off", f"{off_ms:.2f} ms ({_spread(off, n)})"),
        (
            "worker CPU per session, spans on" + (" with content" if args.content else ""),
            f"{on_ms:.2f} ms ({_spread(on, n)})",
        ),
        ("spans' cost per session", f"{on_ms - off_ms:+.2f} ms ({(on_ms / off_ms - 1):+.0%})"),
        ("  a span", f"{(on_ms - off_ms) / SPANS_PER_SESSION:+.3f} ms"),
        (
            "  the SDK's part of a span (convert + encode, in-process)",
            f"{sdk_ms_per_span():.3f} ms",
        ),
        ("spans received in the last run", f"{received} ({received / n:.1f} a session)"),
    ]
    width = max(len(k) for k, _ in rows)
    print(f"\n{'measure'.ljust(width)}  result\n{'-' * width}  {'-' * 30}")
    for key, value in rows:
        print(f"{key.ljust(width)}  {value}")
    return 0


def _ms(cost: Cost, n: int) -> str:
    """Worker CPU per session, in all and by queue."""
    kinds = ", ".join(f"{k} {v * 1000 / n:.2f}" for k, v in sorted(cost.cpu_s.items()) if v > 0)
    return f"{cost.cpu_total_s * 1000 / n:.2f} ms ({kinds})"


def _spread(costs: list[Cost], n: int) -> str:
    return "runs " + ", ".join(f"{c.cpu_total_s * 1000 / n:.2f}" for c in costs)


if __name__ == "__main__":
    sys.exit(main())
