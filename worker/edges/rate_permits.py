"""The blocks of slots a process keeps for its next calls while their controller is far from its
limit (rate_control_lua.py's ACQUIRE grants them): a call takes a kept slot and gives it back
when it ends, with no command, so a process pays one script a block instead of one a call.

A block is kept for BLOCK_AGE_S at most: the controller's view (a 429 another worker met, a
window cut) reaches a process within that, as its next call asks for a block again. Its slots
stay in the controller's set (they count in its window) until given back: those free when it
ages, and each in-flight one as its call ends after that.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

BLOCK_AGE_S = 1.0


@dataclass
class _Block:
    born_s: float
    base: str  # its first slot's name; the others are `base.2` ... (rate_control_lua.py)
    free: list[str] = field(default_factory=list)  # slots no call holds now

    def holds(self, slot: str) -> bool:
        return slot.split(".", 1)[0] == self.base


@dataclass
class Tally:
    """Calls served from blocks since the controller last heard of them, and how many of them
    asked for nothing (the sample of latencies)."""

    untold: int = 0
    quiet: int = 0


class PermitBlocks:
    """This process's blocks, one per controller (by its id), thread-safe."""

    def __init__(self, clock_s: Callable[[], float] = time.monotonic) -> None:
        self._blocks: dict[str, _Block] = {}
        self._tallies: dict[str, Tally] = {}
        self._lock = threading.Lock()
        self._clock_s = clock_s
        self._asking: dict[str, threading.Lock] = {}  # controller -> its one asking thread
        self._refused: set[str] = set()  # controllers whose last ask granted no block

    def granting(self, cid: str) -> bool:
        """Whether the controller granted a block when last asked (or was never asked)."""
        return cid not in self._refused

    def granted(self, cid: str, block: bool) -> None:
        with self._lock:
            if block:
                self._refused.discard(cid)
            else:
                self._refused.add(cid)

    def asking(self, cid: str) -> threading.Lock:
        """The lock its threads ask the controller under while it grants blocks."""
        with self._lock:
            return self._asking.setdefault(cid, threading.Lock())

    def take(self, cid: str) -> str | None:
        """A free slot of the controller's block, if it has a young one with one free."""
        with self._lock:
            block = self._blocks.get(cid)
            if block is None or not block.free or self._aged(block):
                return None
            self._tallies.setdefault(cid, Tally()).untold += 1
            return block.free.pop()

    def stale(self, cid: str) -> list[str]:
        """The controller's block dropped if it aged: its free slots, to give back."""
        with self._lock:
            block = self._blocks.get(cid)
            if block is None or not self._aged(block):
                return []
            return self._blocks.pop(cid).free

    def keep(self, cid: str, base: str, free: list[str]) -> list[str]:
        """A new block (first slot `base`, its `free` slots) kept; the free slots of the block
        it replaces, to give back."""
        with self._lock:
            old = self._blocks.get(cid)
            self._blocks[cid] = _Block(self._clock_s(), base, list(free))
            return [] if old is None else old.free

    def give_back(self, cid: str, slot: str) -> bool:
        """A call's slot back into its block: False when the block aged or was dropped (the
        caller gives it back to the controller)."""
        with self._lock:
            block = self._blocks.get(cid)
            if block is None or self._aged(block) or not block.holds(slot):
                return False
            block.free.append(slot)
            return True

    def drop(self, cid: str) -> list[str]:
        """The controller's block dropped (its account met a 429): its free slots."""
        with self._lock:
            block = self._blocks.pop(cid, None)
            return [] if block is None else block.free

    def aged(self) -> dict[str, list[str]]:
        """The blocks past their age, dropped: each controller's free slots, to give back."""
        with self._lock:
            old = [cid for cid, block in self._blocks.items() if self._aged(block)]
            return {cid: self._blocks.pop(cid).free for cid in old}

    def sample_due(self, cid: str, every: int) -> int | None:
        """A block's call with nothing to teach: the first of this process and every
        `every`-th report its latency (a new controller's epoch is a second until one has),
        with the calls its blocks served untold (then told: reset); None for the others."""
        with self._lock:
            tally = self._tallies.setdefault(cid, Tally())
            tally.quiet += 1
            if tally.quiet % every and tally.quiet != 1:
                return None
            untold, tally.untold = tally.untold, 0
            return untold

    def untold(self, cid: str) -> int:
        """The calls the controller's blocks served that it has not heard of (now told)."""
        with self._lock:
            tally = self._tallies.get(cid)
            if tally is None:
                return 0
            untold, tally.untold = tally.untold, 0
            return untold

    def _aged(self, block: _Block) -> bool:
        return self._clock_s() - block.born_s >= BLOCK_AGE_S
