"""What a batch costs: CPU seconds per process kind (each process with its children, read from
/proc) and Redis commands (INFO commandstats), sampled before and after a run."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds) of a live process, or None."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()  # after "pid (comm) "
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / TICKS_PER_S


def tree_cpu_s(root: int) -> float:
    """CPU seconds of a process and every live descendant (a prefork worker's pool)."""
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None:
                parents[int(entry)], cpu[int(entry)] = stat
    total, stack = 0.0, [root]
    while stack:
        pid = stack.pop()
        total += cpu.get(pid, 0.0)
        stack.extend(child for child, parent in parents.items() if parent == pid)
    return total


def redis_commands(client: Any) -> dict[str, int]:
    """Calls so far, by command name."""
    stats = client.info("commandstats")
    return {k[8:]: int(v["calls"]) for k, v in stats.items() if k.startswith("cmdstat_")}


@dataclass
class Cost:
    wall_s: float = 0.0
    cpu_s: dict[str, float] = field(default_factory=dict)  # process kind -> CPU seconds
    redis_commands: int = 0
    redis_by_command: dict[str, int] = field(default_factory=dict)

    @property
    def cpu_total_s(self) -> float:
        return sum(self.cpu_s.values())


@contextmanager
def measured(kinds: dict[str, list[int]], redis_client: Any | None) -> Iterator[Cost]:
    """Cost of the block: `kinds` maps a process kind to its root pids (0 = this process)."""

    def sample() -> dict[str, float]:
        return {
            kind: sum(time.process_time() if pid == 0 else tree_cpu_s(pid) for pid in pids)
            for kind, pids in kinds.items()
        }

    cost = Cost()
    cpu0 = sample()
    cmds0 = redis_commands(redis_client) if redis_client is not None else {}
    started = time.perf_counter()
    yield cost
    cost.wall_s = time.perf_counter() - started
    cpu1 = sample()
    cost.cpu_s = {kind: cpu1[kind] - cpu0[kind] for kind in kinds}
    if redis_client is not None:
        cmds1 = redis_commands(redis_client)
        cost.redis_by_command = {k: v - cmds0.get(k, 0) for k, v in cmds1.items()}
        cost.redis_by_command["info"] = cost.redis_by_command.get("info", 1) - 1  # the sample's
        cost.redis_commands = sum(cost.redis_by_command.values())
