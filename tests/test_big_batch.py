"""A big batch's producer side on a private Redis, no workers: validation holds a compact form a
line, a file with an error anywhere enqueues nothing, a batch's status and the viewer's page
read as much for 3,000 sessions as for 1,500 (commands counted by Redis's INFO commandstats),
and result lines are put in input order from where they were written. Sessions are ended by
the workers' own write-once script, and their batches told as the workers tell them
(bench/synthetic_finish.py)."""

from __future__ import annotations

import json
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.synthetic_finish import finish_sessions
from producer.batches import SAMPLE, Batches
from producer.cli import main
from producer.cli_common import EXIT_OK, EXIT_REJECTED
from producer.client import Client
from producer.fleet import Fleet
from producer.local_cluster import LocalCluster
from producer.openai_output import ResultFiles
from producer.specfile import load_spec_file, load_stored_specs
from producer.viewer.fleet_source import FleetSource
from producer.viewer.model import PAGE_ROWS, BatchQuery
from schemas import keys
from schemas.bodies import dump_body
from schemas.fleet_config import FleetConfig
from schemas.spec_types import spec_to_json

WRITES = ("hset", "hincrby", "hsetnx", "set", "rpush", "lpush", "del", "expire", "zadd")


def write_specs(path: Path, count: int, prefix: str, last: str | None = None) -> Path:
    """`count` plain one-message sessions, one a line (and `last`, a line of its own)."""
    with path.open("w") as out:
        for n in range(count):
            spec = {"id": f"{prefix}/{n:06d}", "model": "replay/plain",
                    "messages": [{"role": "user", "content": f"Say hello to session {n}"}],
                    "metadata": {"row": n}}  # fmt: skip
            out.write(json.dumps(spec) + "\n")
        if last is not None:
            out.write(last + "\n")
    return path


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    fleet = Fleet(workdir=tmp_path_factory.mktemp("big-batch"))
    try:
        yield fleet.ensure_redis(private=True)
    finally:
        fleet.stop()


@pytest.fixture()
def client(redis_url: str) -> Iterator[Client]:
    client = Client(redis_url, config=FleetConfig())
    client.redis.flushdb()
    try:
        yield client
    finally:
        client.close()


def commands(client: Client) -> dict[str, int]:
    """Commands Redis ran since the last call, by name (INFO and CONFIG not counted)."""
    stats = client.redis.info("commandstats")
    client.redis.config_resetstat()
    ran = {name.removeprefix("cmdstat_"): int(s["calls"]) for name, s in stats.items()}
    return {name: n for name, n in ran.items() if name not in ("info", "config|resetstat")}


def submitted(client: Client, tmp_path: Path, count: int) -> str:
    path = write_specs(tmp_path / f"b{count}.jsonl", count, f"b{count}")
    return client.enqueue(load_stored_specs(path)).batch


