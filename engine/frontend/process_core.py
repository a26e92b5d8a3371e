"""An engine core in a separate process, so the engine loop never waits for the server's GIL.

The parent (the HTTP server) keeps tokenization, detokenization and response shaping; the child
owns the model, the KV cache and the scheduler. They talk over one ``multiprocessing`` pipe:
commands go down as typed commands (``engine.core.commands``), each engine step comes back as
one ``("out", outputs, stats)`` message. This is the split vLLM's V1 engine makes (its EngineCore
process), for the same reason.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import multiprocessing as mp
import signal
import sys
import threading

from engine.core.commands import Command, Shutdown
from engine.core.config import EngineConfig
from engine.core.engine_loop import Emit, run_engine_loop
from engine.core.limits import EngineLimits
from engine.frontend.core_client import SWITCH_INTERVAL_S

log = logging.getLogger(__name__)


def _child_main(
    config: EngineConfig, eos_token_ids, conn, log_level: int, log_interval: float
) -> None:
    """Entry point of the engine process: build the engine, report its limits, serve commands.

    A tensor-parallel engine core ignores SIGTERM and SIGINT: launchers (torchrun, a terminal's
    Ctrl-C) signal the whole process group, and the server stops its engine itself (a Shutdown
    command, then the ranks' shutdown message) once its requests are done; a core killed by
    the signal instead would leave its ranks to fail on a closed connection."""
    if config.tensor_parallel_size > 1:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=log_level, format="%(asctime)s %(levelname)s %(name)s[engine]: %(message)s"
    )
    from engine.worker.build import (
        build_engine,
    )  # here: the parent need not load torch's CUDA state

    try:
        engine = build_engine(config, eos_token_ids=eos_token_ids)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails its start-up
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    # The model, caches and compiled code are permanent: keep them out of the garbage collector's
    # full passes, which would otherwise walk them all and pause the engine loop (vLLM does the
    # same).
    gc.collect()
    gc.freeze()
    conn.send(("ready", engine.limits))

    def next_commands(timeout: float) -> list[Command]:
        commands = []
        try:
            if conn.poll(timeout):
                while conn.poll(0):
                    commands.append(conn.recv())
        except (EOFError, OSError):  # the parent is gone
            commands.append(Shutdown())
        return commands

    def emit(outputs, stats) -> None:
        try:
            conn.send(("out", outputs, stats))
        except (BrokenPipeError, OSError):
            pass

    try:
        run_engine_loop(engine, next_commands, emit, log_interval)
    finally:  # also after a fatal step: stop the other tensor-parallel ranks
        engine.shutdown()


class ProcessCore:
    """Starts the engine process and waits until its model is loaded.

    Args:
        config: engine settings; eos_token_ids: ids ending generation.
        startup_timeout: seconds to wait for the model (compilation and CUDA graphs included).

    Raises:
        RuntimeError: the engine process failed to start (its error message included).
    """

    engine = None  # the LLMEngine lives in the other process

    def __init__(
        self,
        config: EngineConfig,
        eos_token_ids: frozenset[int],
        log_interval: float = 10.0,
        startup_timeout: float = 1800.0,
    ):
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self._send_lock = threading.Lock()
        # a tensor-parallel engine core spawns its other ranks, which a daemonic process may
        # not do; it leaves when this process's pipe closes (next_commands) and its ranks die
        # with it (engine.worker.tp_worker), and shutdown() kills it after its timeout
        self._proc = ctx.Process(
            target=_child_main,
            name="engine-core",
            daemon=config.tensor_parallel_size == 1,
            args=(config, eos_token_ids, child_conn, logging.getLogger().level, log_interval),
        )
        self._proc.start()
        child_conn.close()
        if not self._proc.daemon:  # multiprocessing would join it at exit, maybe forever
            atexit.register(self._reap)
        if not self._conn.poll(startup_timeout):
            self._proc.kill()
            raise RuntimeError(f"engine process not ready after {startup_timeout:.0f}s")
        try:
            kind, payload = self._conn.recv()
        except EOFError:
            raise RuntimeError(
                f"engine process died during start-up (exit code {self._proc.exitcode})"
            ) from None
        if kind != "ready":
            self._proc.join(10)
            raise RuntimeError(f"engine process failed: {payload}")
        self.limits: EngineLimits = payload
        self._reader: threading.Thread | None = None
        self._stopping = False

    def start(self, emit: Emit, on_death) -> None:
        """Forward the child's step outputs to ``emit`` from a reader thread; ``on_death()`` is
        called if the child goes away without being asked to.

        The reader thread must win the GIL from the busy event loop for every step, so the
        interpreter's switch interval is lowered to 0.5 ms (as for the thread core); the
        thread also keeps draining the pipe while the loop is blocked sending a command, so
        neither process can block the other on a full pipe.
        """
        sys.setswitchinterval(SWITCH_INTERVAL_S)

        def read() -> None:
            while True:
                try:
                    msg = self._conn.recv()
                except (EOFError, OSError):
                    if not self._stopping:
                        self._proc.join(5)
                        log.error("engine process died (exit code %s)", self._proc.exitcode)
                        on_death()
                    return
                if msg[0] == "out":
                    emit(msg[1], msg[2])

        self._reader = threading.Thread(target=read, name="engine-reader", daemon=True)
        self._reader.start()

    def send(self, command: Command) -> None:
        with self._send_lock:
            try:
                self._conn.send(command)
            except (BrokenPipeError, OSError):
                log.error("engine process is gone; dropped command %s", command.kind.value)

    def shutdown(self, timeout: float = 30.0) -> None:
        self._stopping = True
        self.send(Shutdown())
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        self._conn.close()

    def is_alive(self) -> bool:
        return self._proc.is_alive()

    def _reap(self, timeout: float = 30.0) -> None:
        """At interpreter exit without :meth:`shutdown` (a server that failed after starting
        its engine): close the pipe, which stops the engine loop and its ranks, then wait for
        the process, and kill it after ``timeout`` seconds."""
        if not self._proc.is_alive():
            return
        with contextlib.suppress(OSError):
            self._conn.close()
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
