"""A bare Celery no-op trampoline with our reliability settings: the floor a step hop costs."""

from __future__ import annotations

import os

import redis
from celery import Celery

from worker.config import load_settings
from worker.wiring import celery_config

app = Celery("cchatq-bench")
app.conf.update(celery_config(load_settings()))
app.conf.task_routes = {"bench.hop": {"queue": "bench"}}
_redis = redis.Redis.from_url(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))


@app.task(name="bench.hop")
def hop(remaining: int, done_key: str) -> None:
    if remaining <= 0:
        _redis.rpush(done_key, "1")
        return
    hop.apply_async((remaining - 1, done_key), queue="bench")
