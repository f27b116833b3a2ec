"""The Redis commands one session costs, counted with MONITOR on the test's private Redis (the
commands a script runs counted as INFO commandstats counts them), and held to a budget per part:
a change that adds a command fails here, in CI, where timings cannot be trusted.

Counted: every command that names the session (its keys carry its `sk`; its messages' headers
their step ids; the fleet's trace entries its spec id), its batch, or its rate controller. Not
counted: what runs whatever the sessions do (heartbeats, idle broker polls, the reconciler's
passes) and the producer's polls of the done list while it waits. A task's take (BLMOVE) names
no session: the broker's part is counted as its publish (LPUSH) and acknowledgement (LREM),
one BLMOVE assumed for each LREM."""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from bench.goals import workload
from producer.fleet import Fleet
from producer.specfile import load_spec_from_objects
from tests.conftest import Running, _workers
from tests.test_pipeline import wait_for

pytestmark = pytest.mark.fleet

REDIS_DB = 6
RATED = f"budget-{uuid.uuid4().hex[:8]}"  # a controller of this run's own: a fresh one
STATIC = "budget-static"  # rate control off (`adaptive: false`, no limit: no command)

# The two-round calculator session of `make bench`, alone in its batch (3 model calls, 2 tool
# calls: the steps start, r0, r0.t0, r1, r1.t0, r2), rate control off. Where the commands go:
TWO_ROUNDS = {
    # submit: SET spec, HSET+EXPIRE meta (its batch is the one told: no watchers set); each
    # of the 5 steps of the session: its start's script (EVAL, SET NX GET its lease, MGET its
    # reads; a round's also EXISTS + HSET of the meta's state); its commit's script (EVALSHA),
    # in it its marker's SET, the session's trace XADD, a tool's outcome SET, a round's reply
    # SET (the ending round's: its own SET, before the ending); the trace's TTL at its first;
    # the ending: GET of a failure, EXISTS of the cancel
    # flag, the script writing it once (EVALSHA: SET response and record, HSET + EXPIRE of the
    # meta, SMEMBERS of the batches that joined); its commit (a MULTI: it runs a script of its
    # own) retires the session: HGETALL, XRANGE (the record and the spec known), the script
    # (EVAL: HGET, HSETNX, SET record, EXPIRE, DEL of the rest)
    "session": 61,
    # submit: DEL, RPUSH, EXPIRE of ids and runs, SET ns, the chunk (DEL, RPUSH, EXPIRE); the
    # start step: its start's script (EVAL, SET NX GET, MGET), LRANGE of the chunk, its
    # marker; the batch told: RPUSH, EXPIRE of the done list, HSET, EXPIRE of the ended index
    "batch": 18,
    # the claim SET; cq:active ZADD at submit, ZREM at the end, cq:batches ZADD; the fleet's
    # trace XADD a step (start and the session's 5 are 5 entries: the start's and 4 commits)
    "fleet": 9,
    # MULTI and EXEC: submit, the ending's commit
    "transactions": 4,
    # LPUSH a task, BLMOVE to take it, LREM to acknowledge it: 6 tasks
    "broker": 18,
}
# One call (replay/plain, no tools: the steps start and r0, which ends the session), rate
# control on with a controller of its own, new:
ONE_CALL_RATED = {
    # submit as above; the start step's commit's script (EVALSHA); r0's start's script (5),
    # reply, marker; its ending as above
    "session": 28,
    "batch": 18,  # as above
    "fleet": 5,  # the claim, cq:active ZADD and ZREM, cq:batches ZADD, the start's trace entry
    "transactions": 4,  # submit, the ending's commit
    "broker": 6,  # 2 tasks
    # the acquire script, which makes the controller (no latency known yet: one slot, no
    # block): EVALSHA, HMGET, ZCARD, ZADD, PEXPIRE of the slots, HSET and EXPIRE of the state,
    # PEXPIRE, HSET of the index; the call's report, the controller's first in this process
    # (its latency lets it grant blocks): EVALSHA, ZREM of the slot, HMGET, HSET
    "rate control": 13,
}


@pytest.fixture(scope="module")
def budget(base_fleet: Fleet) -> Iterator[Running]:
    backends = {
        RATED: {"base_url": base_fleet.replay_url},
        STATIC: {"base_url": base_fleet.replay_url, "adaptive": False},
    }
    config = {"backends": backends}
    yield from _workers(base_fleet, db=REDIS_DB, config=config)


class Monitor:
    """MONITOR of one database, from `start` until `stop`."""

    def __init__(self, url: str, db: int) -> None:
        self.client = redis.Redis.from_url(url.rsplit("/", 1)[0] + "/0")
        self.db = db
        self.lines: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()
        assert self._ready.wait(10)

    def _run(self) -> None:
        with self.client.monitor() as monitor:
            self._ready.set()
            for line in monitor.listen():
                if self._stop.is_set():
                    return
                if line.get("db") == self.db:
                    self.lines.append(line)

    def stop(self) -> None:
        self._stop.set()
        self.client.ping()  # one more line, so the listener sees the flag
        self._thread.join(10)
        self.client.close()


