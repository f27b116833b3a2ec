"""The store backends each role's contract runs on: the in-memory twin, one Redis and a
3-master Redis Cluster (as dramatiq runs its result backends over ["redis", "stub"]). The Redis
halves need the private Redis (fleet marker)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis

from producer.fleet import Fleet
from schemas import keys
from schemas.bodies import dump_body
from schemas.spec_types import (
    spec_from_json,
)
from worker.codecs.reply import Reply
from worker.edges.redis_pool import pooled_client
from worker.edges.store import RedisStore
from worker.session.store_ports import SessionStore
from worker.session.twins.store import MemoryStore

REDIS_DB = 9


@dataclass
class Backend:
    """A store under test, with what a producer does to it (submit, cancel, chunk) and what a
    waiting producer reads (`told`: the sessions a batch was told ended, in order)."""

    store: SessionStore
    submit: Any
    cancel: Any
    chunk: Any
    told: Callable[[str], list[str]]


def _memory() -> Backend:
    store = MemoryStore()

    def chunk(batch: str, n: int, members: list[str]) -> None:
        store.chunks[(batch, n)] = [keys.ChunkMember.decode(m) for m in members]

    def submit(sk: str, spec: dict[str, Any], batch: str) -> None:
        store.submit(sk, spec_from_json(spec), batch)

    return Backend(store, submit, store.cancel, chunk, lambda b: list(store.done.get(b, ())))


def _redis(base_fleet: Fleet) -> Backend:
    url = base_fleet.redis_url.rsplit("/", 1)[0] + f"/{REDIS_DB}"
    return _on(redis.Redis.from_url(url))


def _on(client: Any) -> Backend:
    store = RedisStore(client, ttl_s=600)

    def submit(sk: str, spec: dict[str, Any], batch: str) -> None:
        client.set(keys.spec(sk), dump_body(spec), ex=600)
        client.hset(keys.meta(sk), mapping={"id": spec["id"], "submitted_ms": 1})
        client.zadd(keys.ACTIVE, {sk: 1})  # watched by the reconciler, as a producer does
        if batch:
            client.sadd(keys.watchers(sk), batch)

    def chunk(batch: str, n: int, members: list[str]) -> None:
        client.rpush(keys.chunk(batch, n), *members)

    def told(batch: str) -> list[str]:
        return [sk.decode() for sk in client.lrange(keys.done_list(batch), 0, -1)]

    return Backend(store, submit, lambda sk: client.set(keys.cancel(sk), 1), chunk, told)


@pytest.fixture(
    params=[
        "memory",
        pytest.param("redis", marks=pytest.mark.fleet),
        pytest.param("cluster", marks=pytest.mark.fleet),
    ]
)
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    if request.param == "memory":
        yield _memory()
    elif request.param == "redis":
        yield _redis(request.getfixturevalue("base_fleet"))
    else:
        yield _on(pooled_client(request.getfixturevalue("state_cluster"), 4))


@pytest.fixture
def sk() -> str:
    return uuid.uuid4().hex[:12]


def spec(sk: str) -> dict[str, Any]:
    return {"id": f"contract/{sk}", "model": "m", "messages": [], "limits": {"max_iterations": 3}}


def completion(*call_ids: str) -> dict[str, Any]:
    calls = [
        {"id": c, "type": "function", "function": {"name": "f", "arguments": "{}"}}
        for c in call_ids
    ]
    message: dict[str, Any] = {"role": "assistant", "content": None if calls else "done"}
    if calls:
        message["tool_calls"] = calls
    return {"choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}


def store_reply(store: Any, sk: str, round_no: int, raw: dict[str, Any]) -> Reply:
    return store.store_round(sk, round_no, Reply.parse(raw), ())
