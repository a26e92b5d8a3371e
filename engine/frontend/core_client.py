"""The front end's view of an engine core: where the engine loop runs, and the in-thread core.

Two implementations: :class:`ThreadCore` (the loop in a thread of this process: the CPU
default, and what tests use to reach the live engine) and
:class:`engine.frontend.process_core.ProcessCore` (the loop in its own process: the CUDA
default).
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable
from typing import Protocol

from engine.core.commands import Command, Shutdown
from engine.core.engine_loop import Emit, run_engine_loop
from engine.core.limits import EngineLimits
from engine.core.llm_engine import LLMEngine

log = logging.getLogger(__name__)

#: GIL switch interval while an engine thread (or the engine process's reader thread) runs in
#: this process, seconds: the thread must win the GIL from the busy event loop every step, and
#: the default 5 ms wait would add directly to the time per output token
SWITCH_INTERVAL_S = 0.0005


class EngineCoreClient(Protocol):
    """Where the engine loop runs.

    Attributes:
        limits: the running engine's constants; engine: the in-process LLMEngine, or None.
    """

    limits: EngineLimits
    engine: LLMEngine | None

    def start(self, emit: Emit, on_death: Callable[[], None]) -> None:
        """Start serving; ``emit`` receives each step's outputs (on the core's thread),
        ``on_death()`` is called if the core dies without being asked to."""
        ...

    def send(self, command: Command) -> None:
        """Queue a command for the engine loop (never blocks on the engine)."""
        ...

    def shutdown(self, timeout: float) -> None:
        """Stop the loop and wait up to ``timeout`` seconds for it."""
        ...

    def is_alive(self) -> bool: ...


class ThreadCore:
    """The engine loop in a thread of this process.

    Lowers the interpreter's thread switch interval to :data:`SWITCH_INTERVAL_S` while running.

    Args:
        engine: the engine, used only by the loop thread once started.
        log_interval: seconds between periodic engine log lines.
    """

    def __init__(self, engine: LLMEngine, log_interval: float = 10.0):
        self.engine = engine
        self.limits = engine.limits
        self.log_interval = log_interval
        self._lock = threading.Lock()
        self._commands: list[Command] = []
        self._wakeup = threading.Event()
        self._thread: threading.Thread | None = None

    def _next(self, timeout: float) -> list[Command]:
        if timeout and not self._commands:
            self._wakeup.wait(timeout)
        self._wakeup.clear()
        with self._lock:
            commands, self._commands = self._commands, []
        return commands

    def start(self, emit: Emit, on_death: Callable[[], None] | None = None) -> None:
        sys.setswitchinterval(SWITCH_INTERVAL_S)

        def run() -> None:
            try:
                run_engine_loop(self.engine, self._next, emit, self.log_interval)
            except Exception:  # noqa: BLE001 - logged; the front end fails what is in flight
                log.exception("engine loop died")
                if on_death is not None:
                    on_death()

        self._thread = threading.Thread(target=run, name="engine-loop", daemon=True)
        self._thread.start()

    def send(self, command: Command) -> None:
        with self._lock:
            self._commands.append(command)
        self._wakeup.set()

    def shutdown(self, timeout: float = 30.0) -> None:
        if self._thread is not None:
            self.send(Shutdown())
            self._thread.join(timeout)
        if self._thread is None or not self._thread.is_alive():
            self.engine.shutdown()

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()