def part_of(command: str, names: dict[str, tuple[str, ...]]) -> str | None:
    """Whose a command is, by its key: the session's, its batch's, its rate controller's, or a
    fleet-wide one's written for it; a step's publish and acknowledgement are the broker's."""
    tokens = command.split(" ")
    verb = tokens[0].upper()
    mine = any(word in command for words in names.values() for word in words)
    if not mine:
        return None
    if verb in ("LPUSH", "LREM"):
        return "broker"
    if any(word in command for word in names.get("rate control", ())):
        return "rate control"  # its keys, and its line in the index of controllers
    key = command if verb in ("EVAL", "EVALSHA") else (tokens[1] if len(tokens) > 1 else "")
    for part in ("session", "batch"):
        if any(word in key for word in names.get(part, ())):
            return part
    return "fleet"


def counted(lines: list[dict[str, Any]], names: dict[str, tuple[str, ...]]) -> Counter[Any]:
    """(part, command) -> how many. A MULTI and an EXEC around commands of ours are counted
    apart (`transactions`), a script's commands as INFO commandstats counts them."""
    found: Counter[tuple[str, str]] = Counter()
    open_tx: dict[str, bool] = {}  # connection in a MULTI -> whether it held a command of ours
    for line in lines:
        command = str(line["command"])
        verb = command.split(" ", 1)[0].upper()
        client = f"{line.get('client_address')}:{line.get('client_port')}"
        if verb in ("BLPOP", "LPOP"):  # the producer's polls while it waits
            continue
        if verb == "MULTI":
            open_tx[client] = False
            continue
        if verb == "EXEC":
            if open_tx.pop(client, False):
                found[("transactions", "MULTI")] += 1
                found[("transactions", "EXEC")] += 1
            continue
        part = part_of(command, names)
        if part is not None:
            found[(part, verb)] += 1
            if client in open_tx:
                open_tx[client] = True
    return found


def run_counted(running: Running, specs: list[Any], rated: str = "") -> Counter[Any]:
    """The commands of the sessions of `specs`, run to their end."""
    monitor = Monitor(running.redis_url, REDIS_DB)
    monitor.start()
    try:
        sub = running.client.enqueue(specs)
        assert [r["status"] for _, r in running.client.wait(sub, timeout_s=60)] == ["ok"] * len(
            specs
        )
        # until every task is acknowledged: no worker holds one
        wait_for(lambda: not running.client.redis.keys("_cchatq:broker:taken:*"), timeout_s=30)
    finally:
        monitor.stop()
    names = {"session": (*sub.order, *(s.id for s in specs)), "batch": (sub.batch,)}
    if rated:
        # its keys (tagged with its id), and its line in the index of controllers
        names["rate control"] = (f"{{{rated}/", f" {rated}/")
    return counted(monitor.lines, names)


def by_part(found: Counter[Any]) -> dict[str, int]:
    """Commands by part, a BLMOVE counted for each LREM."""
    parts: Counter[str] = Counter()
    for (part, verb), n in found.items():
        parts[part] += n * (2 if verb == "LREM" else 1)
    return dict(parts)


def warm(running: Running) -> None:
    """The tool compiled, the connections made, the specs' module stored."""
    sub = running.client.enqueue(workload(f"warm-{uuid.uuid4().hex[:6]}", 3))
    assert all(r["status"] == "ok" for _, r in running.client.wait(sub, timeout_s=60))


def within(found: Counter[Any], budget: dict[str, int]) -> None:
    parts = by_part(found)
    detail = "; ".join(f"{part} {verb} {n}" for (part, verb), n in sorted(found.items()))
    for part in parts.keys() | budget.keys():
        assert parts.get(part, 0) <= budget.get(part, 0), f"{part}: {parts} ({detail})"


def test_a_two_round_session_stays_within_its_command_budget(budget: Running) -> None:
    warm(budget)
    specs = workload(f"b-{uuid.uuid4().hex[:6]}", 1, provider=STATIC)
    within(run_counted(budget, specs), TWO_ROUNDS)


def test_a_one_call_session_with_rate_control_on_stays_within_its_command_budget(
    budget: Running,
) -> None:
    warm(budget)
    one = {"id": f"c-{uuid.uuid4().hex[:6]}", "model": "replay/plain", "provider": RATED,
           "messages": [{"role": "user", "content": "hello"}]}  # fmt: skip
    within(run_counted(budget, load_spec_from_objects([one]), rated=RATED), ONE_CALL_RATED)
