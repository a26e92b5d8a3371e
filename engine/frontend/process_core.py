"""An engine core in a separate process, so the engine loop never waits for the server's GIL.

The parent (the HTTP server) keeps tokenization, detokenization and response shaping; the child
owns the model, the KV cache and the scheduler. They talk over a ``multiprocessing`` pipe:
commands go down as typed commands (``engine.core.commands``), each engine step comes back as
one ``("out", outputs, stats)`` message. This is the split vLLM's V1 engine makes (its EngineCore
process), for the same reason. With several API servers (``server.api_servers``) the engine
process has one pipe per server (:class:`EngineProcess`, ``engine.frontend.client_channels``)
and each server holds a :meth:`ProcessCore.attach` client.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import time

from engine.core.commands import Command, Shutdown
from engine.core.config import EngineConfig
from engine.core.engine_loop import Emit, idle_polling, run_engine_loop
from engine.core.limits import EngineLimits
from engine.core.parent_death import set_parent_death_signal
from engine.frontend.client_channels import ClientChannels
from engine.frontend.core_client import SWITCH_INTERVAL_S

log = logging.getLogger(__name__)

#: seconds between the checks of ``should_stop`` while the engine process loads
STARTUP_POLL_S = 0.1


def _child_main(
    config: EngineConfig,
    eos_token_ids,
    conns: list,
    log_level: int,
    log_interval: float,
) -> None:
    """Entry point of the engine process: build the engine, report its limits on ``conns[0]``,
    serve the commands of every front end (:class:`ClientChannels`).

    An engine core ignores SIGINT and SIGTERM (it starts with both blocked: none hits the
    bootstrap). A terminal's Ctrl-C reaches the whole foreground process group, and launchers
    (``make serve``'s process group, torchrun, the API-server supervisor, a service manager
    stopping the control group) signal every process; the front ends drain their requests and
    the engine stops itself once every front end has left (each sends Shutdown or closes its
    pipe). A core stopped by the signal instead would fail the requests still finishing (an
    idle one printed a KeyboardInterrupt traceback), and a tensor-parallel core would leave its
    ranks to fail on a closed connection. Nothing is lost for it: the process is not daemonic,
    and a front end that exits without a shutdown ends the pipes, which stops it, and kills
    it only if it is still running after a timeout (:meth:`EngineProcess.reap`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # started with them blocked (EngineProcess): none hit the bootstrap
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})
    # a parent killed during the load (minutes with a large model) must not leave this process
    # loading and holding the GPU: until it reports ready, its parent's death kills it (and a
    # parent already gone before the signal was set ends it here)
    set_parent_death_signal(signal.SIGKILL)
    parent = mp.parent_process()
    if parent is not None and os.getppid() != parent.pid:
        os._exit(1)
    if config.device == "cpu" and len(conns) > 1 and "torch" not in sys.modules:
        # a CPU model next to several API servers: libgomp's threads must sleep between
        # parallel regions, not spin, or they take the cores the API servers (and the other
        # OpenMP threads) need; measured on the 2-core CPU box with one core busy, a 64-token
        # completion took 4.7 s with spinning threads, 1.8 s passive (1.0 / 1.2 s idle)
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    logging.basicConfig(
        level=log_level, format="%(asctime)s %(levelname)s %(name)s[engine]: %(message)s"
    )
    from engine.worker.build import (
        build_engine,
    )  # here: the parent need not load torch's CUDA state

    try:
        engine = build_engine(config, eos_token_ids=eos_token_ids)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails its start-up
        conns[0].send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    # The model, caches and compiled code are permanent: keep them out of the garbage collector's
    # full passes, which would otherwise walk them all and pause the engine loop (vLLM does the
    # same).
    gc.collect()
    gc.freeze()
    # from here on the front ends stop it (they leave; see ClientChannels), also when the
    # parent dies: a supervisor's API servers finish their requests first. (Cleared before the
    # report: the parent-death signal follows the parent's thread, which may end once it has
    # the report.)
    set_parent_death_signal(0)
    try:
        conns[0].send(("ready", engine.limits))
    except OSError:  # the parent is gone
        engine.shutdown()
        return
    channels = ClientChannels(conns)
    try:
        next_commands = idle_polling(channels.next_commands, config.engine_idle_poll_ms / 1e3)
        run_engine_loop(engine, next_commands, channels.emit, log_interval)
    finally:  # also after a fatal step: deliver what is queued, stop the tensor-parallel ranks
        channels.close(CHANNELS_DRAIN_S)
        engine.shutdown()


