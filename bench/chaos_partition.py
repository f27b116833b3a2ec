"""Silent network partitions (`python -m bench.chaos partition`, or `partition-long`): workers
on hosts in network namespaces (bench/netns.py) whose links are cut mid-batch by dropping
every packet, with no FIN or RST, then healed. Redis and the replay server run in the root
namespace, reached by each host at its gateway address; the producer (this process) is never
cut. Needs root, `ip` and `nft`: otherwise each run is a skipped row saying why.

  partition       (a) one worker host (llm, tools) of two cut 30 s, the root's workers
                  (control, tools, llm) carrying on; (b) the whole fleet (two hosts: control
                  and tools, llm) cut 30 s; (c) the whole fleet cut 30 s while Redis restarts
                  (SIGTERM, append-only file), so the hosts' connections are half-open when
                  the cut heals.
  partition-long  (a) and (b) with a 5-minute cut.

Each row says: sessions ended ok of those submitted (and duplicates, hung: bench/chaos_report),
how long after the heal each cut-off worker served again (its broker consumer beating in Redis
again; goal <= 15 s) and ran its first step, how long after the heal every session had ended
(goal <= 60 s), tracebacks in the workers' logs, and model calls made twice (the replay
server's requests beyond the batch's rounds).
"""

from __future__ import annotations

import re
import signal
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from bench import netns
from bench.chaos_fleet import (
    expected,
    history_problems,
    verdict_of,
    wait_in_process,
    weather_objects,
    weather_specs,
)
from bench.chaos_report import Row, dead_letters, finished_count, log_digest, remove_dumps, tally
from bench.history_read import check_run, mark_run
from producer.client import Client
from producer.fleet import Fleet
from producer.specfile import load_spec_from_objects
from schemas import fleet_keys, keys

CUT_S = 30.0
LONG_CUT_S = 300.0
REPLAY_LATENCY_MS = 300  # so the batch is still running when the cut comes
SERVED_GOAL_S = 15.0
ENDED_GOAL_S = 60.0
ROUNDS_PER_SESSION = 2  # the weather session: round, tool call, round
# where the workers run: "root" (never cut) or a host's label, and which hosts are cut
ONE_HOST = {"root": ["control", "tools", "llm"], "a": ["llm", "tools"]}
WHOLE_FLEET = {"a": ["control", "tools"], "b": ["llm"]}


@dataclass
class Worker:
    name: str  # the fleet's name for it (its log: <name>.log; Celery's: <name>@<hostname>)
    pid: int
    host: str


@dataclass
class Cut:
    """What one cut did: when it healed (monotonic, and Redis-stream ms), the workers cut."""

    healed_at: float = 0.0
    healed_ms: int = 0
    workers: list[Worker] = field(default_factory=list)
    served_s: dict[str, float] = field(default_factory=dict)  # worker -> its first beat after
    stepped_s: dict[str, float] = field(default_factory=dict)  # worker -> its first step after
    ended_s: float | None = None  # every session ended, after the heal (< 0: before it)
    ended_at: float | None = None  # monotonic, when the producer's wait ended
    # pid -> its consumers' heartbeat TTLs (ms) last seen, from a look just before the heal
    seen: dict[int, dict[str, int]] = field(default_factory=dict)


def start(
    workdir: Path, net: netns.Network, placement: dict[str, list[str]], appendonly: bool
) -> tuple[Fleet, dict[str, netns.Host], list[Worker]]:
    """The hosts, a private Redis on 127.0.0.1 and their gateways, the replay server on the
    first gateway (the root namespace reaches it there too), the workers where `placement`
    puts them; once every queue is served."""
    hosts = {label: net.add_host() for label in placement if label != "root"}
    fleet = Fleet(workdir=workdir)
    fleet.ensure_redis(private=True, appendonly=appendonly, bind=net.gateways)
    port = fleet.redis_url.rsplit(":", 1)[1]
    fleet.start_replay(REPLAY_LATENCY_MS, ["--host", net.gateways[0]])
    workers = []
    for label, queues in placement.items():
        host = hosts.get(label)
        prefix = host.prefix() if host else []
        env = {"REDIS_URL": f"redis://{host.gateway}:{port}"} if host else None
        for queue in queues:
            proc = fleet.start_worker(queue, extra_env=env, prefix=prefix)
            workers.append(Worker(fleet.names[proc.pid], proc.pid, label))
    fleet.wait_served(sorted({q for queues in placement.values() for q in queues}))
    return fleet, hosts, workers


