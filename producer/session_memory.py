"""What a session holds in Redis, sampled for `cchatq status`: the bytes and keys of a finished
session (its retired record, its response fd and its id's claim: schemas/session_record.py)
and of a running one (its spec, meta, trace, outputs and markers so far), each the mean of
MEMORY USAGE over up to SAMPLE sessions. Finished ones are drawn from the latest batches' ended
indexes, running ones from the reconciler's index of active sessions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from schemas import keys
from schemas.session_record import read_record

SAMPLE = 20  # sessions of each kind measured
BATCHES = 5  # the latest batches finished sessions are drawn from
ROUND_KEYS = 8  # of a running session's rounds, the outputs looked at: its model reply, calls


@dataclass(frozen=True)
class SessionMemory:
    finished_bytes: int | None  # mean over the sampled finished sessions (None: none found)
    finished_keys: float | None
    running_bytes: int | None
    running_keys: float | None
    sampled_finished: int
    sampled_running: int


def _mean(sizes: list[list[int | None]]) -> tuple[int | None, float | None]:
    """The mean bytes and keys of sessions given as their keys' MEMORY USAGE (None: no key)."""
    if not sizes:
        return None, None
    held = [[n for n in each if n is not None] for each in sizes]
    return sum(sum(h) for h in held) // len(held), round(sum(len(h) for h in held) / len(held), 2)


def _finished(client: Any) -> list[list[int | None]]:
    batches = [b.decode() for b in client.zrevrange(keys.BATCHES, 0, BATCHES - 1)]
    sks: list[tuple[str, str]] = []  # (sk, its batch)
    for batch in batches:
        drawn = client.hrandfield(keys.batch_ended(batch), SAMPLE - len(sks)) or []
        sks += [(sk.decode(), batch) for sk in drawn]
        if len(sks) >= SAMPLE:
            break
    sizes: list[list[int | None]] = []
    for sk, batch in sks:
        raw = client.get(keys.record(sk))
        if raw is None:  # expired since it ended
            continue
        spec_id = read_record(raw).record.get("id")
        namespace = (client.get(keys.batch_namespace(batch)) or b"").decode()
        names = [keys.record(sk), keys.response(sk)]
        if isinstance(spec_id, str) and namespace:
            names.append(keys.id_claim(namespace, spec_id))
        sizes.append([client.memory_usage(name) for name in names])
    return sizes


def _running(client: Any) -> list[list[int | None]]:
    sks = [sk.decode() for sk in client.zrandmember(keys.ACTIVE, SAMPLE) or []]
    sizes: list[list[int | None]] = []
    for sk in sks:
        rounds = int(client.hget(keys.meta(sk), "round") or 0) + 1
        names = [keys.spec(sk), keys.meta(sk), keys.trace(sk), keys.watchers(sk),
                 keys.partial(sk), keys.mcp_tools(sk)]  # fmt: skip
        for r in range(rounds):
            names += [keys.model_out(sk, r), keys.step_state(keys.round_step(sk, r))]
            names += [keys.tool_out(sk, r, i) for i in range(ROUND_KEYS)]
            names += [keys.step_state(keys.tool_step(sk, r, i)) for i in range(ROUND_KEYS)]
        pipe = client.pipeline(transaction=False)
        for name in names:
            pipe.memory_usage(name)
        sizes.append(pipe.execute())
    return sizes


def session_memory(client: Any) -> SessionMemory:
    """A sample's means (a few hundred commands: `cchatq status` only, not the metrics)."""
    finished, running = _finished(client), _running(client)
    finished_bytes, finished_keys = _mean(finished)
    running_bytes, running_keys = _mean(running)
    return SessionMemory(
        finished_bytes, finished_keys, running_bytes, running_keys, len(finished), len(running)
    )
