"""Several API-server processes in front of one engine core (``--api-server-count N``).

One HTTP process spends tens of microseconds of CPU per streamed token (JSON, SSE framing,
``socket.send``); at a few thousand tokens per second its event loop falls behind and merges
tokens into chunks, which is the inter-token tail measured at concurrency 64 and 256
(docs/benchmarks.md). vLLM's answer is ``--api-server-count``: N API-server processes, one engine
core. Here:

* this process (the supervisor) binds the address (so a taken port fails at once), starts the
  engine-core process with one pipe per API server (``engine.frontend.process_core
  .EngineProcess``), then N API-server processes, and serves nothing itself;
* each API server builds its own tokenizer, grammar validator and app around a
  :meth:`ProcessCore.attach` client of its pipe, and listens on its own SO_REUSEPORT socket at
  the same address: the kernel spreads new connections over the N listeners;
* ``/metrics`` is one view from any of them: counters and histograms are aggregated over the
  processes through prometheus_client's multiprocess directory, the engine's step stats go to
  API server 0 alone (``engine.frontend.client_channels``);
* ``--limit-concurrency`` is one limit over all of them (a shared connection count,
  ``server.http_protocol.ConnectionSlots``); the engine's own limits (``--max-num-seqs``, the
  KV cache) are the engine core's, shared by construction;
* signals: only the supervisor acts on SIGTERM/SIGINT. The API servers run in process groups
  of their own (a terminal's Ctrl-C reaches only the supervisor) and ignore both signals (a
  service manager that signals every process of the service, as systemd does, must not count
  twice); the supervisor turns each SIGTERM/SIGINT it gets into one SIGUSR1 to every API server
  (the first starts their graceful shutdown, a second ends their requests at once, a third
  forces the quit: ``server.http_server.GracefulServer``). A signal during start-up kills the
  loading engine and exits. The engine core ignores signals and stops when the last API server
  has left it. An API server or engine core that dies unexpectedly stops the others and the
  supervisor exits 1 (a container restart policy brings the server back); an API server whose
  supervisor died shuts itself down (a parent-death signal, and a watcher thread).
* a second supervisor on the same port fails at start-up (SO_REUSEPORT would otherwise let both
  listen and split the connections): each holds an abstract Unix socket named after the port.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import multiprocessing as mp
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from multiprocessing.connection import wait

from engine.core.config import EngineConfig
from engine.core.limits import EngineLimits
from engine.core.parent_death import set_parent_death_signal
from server.signal_repeats import SignalRepeats

log = logging.getLogger("server")

#: seconds the supervisor waits, after the last API server exited, for the engine core to stop
ENGINE_STOP_TIMEOUT_S = 30.0
#: seconds between an API server's checks that its supervisor is still alive
PARENT_CHECK_S = 1.0
#: the signal the supervisor sends its API servers (they ignore SIGTERM and SIGINT)
STOP_SIGNAL = signal.SIGUSR1
#: the parent-death signal of an API server (turned into one STOP_SIGNAL)
PARENT_DEATH_SIGNAL = signal.SIGUSR2
#: the signals only the supervisor acts on
_SUPERVISOR_SIGNALS = {signal.SIGTERM, signal.SIGINT}


def _watch_supervisor(supervisor_pid: int) -> None:
    """In an API server: stop (one :data:`STOP_SIGNAL` to itself) once the supervisor is gone.

    The kernel's parent-death signal (Linux ``prctl``) is :data:`PARENT_DEATH_SIGNAL`, not the
    stop signal itself: it comes once for each thread of the dying supervisor that the process
    is handed over from (the tokenizer's thread pool makes several), and a second stop signal
    would end the requests at once; its handler sends the stop signal the first time only.
    Where there is no ``prctl``, a thread watches for the process being re-parented. Either
    way a supervisor that died before this process got here counts too."""
    fired = []

    def once(sig=None, frame=None) -> None:
        if not fired:
            fired.append(True)
            log.warning("the supervisor (pid %d) is gone: shutting down", supervisor_pid)
            os.kill(os.getpid(), STOP_SIGNAL)

    signal.signal(PARENT_DEATH_SIGNAL, once)
    if set_parent_death_signal(PARENT_DEATH_SIGNAL):
        if os.getppid() != supervisor_pid:  # it died before the parent-death signal was set
            once()
        return

    def watch() -> None:
        while os.getppid() == supervisor_pid:
            time.sleep(PARENT_CHECK_S)
        once()

    threading.Thread(target=watch, name="supervisor-watch", daemon=True).start()


def api_server_main(
    args: argparse.Namespace,
    config: EngineConfig,
    index: int,
    conn,
    limits: EngineLimits,
    port: int,
    shared_connections,
    num_ready,
    metrics_dir: str,
    supervisor_pid: int,
) -> None:
    """Entry point of API server ``index``: serve HTTP on ``args.host:port`` in front of the
    engine core reached through ``conn`` (its pipe end), until :data:`STOP_SIGNAL`.

    Args:
        args: the parsed flags; config: the engine settings (the model directory resolved).
        limits: the engine's constants. shared_connections: the server-wide connection count
            (``multiprocessing.Value``). num_ready: a ``multiprocessing.Value`` each API server
            increments once it listens. metrics_dir: prometheus_client's multiprocess
            directory (PROMETHEUS_MULTIPROC_DIR is set to it in this process's environment).
            supervisor_pid: the supervisor's pid (this process stops when it is gone).
    """
    # SIGTERM/SIGINT are the supervisor's alone (it started this process with them blocked, so
    # none arrived before they were ignored here); until uvicorn runs, STOP_SIGNAL's default
    # action (exit) is the right one: nothing is in flight yet
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _SUPERVISOR_SIGNALS)
    os.setpgid(0, 0)
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s %(levelname)s %(name)s[api {index}]: %(message)s",
    )
    _watch_supervisor(supervisor_pid)
    from engine.frontend.process_core import ProcessCore
    from server.app import create_app
    from server.factory import build_context
    from server.http_server import listen_socket, make_server

    core = ProcessCore.attach(conn, limits)
    ctx = build_context(args, config, core=core, metrics_dir=metrics_dir)
    app = create_app(ctx)
    sock = listen_socket(args.host, port, reuse_port=True)
    gc.collect()
    gc.freeze()
    timeout = float(args.graceful_timeout)
    server = make_server(
        app,
        args,
        on_graceful_timeout=lambda early: ctx.end_in_flight(timeout, early=early),
        shared_connections=shared_connections,
    )
    server.exit_signals = (STOP_SIGNAL,)
    server.ignored_signals = (signal.SIGTERM, signal.SIGINT)

    def started() -> None:
        with num_ready.get_lock():
            num_ready.value += 1

    server.on_started = started
    server.run(sockets=[sock])


class _Supervisor:
    """Forwards signals to the API servers and watches them and the engine core (see the module
    docstring). Its handler is installed before the engine loads and only counts (it may run
    in the main thread inside any call, a process start included); the main thread sends each
    API server the stop signals it has not had yet (:meth:`deliver`), so none is lost and none
    is sent twice, and the start-up checks :meth:`stopping` between its steps (and while the
    engine loads)."""

    def __init__(self):
        self.procs: list[mp.Process] = []  # the API servers started so far
        self.signals = 0
        self._repeats = SignalRepeats()
        self.failed = False
        self._sent: dict[int, int] = {}  # pid -> stop signals sent to it
        self._wakeup_r, self._wakeup_w = os.pipe()
        os.set_blocking(self._wakeup_w, False)
        os.set_blocking(self._wakeup_r, False)

    def forward(self, sig, frame) -> None:
        """The signal handler: count the SIGTERM/SIGINT (:meth:`deliver` forwards it); the
        same signal again within :data:`~server.signal_repeats.REPEAT_WINDOW_S` is one signal
        delivered twice (make's copy) and is not counted."""
        if not self._repeats.is_repeat(sig):
            self.signals += 1

    def install(self) -> dict:
        """Install the handler for SIGTERM/SIGINT (and a wake-up of :meth:`run` on each);
        returns the previous handlers for :meth:`uninstall`."""
        signal.set_wakeup_fd(self._wakeup_w)
        return {s: signal.signal(s, self.forward) for s in _SUPERVISOR_SIGNALS}

    def uninstall(self, previous: dict) -> None:
        for s, handler in previous.items():
            signal.signal(s, handler)
        signal.set_wakeup_fd(-1)
        os.close(self._wakeup_r)
        os.close(self._wakeup_w)

    def deliver(self) -> None:
        """Send every API server alive the stop signals it lacks: one per SIGTERM/SIGINT the
        supervisor got, and one after a failure (main thread only)."""
        wanted = self.signals + (1 if self.failed else 0)
        for p in self.procs:
            while self._sent.get(p.pid, 0) < wanted and p.is_alive():
                self._sent[p.pid] = self._sent.get(p.pid, 0) + 1
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, STOP_SIGNAL)

    def stopping(self) -> bool:
        return self.signals > 0 or self.failed

    def start(self, process: mp.Process) -> None:
        """Start one API server with SIGTERM/SIGINT blocked in this thread, so the child
        inherits them blocked (it unblocks once it ignores them: none hits its bootstrap);
        then send it what it missed (:meth:`deliver`)."""
        old = signal.pthread_sigmask(signal.SIG_BLOCK, _SUPERVISOR_SIGNALS)
        try:
            process.start()
            self.procs.append(process)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
        self.deliver()

    def _fail(self, what: str, code) -> None:
        log.error("%s exited unexpectedly (exit code %s): stopping the server", what, code)
        self.failed = True
        self.deliver()

    def run(self, engine_proc: mp.Process, num_ready, announce) -> None:
        """Wait until every API server has exited, forwarding signals as they come; call
        ``announce()`` once all listen; after an unexpected exit of an API server or of the
        engine core, stop the others (:attr:`failed`)."""
        announced = False
        alive = list(self.procs)
        engine_watched = True
        while alive:
            self.deliver()
            sentinels = [p.sentinel for p in alive] + [self._wakeup_r]
            if engine_watched:
                sentinels.append(engine_proc.sentinel)
            wait(sentinels, timeout=0.2)
            with contextlib.suppress(BlockingIOError):
                os.read(self._wakeup_r, 512)
            for p in [p for p in alive if not p.is_alive()]:
                alive.remove(p)
                if not self.stopping():
                    self._fail(p.name, p.exitcode)
            if engine_watched and not engine_proc.is_alive():
                engine_watched = False
                if not self.stopping():
                    self._fail("the engine core", engine_proc.exitcode)
            if not announced and num_ready.value == len(self.procs) and not self.stopping():
                announced = True
                announce()

    def stop_leftovers(self, timeout: float = 10.0) -> None:
        """After an error in the supervisor itself: stop the API servers still running (their
        supervisor is alive, so nothing else would), killing those that do not exit."""
        left = [p for p in self.procs if p.is_alive()]
        if not left:
            return
        for p in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, STOP_SIGNAL)
        deadline = time.monotonic() + timeout
        for p in left:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(5)


def _hold_port(host: str, port: int) -> socket.socket:
    """The supervisor's socket on ``host:port``, bound (never listening) for the server's
    lifetime: a taken port fails at once, port 0 is resolved once, and while the engine loads no
    other server can take the port (no SO_REUSEADDR: only SO_REUSEPORT sockets of this user,
    the API servers', may join it). Connections from an earlier server left in TIME_WAIT block
    that; then the port is held with SO_REUSEADDR as a single server holds it.

    Raises:
        SystemExit: the address cannot be bound.
    """
    from server.http_server import listen_socket

    try:
        return listen_socket(host, port, reuse_port=True, reuse_addr=False)
    except SystemExit:
        if not _in_time_wait(port):  # another server has it (maybe bound, not listening yet)
            raise
        sock = listen_socket(host, port, reuse_port=True)  # SystemExit: truly taken
        log.info("port %d has connections in TIME_WAIT: held as a single server holds it", port)
        return sock


def _in_time_wait(port: int) -> bool:
    """Whether a TCP connection on local port ``port`` is in TIME_WAIT (Linux /proc/net)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if (
                len(fields) > 3
                and fields[3] == "06"
                and int(fields[1].rsplit(":", 1)[1], 16) == port
            ):
                return True
    return False


def _port_lock(port: int) -> socket.socket:
    """An abstract Unix socket named after ``port``, bound for this supervisor's lifetime (the
    kernel frees it when the process ends, however it ends).

    Raises:
        SystemExit: another supervisor holds it (serves with several API servers on the port).
    """
    lock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        lock.bind(f"\0qwen-serve-api-servers-port-{port}")
    except OSError:
        lock.close()
        raise SystemExit(
            f"python -m server: cannot listen on port {port}: another server with "
            "--api-server-count already serves on it (choose one with --port or QWEN_SERVE_PORT)"
        ) from None
    return lock


def run_api_servers(args: argparse.Namespace, config: EngineConfig) -> int:
    """Serve with ``args.api_server_count`` API-server processes and one engine core; returns
    the exit code: 0 after a signal's shutdown (also one during start-up), 1 after an API server
    or the engine core died unexpectedly, or one of them failed while shutting down.

    Raises:
        SystemExit: the address cannot be bound.
        RuntimeError: the engine process failed to start.
    """
    from engine.frontend.process_core import EngineProcess, StartupInterrupted
    from engine.frontend.tokenizer import Tokenizer

    count = int(args.api_server_count)
    hold = _hold_port(args.host, args.port)
    port = hold.getsockname()[1]
    lock = _port_lock(port)
    metrics_dir = tempfile.mkdtemp(prefix="qwen-serve-metrics-")
    supervisor = _Supervisor()
    previous = supervisor.install()
    try:
        # the API servers (spawned: they inherit this environment) import prometheus_client
        # with it set, which selects its multiprocess value files
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
        eos = Tokenizer(config.model).eos_token_ids
        if supervisor.stopping():
            raise StartupInterrupted("stopped before the engine started")
        engine = EngineProcess(config, eos, num_clients=count, should_stop=supervisor.stopping)
        ctx = mp.get_context("spawn")
        shared_connections = ctx.Value("q", 0)
        num_ready = ctx.Value("i", 0)
        for i in range(count):
            if supervisor.stopping():
                break
            supervisor.start(
                ctx.Process(
                    target=api_server_main,
                    name=f"api-server-{i}",
                    args=(
                        args,
                        config,
                        i,
                        engine.conns[i],
                        engine.limits,
                        port,
                        shared_connections,
                        num_ready,
                        metrics_dir,
                        os.getpid(),
                    ),
                )
            )
        engine.close_conns()  # each pipe is its API server's alone now (or no one's)

        def announce() -> None:
            log.info(
                "serving on http://%s:%d with %d API servers (pids %s; engine core pid %d)",
                args.host,
                port,
                count,
                ", ".join(str(p.pid) for p in supervisor.procs),
                engine.proc.pid,
            )

        supervisor.run(engine.proc, num_ready, announce)
        engine.join(ENGINE_STOP_TIMEOUT_S)  # it stops once the last API server has left it
        codes = [p.exitcode for p in supervisor.procs]
        log.info(
            "API servers exited (codes %s); engine core stopped (code %s)",
            codes,
            engine.proc.exitcode,
        )
        clean = all(c in (0, -STOP_SIGNAL) for c in codes)  # (stopped before uvicorn ran)
        clean = clean and engine.proc.exitcode == 0
        if not clean and not supervisor.failed:
            log.error("a process failed while shutting down (exit codes above)")
        return 1 if supervisor.failed or not clean else 0
    except StartupInterrupted as e:
        log.info("signal during start-up: %s", e)
        return 0
    finally:
        supervisor.stop_leftovers()
        supervisor.uninstall(previous)
        hold.close()
        lock.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)
