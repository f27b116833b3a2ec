"""The chaos suite's `kill` scenario: worker processes SIGKILLed every 2 s mid-batch."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.chaos_fleet import (
    expected,
    fleet_client,
    problems_of,
    start_fleet,
    verdict_of,
    wait_in_process,
    weather_objects,
)
from bench.chaos_report import (
    Row,
    dead_letters,
    log_digest,
    remove_dumps,
    tally,
)
from bench.history_read import check_run, mark_run
from producer.fleet import Fleet
from producer.specfile import load_spec_from_objects
from schemas import fleet_keys

KILL_EVERY_S = 2.0


class Killer:
    """Every KILL_EVERY_S, SIGKILL one random worker process: a worker's main process (its
    process group: the pool too), started again at once, or a prefork pool child, which
    Celery replaces. Each kill is logged with the messages the main process held then.
    `restart`: how a queue's worker is started again (default: `fleet.start_worker(queue)`);
    a worker on a namespace host must come back inside it, with the REDIS_URL it reaches."""

    def __init__(
        self,
        fleet: Fleet,
        r: Any,
        seed: int,
        restart: Callable[[str], subprocess.Popen[bytes]] | None = None,
    ) -> None:
        self.fleet = fleet
        self.restart = restart or fleet.start_worker
        self.redis = r
        self.random = random.Random(seed)
        self.live = {name.rsplit("-", 1)[0]: proc for name, proc in fleet.workers.items()}
        self.kills: Counter[str] = Counter()
        self.timeline: list[str] = []
        self.started = time.monotonic()

    def targets(self) -> list[tuple[str, str, int]]:
        found = []
        for queue, proc in sorted(self.live.items()):
            found.append((queue, "main", proc.pid))
            found.extend((queue, "child", pid) for pid in self.fleet.pool_children(proc))
        return found

    def held(self, pid: int) -> int:
        """Messages the consumers of process `pid` took and did not acknowledge."""
        held = 0
        for raw in self.redis.smembers(fleet_keys.BROKER_CONSUMERS):
            consumer = raw.decode()
            if f".{pid}@" in consumer:  # <id>.<pid>@<host> (worker/edges/liveness.py)
                held += self.redis.hlen(fleet_keys.broker_unacked(consumer))
                held += self.redis.llen(fleet_keys.broker_taken(consumer))
        return held

    def kill_one(self) -> None:
        queue, kind, pid = self.random.choice(self.targets())
        at = time.monotonic() - self.started
        if kind == "main":
            held = self.held(pid)
            self.fleet.kill(self.live[queue])
            self.live[queue] = self.restart(queue)
            self.timeline.append(f"{at:.1f}s {queue} main (held {held})")
        else:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                return  # the pool replaced it meanwhile
            self.timeline.append(f"{at:.1f}s {queue} child")
        self.kills[f"{queue} {kind}"] += 1


def scenario_kill(root: Path, n: int, deadline_s: float, seed: int) -> list[Row]:
    fleet, client = start_fleet(root / "kill")
    with fleet:
        base_objects = weather_objects(f"base-{uuid.uuid4().hex[:6]}", n)
        mark, delivered = mark_run(fleet.replay_url), list[str]()
        sub = client.enqueue(load_spec_from_objects(base_objects))
        base_wall = wait_in_process(client, sub, deadline_s, delivered)
        base = tally(client.redis, "kill: baseline, no kill", sub.order, expected(base_objects))
        base.wall_s = base_wall
        base.verdict = check_run(base.scenario, client, base_objects, mark, delivered)
        base.goal = "-"

        objects = weather_objects(f"kill-{uuid.uuid4().hex[:6]}", n)
        specs = load_spec_from_objects(objects)
        waiter_client = fleet_client(fleet)
        walls: list[float] = []
        mark, delivered = mark_run(fleet.replay_url), list[str]()
        sub = waiter_client.enqueue(specs)
        killer = Killer(fleet, client.broker_redis, seed)
        waiter = threading.Thread(
            target=lambda: walls.append(wait_in_process(waiter_client, sub, deadline_s, delivered)),
            daemon=True,
        )
        waiter.start()
        deadline = time.monotonic() + deadline_s + 5
        while waiter.is_alive() and time.monotonic() < deadline:
            waiter.join(timeout=KILL_EVERY_S)
            if waiter.is_alive():
                killer.kill_one()
        waiter.join(timeout=30)
        row = tally(client.redis, "kill: SIGKILL every 2 s", sub.order, expected(objects))
        row.wall_s = walls[0] if walls else deadline_s
        row.verdict = check_run(row.scenario, client, objects, mark, delivered)
        ratio = row.wall_s / base_wall
        row.notes.insert(
            0, f"kills: {sum(killer.kills.values())} ({dict(sorted(killer.kills.items()))})"
        )
        row.notes.insert(
            1, f"baseline {base_wall:.1f} s; with kills {row.wall_s:.1f} s = {ratio:.2f}x"
        )
        row.notes.insert(2, "kills, from submit: " + "; ".join(killer.timeline))
        problems = problems_of(row) + ([f"wall {ratio:.2f}x baseline > 2x"] if ratio > 2 else [])
        row.goal = verdict_of(problems)
        row.notes.extend(dead_letters(client.redis))
        row.notes.extend(["log digest:", *log_digest(fleet.workdir), *remove_dumps(fleet.workdir)])
        waiter_client.close()
        client.close()
    return [base, row]
