"""Issue 10, point 5: the metrics exporter's values move as a small batch runs (a real fleet,
the exporter in process, scraped over HTTP)."""

from __future__ import annotations

import socket
import uuid
from pathlib import Path
from typing import Any

import pytest
import requests

from fixtures.demo_batch import WEATHER
from producer.metrics import Exporter
from tests.conftest import Running
from tests.test_pipeline import run_specs, wait_for

pytestmark = pytest.mark.fleet


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def sample(text: str, name: str, **labels: str) -> float:
    """The value of one sample of the exposition `text` (0 when it is not there yet)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        metric, _, value = line.rpartition(" ")
        if metric == (f"{name}{{{want}}}" if want else name):
            return float(value)
    return 0.0


def test_metrics_move_as_a_batch_runs(running: Running, tmp_path: Path) -> None:
    exporter = Exporter(running.redis_url)
    port = free_port()
    exporter.serve(port, "127.0.0.1")
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        before = requests.get(url, timeout=5).text
        assert "cchatq_queue_depth" in before and "cchatq_sessions_active" in before
        run = uuid.uuid4().hex[:8]
        specs: list[dict[str, Any]] = [
            {
                "id": f"{run}/m/{n}",
                "model": "replay/weather",
                "messages": [{"role": "user", "content": f"Weather in Oslo {n}?"}],
                "tools": [dict(WEATHER)],
            }
            for n in range(4)
        ]
        records = run_specs(running.client, specs, tmp_path)
        assert all(r["status"] == "ok" for r in records.values())

        def counted() -> bool:
            text = requests.get(url, timeout=5).text
            return sample(text, "cchatq_sessions_finished_total", outcome="ok") >= 4

        wait_for(counted)  # the exporter follows the trace stream as it is written
        text = requests.get(url, timeout=5).text
        calls = sample(text, "cchatq_model_calls_total", backend="replay", outcome="finished")
        assert calls >= 8  # 2 rounds a session
        assert sample(text, "cchatq_tool_calls_total", tool="get_weather", outcome="ok") >= 4
        assert sample(text, "cchatq_tokens_total", backend="replay", direction="out") > 0
        assert sample(text, "cchatq_tool_call_seconds_count", tool="get_weather") >= 4
    finally:
        exporter.close()
