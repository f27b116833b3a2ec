"""The figures of `python -m bench.scale` (bench/scale.py): which sizes fit the machine, the
efficiency against linear, each cluster master's share, and the table. Pure functions, so the
definitions are unit-tested rather than trusted to a fleet run.

A row is one batch on `units` worker units against one state back end. Its counters per state
Redis (one for a plain Redis, one a master for a cluster) are deltas over the timed batch, from
submit to last result: CPU seconds (INFO cpu: used_cpu_sys + used_cpu_user), commands (INFO
commandstats, every command's calls) and keys (DBSIZE).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

DEFAULT_SIZES = (1, 2, 4, 8, 16)
CORES_PER_UNIT = 2  # a size runs when its units have this many cores each
GOAL_LINEAR_SHARE = 0.90  # sessions/s at GOAL_UNITS units against GOAL_UNITS x 1 unit's
GOAL_UNITS = 8
GOAL_BUSIEST_MASTER = 0.45  # of the cluster's state commands, on its busiest master


def sizes_to_run(requested: Iterable[int], cores: int) -> tuple[list[int], list[int]]:
    """(sizes that run, sizes left out): a size runs when `cores` hold CORES_PER_UNIT per unit;
    the 1-unit row always runs, since every efficiency is measured against it."""
    wanted = sorted(set(requested) | {1})
    fits = [n for n in wanted if n == 1 or n * CORES_PER_UNIT <= cores]
    return fits, [n for n in wanted if n not in fits]


@dataclass(frozen=True)
class Counters:
    """One Redis's counters at one moment, or what changed between two."""

    cpu_s: float  # used_cpu_sys + used_cpu_user
    by_command: Mapping[str, int]  # calls so far, by command name
    keys: int  # DBSIZE

    @property
    def commands(self) -> int:
        return sum(self.by_command.values())

    def since(self, before: Counters, own: Mapping[str, int] | None = None) -> Counters:
        """What happened between `before` and this; `own`: the sampler's own calls counted in
        between (by command), left out."""
        own = own or {}
        calls = {
            name: max(n - before.by_command.get(name, 0) - own.get(name, 0), 0)
            for name, n in self.by_command.items()
        }
        return Counters(
            self.cpu_s - before.cpu_s,
            {name: n for name, n in calls.items() if n},
            max(self.keys - before.keys, 0),
        )


@dataclass(frozen=True)
class Row:
    backend: str
    units: int
    sessions: int
    ok: int  # sessions that ended ok
    wall_s: float  # from submit to last result
    state: tuple[Counters, ...]  # per state Redis (a cluster's masters), deltas over the batch
    broker_cpu_s: float
    producer_cpu_s: float

    @property
    def sessions_per_s(self) -> float:
        return self.sessions / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def state_commands(self) -> int:
        return sum(c.commands for c in self.state)

    @property
    def commands_per_session(self) -> float:
        return self.state_commands / self.sessions if self.sessions else 0.0

    @property
    def busiest_cpu_share(self) -> float:
        """The busiest state Redis's CPU over the batch, as a share of one core."""
        return cpu_share(max((c.cpu_s for c in self.state), default=0.0), self.wall_s)

    @property
    def key_shares(self) -> list[float]:
        return shares([c.keys for c in self.state])

    @property
    def command_shares(self) -> list[float]:
        return shares([c.commands for c in self.state])


def busiest_extra(row: Row, top: int = 5) -> list[tuple[str, float]]:
    """What makes a cluster's busiest master (by commands) the busiest: the commands it runs
    more of than the other masters' mean, per session, the most first."""
    if len(row.state) < 2 or not row.sessions:
        return []
    ranked = sorted(row.state, key=lambda c: c.commands, reverse=True)
    busiest, others = ranked[0], ranked[1:]
    extra = {
        name: (n - sum(o.by_command.get(name, 0) for o in others) / len(others)) / row.sessions
        for name, n in busiest.by_command.items()
    }
    return sorted(((k, v) for k, v in extra.items() if v > 0), key=lambda kv: -kv[1])[:top]


def cpu_share(cpu_s: float, wall_s: float) -> float:
    """CPU seconds over a wall time, as a share of one core (1.0: one core busy throughout)."""
    return cpu_s / wall_s if wall_s > 0 else 0.0


def shares(values: Sequence[int]) -> list[float]:
    """Each value's share of their total (all 0 when the total is)."""
    total = sum(values)
    return [v / total if total else 0.0 for v in values]


def efficiencies(rows: Iterable[Row]) -> dict[tuple[str, int], float]:
    """(backend, units) -> sessions/s at n units / (n x sessions/s at 1 unit, same backend);
    rows of a backend with no 1-unit row have none."""
    rows = list(rows)
    base = {r.backend: r.sessions_per_s for r in rows if r.units == 1}
    return {
        (r.backend, r.units): r.sessions_per_s / (r.units * base[r.backend])
        for r in rows
        if base.get(r.backend)
    }


