"""A local Redis Cluster (producer/local_cluster.py) as the tests and the benchmarks start it:
its masters form one cluster with every slot served, keys of different slots land on different
masters, and what started it stops every process it started."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
from redis.cluster import RedisCluster

from producer.fleet import Fleet, proc_stat
from producer.local_cluster import SLOTS, LocalCluster

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
