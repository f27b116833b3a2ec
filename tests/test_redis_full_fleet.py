"""A Redis that fills up, on a real fleet: its own redis-server with a small maxmemory (the
shared one's limit would reach every other test), the base fleet's replay server, real Celery
workers. Workers stay up through an OOM mid-batch and their sessions end once memory is
freed, no try spent; `cchatq submit` enqueues what fits and says so in one line; an evicting
maxmemory-policy is refused by workers and submit, unless CCHATQ_ALLOW_EVICTION=1."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from producer.client import Client
from producer.fleet import Fleet
from producer.specfile import load_spec_from_objects
from schemas import keys, redis_links

pytestmark = pytest.mark.fleet

MB = 1024 * 1024
QUEUES = ("llm", "control")  # plain one-round sessions need no tool worker


def chats(run: str, n: int, prompt_bytes: int = 100, latency_ms: int = 0) -> list[dict[str, Any]]:
    marker = f" [[latency_ms:{latency_ms}]]" if latency_ms else ""
    pad = "x" * prompt_bytes
    return [
        {"id": f"{run}/{i}", "model": "replay/plain",
         "messages": [{"role": "user", "content": f"[{run} {i}] {pad}{marker}"}]}
        for i in range(n)
    ]  # fmt: skip


def until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def ended(client: Client, sks: list[str]) -> int:
    pipe = client.redis.pipeline(transaction=False)
    for sk in sks:
        pipe.exists(keys.record(sk))
    return sum(pipe.execute())


def cli(
    fleet: Fleet, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "producer.cli", *args]
    return subprocess.run(
        cmd, env=fleet.worker_env(env), capture_output=True, text=True, timeout=180
    )


def worker_logs(fleet: Fleet) -> str:
    return "".join(fleet.log_of(name).read_text(errors="replace") for name in fleet.workers)


@pytest.fixture(scope="module")
def full(base_fleet: Fleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """A private Redis (noeviction, no limit until a test sets one) and workers on it."""
    workdir = tmp_path_factory.mktemp("redis-full")
    fleet = Fleet(replay_url=base_fleet.replay_url, workdir=workdir, env=dict(base_fleet.env))
    try:
        fleet.ensure_redis(private=True)
        # CONFIG SET dir, which the MISCONF test needs, is refused unless allowed at start
        fleet.redis_cmd += ["--enable-protected-configs", "yes"]
        fleet.restart_redis(signal.SIGTERM)
        admin = redis.Redis.from_url(fleet.redis_url)
        admin.config_set("maxmemory-policy", "noeviction")
        for queue in QUEUES:
            fleet.start_worker(queue)
        fleet.wait_served(QUEUES)
        yield fleet
    finally:
        fleet.stop()


def limit(fleet: Fleet, maxmemory: int | str) -> None:
    redis.Redis.from_url(fleet.redis_url).config_set("maxmemory", maxmemory)


def test_workers_stay_up_through_an_oom_mid_batch_and_no_try_is_spent(full: Fleet) -> None:
    client = Client(full.redis_url, config=full.config())
    try:
        sub = client.enqueue(load_spec_from_objects(chats(uuid.uuid4().hex[:8], 120, 100, 200)))
        until(lambda: ended(client, sub.order) >= 10, 60, "the batch to start")
        # far below what it uses, so nothing the fleet frees (acks, expiries) lets a write in
        limit(full, MB)
        try:
            with pytest.raises(redis.exceptions.OutOfMemoryError):
                client.redis.set("cq:test:probe", "x" * 10_000)
            stuck = ended(client, sub.order)
            # the fleet meets the refusal (takes, leases, commits refused) and says so
            until(lambda: "Redis refuses writes (OOM)" in worker_logs(full), 60, "the refusal")
            assert ended(client, sub.order) == stuck < len(sub.order)
            assert [name for name, p in full.workers.items() if p.poll() is not None] == []
        finally:
            limit(full, 0)  # memory freed
        records = dict(client.wait(sub, timeout_s=120))
        assert {r["status"] for r in records.values()} == {"ok"}
        assert len(records) == len(sub.order)
        assert [name for name, p in full.workers.items() if p.poll() is not None] == []
        tries = [
            keys.tries_count(client.redis.get(k)) for k in client.redis.scan_iter("cq:tries:*")
        ]
        assert all(t <= 1 for t in tries), "a try was spent for the refusal"
        assert client.redis.xlen(keys.DEADLETTER) == 0
        logs = worker_logs(full)
        assert "Unrecoverable error" not in logs and "Traceback" not in logs
        assert "Redis refuses writes (OOM)" in logs
    finally:
        client.close()


def test_workers_stay_up_while_redis_cannot_persist_past_their_health_checks(
    full: Fleet, tmp_path: Path
) -> None:
    """MISCONF (Redis cannot write its snapshot or append-only file: a full disk) refuses
    writes and PING alike, so the health check a connection idle past HEALTH_CHECK_S sends
    is refused too, on the broker's take and its subscription as on the state store's: the
    refusal is held past that, and every worker must stay up and every session end after."""
    admin = redis.Redis.from_url(full.redis_url)
    client = Client(full.redis_url, config=full.config())
    gone = tmp_path / "gone"
    gone.mkdir()
    try:
        sub = client.enqueue(load_spec_from_objects(chats(uuid.uuid4().hex[:8], 60, 100, 300)))
        until(lambda: ended(client, sub.order) >= 5, 60, "the batch to start")
        # a snapshot into a directory that is no more fails, and with a save point set, Redis
        # then refuses writes (stop-writes-on-bgsave-error)
        admin.config_set("save", "3600 1")
        admin.config_set("dir", str(gone))
        gone.rmdir()
        admin.bgsave()
        until(lambda: admin.info("persistence")["rdb_last_bgsave_status"] == "err", 30, "MISCONF")
        refused_at = time.monotonic()
        until(lambda: "Redis refuses writes (MISCONF)" in worker_logs(full), 60, "the refusal")
        # held past the connections' health checks, as a full disk is
        until(lambda: time.monotonic() - refused_at > 2 * redis_links.HEALTH_CHECK_S, 60, "")
        assert [name for name, p in full.workers.items() if p.poll() is not None] == []
    finally:
        admin.config_set("dir", str(tmp_path))
        admin.bgsave()
        until(lambda: admin.info("persistence")["rdb_last_bgsave_status"] == "ok", 30, "a save")
        admin.config_set("save", "")
    records = dict(client.wait(sub, timeout_s=120))
    assert {r["status"] for r in records.values()} == {"ok"}
    assert len(records) == len(sub.order)
    assert [name for name, p in full.workers.items() if p.poll() is not None] == []
    assert "Unrecoverable error" not in worker_logs(full)
    client.close()


def test_submit_enqueues_what_fits_and_says_so_in_one_line(full: Fleet, tmp_path: Path) -> None:
    admin = redis.Redis.from_url(full.redis_url)
    used = int(admin.info("memory")["used_memory"])
    objects = chats(uuid.uuid4().hex[:8], 300, 2048)
    spec_file = tmp_path / "sessions.jsonl"
    spec_file.write_text("".join(json.dumps(o) + "\n" for o in objects))
    limit(full, used + 6 * MB)  # room for a few dozen of the 300
    try:
        first = cli(full, "submit", str(spec_file), "--out", str(tmp_path / "a.jsonl"))
    finally:
        limit(full, 0)
    said = [line for line in first.stderr.splitlines() if line.startswith("cchatq:")]
    assert first.returncode == 4, first.stderr
    assert len(said) == 1 and "Traceback" not in first.stderr
    assert said[0].startswith(f"cchatq: Redis at {full.redis_url} has ")
    assert "free of maxmemory" in said[0] and "submit the same file again" in said[0]
    enqueued = int(said[0].split("enqueued ")[1].split(" of ")[0].replace(",", ""))
    assert 0 < enqueued < 300
    client = Client(full.redis_url, config=full.config())
    try:  # the ones that went in are claimed, the rest not
        claims = client.claims([o["id"] for o in objects])
        assert sum(c is not None for c in claims) == enqueued
        assert all(c is None for c in claims[enqueued:])
    finally:
        client.close()
    again = cli(full, "submit", str(spec_file), "--out", str(tmp_path / "b.jsonl"))
    assert again.returncode == 0, again.stderr
    lines = [json.loads(line) for line in (tmp_path / "b.jsonl").read_text().splitlines()]
    assert len(lines) == 300 and {line["status"] for line in lines} == {"ok"}
    assert f"{300 - enqueued} sessions enqueued, {enqueued} already submitted" in again.stderr


@pytest.fixture()
def evicting(base_fleet: Fleet, tmp_path: Path) -> Iterator[Fleet]:
    """A Redis whose maxmemory-policy may evict cchatq's keys; no workers yet."""
    fleet = Fleet(replay_url=base_fleet.replay_url, workdir=tmp_path, env=dict(base_fleet.env))
    try:
        fleet.ensure_redis(private=True)
        # CONFIG SET dir, which the MISCONF test needs, is refused unless allowed at start
        fleet.redis_cmd += ["--enable-protected-configs", "yes"]
        fleet.restart_redis(signal.SIGTERM)
        admin = redis.Redis.from_url(fleet.redis_url)
        admin.config_set("maxmemory", "64mb")
        admin.config_set("maxmemory-policy", "volatile-lru")
        yield fleet
    finally:
        fleet.stop()