def _pct(share: float, decimals: int = 0) -> str:
    return f"{share * 100:.{decimals}f}%"


def _split(values: Sequence[float]) -> str:
    return "/".join(f"{v * 100:.0f}" for v in values) + "%"


def _units(n: int) -> str:
    return f"{n} unit" + ("" if n == 1 else "s")


def _verdict(met: bool) -> str:
    return "ok" if met else "MISSED"


HEADERS = (
    "backend", "units", "sessions", "sessions/s", "vs linear", "state CPU (busiest)",
    "broker CPU", "producer CPU", "keys per master", "commands per master",
    f"busiest master (goal <= {_pct(GOAL_BUSIEST_MASTER)})",
)  # fmt: skip


def table_rows(rows: Sequence[Row]) -> list[tuple[str, ...]]:
    """One line of cells per row, HEADERS' columns; per-master columns for a cluster only."""
    eff = efficiencies(rows)
    out: list[tuple[str, ...]] = []
    for r in rows:
        failed = r.sessions - r.ok
        sessions = f"{r.sessions}" + (f" ({failed} failed)" if failed else "")
        linear = eff.get((r.backend, r.units))
        masters = ("-", "-", "-")
        if len(r.state) > 1:
            busiest = max(r.command_shares)
            masters = (
                _split(r.key_shares),
                _split(r.command_shares),
                f"{_pct(busiest, 1)} {_verdict(busiest <= GOAL_BUSIEST_MASTER)}",
            )
        out.append(
            (
                r.backend, str(r.units), sessions, f"{r.sessions_per_s:.1f}",
                "-" if linear is None else _pct(linear), _pct(r.busiest_cpu_share),
                _pct(cpu_share(r.broker_cpu_s, r.wall_s)),
                _pct(cpu_share(r.producer_cpu_s, r.wall_s)), *masters,
            )
        )  # fmt: skip
    return out


def format_table(headers: Sequence[str], lines: Sequence[Sequence[str]]) -> str:
    """Columns padded to their widest cell: the first left-aligned, the figures right."""
    widths = [max(len(c) for c in column) for column in zip(headers, *lines, strict=True)]

    def line(cells: Sequence[str]) -> str:
        first, *rest = cells
        padded = [first.ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(rest, widths[1:], strict=True)
        ]
        return "  ".join(padded).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(cells) for cells in lines)])


def goal_lines(rows: Sequence[Row], cores: int, left_out: Sequence[int]) -> list[tuple[str, str]]:
    """(goal, figure) lines under the table."""
    eff = efficiencies(rows)
    at_goal = [
        (r.backend, eff[(r.backend, r.units)])
        for r in rows
        if r.units == GOAL_UNITS and (r.backend, r.units) in eff
    ]
    scaling = (
        ", ".join(f"{b} {_pct(e)} {_verdict(e >= GOAL_LINEAR_SHARE)}" for b, e in at_goal)
        if at_goal
        else f"not run here: {cores} cores"
    )
    out = [
        (f"scaling: >= {_pct(GOAL_LINEAR_SHARE)} of linear at {GOAL_UNITS} units "
         "(on a machine with the cores)", scaling),
    ]  # fmt: skip
    clustered = [r for r in rows if len(r.state) > 1]
    if clustered:
        worst = max(clustered, key=lambda r: max(r.command_shares))
        busiest = max(worst.command_shares)
        extra = ", ".join(f"{name} +{n:.1f}" for name, n in busiest_extra(worst))
        out.append(
            (f"busiest cluster master: <= {_pct(GOAL_BUSIEST_MASTER)} of the state's commands",
             f"{_pct(busiest, 1)} at {_units(worst.units)} "
             f"{_verdict(busiest <= GOAL_BUSIEST_MASTER)}")
        )  # fmt: skip
        if extra:
            out.append(("  its commands beyond the other masters' mean, per session", extra))
    singles = [r for r in rows if r.units == 1]
    if singles:
        out.append(
            ("state Redis commands per session at 1 unit (the broker's Redis not counted)",
             ", ".join(f"{r.backend} {r.commands_per_session:.1f}" for r in singles))
        )  # fmt: skip
    if left_out:
        need = ", ".join(f"{n} units need {n * CORES_PER_UNIT} cores" for n in left_out)
        out.append(("sizes left out", f"{need}; {cores} here"))
    return out


def report(rows: Sequence[Row], cores: int, left_out: Sequence[int]) -> str:
    """The table, then the goal lines."""
    goals = goal_lines(rows, cores, left_out)
    width = max(len(goal) for goal, _ in goals)
    below = [f"{goal.ljust(width)}  {figure}" for goal, figure in goals]
    return "\n".join([format_table(HEADERS, table_rows(rows)), "", *below])