def run_cut(
    root: Path,
    title: str,
    placement: dict[str, list[str]],
    cut: Sequence[str],
    n: int,
    cut_s: float,
    restart_redis: bool = False,
) -> Row:
    why = netns.missing()
    if why:
        return Row(title, n, goal=f"- (skipped: {why})")
    workdir = root / re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")  # one per run
    workdir.mkdir(parents=True, exist_ok=True)
    with netns.Network() as net:
        fleet, hosts, workers = start(workdir, net, placement, appendonly=restart_redis)
        with fleet:
            client = Client(fleet.redis_url)
            warm = client.enqueue(weather_specs(f"warm-{uuid.uuid4().hex[:6]}", 20))
            wait_in_process(client, warm, 120)
            replay = fleet.replay_url.removesuffix("/v1")
            requests.post(f"{replay}/reset", timeout=5).raise_for_status()
            objects = weather_objects(f"part-{uuid.uuid4().hex[:6]}", n)
            # the replay server listens on the first gateway: the root namespace reaches it
            mark, delivered = mark_run(fleet.replay_url), list[str]()
            sub = client.enqueue(load_spec_from_objects(objects))
            started = time.monotonic()
            done = Cut(workers=[w for w in workers if w.host in cut])
            waiter_client = Client(fleet.redis_url)

            def wait() -> None:  # as a producer waits (it nudges what stalls)
                wait_in_process(waiter_client, sub, 600, delivered)
                done.ended_at = time.monotonic()

            waiter = threading.Thread(target=wait, daemon=True)
            waiter.start()
            _until(lambda: finished_count(client.redis, sub.order) >= n // 3, 120)
            before = finished_count(client.redis, sub.order)
            for label in cut:
                hosts[label].cut()
            cut_at = time.monotonic()
            restarted = ""
            if restart_redis:
                time.sleep(cut_s / 2)
                down_s = fleet.restart_redis(signal.SIGTERM, 1.0)
                restarted = (
                    f"; Redis restarted {cut_s / 2:.0f} s into the cut (down {down_s:.1f} s)"
                )
            time.sleep(max(cut_s - (time.monotonic() - cut_at), 0))
            done.seen = {w.pid: heartbeats(client, w.pid) for w in done.workers}
            for label in cut:
                hosts[label].heal()
            done.healed_at = time.monotonic()
            done.healed_ms = _redis_ms(client)
            follow(client, sub.order, done, deadline_s=180)
            waiter.join(timeout=30)
            waiter_client.close()
            if done.ended_at is not None:  # when the producer saw the last one end
                done.ended_s = done.ended_at - done.healed_at
            row = tally(client.redis, title, sub.order, expected(objects))
            row.wall_s = time.monotonic() - started
            row.verdict = check_run(row.scenario, client, objects, mark, delivered)
            stats = requests.get(f"{replay}/stats", timeout=5).json()
            row.notes[:0] = describe(done, n, before, cut_s, restarted, stats, fleet)
            problems = goals(row, done)
            row.goal = verdict_of(problems)
            row.notes.extend(dead_letters(client.redis))
            row.notes.extend(["log digest:", *log_digest(fleet.workdir), *remove_dumps(workdir)])
            client.close()
    return row


def follow(client: Client, sks: Sequence[str], cut: Cut, deadline_s: float) -> None:
    """After the heal: when each cut-off worker beats again and runs its first step, and when
    every session has ended; until all are known or `deadline_s` passes."""
    last_entry = f"{cut.healed_ms}-0"
    deadline = cut.healed_at + deadline_s
    while time.monotonic() < deadline:
        now = time.monotonic() - cut.healed_at
        try:
            for worker in cut.workers:
                seen = cut.seen.setdefault(worker.pid, {})
                if worker.name not in cut.served_s and _beat_again(client, worker.pid, seen):
                    cut.served_s[worker.name] = now
            last_entry = _first_steps(client, cut, last_entry, now)
            if cut.ended_s is None and finished_count(client.redis, sks) >= len(sks):
                cut.ended_s = now if cut.ended_at is None else cut.ended_at - cut.healed_at
        except Exception:  # Redis restarting, or busy: look again
            pass
        if cut.ended_s is not None and len(cut.served_s) == len(cut.workers):
            return
        time.sleep(0.2)


def heartbeats(client: Client, pid: int) -> dict[str, int]:
    """The live heartbeats (their TTLs, ms) of process `pid`'s broker consumers (named
    `<id>.<pid>@<host>`: worker/edges/liveness.py)."""
    mine = [c.decode() for c in client.redis.smembers(fleet_keys.BROKER_CONSUMERS)]
    mine = [c for c in mine if f".{pid}@" in c]
    pipe = client.redis.pipeline(transaction=False)
    for consumer in mine:
        pipe.pttl(fleet_keys.broker_alive(consumer))
    return {c: ttl for c, ttl in zip(mine, pipe.execute(), strict=True) if ttl > 0}


def _beat_again(client: Client, pid: int, seen: dict[str, int]) -> bool:
    """Whether a consumer of `pid` beat since the last look (`seen`): a TTL only goes up by
    a beat, and a consumer not seen before (a new one, or one whose heartbeat had run out)
    beat to be there."""
    now = heartbeats(client, pid)
    beat = any(ttl > seen.get(consumer, 0) for consumer, ttl in now.items())
    seen.update(now)
    return beat


def _first_steps(client: Client, cut: Cut, after: str, now_s: float) -> str:
    """Each cut-off worker's first step after the heal, from the fleet's trace stream (a
    step's last event names its worker, `<name>@<hostname>`)."""
    entries = client.redis.xrange(keys.TRACE, f"({after}", "+", count=5000)
    for entry_id, fields in entries:
        after = entry_id.decode()
        for event in keys.trace_events(fields):
            worker = str(event.get("worker") or "").split("@")[0]
            named = [w.name for w in cut.workers if w.name == worker]
            if named and named[0] not in cut.stepped_s:
                cut.stepped_s[named[0]] = now_s
    return after


def _redis_ms(client: Client) -> int:
    seconds, micros = client.redis.time()
    return int(seconds) * 1000 + int(micros) // 1000


def _until(condition: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return False


def describe(
    cut: Cut, n: int, before: int, cut_s: float, restarted: str, stats: dict[str, Any], fleet: Fleet
) -> list[str]:
    twice = stats["requests"] - ROUNDS_PER_SESSION * n
    ended = "not by the deadline"
    if cut.ended_s is not None:
        when = "after" if cut.ended_s >= 0 else "before"
        ended = f"{abs(cut.ended_s):.1f} s {when} the heal"
    lines = [
        f"cut {cut_s:.0f} s with {before}/{n} ended{restarted}",
        f"every session ended {ended} (goal <= {ENDED_GOAL_S:.0f} s after)",
        f"model calls {stats['requests']} for {ROUNDS_PER_SESSION * n} rounds: "
        f"{max(twice, 0)} made twice ({100 * max(twice, 0) / (ROUNDS_PER_SESSION * n):.1f}%)",
    ]
    for worker in cut.workers:
        served = cut.served_s.get(worker.name)
        stepped = cut.stepped_s.get(worker.name)
        tracebacks = _tracebacks(fleet.log_of(worker.name))
        lines.append(
            f"{worker.name} (host {worker.host}): beat again "
            f"{'never' if served is None else f'{served:.1f} s'} after the heal, first step "
            f"{'none' if stepped is None else f'{stepped:.1f} s'}; tracebacks in its log: "
            f"{tracebacks}"
        )
    others = [log for log in sorted(fleet.workdir.glob("*.log")) if log.stem != "replay"]
    total = sum(_tracebacks(log) for log in others)
    lines.append(f"tracebacks in all the fleet's logs: {total}")
    return lines


def _tracebacks(log: Path) -> int:
    if not log.exists():
        return 0
    return sum(1 for line in log.read_text(errors="replace").splitlines() if "Traceback" in line)


def goals(row: Row, cut: Cut) -> list[str]:
    problems = history_problems(row)
    if row.ok < row.expected:
        problems.append(f"{row.expected - row.ok} not ok")
    if row.duplicates:
        problems.append(f"{row.duplicates} duplicates")
    late = [w.name for w in cut.workers if cut.served_s.get(w.name, 1e9) > SERVED_GOAL_S]
    if late:
        problems.append(f"{', '.join(late)} served again > {SERVED_GOAL_S:.0f} s after the heal")
    if cut.ended_s is None or cut.ended_s > ENDED_GOAL_S:
        problems.append(f"sessions ended > {ENDED_GOAL_S:.0f} s after the heal")
    return problems


def scenario_partition(root: Path, n: int, deadline_s: float, seed: int) -> list[Row]:
    return [
        run_cut(root, "partition: one host cut 30 s", ONE_HOST, ["a"], n, CUT_S),
        run_cut(root, "partition: whole fleet cut 30 s", WHOLE_FLEET, ["a", "b"], n, CUT_S),
        run_cut(
            root,
            "partition: whole fleet cut 30 s, Redis restarted",
            WHOLE_FLEET,
            ["a", "b"],
            n,
            CUT_S,
            restart_redis=True,
        ),
    ]


def scenario_partition_long(root: Path, n: int, deadline_s: float, seed: int) -> list[Row]:
    return [
        run_cut(root, "partition-long: one host cut 5 min", ONE_HOST, ["a"], n, LONG_CUT_S),
        run_cut(
            root, "partition-long: whole fleet cut 5 min", WHOLE_FLEET, ["a", "b"], n, LONG_CUT_S
        ),
    ]
