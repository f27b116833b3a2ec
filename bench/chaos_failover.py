"""`python -m bench.chaos failover`: a batch on a fleet whose REDIS_URL is a `sentinel://` URL
(primary, replica, three sentinels: bench/sentinel_fleet.py) while the primary fails:

  SIGKILL   the primary is killed mid-batch; the sentinels promote the replica.
  SIGSTOP   the primary is paused mid-batch until the replica is promoted, then resumed: it
            comes back as a master for a moment (clients still connected to it write there)
            before the sentinels make it a replica of the new master, dropping those writes.

Replication is asynchronous, so what the primary acknowledged and had not yet sent is lost at
the promotion. A watcher reads the fleet's trace stream from the primary itself as it is
written: each entry is one step's commit (its outputs, its published marker, the next step's
message, in one MULTI/EXEC), so the entries it saw that the new master lacks are the commits
lost. The batch is read, never waited for (no producer nudges): what finishes the sessions
whose commits were lost is the fleet's reconciler, whose passes say how many it re-drove.

Each row: sessions finished ok of those submitted, and in its notes the time from the
promotion to the last session's end (goal <= 120 s), commits lost, replication bytes lost (the
primary's last offset seen against where the promoted replica's history ends), sessions the
reconciler re-drove and ended, and the cost of `WAIT 1 100` after a commit-sized pipeline.
"""

from __future__ import annotations

import json
import signal
import statistics
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from bench.chaos_fleet import expected, history_problems, verdict_of, wait_records, weather_objects
from bench.chaos_report import Row, dead_letters, log_digest, remove_dumps, tally
from bench.history_read import check_run, mark_run
from bench.sentinel_fleet import HOST, SentinelRedis
from producer.client import Client
from producer.fleet import Fleet
from producer.specfile import load_spec_from_objects
from schemas import keys
from schemas.session_record import read_record

GOAL_S = 120.0
DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 3000
LATENCY_MS = 100  # per model call: a batch long enough to be cut in the middle
# the reconciler as a user would run it: looks every 10 s at sessions quiet for 30 s
WORKER_ENV = {"CCHATQ_CONSUMER_DEAD_AFTER_S": "5"}
WAIT_SAMPLES = 2000


