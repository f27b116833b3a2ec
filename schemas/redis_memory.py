"""Redis's memory as cchatq reads it, shared by the producer and the workers: the limit, what
is used and the eviction policy, from `INFO memory` (which a managed Redis answers where it
forbids CONFIG GET), and the one rule both apply: a Redis that may evict cchatq's keys is
refused unless the operator says otherwise (ALLOW_EVICTION_ENV).

Why refuse: every cchatq key carries a TTL, which is exactly what a volatile-* policy evicts
first (a session's spec, its rounds, its lease, its response); an allkeys-* policy evicts
anything, the broker's queues included. Either loses sessions silently. With `noeviction`
a full Redis refuses writes instead, which the workers wait out and the producer measures.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

ALLOW_EVICTION_ENV = "CCHATQ_ALLOW_EVICTION"  # "1": run on an evicting Redis, loudly
NO_EVICTION = "noeviction"
FIX = "CONFIG SET maxmemory-policy noeviction"
MB = 1024 * 1024


@dataclass(frozen=True)
class RedisMemory:
    maxmemory_bytes: int  # 0: no limit
    used_bytes: int
    policy: str  # maxmemory-policy

    @classmethod
    def from_info(cls, info: Mapping[str, Any]) -> RedisMemory:
        """From redis-py's parsed `INFO memory` (numbers as ints, the policy as a string)."""
        policy = info.get("maxmemory_policy", NO_EVICTION)
        if isinstance(policy, bytes):
            policy = policy.decode()
        return cls(
            int(info.get("maxmemory", 0) or 0), int(info.get("used_memory", 0) or 0), str(policy)
        )

    @classmethod
    def from_infos(cls, infos: Sequence[Mapping[str, Any]]) -> RedisMemory:
        """A Redis Cluster's, from each master's `INFO memory`: what they use together, their
        limits together (none when one has none), and an evicting policy when one evicts."""
        each = [cls.from_info(info) for info in infos]
        limit = sum(m.maxmemory_bytes for m in each) if all(m.limited for m in each) else 0
        policy = next((m.policy for m in each if m.evicts), each[0].policy if each else NO_EVICTION)
        return cls(limit, sum(m.used_bytes for m in each), policy)

    @classmethod
    def of(cls, client: Any) -> RedisMemory:
        """A client's Redis's memory (INFO: allowed where CONFIG is not); a Redis Cluster
        client's (redis-py's RedisCluster, known by its masters), its masters' together."""
        if hasattr(client, "get_primaries"):
            infos = client.info("memory", target_nodes="primaries")
            return cls.from_infos(list(infos.values()))
        return cls.from_info(client.info("memory"))

    @property
    def limited(self) -> bool:
        return self.maxmemory_bytes > 0

    @property
    def free_bytes(self) -> int:
        """What is left under maxmemory (0 when over it); meaningless without a limit."""
        return max(self.maxmemory_bytes - self.used_bytes, 0)

    @property
    def evicts(self) -> bool:
        """Whether Redis may evict cchatq's keys: any policy but noeviction, under a limit."""
        return self.limited and self.policy != NO_EVICTION


def allow_eviction(env: Mapping[str, str]) -> bool:
    return env.get(ALLOW_EVICTION_ENV, "").strip().lower() in ("1", "true", "yes")


def mb(n_bytes: int) -> str:
    """`3.1 MB`, `24 MB`: a size as the messages show it."""
    value = n_bytes / MB
    return f"{value:.0f} MB" if value >= 10 or value == int(value) else f"{value:.1f} MB"


def eviction_refused(memory: RedisMemory, where: str, who: str) -> str:
    """The one line a worker or `cchatq submit` stops with on an evicting Redis."""
    return (
        f"{who}: Redis at {where} has maxmemory-policy {memory.policy} (maxmemory"
        f" {mb(memory.maxmemory_bytes)}), which may evict cchatq's keys and lose sessions:"
        f" run `{FIX}` (or set {ALLOW_EVICTION_ENV}=1 to run on it anyway)"
    )


def eviction_warning(memory: RedisMemory, where: str) -> str:
    """The loud line of a worker started on an evicting Redis with the override, and of
    `cchatq status`."""
    return (
        f"WARNING: Redis at {where} has maxmemory-policy {memory.policy} (maxmemory"
        f" {mb(memory.maxmemory_bytes)}): it may evict cchatq's keys and sessions may be lost"
        f" ({ALLOW_EVICTION_ENV}=1 lets the fleet run on it; `{FIX}` is the fix)"
    )
