"""The FleetUpkeep contract: dead letters and the reconciler's fleet-wide structures;
run on the in-memory twin, one Redis and a 3-master cluster (conftest.py)."""

from __future__ import annotations

from tests.store_contract.conftest import Backend, spec
from worker.session.store_ports import FleetUpkeep


def port(backend: Backend) -> FleetUpkeep:
    """The store as this role's port: a test of it calls nothing else."""
    return backend.store


def test_a_dead_letter_keeps_the_first_failure(backend: Backend, sk: str) -> None:
    store = port(backend)
    assert backend.store.failure(sk) is None
    store.dead_letter("s1", sk, {"error": {"code": "step_failed", "message": "one"}}, "why")
    store.dead_letter("s2", sk, {"error": {"code": "step_failed", "message": "two"}}, "why")
    assert backend.store.failure(sk) == {"error": {"code": "step_failed", "message": "one"}}


def test_the_reconciler_turn_is_one_holders_at_a_time(backend: Backend) -> None:
    port(backend).take_reconciler_turn(60_000)  # taken now, whoever had it before
    assert not port(backend).take_reconciler_turn(60_000)


def test_an_unfinished_session_is_stalled_until_it_ends_or_is_forgotten(
    backend: Backend, sk: str
) -> None:
    """Found once quiet for `quiet_ms`, and marked as just seen (the next turns look at others
    first); a session that ended, or was forgotten, is not watched any more."""
    ended, forgotten = f"{sk}-e", f"{sk}-f"
    for one in (sk, ended, forgotten):
        backend.submit(one, spec(one), "")
    store = port(backend)
    found = store.stalled(0, 100_000)
    assert {sk, ended, forgotten} <= set(found)
    assert sk not in store.stalled(60_000, 100_000)  # just seen
    backend.store.write_result(ended, b"{}", {"id": ended})
    store.forget_session(forgotten)
    assert not {ended, forgotten} & set(store.stalled(0, 100_000))
    assert sk in store.stalled(0, 100_000)
    submitted, unknown = store.submitted_ms([sk, f"{sk}-never"])
    assert isinstance(submitted, int) and unknown is None
    assert store.now_ms() >= submitted