@dataclass
class LossWatch:
    """Follows the fleet's trace stream on one server (the primary, by its port, not through
    the sentinels) and its replication offset, until the server dies or becomes a replica."""

    port: int
    seen: dict[bytes, dict[bytes, bytes]] = field(default_factory=dict)
    offset: int = 0  # the last master_repl_offset read
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> LossWatch:
        self._thread = threading.Thread(target=self._follow, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _follow(self) -> None:
        # Any: redis-py annotates replies as bytes | str; this client never decodes
        client: Any = redis.Redis(HOST, self.port, socket_timeout=1, socket_connect_timeout=1)
        last = b"$"
        while not self._stop.is_set():
            try:
                read = client.xread({keys.TRACE: last}, count=1000, block=100)
                for _, entries in read:
                    for entry_id, fields in entries:
                        self.seen[entry_id] = fields
                        last = entry_id
                info = client.info("replication")
            except redis.TimeoutError:
                continue  # paused: it answers again once resumed
            except redis.ConnectionError:
                return  # killed
            if info.get("role") != "master":
                return  # demoted: what it held is replaced by the new master's
            self.offset = int(info.get("master_repl_offset", 0))

    def lost(self, master: Any) -> tuple[Entries, Entries]:
        """The entries this watcher saw that `master`'s stream does not hold: those whose
        events it holds under another id (the same commit sent again by a client that gave up
        on the paused primary: it was executed twice, once on each), and the others, lost."""
        if not self.seen:
            return [], []
        ids = sorted(self.seen, key=_id_order)
        held = dict(master.xrange(keys.TRACE, ids[0], "+"))
        payloads = {fields.get(keys.TRACE_FIELD.encode()) for fields in held.values()}
        missing = [(i, self.seen[i]) for i in ids if i not in held]
        twice = {i for i, f in missing if f.get(keys.TRACE_FIELD.encode()) in payloads}
        return [e for e in missing if e[0] not in twice], [e for e in missing if e[0] in twice]


Entries = list[tuple[bytes, dict[bytes, bytes]]]


def _id_order(entry_id: bytes) -> tuple[int, int]:
    ms, _, seq = entry_id.partition(b"-")
    return int(ms), int(seq or 0)


def lost_summary(lost: Entries) -> tuple[int, list[str]]:
    """How many sessions the lost commits were of, and what kinds of steps they were."""
    sessions: set[str] = set()
    kinds: dict[str, int] = {}
    for _, fields in lost:
        events = keys.trace_events(fields)
        for event in events:
            if event.get("session"):
                sessions.add(str(event["session"]))
        if events:
            kind = str(events[-1].get("event"))
            kinds[kind] = kinds.get(kind, 0) + 1
    return len(sessions), [f"{kind} x{n}" for kind, n in sorted(kinds.items())]


def reconciled_since(master: Any, since_ms: int) -> dict[str, int]:
    """The reconciler's passes since `since_ms`, added up: sessions nudged, ended overdue."""
    totals = {"passes": 0, "nudged": 0, "overdue": 0, "forgotten": 0}
    for _, fields in master.xrange(keys.TRACE, f"{since_ms}-0", "+"):
        for event in keys.trace_events(fields):
            if event.get("event") == "reconciler.pass":
                totals["passes"] += 1
                for name in ("nudged", "overdue", "forgotten"):
                    totals[name] += int(event.get(name) or 0)
    return totals


def last_end_ms(r: Any, sks: Sequence[str]) -> int | None:
    """When the last of these sessions ended (its meta's finished_ms), None if none did."""
    pipe = r.pipeline(transaction=False)
    for sk in sks:
        pipe.hget(keys.meta(sk), "finished_ms")
        pipe.get(keys.record(sk))  # retired: its meta folded into its record
    replies = pipe.execute()
    ends = []
    for finished, record in zip(replies[0::2], replies[1::2], strict=True):
        if finished is None and record is not None:
            finished = read_record(record).meta.get("finished_ms")
        if finished is not None:
            ends.append(int(finished))
    return max(ends) if ends else None


def wait_cost_us(master_port: int) -> tuple[float, float]:
    """The median microseconds of a commit-sized pipeline (SET, LPUSH, XADD in MULTI/EXEC)
    without and with `WAIT 1 100` after it, against the primary with its replica in sync;
    the two alternate, so a busy machine weighs on both alike."""
    client = redis.Redis(HOST, master_port)
    costs: tuple[list[float], list[float]] = ([], [])
    for n in range(WAIT_SAMPLES):
        for wait in (False, True):
            started = time.perf_counter()
            pipe = client.pipeline(transaction=True)
            pipe.set(f"cq:waitbench:{n}", "x" * 200, ex=60)
            pipe.lpush("cq:waitbench:q", "y" * 600)
            pipe.xadd("cq:waitbench:s", {"events": "z" * 300}, maxlen=100, approximate=True)
            pipe.execute()
            if wait:
                client.wait(1, 100)
            costs[wait].append((time.perf_counter() - started) * 1e6)
    client.delete("cq:waitbench:q", "cq:waitbench:s")
    client.close()
    return statistics.median(costs[0]), statistics.median(costs[1])


def failover_fleet(workdir: Path, server_args: Sequence[str] = ()) -> tuple[Fleet, SentinelRedis]:
    workdir.mkdir(parents=True, exist_ok=True)
    fleet = Fleet(workdir=workdir)
    sentinels = SentinelRedis(
        fleet, DOWN_AFTER_MS, FAILOVER_TIMEOUT_MS, server_args=list(server_args)
    )
    try:
        sentinels.start()
        fleet.start_replay(LATENCY_MS)
        fleet.start_workers(extra_env=WORKER_ENV)
        fleet.wait_served()
    except BaseException:
        fleet.stop()
        raise
    return fleet, sentinels


def run_failover(root: Path, n: int, how: str, server_args: Sequence[str] = ()) -> Row:
    """One batch of `n` weather sessions; the primary SIGKILLed (`how` "kill") or paused
    until the promotion ("pause") once a third of them finished."""
    workdir = (
        root / f"failover-{how}{'-' + '-'.join(server_args).strip('-') if server_args else ''}"
    )
    fleet, sentinels = failover_fleet(workdir, server_args)
    label = f"failover: primary {'SIGKILLed' if how == 'kill' else 'SIGSTOPped, then resumed'}"
    if server_args:
        label += f" ({' '.join(server_args)})"
    with fleet:
        client = Client(fleet.redis_url, config=fleet.config())
        warm = client.enqueue(
            load_spec_from_objects(weather_objects(f"w{uuid.uuid4().hex[:6]}", 20))
        )
        for _ in client.wait(warm, timeout_s=120, poll_s=0.05):
            pass
        old = sentinels.master_port()
        plain_us, wait_us = wait_cost_us(old) if how == "kill" and not server_args else (0, 0)
        objects = weather_objects(f"fo-{how}-{uuid.uuid4().hex[:6]}", n)
        ids = [o["id"] for o in objects]
        mark = mark_run(fleet.replay_url)  # the replay server's log outlives the failover
        sub = client.enqueue(load_spec_from_objects(objects))
        watch = LossWatch(old).start()
        started = time.monotonic()
        wait_records(client, ids, n // 3, started + 120)
        hit_ms = int(time.time() * 1000)
        hit = time.monotonic()
        if how == "kill":
            sentinels.kill_master(signal.SIGKILL)
            promoted = sentinels.wait_promoted(old)
        else:
            sentinels.pause_master()
            promoted = sentinels.wait_promoted(old)
            sentinels.resume(old)
        promoted_ms = hit_ms + int((promoted.at - hit) * 1000)
        reader = Client(fleet.redis_url, config=fleet.config())  # reads, never nudges
        wait_records(reader, ids, n, promoted.at + GOAL_S + 60)
        if how == "pause":
            sentinels.wait_replica(old, timeout_s=60)  # demoted, resynced: its writes gone
        watch.stop()
        sks = sub.order
        row = tally(reader.redis, label, sks, expected(objects))
        ended_ms = last_end_ms(reader.redis, sks)
        row.wall_s = (ended_ms - promoted_ms) / 1000 if ended_ms else float("nan")
        # read through the sentinels, from the new master; the batch was never waited for
        row.verdict = check_run(row.scenario, reader, objects, mark)
        lost, again = watch.lost(reader.redis)
        sessions_hit, kinds = lost_summary(lost)
        second = int(reader.redis.info("replication").get("second_repl_offset", -1))
        bytes_lost = max(0, watch.offset - (second - 1)) if second > 0 else None
        redriven = reconciled_since(reader.redis, hit_ms)
        row.notes[:0] = [
            f"promotion {promoted.at - hit:.1f} s after the {how}; sessions finished "
            f"{row.finished}/{n}, the last {row.wall_s:.1f} s after the promotion "
            f"(goal <= {GOAL_S:.0f} s)",
            f"commits lost: {len(lost)} of {len(watch.seen)} the primary acknowledged while "
            f"watched, of {sessions_hit} sessions ({', '.join(kinds) or 'none'}); "
            f"{len(again)} more ran on both masters (a client gave up on the paused one and "
            f"sent it again); replication bytes lost >= "
            f"{bytes_lost if bytes_lost is not None else '?'}",
            f"reconciler since the {how}: {redriven['passes']} passes, re-drove "
            f"{redriven['nudged']} sessions, ended {redriven['overdue']} overdue",
        ]
        if plain_us:
            row.notes.insert(
                3,
                f"commit-sized MULTI/EXEC: {plain_us:.0f} us; with WAIT 1 100 after it: "
                f"{wait_us:.0f} us (+{wait_us - plain_us:.0f} us a step)",
            )
        problems = history_problems(row)
        if row.finished < n:
            problems.append(f"{n - row.finished} not finished")
        if row.duplicates:
            problems.append(f"{row.duplicates} duplicates")
        if not row.wall_s <= GOAL_S:
            problems.append(f"last ending {row.wall_s:.0f} s after the promotion")
        row.goal = verdict_of(problems)
        row.notes.extend(dead_letters(reader.redis))
        row.notes.extend(["log digest:", *log_digest(fleet.workdir), *remove_dumps(fleet.workdir)])
        row.notes.append(
            f"redis: {json.dumps({p: i.get('role') for p, i in sentinels.info().items()})}"
        )
        reader.close()
        client.close()
        sentinels.stop()
    return row


def scenario_failover(root: Path, n: int, deadline_s: float, seed: int) -> list[Row]:
    """The SIGKILL run, then the SIGSTOP one, then SIGSTOP with min-replicas-to-write 1 (a
    primary that lost its replica for over a second refuses writes)."""
    return [
        run_failover(root, n, "kill"),
        run_failover(root, n, "pause"),
        run_failover(
            root, n, "pause", ["--min-replicas-to-write", "1", "--min-replicas-max-lag", "1"]
        ),
    ]
