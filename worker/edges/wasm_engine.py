"""The tool runtime's wasmtime engine, one per process: epoch interruption driven by a ticker
thread (a call's timeout is a number of ticks), and the HostSwitch that every module linked
on it calls. wasmtime state does not survive a fork (Celery prefork): a process that did not
build the engine builds its own, with empty caches.
"""

from __future__ import annotations

import math
import os
import threading
import weakref
from dataclasses import dataclass, field

from wasmtime import Config, Engine, InstancePre, Module

from worker.guest.fork import HostSwitch


@dataclass
class EngineState:
    """One process's engine, and what was compiled and linked for it (gone with it)."""

    pid: int
    engine: Engine
    hosts: HostSwitch  # the spear host every linked module calls: the current call's
    stop: threading.Event
    ticker: threading.Thread
    modules: dict[str, Module] = field(default_factory=dict)  # sha -> compiled module
    linked: dict[str, InstancePre] = field(default_factory=dict)  # sha -> linked tool module


def _tick(engine: Engine, stop: threading.Event, tick_s: float) -> None:
    while not stop.wait(tick_s):
        engine.increment_epoch()


class WasmEngine:
    def __init__(self, epoch_tick_ms: int) -> None:
        self._epoch_tick_ms = epoch_tick_ms
        self._lock = threading.Lock()
        self._state: EngineState | None = None

    def current(self) -> EngineState:
        """This process's engine, started on first use."""
        pid = os.getpid()
        with self._lock:
            if self._state is None or self._state.pid != pid:
                # After a fork the parent's ticker thread does not exist here: start over.
                self._state = self._new(pid)
            return self._state

    def ticks(self, budget_ms: float) -> int:
        """The epoch deadline of a budget, in ticks."""
        # +1: the first tick may land at any point within the current period.
        return math.ceil(budget_ms / self._epoch_tick_ms) + 1

    def close(self) -> None:
        """Stop the epoch ticker. A later `current` starts a new engine."""
        with self._lock:
            state, self._state = self._state, None
        if state is not None and state.pid == os.getpid():
            state.stop.set()
            state.ticker.join(timeout=1.0)

    def _new(self, pid: int) -> EngineState:
        config = Config()
        config.epoch_interruption = True
        engine = Engine(config)
        stop = threading.Event()
        ticker = threading.Thread(
            target=_tick,
            args=(engine, stop, self._epoch_tick_ms / 1000),
            name="wasm-epoch-ticker",
            daemon=True,
        )
        ticker.start()
        weakref.finalize(self, stop.set)  # an engine dropped without close() stops its ticker
        return EngineState(pid, engine, HostSwitch(), stop, ticker)
