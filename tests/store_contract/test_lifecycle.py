"""The SessionLifecycle contract: a session's end, written once and owned by the step that
wrote it; run on the in-memory twin, one Redis and a 3-master cluster (conftest.py)."""

from __future__ import annotations

from schemas import keys
from tests.store_contract.conftest import Backend, spec
from worker.session.store_ports import SessionLifecycle


def port(backend: Backend) -> SessionLifecycle:
    """The store as this role's port: a test of it calls nothing else."""
    return backend.store


def test_a_result_is_written_once_and_announced(backend: Backend, sk: str) -> None:
    backend.submit(sk, spec(sk), "batch-" + sk)
    store = port(backend)
    assert not store.has_result(sk)
    assert store.write_result(sk, b'{"ok":1}', {"id": "x"}) == "ok"
    assert store.write_result(sk, b'{"ok":2}', {"id": "y"}) is None
    assert store.has_result(sk)
    assert backend.store.watcher_batches(sk) == ["batch-" + sk]
    assert store.meta(sk)["state"] == "done"


def test_the_end_is_decided_once_and_owned_by_the_step_that_wrote_it(
    backend: Backend, sk: str
) -> None:
    """The first writer ends the session: the meta keeps its outcome and names it; another
    step's write changes nothing and tells no batch; the winner's own redelivery (whose commit
    may not have been written) is told it ended the session."""
    backend.submit(sk, spec(sk), "")
    store = port(backend)
    ok = {"id": "x", "body": {"choices": []}}
    cancelled = {"id": "x", "body": {"error": {"code": "cancelled", "message": "m"}}}
    round_step, finish = keys.round_step(sk, 0), keys.finish_step(sk)
    assert store.write_result(sk, b'{"choices":[]}', ok, [], round_step) == "ok"
    told: list[str] = []
    assert store.write_result(sk, b'{"error":{}}', cancelled, told, finish) is None
    assert told == []
    assert store.write_result(sk, b'{"error":{}}', cancelled, None, "") is None
    # the winner's redelivery, whose ending now says cancelled: told the outcome written
    assert store.write_result(sk, b'{"error":{}}', cancelled, [], round_step) == "ok"
    meta = store.meta(sk)
    assert (meta["state"], meta["outcome"], meta["ended_by"]) == ("done", "ok", round_step)
