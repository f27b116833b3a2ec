"""The BatchLinks contract: the batches a session is in, telling them, a batch's chunks;
run on the in-memory twin, one Redis and a 3-master cluster (conftest.py)."""

from __future__ import annotations

from schemas import keys
from tests.store_contract.conftest import Backend, spec
from worker.session.store_ports import BatchLinks


def port(backend: Backend) -> BatchLinks:
    """The store as this role's port: a test of it calls nothing else."""
    return backend.store


def test_chunk_members_in_order(backend: Backend, sk: str) -> None:
    backend.chunk("b" + sk, 0, ["x", "p:y", "z"])
    assert port(backend).chunk_members("b" + sk, 0) == [
        keys.ChunkMember("x"),
        keys.ChunkMember("y", program=True),
        keys.ChunkMember("z"),
    ]
    assert port(backend).chunk_members("b" + sk, 1) == []


def test_a_batch_is_told_each_session_that_ended_in_order(backend: Backend, sk: str) -> None:
    batch, other = f"b-{sk}", f"c-{sk}"
    backend.submit(sk, spec(sk), batch)
    assert port(backend).watcher_batches(sk) == [batch]
    port(backend).notify(sk, [batch, other], "ok")
    port(backend).notify(f"{sk}-2", [batch])
    assert backend.told(batch) == [sk, f"{sk}-2"] and backend.told(other) == [sk]