#: seconds the engine process waits at exit for its sender threads to deliver what is queued
CHANNELS_DRAIN_S = 5.0


class StartupInterrupted(Exception):
    """The wait for the engine process was stopped (``should_stop``); the process was killed."""


class EngineProcess:
    """The engine-core process, started and loaded, with one pipe per front end.

    Args:
        config: engine settings; eos_token_ids: ids ending generation.
        num_clients: front ends (API servers) it serves, one pipe each (:attr:`conns`).
        log_interval: seconds between the engine's periodic log lines.
        startup_timeout: seconds to wait for the model (compilation and CUDA graphs included).
        should_stop: called every :data:`STARTUP_POLL_S` seconds while the model loads; True
            kills the process and raises :class:`StartupInterrupted` (a supervisor's signal
            handler sets the flag it reads; it never raises from the handler).

    Attributes:
        conns: this side of the pipes; hand each to its front end. limits: the engine's
            constants. proc: the ``multiprocessing`` process. reaping: :meth:`reap` ran (the
            pipes end without a Shutdown; a reader seeing that is not an engine death).

    Raises:
        RuntimeError: the engine process failed to start (its error message included).
        StartupInterrupted: ``should_stop()`` said so.
        BaseException: whatever else interrupted the wait (KeyboardInterrupt); the process is
            killed first in every case.
    """

    def __init__(
        self,
        config: EngineConfig,
        eos_token_ids: frozenset[int],
        num_clients: int = 1,
        log_interval: float = 10.0,
        startup_timeout: float = 1800.0,
        should_stop=None,
    ):
        if num_clients < 1:
            raise ValueError(f"num_clients must be at least 1, got {num_clients}")
        ctx = mp.get_context("spawn")
        self.reaping = False  # reap() ran: the pipes end without a Shutdown, on purpose
        pipes = [ctx.Pipe() for _ in range(num_clients)]
        self.conns = [p[0] for p in pipes]
        # not daemonic: multiprocessing would end a daemonic child with SIGTERM at exit, which
        # the engine core ignores (see _child_main), and a tensor-parallel core spawns its
        # other ranks, which a daemonic process may not do. It leaves when its front ends'
        # pipes close (ClientChannels), its ranks die with it (engine.worker.tp_worker), and
        # join() / reap() kill it after their timeout.
        self.proc = ctx.Process(
            target=_child_main,
            name="engine-core",
            daemon=False,
            args=(
                config,
                eos_token_ids,
                [p[1] for p in pipes],
                logging.getLogger().level,
                log_interval,
            ),
        )
        try:
            # the engine core starts with SIGTERM/SIGINT blocked (see _child_main)
            blocked = {signal.SIGTERM, signal.SIGINT}
            old = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
            try:
                self.proc.start()
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, old)
            for _, child_conn in pipes:
                child_conn.close()
            atexit.register(self.reap)  # multiprocessing would join it at exit, maybe forever
            self.limits: EngineLimits = self._wait_ready(startup_timeout, should_stop)
        except BaseException:
            if self.proc.pid is not None and self.proc.is_alive():
                self.proc.kill()
                self.proc.join(5)
            self.close_conns()
            raise

    def _wait_ready(self, startup_timeout: float, should_stop) -> EngineLimits:
        first = self.conns[0]
        deadline = time.monotonic() + startup_timeout
        while not first.poll(min(STARTUP_POLL_S, max(0.0, deadline - time.monotonic()))):
            if should_stop is not None and should_stop():
                raise StartupInterrupted("stopped while the engine loaded")
            if time.monotonic() >= deadline:
                raise RuntimeError(f"engine process not ready after {startup_timeout:.0f}s")
        try:
            kind, payload = first.recv()
        except EOFError:
            self.proc.join(5)
            raise RuntimeError(
                f"engine process died during start-up (exit code {self.proc.exitcode})"
            ) from None
        if kind != "ready":
            self.proc.join(10)
            raise RuntimeError(f"engine process failed: {payload}")
        return payload

    def close_conns(self) -> None:
        """Close this process's copies of the pipes (after handing them to the front-end
        processes, so that a front end that exits closes its pipe for good)."""
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.close()

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the process to exit, then kill it."""
        self.proc.join(timeout)
        if self.proc.is_alive():
            log.warning("engine process still running after %.0f s: killing it", timeout)
            self.proc.kill()
            self.proc.join(5)

    def reap(self, timeout: float = 30.0) -> None:
        """At interpreter exit without a shutdown (a server that failed after starting its
        engine): end the pipes, which stops the engine loop and its ranks, then wait for the
        process, and kill it after ``timeout`` seconds.

        Each pipe (a socket pair) is shut down before it is closed: closing alone would not
        end a front end's reader thread blocked in ``recv`` on it (Linux keeps the file open
        under a blocked read), so the engine would never see the end of the pipe and would be
        killed only after the timeout."""
        self.reaping = True
        if not self.proc.is_alive():
            return
        for conn in self.conns:
            with contextlib.suppress(OSError, ValueError):  # closed already, or not a socket
                with socket.socket(fileno=os.dup(conn.fileno())) as sock:
                    sock.shutdown(socket.SHUT_RDWR)
        self.close_conns()
        self.join(timeout)


class ProcessCore:
    """A front end's client of the engine process: commands down its pipe, step outputs up.

    ``ProcessCore(config, eos_token_ids)`` starts its own engine process (one front end, which
    owns the process and stops it at :meth:`shutdown`); :meth:`attach` makes the client of one
    pipe of an :class:`EngineProcess` that another process started (an API server of several,
    which leaves the engine at :meth:`shutdown` and does not stop it).

    Args:
        config: engine settings; eos_token_ids: ids ending generation.
        log_interval: seconds between the engine's periodic log lines.
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
        process = EngineProcess(config, eos_token_ids, 1, log_interval, startup_timeout)
        self._setup(process.conns[0], process.limits, process)

    @classmethod
    def attach(cls, conn, limits: EngineLimits) -> ProcessCore:
        """The client of an engine process started elsewhere, over its pipe end ``conn``
        (one of :attr:`EngineProcess.conns`, passed to this process); ``limits`` are that
        engine's (:attr:`EngineProcess.limits`)."""
        core = cls.__new__(cls)
        core._setup(conn, limits, None)
        return core

    def _setup(self, conn, limits: EngineLimits, process: EngineProcess | None) -> None:
        self._conn = conn
        self.limits = limits
        self._process = process
        self._proc = process.proc if process is not None else None
        self._send_lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self._stopping = False
        self._lost = False  # the pipe closed (an attached client's view of the engine's death)

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
                    self._lost = True
                    reaped = self._process is not None and self._process.reaping
                    if not (self._stopping or reaped):
                        if self._proc is not None:
                            self._proc.join(5)
                            log.error("engine process died (exit code %s)", self._proc.exitcode)
                        else:
                            log.error("the engine process closed its pipe (it died)")
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
        """Leave the engine (a Shutdown command: the engine aborts what this front end still
        has and closes its pipe); an owning client then waits ``timeout`` seconds for the
        process to exit (its only front end left, it stops) and kills it after that."""
        self._stopping = True
        self.send(Shutdown())
        if self._process is not None:
            self._process.join(timeout)
        elif self._reader is not None:  # the engine closes the pipe once it read the Shutdown
            self._reader.join(min(timeout, 5.0))
        with contextlib.suppress(OSError):
            self._conn.close()

    def is_alive(self) -> bool:
        if self._proc is not None:
            return self._proc.is_alive()
        return not self._lost
