"""The HTTP server of one API-server process: uvicorn with graceful SIGTERM
(:class:`GracefulServer`), its listening socket (:func:`listen_socket`) and its configuration
from the parsed flags (:func:`make_server`). Used by ``python -m server`` (``server.__main__``),
by each API server of ``--api-server-count N`` (``server.api_servers``) and by the front-end
benchmarks."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import socket
import threading

import uvicorn

from server.signal_repeats import SignalRepeats

log = logging.getLogger("server")


#: seconds uvicorn waits past --graceful-timeout before it cancels the tasks still running: the
#: app ends its requests at the timeout itself (error event + [DONE]); this backstop only hits a
#: response that cannot be written (a client that stopped reading)
SHUTDOWN_BACKSTOP_S = 5.0


class GracefulServer(uvicorn.Server):
    """uvicorn's server, except that a SIGTERM/SIGINT ending in a graceful shutdown exits 0, that
    the app ends its own in-flight requests when the graceful timeout expires, and that a second
    signal ends them at once.

    On SIGTERM/SIGINT uvicorn stops accepting connections and waits for the open ones to finish;
    past its ``timeout_graceful_shutdown`` it cancels their tasks, which cuts streams without an
    error or ``[DONE]`` and logs a CancelledError traceback per request. Here
    ``on_graceful_timeout`` runs ``graceful_timeout`` seconds after shutdown starts
    (:meth:`ServerContext.end_in_flight`: streams end with an error event and ``[DONE]``, the
    engine aborts the requests), and uvicorn's own timeout is set
    :data:`SHUTDOWN_BACKSTOP_S` later, so the connections close before it and the lifespan
    shutdown runs normally.

    A second signal during the shutdown (a second Ctrl-C, which uvicorn's "CTRL+C to force
    quit" invites) runs ``on_graceful_timeout`` at once instead of uvicorn's force quit (which
    would skip the hook, cut the streams and skip the lifespan shutdown): the requests end as
    above and the server finishes shutting down cleanly, promptly. Only a third signal forces
    the quit (uvicorn's ``force_exit``: no more waiting, no lifespan shutdown). Without a hook,
    signals behave as in uvicorn.

    uvicorn re-raises the captured signal after shutting down, which ends the process with
    -SIGTERM; by then in-flight requests have finished (or were ended), so it is a normal exit:
    the captured signals are dropped and the process exits 0.
    """

    def __init__(
        self,
        config: uvicorn.Config,
        graceful_timeout=None,
        on_graceful_timeout=None,
        signal_repeats: SignalRepeats | None = None,
    ):
        """
        Args:
            config: uvicorn's configuration; its ``timeout_graceful_shutdown`` (seconds) is when
                uvicorn cancels the tasks still running, the backstop.
            graceful_timeout: seconds from the start of the shutdown until
                ``on_graceful_timeout`` runs (None: it runs only on a second signal).
            on_graceful_timeout: ends the in-flight requests; called once, on the event loop,
                as ``on_graceful_timeout(early)``: ``early`` is False when ``graceful_timeout``
                expired, True when a second signal came first. None: no hook (uvicorn's
                behaviour, a second SIGINT forces the quit).
            signal_repeats: tells a SIGTERM/SIGINT that is a copy of the one just handled
                (:class:`~server.signal_repeats.SignalRepeats`; None: a new one). Other exit
                signals (an API server's stop signal, which its supervisor sends once per
                signal counted) are never taken for copies.
        """
        super().__init__(config)
        self.graceful_timeout = graceful_timeout
        self.on_graceful_timeout = on_graceful_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ended = False  # the hook ran
        self._signals_in_shutdown = 0
        # make's copy of a SIGTERM is not a second signal
        self._repeats = signal_repeats if signal_repeats is not None else SignalRepeats()
        #: called once the server listens (set by ``server.api_servers`` to report readiness)
        self.on_started = None
        #: the signals that shut the server down (an API server of several: the supervisor's
        #: SIGUSR1 alone) and those ignored while it serves
        self.exit_signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)
        self.ignored_signals: tuple[int, ...] = ()

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and self.on_started is not None:
            self.on_started()

    def _end_in_flight(self, early: bool) -> None:
        if self._ended:
            return
        self._ended = True
        if early:
            log.warning(
                "second shutdown signal: ending the in-flight requests now "
                "(a third signal forces the quit)"
            )
        self.on_graceful_timeout(early)

    def handle_exit(self, sig, frame) -> None:
        """The signal handler (run by Python in the main thread, between two bytecodes of
        whatever runs there, so it only sets flags and hands work to the loop). The same
        SIGTERM/SIGINT again within :data:`~server.signal_repeats.REPEAT_WINDOW_S` is one
        signal delivered twice and is dropped."""
        if sig in (signal.SIGTERM, signal.SIGINT) and self._repeats.is_repeat(sig):
            return
        if self.on_graceful_timeout is None or not self.should_exit or self._loop is None:
            first = self.on_graceful_timeout is not None and not self.should_exit
            super().handle_exit(sig, frame)
            if first and self._loop is not None:  # uvicorn's own line says CTRL+C force-quits
                self._loop.call_soon_threadsafe(
                    log.info,
                    "shutting down: in-flight requests get %s; a second signal (Ctrl-C) ends "
                    "them at once, a third forces the quit",
                    "until they finish"
                    if self.graceful_timeout is None
                    else f"{self.graceful_timeout:g} s (--graceful-timeout)",
                )
            return
        self._signals_in_shutdown += 1
        if self._signals_in_shutdown == 1:  # (nothing to do if the timeout ended them already)
            self._loop.call_soon_threadsafe(self._end_in_flight, True)
        else:
            self.force_exit = True
            self._loop.call_soon_threadsafe(log.warning, "another signal: forcing the quit")

    async def shutdown(self, sockets=None) -> None:
        timer = None
        if self.on_graceful_timeout is not None and self.graceful_timeout is not None:
            timer = asyncio.get_running_loop().call_later(
                self.graceful_timeout, self._end_in_flight, False
            )
        try:
            await super().shutdown(sockets)
        finally:
            if timer is not None:
                timer.cancel()

    @contextlib.contextmanager
    def capture_signals(self):
        """While serving: :attr:`exit_signals` run :meth:`handle_exit`, :attr:`ignored_signals`
        are ignored; the previous handlers come back afterwards. uvicorn's version would
        re-raise the captured signals at the end; here the process goes on (exit 0)."""
        if threading.current_thread() is not threading.main_thread():
            yield  # signals can be handled only in the main thread
            return
        previous = {s: signal.signal(s, self.handle_exit) for s in self.exit_signals}
        previous.update({s: signal.signal(s, signal.SIG_IGN) for s in self.ignored_signals})
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


def listen_socket(
    host: str, port: int, reuse_port: bool = False, reuse_addr: bool = True
) -> socket.socket:
    """A TCP socket bound to ``host:port`` (uvicorn listens on it), so that an address in use
    or not available ends start-up at once, before the engine loads its weights.

    ``reuse_port``: set SO_REUSEPORT, so that several API-server processes each listen on a
    socket of their own at the same address and the kernel spreads the connections over them
    (``server.api_servers``; Linux allows it only to sockets of the same user).
    ``reuse_addr`` (SO_REUSEADDR, on by default so that a restart is not refused by the last
    run's connections in TIME_WAIT): off, no other server without SO_REUSEPORT can bind the
    port while this socket holds it.

    Raises:
        SystemExit: the address cannot be bound (one line naming it and the reason).
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as e:
        raise SystemExit(f"python -m server: cannot listen on {host}:{port}: {e}") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    if reuse_addr:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise SystemExit(
            f"python -m server: cannot listen on {host}:{port}: {e.strerror or e} "
            "(another server on that port? choose one with --port or QWEN_SERVE_PORT)"
        ) from None
    return sock


def make_server(
    app, args: argparse.Namespace, on_graceful_timeout=None, shared_connections=None
) -> GracefulServer:
    """The uvicorn server for ``app`` with the parsed flags (also used by
    bench/frontend_latency.py): the ``--http`` protocol (httptools or h11) with request read
    deadlines (:mod:`server.http_protocol`), the keep-alive timeout, the connection cap and the
    header size limit. ``on_graceful_timeout(early)`` (the app's
    :meth:`ServerContext.end_in_flight`) runs when --graceful-timeout expires during a shutdown,
    or at a second signal
    (:class:`GracefulServer`); uvicorn's own timeout, which cancels
    the requests' tasks, comes :data:`SHUTDOWN_BACKSTOP_S` later (without a hook, at the
    timeout itself). ``shared_connections``: the ``multiprocessing.Value`` in which several
    API servers count their served connections (``server.http_protocol.ConnectionSlots``), so
    that --limit-concurrency limits the whole server."""
    from server.http_protocol import ConnectionSlots, guarded_protocol

    timeout = float(args.graceful_timeout)
    return GracefulServer(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=timeout
            + (SHUTDOWN_BACKSTOP_S if on_graceful_timeout is not None else 0.0),
            http=guarded_protocol(
                float(args.timeout_request_header),
                float(args.timeout_request_body),
                ConnectionSlots(int(args.limit_concurrency), shared_connections),
                http=args.http,
                max_header_bytes=int(args.h11_max_incomplete_event_size),
            ),
            timeout_keep_alive=int(args.timeout_keep_alive),
            h11_max_incomplete_event_size=int(args.h11_max_incomplete_event_size),
        ),
        graceful_timeout=timeout,
        on_graceful_timeout=on_graceful_timeout,
    )