def test_an_evicting_policy_is_refused_by_workers_and_submit_unless_allowed(
    evicting: Fleet, tmp_path: Path
) -> None:
    spec_file = tmp_path / "one.jsonl"
    spec_file.write_text(json.dumps(chats(uuid.uuid4().hex[:8], 1)[0]) + "\n")
    worker = evicting.start_worker("control")
    assert worker.wait(timeout=60) == 78  # EX_CONFIG, before it takes any task
    log = evicting.log_of("control-0").read_text()
    refusal = [line for line in log.splitlines() if "maxmemory-policy volatile-lru" in line]
    assert len(refusal) == 1 and "CONFIG SET maxmemory-policy noeviction" in refusal[0]
    assert "Traceback" not in log
    submitted = cli(evicting, "submit", str(spec_file), "--out", str(tmp_path / "r.jsonl"))
    assert submitted.returncode == 4
    assert submitted.stderr.strip().splitlines() == [
        line for line in submitted.stderr.strip().splitlines() if "volatile-lru" in line
    ]
    assert "CCHATQ_ALLOW_EVICTION=1" in submitted.stderr

    evicting.workers.pop("control-0")  # the refused one: exited
    allowed = {"CCHATQ_ALLOW_EVICTION": "1"}
    evicting.start_worker("control", extra_env=allowed)
    evicting.start_worker("llm", extra_env=allowed)
    evicting.wait_served(("control", "llm"))
    log = evicting.log_of("control-0").read_text()  # its name again, its log written anew
    assert "WARNING: Redis at" in log and "volatile-lru" in log
    assert all(p.poll() is None for p in evicting.workers.values())
    submitted = cli(
        evicting, "submit", str(spec_file), "--out", str(tmp_path / "r.jsonl"), env=allowed
    )
    assert submitted.returncode == 0, submitted.stderr
    assert "WARNING: Redis at" in submitted.stderr
    status = cli(evicting, "status")
    assert status.returncode == 0
    assert "volatile-lru" in status.stderr
    assert json.loads(status.stdout)["redis_memory"]["policy"] == "volatile-lru"
