"""The scale bench's figures (bench/scale_figures.py) on made-up rows: which sizes run, the
efficiency against linear, the masters' shares and the table, with no process started."""

from __future__ import annotations

import pytest

from bench import scale_figures as sf


def counters(commands: dict[str, int], keys: int = 0, cpu_s: float = 0.0) -> sf.Counters:
    return sf.Counters(cpu_s, commands, keys)


def row(
    backend: str, units: int, wall_s: float, state: tuple[sf.Counters, ...] = (), ok: int = -1
) -> sf.Row:
    sessions = 100 * units
    return sf.Row(
        backend=backend,
        units=units,
        sessions=sessions,
        ok=sessions if ok < 0 else ok,
        wall_s=wall_s,
        state=state or (counters({"set": 10 * sessions}, 5 * sessions, wall_s / 2),),
        broker_cpu_s=wall_s / 4,
        producer_cpu_s=wall_s / 10,
    )


@pytest.mark.parametrize(
    ("cores", "runs", "left_out"),
    [
        (2, [1], [2, 4, 8, 16]),
        (3, [1], [2, 4, 8, 16]),
        (4, [1, 2], [4, 8, 16]),
        (16, [1, 2, 4, 8], [16]),
        (32, [1, 2, 4, 8, 16], []),
        (1, [1], [2, 4, 8, 16]),  # fewer cores than a unit needs: the 1-unit row all the same
    ],
)
def test_a_size_runs_when_its_units_have_two_cores_each(
    cores: int, runs: list[int], left_out: list[int]
) -> None:
    assert sf.sizes_to_run(sf.DEFAULT_SIZES, cores) == (runs, left_out)


def test_the_one_unit_row_runs_though_not_asked_for() -> None:
    assert sf.sizes_to_run([4, 2, 4], 8) == ([1, 2, 4], [])


def test_efficiency_is_against_n_times_one_unit_of_the_same_backend() -> None:
    rows = [
        row("redis", 1, 10.0),  # 10/s
        row("redis", 4, 10.0),  # 40/s: linear
        row("redis", 8, 16.0),  # 50/s against 80/s
        row("cluster-3", 1, 20.0),  # 5/s
        row("cluster-3", 8, 20.0),  # 40/s: linear against its own 1 unit, not redis's
    ]
    eff = sf.efficiencies(rows)
    assert eff == pytest.approx(
        {("redis", 1): 1.0, ("redis", 4): 1.0, ("redis", 8): 0.625,
         ("cluster-3", 1): 1.0, ("cluster-3", 8): 1.0}
    )  # fmt: skip


def test_a_backend_without_its_one_unit_row_has_no_efficiency() -> None:
    assert sf.efficiencies([row("redis", 1, 10.0), row("cluster-3", 2, 10.0)]) == {
        ("redis", 1): 1.0
    }


def test_shares_split_the_total_and_zero_stays_zero() -> None:
    assert sf.shares([1, 1, 2]) == [0.25, 0.25, 0.5]
    assert sf.shares([0, 0, 0]) == [0.0, 0.0, 0.0]


def test_counters_since_leave_out_the_samplers_own_calls() -> None:
    before = counters({"info": 7, "set": 10, "dbsize": 2}, keys=5, cpu_s=1.0)
    after = counters({"info": 9, "set": 25, "dbsize": 3, "get": 4}, keys=12, cpu_s=1.5)
    delta = after.since(before, {"info": 2, "dbsize": 1})
    assert delta.by_command == {"set": 15, "get": 4}
    assert (delta.commands, delta.keys) == (19, 7) and delta.cpu_s == pytest.approx(0.5)


def test_the_busiest_master_and_what_it_runs_beyond_the_others() -> None:
    masters = (
        counters({"set": 300, "zadd": 0}, keys=300, cpu_s=2.0),
        counters({"set": 300, "zadd": 200, "xadd": 100}, keys=400, cpu_s=3.0),
        counters({"set": 300, "zadd": 0}, keys=300, cpu_s=1.0),
    )
    r = row("cluster-3", 1, 10.0, masters)
    assert r.command_shares == pytest.approx([0.25, 0.5, 0.25])
    assert r.key_shares == pytest.approx([0.3, 0.4, 0.3])
    assert r.busiest_cpu_share == pytest.approx(0.3)  # 3 s of 10 on one core
    assert r.commands_per_session == 12.0  # all masters: 1,200 commands, 100 sessions
    assert sf.busiest_extra(r) == [("zadd", 2.0), ("xadd", 1.0)]


def test_the_table_shows_shares_and_goals_for_the_cluster_only() -> None:
    even = tuple(counters({"set": 1000}, keys=100, cpu_s=1.0) for _ in range(3))
    hot = (
        counters({"set": 1000}, keys=100),
        counters({"set": 1000, "zadd": 1000}, keys=100, cpu_s=4.0),
        counters({"set": 1000}, keys=100),
    )
    rows = [
        row("redis", 1, 10.0),
        row("redis", 8, 16.0),
        row("cluster-3", 1, 10.0, even, ok=90),
        row("cluster-3", 8, 10.0, hot),
    ]
    text = sf.report(rows, cores=16, left_out=[16])
    lines = text.splitlines()
    header, rule = lines[0], lines[1]
    assert len(header) == len(rule) and header.startswith("backend")
    cells = {(ln.split()[0], ln.split()[1]): ln for ln in lines[2:6]}
    assert cells[("redis", "8")].split()[2:5] == ["800", "50.0", "62%"]
    assert cells[("redis", "1")].rstrip().endswith("-")  # no masters on a plain Redis
    assert "100 (10 failed)" in cells[("cluster-3", "1")]
    assert "33/33/33%" in cells[("cluster-3", "1")] and "33.3% ok" in cells[("cluster-3", "1")]
    assert cells[("cluster-3", "8")].endswith("50.0% MISSED")
    assert "40%" in cells[("cluster-3", "8")].split()  # the busiest master: 4 s of 10 s
    goals = "\n".join(lines[6:])
    assert "redis 62% MISSED, cluster-3 100% ok" in goals
    assert "50.0% at 8 units MISSED" in goals
    assert "zadd +1.2" in goals  # 1,000 more than the others' mean, over 800 sessions
    assert "redis 10.0, cluster-3 30.0" in goals  # state commands per session at 1 unit
    assert "16 units need 32 cores; 16 here" in goals


def test_the_scaling_goal_says_it_was_not_run_without_the_cores() -> None:
    text = sf.report([row("redis", 1, 10.0)], cores=2, left_out=[2, 4, 8, 16])
    assert "not run here: 2 cores" in text
    assert "busiest cluster master" not in text
