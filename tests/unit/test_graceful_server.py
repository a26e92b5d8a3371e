"""GracefulServer's signal handling during a shutdown, without a server process."""

from __future__ import annotations

import asyncio
import signal

import uvicorn

from server.http_server import GracefulServer
from server.signal_repeats import SignalRepeats

#: the clock the servers' SignalRepeats read (seconds)
NOW = [0.0]


def _server(hook=None) -> GracefulServer:
    return GracefulServer(
        uvicorn.Config(app=None),
        graceful_timeout=60,
        on_graceful_timeout=hook,
        signal_repeats=SignalRepeats(window_s=0.1, clock=lambda: NOW[0]),
    )


def _signals(server: GracefulServer, sigs: list[int], apart_s: float = 1.0) -> None:
    """Deliver ``sigs`` ``apart_s`` seconds apart (a person's signals: 1 s)."""

    async def run():
        server._loop = asyncio.get_running_loop()
        for sig in sigs:
            NOW[0] += apart_s
            server.handle_exit(sig, None)
            await asyncio.sleep(0)  # the loop runs what the handler handed it

    asyncio.run(run())


def test_a_signal_delivered_twice_is_one_signal():
    """A SIGTERM to make's process group arrives from the kernel and again from make, within
    milliseconds: one signal (the graceful timeout is kept); a person's second signal later
    still ends the requests. An API server's stop signal is never taken for a copy."""
    calls = []
    server = _server(calls.append)
    _signals(server, [signal.SIGTERM, signal.SIGTERM], apart_s=0.005)
    assert server.should_exit and calls == []
    _signals(server, [signal.SIGTERM])
    assert calls == [True]
    stopper = _server(calls.append)
    stopper.exit_signals = (signal.SIGUSR1,)
    _signals(stopper, [signal.SIGUSR1, signal.SIGUSR1], apart_s=0.005)
    assert calls == [True, True]  # the supervisor's two stops are two


def test_second_signal_ends_in_flight_requests_and_a_third_forces():
    calls = []
    server = _server(calls.append)
    _signals(server, [signal.SIGINT])
    assert server.should_exit and not server.force_exit and calls == []
    _signals(server, [signal.SIGINT])
    assert calls == [True] and not server.force_exit  # ended at once, shutdown continues
    _signals(server, [signal.SIGINT])
    assert calls == [True] and server.force_exit


def test_second_sigterm_also_ends_in_flight_requests():
    calls = []
    server = _server(calls.append)
    _signals(server, [signal.SIGTERM, signal.SIGTERM])
    assert calls == [True] and not server.force_exit


def test_the_hook_runs_once_when_the_timeout_and_a_signal_both_come():
    calls = []
    server = _server(calls.append)
    server._end_in_flight(False)  # the graceful timeout expired
    _signals(server, [signal.SIGINT, signal.SIGINT])  # then a second signal: nothing to end
    assert calls == [False] and not server.force_exit
    _signals(server, [signal.SIGINT])  # a third still forces
    assert server.force_exit


def test_without_a_hook_signals_behave_as_in_uvicorn():
    server = _server()
    _signals(server, [signal.SIGTERM, signal.SIGTERM])
    assert server.should_exit and not server.force_exit
    _signals(server, [signal.SIGINT])
    assert server.force_exit


def test_exit_signals_and_ignored_signals_while_serving():
    """An API server of several: only the supervisor's SIGUSR1 shuts it down; a SIGTERM that
    reaches it directly is ignored; the previous handlers come back afterwards."""
    server = _server(lambda early: None)
    server.exit_signals = (signal.SIGUSR1,)
    server.ignored_signals = (signal.SIGTERM,)
    seen: list[int] = []
    before = signal.signal(signal.SIGTERM, lambda sig, frame: seen.append(sig))
    try:
        outer = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)
        with server.capture_signals():
            signal.raise_signal(signal.SIGTERM)  # ignored (not even the handler outside sees it)
            assert not server.should_exit
            signal.raise_signal(signal.SIGUSR1)
            assert server.should_exit
        assert seen == []
        assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)) == outer
    finally:
        signal.signal(signal.SIGTERM, before)


def test_the_server_runs_on_uvloop():
    """uvloop is a dependency, and the server built from the parsed flags runs its event loop
    on it (uvicorn's "auto" loop), as every GPU benchmark of the server did."""
    import uvloop

    from server.__main__ import build_parser
    from server.http_server import make_server

    server = make_server(None, build_parser().parse_args(["--port", "0"]))
    loop = server.config.get_loop_factory()()
    try:
        assert isinstance(loop, uvloop.Loop)
    finally:
        loop.close()


def test_the_server_parses_http_with_httptools_unless_asked_for_h11():
    """httptools is a dependency and ``--http auto`` (the default) serves on it, the guard's
    subclass of uvicorn's HttpToolsProtocol; ``--http h11`` keeps the pure-Python parser with the
    same guard; an unknown parser is refused by name."""
    import pytest
    from uvicorn.protocols.http.h11_impl import H11Protocol
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from server.__main__ import build_parser
    from server.http_protocol import protocol_base
    from server.http_server import make_server

    for flags, base in (([], HttpToolsProtocol), (["--http", "h11"], H11Protocol)):
        server = make_server(None, build_parser().parse_args(["--port", "0", *flags]))
        cls = server.config.http
        assert issubclass(cls, base) and cls is not base, (flags, cls)
    with pytest.raises(ValueError, match="unknown HTTP parser 'h2'"):
        protocol_base("h2")
