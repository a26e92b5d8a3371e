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
  ``server.http_protocol.SharedConnections``); the engine's own limits (``--max-num-seqs``, the
  KV cache) are the engine core's, shared by construction;
* signals: the API servers run in process groups of their own, so a terminal's Ctrl-C reaches
  only the supervisor, which forwards each SIGTERM/SIGINT it gets to every API server as a
  SIGTERM (the first starts their graceful shutdown, a second ends their requests at once, a
  third forces the quit: ``server.http_server.GracefulServer``). The engine core ignores signals
  and stops when the last API server has left it. An API server that dies unexpectedly stops
  the others and the supervisor exits 1 (a container restart policy brings the server back);
  an API server whose supervisor died shuts itself down.
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
import tempfile
import threading
import time
from multiprocessing.connection import wait

from engine.core.config import EngineConfig
from engine.core.limits import EngineLimits

log = logging.getLogger("server")

#: seconds the supervisor waits, after the last API server exited, for the engine core to stop
ENGINE_STOP_TIMEOUT_S = 30.0
#: seconds between an API server's checks that its supervisor is still alive
PARENT_CHECK_S = 1.0


def _watch_parent(parent_pid: int) -> None:
    """In an API server: start a graceful shutdown (SIGTERM to itself) once its supervisor is
    gone (the process was re-parented)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_CHECK_S)
        log.warning("the supervisor (pid %d) is gone: shutting down", parent_pid)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


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
) -> None:
    """Entry point of API server ``index``: serve HTTP on ``args.host:port`` in front of the
    engine core reached through ``conn`` (its pipe end), until a SIGTERM/SIGINT.

    Args:
        args: the parsed flags; config: the engine settings (the model directory resolved).
        limits: the engine's constants. shared_connections: the server-wide connection count
            (``multiprocessing.Value``). num_ready: a ``multiprocessing.Value`` each API server
            increments once it listens. metrics_dir: prometheus_client's multiprocess
            directory (PROMETHEUS_MULTIPROC_DIR is set to it in this process's environment).
    """
    os.setpgid(0, 0)  # a terminal's Ctrl-C goes to the supervisor alone, which forwards it
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s %(levelname)s %(name)s[api {index}]: %(message)s",
    )
    _watch_parent(os.getppid())
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

    def started() -> None:
        with num_ready.get_lock():
            num_ready.value += 1

    server.on_started = started
    server.run(sockets=[sock])


class _Supervisor:
    """Forwards signals to the API servers and watches them (see the module docstring)."""

    def __init__(self, procs: list[mp.Process]):
        self.procs = procs
        self.signals = 0
        self.failed = False

    def forward(self, sig, frame) -> None:
        """The signal handler: each signal becomes one SIGTERM to every API server alive."""
        self.signals += 1
        for p in self.procs:
            if p.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGTERM)

    def stopping(self) -> bool:
        return self.signals > 0 or self.failed

    def run(self, num_ready, announce) -> None:
        """Wait until every API server has exited; call ``announce()`` once all listen; after
        an unexpected exit, stop the others (:attr:`failed`)."""
        announced = False
        alive = list(self.procs)
        while alive:
            wait([p.sentinel for p in alive], timeout=0.2)
            for p in [p for p in alive if not p.is_alive()]:
                alive.remove(p)
                if not self.stopping():
                    log.error(
                        "%s exited unexpectedly (exit code %s): stopping the server",
                        p.name,
                        p.exitcode,
                    )
                    self.failed = True
                    self.forward(signal.SIGTERM, None)
            if not announced and num_ready.value == len(self.procs) and not self.stopping():
                announced = True
                announce()


def run_api_servers(args: argparse.Namespace, config: EngineConfig) -> int:
    """Serve with ``args.api_server_count`` API-server processes and one engine core; returns
    the exit code (0 after a signal's shutdown, 1 after an API server died unexpectedly).

    Raises:
        SystemExit: the address cannot be bound.
        RuntimeError: the engine process failed to start.
    """
    from engine.frontend.process_core import EngineProcess
    from engine.frontend.tokenizer import Tokenizer
    from server.http_server import listen_socket

    count = int(args.api_server_count)
    # bound (never listening) for the server's lifetime: a taken port fails now, port 0 is
    # resolved once, and the port stays ours; connections go only to the listening sockets
    hold = listen_socket(args.host, args.port, reuse_port=True)
    port = hold.getsockname()[1]
    metrics_dir = tempfile.mkdtemp(prefix="qwen-serve-metrics-")
    try:
        # the API servers (spawned: they inherit this environment) import prometheus_client
        # with it set, which selects its multiprocess value files
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
        eos = Tokenizer(config.model).eos_token_ids
        engine = EngineProcess(config, eos, num_clients=count, ignore_signals=True)
        ctx = mp.get_context("spawn")
        shared_connections = ctx.Value("q", 0)
        num_ready = ctx.Value("i", 0)
        procs = [
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
                ),
            )
            for i in range(count)
        ]
        supervisor = _Supervisor(procs)
        previous = {
            s: signal.signal(s, supervisor.forward) for s in (signal.SIGTERM, signal.SIGINT)
        }
        try:
            for p in procs:
                p.start()
            engine.close_conns()  # each pipe is its API server's alone now

            def announce() -> None:
                log.info(
                    "serving on http://%s:%d with %d API servers (pids %s; engine core pid %d)",
                    args.host,
                    port,
                    count,
                    ", ".join(str(p.pid) for p in procs),
                    engine.proc.pid,
                )

            supervisor.run(num_ready, announce)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        engine.join(ENGINE_STOP_TIMEOUT_S)  # it stops once the last API server has left it
        codes = [p.exitcode for p in procs]
        log.info("API servers exited (codes %s); engine core stopped", codes)
        return 1 if supervisor.failed else 0
    finally:
        hold.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)
