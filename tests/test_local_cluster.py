"""A local Redis Cluster (producer/local_cluster.py) as the tests, the benchmarks and
`cchatq up --cluster N` start it: its masters form one cluster with every slot served, keys of
different slots land on different masters, and what started it stops every process it started
(`cchatq down` those of `up`)."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
import redis
from redis.cluster import RedisCluster

from producer.fleet import Fleet, free_port, proc_stat
from producer.local_cluster import SLOTS, LocalCluster
from tests.test_local_fleet import cchatq, clean_env, exports, marked_processes, wait_until_gone

pytestmark = pytest.mark.fleet

KEYS = 300


def cluster_info(url: str) -> dict[str, str]:
    with redis.Redis.from_url(url, decode_responses=True) as client:
        text = client.execute_command("CLUSTER", "INFO")
    return dict(line.split(":", 1) for line in text.split() if ":" in line)


def alive(pids: list[int]) -> list[int]:
    """Those of `pids` still running (a zombie is not: its parent has yet to reap it)."""
    return [pid for pid in pids if (fields := proc_stat(pid)) is not None and fields[0] != "Z"]


def slot_owners(url: str) -> dict[int, int]:
    """Each slot's master's port, as the node at `url` says (CLUSTER SLOTS)."""
    with redis.Redis.from_url(url) as client:
        ranges = client.execute_command("CLUSTER", "SLOTS")
    if isinstance(ranges, dict):  # redis-py's parsed form: {(low, high): {"primary": (h, p)}}
        return {
            slot: int(owner["primary"][1])
            for (low, high), owner in ranges.items()
            for slot in range(low, high + 1)
        }
    return {slot: int(r[2][1]) for r in ranges for slot in range(r[0], r[1] + 1)}


def test_three_masters_form_share_the_keys_and_stop(tmp_path: Path) -> None:
    with LocalCluster(masters=3, workdir=tmp_path) as cluster:
        pids = cluster.pids
        assert len(set(cluster.ports)) == 3 and len(alive(pids)) == 3
        assert cluster.url == cluster.urls[0] and cluster.url.endswith("/0")
        for url in cluster.urls:
            info = cluster_info(url)
            assert info["cluster_state"] == "ok", (url, info)
            assert info["cluster_slots_assigned"] == str(SLOTS)
            assert info["cluster_known_nodes"] == "3"
        owners = slot_owners(cluster.url)
        assert len(owners) == SLOTS and set(owners.values()) == set(cluster.ports)

        client = RedisCluster.from_url(cluster.url)
        try:
            keys = [f"session:{n}" for n in range(KEYS)]
            for n, key in enumerate(keys):
                client.set(key, n)
            assert [client.get(key) for key in keys] == [str(n).encode() for n in range(KEYS)]
            slots = {key: client.keyslot(key) for key in keys}
        finally:
            client.close()
        held = {}
        for port, url in zip(cluster.ports, cluster.urls, strict=True):
            with redis.Redis.from_url(url) as node:
                held[port] = node.dbsize()
                # each key is on the master its slot belongs to, and only there
                for key, slot in slots.items():
                    count = node.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot)
                    assert (count > 0) == (owners[slot] == port), (key, slot, port)
        assert all(held[port] > 0 for port in cluster.ports), held
        assert sum(held.values()) == KEYS
        logs = {p.name for p in tmp_path.glob("redis-cluster-*.log")}
        assert logs == {f"redis-cluster-{port}.log" for port in cluster.ports}
    assert alive(pids) == []
    assert cluster.pids == []


def test_a_cluster_started_through_a_fleet_stops_alone_or_with_it(tmp_path: Path) -> None:
    """Its nodes log in the fleet's folder; its stop() stops them and nothing else of the
    fleet's; the fleet's stop() stops one still running."""
    fleet = Fleet(workdir=tmp_path, log_dir=tmp_path / "logs")
    try:
        fleet.ensure_redis(private=True)
        assert fleet.redis_proc is not None
        first = LocalCluster(masters=2, fleet=fleet)
        assert cluster_info(first.start())["cluster_state"] == "ok"
        first_pids = first.pids
        assert {fleet.names[pid] for pid in first_pids} == {
            f"redis-cluster-{port}" for port in first.ports
        }
        assert all(fleet.log_of(fleet.names[pid]).exists() for pid in first_pids)
        first.stop()
        assert alive(first_pids) == []
        assert fleet.procs == [fleet.redis_proc] and fleet.redis_proc.poll() is None

        second = LocalCluster(masters=1, fleet=fleet)
        assert cluster_info(second.start())["cluster_slots_assigned"] == str(SLOTS)
        started = [p.pid for p in fleet.procs]
        assert len(started) == 2
    finally:
        fleet.stop()
    assert alive(started) == []


def test_up_with_a_cluster_exports_it_and_down_stops_it(tmp_path: Path) -> None:
    """The state on a 3-master cluster, the broker on a plain private Redis. Sessions are not
    run: the workers' store on a cluster is not this test's."""
    mark = uuid.uuid4().hex
    env = clean_env(mark)
    folder = tmp_path / "fleet"
    try:
        up = cchatq("up", "--cluster", "3", "--dir", str(folder), env=env, cwd=tmp_path)
        assert up.returncode == 0, up.stderr
        shell = exports(up.stdout)
        expected = {"REDIS_URL", "CCHATQ_STATE_URL", "CCHATQ_CONFIG", "CCHATQ_REPLAY_URL"}
        assert set(shell) == expected, shell
        state, broker = shell["CCHATQ_STATE_URL"], shell["REDIS_URL"]
        assert state != broker
        info = cluster_info(state)
        assert info["cluster_state"] == "ok" and info["cluster_known_nodes"] == "3", info
        with redis.Redis.from_url(broker) as client:
            assert client.info("cluster")["cluster_enabled"] == 0
        record = json.loads((folder / "fleet.json").read_text())
        assert record["state_url"] == state
        nodes = [p for p in record["processes"] if p["name"].startswith("redis-cluster-")]
        assert len(nodes) == 3
        assert f"127.0.0.1:{nodes[0]['name'].rsplit('-', 1)[1]}/" in state
        assert "state" in up.stderr and "cchatq down" in up.stderr
        pids = [p["pid"] for p in record["processes"]]
        assert len(alive(pids)) == len(pids)
    finally:
        down = cchatq("down", "--dir", str(folder), env=env, cwd=tmp_path)
    assert down.returncode == 0, down.stderr
    assert down.stderr.count(" stopped") == len(pids), down.stderr
    assert not folder.exists()
    assert wait_until_gone(mark) == []
    assert alive(pids) == []


def test_up_with_a_cluster_and_a_redis_url_starts_nothing(tmp_path: Path) -> None:
    mark = uuid.uuid4().hex
    env = {**clean_env(mark), "REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"}
    folder = tmp_path / "fleet"
    up = cchatq("up", "--cluster", "3", "--dir", str(folder), env=env, cwd=tmp_path)
    assert up.returncode != 0
    assert up.stdout == ""
    assert "--cluster" in up.stderr and "unset REDIS_URL" in up.stderr
    assert not folder.exists()
    assert marked_processes(mark) == []