def test_validation_holds_a_compact_form_a_line(tmp_path: Path) -> None:
    """20,000 lines validated in under 12 MB (the specs' own objects take about 20 MB), each
    kept as the very bytes its spec is stored as."""
    path = write_specs(tmp_path / "big.jsonl", 20_000, "mem")
    tracemalloc.start()
    try:
        loaded = load_stored_specs(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(loaded) == 20_000 and [s.line for s in loaded[:3]] == [1, 2, 3]
    assert peak < 12_000_000, f"validation peaked at {peak / 1e6:.1f} MB"
    specs = load_spec_file(path)
    for n in (0, 7, 19_999):
        assert loaded[n].body == dump_body(spec_to_json(specs[n].spec))
        assert loaded[n].content == keys.content_digest(loaded[n].body)
        assert loaded[n].spec() == specs[n].spec


def test_an_error_on_the_last_line_enqueues_nothing(
    client: Client, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.delenv("CCHATQ_STATE_URL", raising=False)
    monkeypatch.delenv("CCHATQ_BROKER_URL", raising=False)
    bad = json.dumps({"id": "last/1", "model": "replay/plain", "messages": []})
    path = write_specs(tmp_path / "bad.jsonl", 5_000, "last", last=bad)
    assert main(["submit", "--no-wait", str(path)]) == EXIT_REJECTED
    said = capsys.readouterr().err
    assert "rejected, nothing enqueued" in said and f"{path}:5001: messages:" in said
    assert client.redis.dbsize() == 0
    good = write_specs(tmp_path / "good.jsonl", 5_000, "last")
    assert main(["submit", "--no-wait", str(good)]) == EXIT_OK
    batch = client.redis.zrange(keys.BATCHES, 0, -1)[0].decode()
    assert client.redis.llen(keys.batch_ids(batch)) == 5_000


@pytest.mark.parametrize("count", [1_500, 3_000])
def test_status_of_a_finished_batch_reads_a_few_fields(
    client: Client, tmp_path: Path, count: int
) -> None:
    batch = submitted(client, tmp_path, count)
    assert finish_sessions(client.redis, batch, error_every=50) == count
    batches = Batches(client)
    commands(client)
    summary = batches.summary(batch)
    ran = commands(client)
    assert summary is not None and summary.sampled == 0
    assert summary.states == {"done": count} and summary.status == "completed"
    assert summary.outcomes == {"ok": count - count // 50, "provider_error": count // 50}
    assert sum(ran.values()) <= 12, ran  # the same for 1,500 and 3,000 sessions


@pytest.mark.parametrize("count", [3_000, 6_000])
def test_status_of_a_running_batch_reads_a_sample(
    client: Client, tmp_path: Path, count: int
) -> None:
    """A third ended: those counted exactly, queued and running among the others (more than
    SAMPLE) from a sample of SAMPLE sessions; the reads stay within what the sample needs."""
    batch = submitted(client, tmp_path, count)
    finish_sessions(client.redis, batch, most=count // 3)
    batches = Batches(client)
    batches.summary(batch)
    commands(client)
    summary = batches.summary(batch)
    ran = commands(client)
    assert summary is not None and summary.status == "in_progress"
    assert summary.states == {"done": count // 3, "queued": count - count // 3}
    assert summary.sampled == SAMPLE
    # a state and a cancel flag per sampled session still running, and a few more
    assert sum(ran.values()) <= 2 * SAMPLE + 80, ran


@pytest.mark.parametrize("count", [1_500, 3_000])
def test_status_finds_the_last_few_unfinished_exactly(
    client: Client, tmp_path: Path, count: int
) -> None:
    """With SAMPLE or fewer left, each of them is found (every member's mark in one HMGET)
    and its state read: exact counts, and a gone session makes the batch expired."""
    batch = submitted(client, tmp_path, count)
    finish_sessions(client.redis, batch, most=count - 10)
    last = keys.Claim.decode(client.redis.lindex(keys.batch_runs(batch), -1)).sk
    client.redis.delete(keys.meta(last))  # expired, or lost with Redis's data
    batches = Batches(client)
    batches.summary(batch)
    commands(client)
    summary = batches.summary(batch)
    ran = commands(client)
    assert summary is not None and summary.sampled == 0
    assert summary.states == {"done": count - 10, "queued": 9, "gone": 1}
    assert sum(ran.values()) <= 40, ran  # the same for 1,500 and 3,000 sessions


def test_an_ending_told_twice_is_counted_once(client: Client, tmp_path: Path) -> None:
    batch = submitted(client, tmp_path, 1_200)
    finish_sessions(client.redis, batch)
    first = keys.Claim.decode(client.redis.lindex(keys.batch_runs(batch), 0)).sk
    told = client.redis.hget(keys.batch_ended(batch), first)
    client.redis.hset(keys.batch_ended(batch), first, told)  # a redelivered ending's telling
    summary = Batches(client).summary(batch)
    assert summary is not None and summary.states == {"done": 1_200}


def test_a_batch_joining_runs_that_ended_counts_them(client: Client, tmp_path: Path) -> None:
    """The same file submitted again joins the runs of its ids, which ended before this batch
    watched them: the submit tells its ended index, so they count at once."""
    path = write_specs(tmp_path / "again.jsonl", 1_200, "again")
    first = client.enqueue(load_stored_specs(path)).batch
    finish_sessions(client.redis, first, error_every=100)
    again = client.enqueue(load_stored_specs(path))
    assert len(again.done) == 1_200 and not again.new
    summary = Batches(client).summary(again.batch)
    assert summary is not None and summary.states == {"done": 1_200}
    assert summary.outcomes == {"ok": 1_188, "provider_error": 12}


def test_the_viewer_pages_a_big_batch_reading_its_page_only(
    client: Client, redis_url: str, tmp_path: Path
) -> None:
    """The default view of a 3,000-session batch reads the records of its page alone and
    counts from the batch's ended index, writing nothing."""
    batch = submitted(client, tmp_path, 3_000)
    finish_sessions(client.redis, batch, error_every=100)
    source = FleetSource(Client(redis_url, config=FleetConfig()))
    asked: list[int] = []
    records = source.client.records

    def counted(sks: Any) -> Any:
        asked.append(len(sks))
        return records(sks)

    source.client.records = counted  # type: ignore[method-assign]
    commands(client)
    page = source.batch_page(batch, BatchQuery(page=2))
    ran = commands(client)
    assert page is not None and page.query.page == 2 and page.pages == 6
    assert [r.spec_id for r in page.rows][:2] == ["b3000/000500", "b3000/000501"]
    assert len(page.rows) == PAGE_ROWS and sum(asked) <= PAGE_ROWS
    assert page.run.done == 3_000 and page.outcomes == {"ok": 2_970, "provider_error": 30}
    assert not any(name in ran for name in WRITES), ran
    source.close()


def test_result_lines_are_put_in_input_order_from_where_they_were_written(
    tmp_path: Path,
) -> None:
    out = tmp_path / "results.jsonl"

    def line(sk: str, record: dict[str, Any], batch: str, attempt: int) -> tuple[bool, str]:
        return False, json.dumps({"sk": sk, "n": record["n"]}) + "\n"

    files = ResultFiles(out, line)
    order = [f"sk{n}" for n in range(50)]
    with files:
        for n, sk in reversed(list(enumerate(order))):  # as they finish
            files.write(sk, {"n": n}, "B", 1)
            assert len(out.read_text().splitlines()) == 50 - n  # written as it arrives
    files.reorder(order)
    assert [json.loads(x)["n"] for x in out.read_text().splitlines()] == list(range(50))


@pytest.mark.fleet  # a Redis Cluster of 3 masters, started and stopped here
def test_a_big_batchs_status_on_a_redis_cluster(redis_url: str, tmp_path: Path) -> None:
    """A big batch's status on a 3-master cluster (the broker on a Redis of its own, as on a
    fleet): its ended index read in the batch's slot, its sessions' states across slots."""
    with LocalCluster(masters=3, workdir=tmp_path) as cluster:
        client = Client(cluster.url, config=FleetConfig(), broker_url=redis_url)
        try:
            batch = submitted(client, tmp_path, 1_200)
            finish_sessions(client.redis, batch, most=700)
            summary = Batches(client).summary(batch)
            assert summary is not None and summary.states == {"done": 700, "queued": 500}
            finish_sessions(client.redis, batch)
            summary = Batches(client).summary(batch)
            assert summary is not None and summary.states == {"done": 1_200}
            assert summary.status == "completed"
        finally:
            client.close()
