"""Every key template used together in one script or transaction is in one Redis Cluster slot.

The slots are computed here (CRC16 as Redis Cluster computes them, redis-py's `key_slot`) for
each family of keys the store writes together: a session's own keys (its steps' markers and
try counts among them), a batch's, a program run's user streams with the done list that wakes
it, a backend's rate limit, a rate controller's. The fleet-wide keys (the reconciler's index,
the dead letters, the fleet's trace, the controllers' index) are in slots of their own, and no
script or transaction of the store names them with a session's keys on a cluster: the store's
contract runs on a real 3-master cluster (tests/store_contract/, `cluster`), and a batch
runs there (tests/test_fleet_apart.py), where Redis refuses any cross-slot script or
transaction."""

from __future__ import annotations

import uuid

from redis.crc import key_slot

from schemas import fleet_keys, keys


def _slots(names: list[str]) -> set[int]:
    return {key_slot(name.encode()) for name in names}


def _session_keys(sk: str) -> list[str]:
    steps = [keys.round_step(sk, 0), keys.tool_step(sk, 1, 2), keys.finish_step(sk),
             keys.background_step(sk, 0, 1), keys.program_step(sk)]  # fmt: skip
    return [
        keys.spec(sk), keys.meta(sk), keys.model_out(sk, 3), keys.tool_out(sk, 3, 7),
        keys.trace(sk), keys.task(sk, "t1"), keys.tool_queued(sk, 0, 1), keys.failure(sk),
        keys.cancel(sk), keys.response(sk), keys.record(sk), keys.watchers(sk), keys.fds(sk),
        keys.mcp_tools(sk), keys.user_in(sk), keys.user_out(sk), keys.partial(sk),
        *(keys.step_state(s) for s in steps), *(keys.tries(s) for s in steps),
    ]  # fmt: skip


def test_every_key_of_a_session_is_in_its_slot() -> None:
    for _ in range(50):
        sk = keys.run_session_key("ns", uuid.uuid4().hex, keys.new_generation())
        assert len(_slots(_session_keys(sk))) == 1, sk
        chat = keys.chat_session_key(sk, 3)
        assert len(_slots(_session_keys(chat))) == 1


def test_a_program_runs_streams_share_a_slot_with_the_list_that_wakes_it() -> None:
    sk = keys.run_session_key("ns", "run-1", keys.new_generation())
    together = [keys.user_in(sk), keys.done_list(keys.run_batch(sk)), *_session_keys(sk)]
    assert len(_slots(together)) == 1


def test_every_key_of_a_batch_is_in_its_slot() -> None:
    batch = uuid.uuid4().hex[:12]
    start = keys.start_step(batch, 4)
    names = [keys.batch_ids(batch), keys.batch_runs(batch), keys.batch_namespace(batch),
             keys.done_list(batch), keys.chunk(batch, 0), keys.chunk(batch, 9),
             keys.step_state(start), keys.tries(start)]  # fmt: skip
    assert len(_slots(names)) == 1


def test_rate_keys_share_their_backends_or_controllers_slot() -> None:
    for backend in ("openai", "replay-anthropic", "x:y/z"):
        limit = [fleet_keys.rate_requests(backend), fleet_keys.rate_tokens(backend),
                 fleet_keys.rate_total(backend)]  # fmt: skip
        assert len(_slots(limit)) == 1
        controller = [fleet_keys.rate_controller(backend), fleet_keys.rate_slots(backend),
                      fleet_keys.rate_room(backend)]  # fmt: skip
        assert len(_slots(controller)) == 1


def test_sessions_spread_over_the_slots() -> None:
    """Sessions' slots are spread (each master of a cluster gets its share): of 3,000
    sessions, each third of the slot range holds between 30% and 37%."""
    slots = [key_slot(keys.meta(keys.run_session_key("ns", str(n), "0000")).encode())
             for n in range(3000)]  # fmt: skip
    thirds = [sum(1 for s in slots if s * 3 // 16384 == third) for third in range(3)]
    assert all(900 <= n <= 1110 for n in thirds), thirds
