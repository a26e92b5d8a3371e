"""The slow-client guard of ``server/http_protocol.py`` over both HTTP parsers, on an in-process
uvicorn server with a small ASGI app (bodies over 1,000 bytes get the server's 413 before they
arrive): an upgrade offer on an ordinary POST keeps its body, the body left after an early 413
is not taken for header bytes (and, where the connection closes after the 413, is dropped
during a bounded lingering close instead of resetting it), a pipelined request neither cuts
the response before it nor escapes the body deadline, the header bound holds while a response
streams, and a header block split over several reads restarts its count with every request.
Found by review of the httptools protocol (uvicorn issue 2722 for the upgrade offer); h11 is
checked alike."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
import uvicorn

from server.app import BodySizeLimit
from server.http_protocol import guarded_protocol

# timing checks (deadlines of 1 and 1.5 s): run alone, in `make test`'s serial run
pytestmark = pytest.mark.serial

PARSERS = ["httptools", "h11"]
H2C = b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\n"


async def _app(scope, receive, send):
    """``/stream``: 30 chunks 0.1 s apart; any other path: ``b"<path> <body bytes>"``."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        return await send({"type": "lifespan.shutdown.complete"})
    if scope["path"] == "/slow":  # answers after 0.5 s
        await asyncio.sleep(0.5)
    if scope["path"] == "/stream":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for i in range(30):
            await send({"type": "http.response.body", "body": b"tok%d\n" % i, "more_body": True})
            await asyncio.sleep(0.1)
        return await send({"type": "http.response.body", "body": b""})
    body = b""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            break
    out = b"%s %d" % (scope["path"].encode(), len(body))
    headers = [(b"content-length", b"%d" % len(out))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": out})


class _Server:
    """The guard (1 s for headers, 1.5 s for a body, 16 KiB of incomplete headers, a lingering
    close of at most ``linger_s``, ``linger_idle_s`` without a byte) around
    ``_app`` behind the server's 1,000-byte body limit, on a loopback port."""

    def __init__(
        self,
        http: str,
        header_s: float = 1.0,
        keep_alive_s: int = 5,
        body_limit: int = 1000,
        linger_s: float = 30.0,
        linger_idle_s: float = 5.0,
    ):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        protocol = guarded_protocol(
            header_s,
            1.5,
            http=http,
            max_header_bytes=16384,
            linger_s=linger_s,
            linger_idle_s=linger_idle_s,
        )
        config = uvicorn.Config(
            BodySizeLimit(_app, body_limit),
            http=protocol,
            log_level="critical",
            timeout_keep_alive=keep_alive_s,
            timeout_graceful_shutdown=1,
            h11_max_incomplete_event_size=16384,
        )
        self.server = uvicorn.Server(config)

    async def __aenter__(self):
        self.task = asyncio.create_task(self.server.serve(sockets=[self.sock]))
        while not self.server.started:
            await asyncio.sleep(0.01)
        return self.sock.getsockname()

    async def __aexit__(self, *exc):
        self.server.should_exit = True
        await self.task


async def _exchange(
    http: str, chunks: list[bytes], read_s: float, pause: float = 0.2, **server
) -> tuple[bytes, bool]:
    """Send ``chunks`` (``pause`` s apart) on one connection; return what came back within
    ``read_s`` s and whether the server kept the connection open."""
    data, still_open = b"", True
    async with _Server(http, **server) as addr:
        reader, writer = await asyncio.open_connection(*addr)
        try:
            for chunk in chunks:
                writer.write(chunk)
                await writer.drain()
                await asyncio.sleep(pause)
            loop = asyncio.get_running_loop()
            end = loop.time() + read_s
            while (left := end - loop.time()) > 0:
                got = await asyncio.wait_for(reader.read(65536), left)
                if not got:
                    still_open = False
                    break
                data += got
        except asyncio.TimeoutError:
            pass
        except ConnectionError:
            still_open = False
        finally:
            writer.close()
    return data, still_open


@pytest.mark.parametrize("http", PARSERS)
def test_an_upgrade_offer_on_a_post_keeps_its_body(http):
    """Java clients offer h2c on ordinary POSTs; the server never upgrades, so the request is
    served with its body, and the next request on the connection too."""
    head = b"POST /p HTTP/1.1\r\nHost: x\r\n" + H2C + b"Content-Length: 7\r\n\r\n"
    for chunks in ([head, b"abcdefg"], [head + b"abcdefg"]):
        chunks = [*chunks, b"GET /next HTTP/1.1\r\nHost: x\r\n\r\n"]
        data, _ = asyncio.run(_exchange(http, chunks, read_s=1.0))
        assert b"/p 7" in data and b"/next 0" in data and b" 400 " not in data, data


@pytest.mark.parametrize("http", PARSERS)
def test_the_body_after_an_early_413_is_not_taken_for_headers(http):
    """A 40 KB body answered 413 before it arrives: the rest of it is read and dropped, the
    413 reaches the client, and the connection serves the next request."""
    chunks = [b"POST /big HTTP/1.1\r\nHost: x\r\nContent-Length: 40000\r\n\r\n"]
    chunks += [b"a" * 10000] * 4 + [b"GET /next HTTP/1.1\r\nHost: x\r\n\r\n"]
    data, _ = asyncio.run(_exchange(http, chunks, read_s=0.5, pause=0.05))
    assert b" 413 " in data and b"/next 0" in data and b" 400 " not in data, data


@pytest.mark.parametrize("http", PARSERS)
def test_a_pipelined_post_neither_cuts_the_stream_before_it_nor_escapes_its_deadline(http):
    """GET /stream (3 s) with a POST pipelined behind it: the stream ends whole (the POST's
    body deadline starts with its request, not while it waits); a POST whose body never comes
    behind a short GET is dropped with a 408 within its body deadline."""
    chunks = [
        b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n"
        b"POST /b HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nabcde"
    ]
    data, _ = asyncio.run(_exchange(http, chunks, read_s=4.0))
    assert b"tok29" in data and b" 408 " not in data and b"/b 5" in data, data[-300:]
    chunks = [
        b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n"
        b"POST /b HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n"
    ]
    data, still_open = asyncio.run(_exchange(http, chunks, read_s=4.0))
    assert b"/a 0" in data and b" 408 " in data and not still_open, data


@pytest.mark.parametrize("http", PARSERS)
def test_incomplete_headers_are_bounded_while_a_response_streams(http):
    """A request line that never ends, written while the response before it streams: the
    server stops it at the header bound (400 and close, or h11's paused reads) instead of
    buffering it: at most a few MB go through in 2 s."""

    async def push() -> int:
        async with _Server(http) as addr:
            reader, writer = await asyncio.open_connection(*addr)
            writer.write(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\nGET /")
            await asyncio.sleep(0.2)
            loop, sent = asyncio.get_running_loop(), 0
            end = loop.time() + 2.0
            try:
                while loop.time() < end:
                    writer.write(b"a" * (1 << 20))
                    await asyncio.wait_for(writer.drain(), end - loop.time())
                    sent += 1
            except (asyncio.TimeoutError, ConnectionError):
                pass
            writer.close()
            return sent

    assert asyncio.run(push()) < 16  # MB accepted


@pytest.mark.parametrize("http", PARSERS)
def test_a_header_block_in_several_reads_is_bounded_per_request(http):
    """12 KB of headers in two writes, twice on one kept-alive connection, are served (the
    count of incomplete header bytes restarts with each request; 24 KB together would be past
    16 KiB); 24 KB of one request in three writes get the 400."""
    pad = b"X-Pad: " + b"a" * 6000 + b"\r\n"
    one = [b"GET /h HTTP/1.1\r\nHost: x\r\n" + pad, pad + b"\r\n"]
    data, still_open = asyncio.run(_exchange(http, one + one, read_s=0.5, pause=0.1))
    assert data.count(b"/h 0") == 2 and still_open, data
    big = [b"GET /h HTTP/1.1\r\nHost: x\r\n" + pad, pad, pad + pad]
    data, still_open = asyncio.run(_exchange(http, big, read_s=1.0, pause=0.1))
    assert b" 400 " in data and b"invalid_http_request" in data and not still_open, data


@pytest.mark.parametrize("http", PARSERS)
def test_a_pipelined_request_whose_header_end_spans_two_reads_is_served(http):
    chunks = [b"GET /a HTTP/1.1\r\nHost: x\r\n\r\nGET /b HTTP/1.1\r\nHost: x\r\n", b"\r\n"]
    data, _ = asyncio.run(_exchange(http, chunks, read_s=1.0))
    assert b"/a 0" in data and b"/b 0" in data and b" 400 " not in data, data


@pytest.mark.parametrize("http", PARSERS)
def test_a_body_that_stops_after_an_early_413_has_a_deadline(http):
    """A declared 100 MB body answered 413 at once, then the client sends a byte and stops:
    the connection is dropped within the deadlines instead of holding its slot."""
    head = b"POST /big HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999\r\n\r\n"
    data, still_open = asyncio.run(_exchange(http, [head, b"a"], read_s=3.5))
    assert data.startswith(b"HTTP/1.1 413") and not still_open, data


@pytest.mark.parametrize("http", PARSERS)
def test_headers_slower_than_the_keep_alive_wait_but_within_their_deadline_are_served(http):
    """Keep-alive 1 s, header deadline 3 s: a next request whose first bytes come 0.5 s after
    the response and the rest 1 s later is answered (its first byte ended the keep-alive)."""
    chunks = [b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n", b"GET /c HTTP/1.1\r\n", b"Host: x\r\n\r\n"]
    data, _ = asyncio.run(
        _exchange(http, chunks, read_s=1.0, pause=0.6, header_s=3.0, keep_alive_s=1)
    )
    assert b"/a 0" in data and b"/c 0" in data, data


@pytest.mark.parametrize("http", PARSERS)
def test_slow_pipelined_headers_do_not_cut_the_stream_before_them(http):
    """Part of a next request's headers arrives while /stream (3 s) runs, the header deadline
    being 1 s: the stream ends whole, without a 408 inside it."""
    chunks = [b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n", b"GET /b HTTP/1.1\r\n"]
    data, _ = asyncio.run(_exchange(http, chunks, read_s=4.5))
    assert b"tok29" in data and b" 408 " not in data.split(b"tok29")[0], data[-300:]


@pytest.mark.parametrize("http", PARSERS)
def test_a_malformed_pipelined_request_is_not_answered_in_place_of_the_one_before(http):
    """GET /slow (answered after 0.5 s) with a malformed request behind it: the first
    response on the connection is never the 400 (the client would take it for /slow's)."""
    chunks = [b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\nBAD\r\n\r\n"]
    data, _ = asyncio.run(_exchange(http, chunks, read_s=1.5))
    assert not data.startswith(b"HTTP/1.1 400"), data
    assert b" 400 " not in data or data.index(b"/slow 0") < data.index(b" 400 "), data


@pytest.mark.parametrize("http", PARSERS)
def test_empty_lines_before_a_request_line_do_not_lift_the_header_bound(http):
    """Empty lines, then a request line that never ends: closed at the bound (httptools: with
    the 400; h11 refuses the empty lines themselves and closes), not buffered on."""
    chunks = [b"\r\n\r\nGET /" + b"a" * 4000] + [b"a" * 4000] * 5
    data, still_open = asyncio.run(_exchange(http, chunks, read_s=1.0, pause=0.05))
    assert not still_open, data
    if http == "httptools":
        assert b" 400 " in data, data


async def _send_all_then_read(
    http: str, chunks: list[bytes], read_s: float, pause: float = 0.0, expect_100: bool = False
) -> tuple[bytes, str]:
    """As Python's urllib: a blocking socket (in a thread) sends ``chunks`` (``pause`` s
    apart; with ``expect_100`` the first, the headers, then the rest once ``100 Continue``
    came; what comes meanwhile is kept too), then reads until the server closes (or ``read_s``
    s pass); returns what came back and how the connection ended ("closed", "open", or the
    reset's exception name)."""

    def client(addr) -> tuple[bytes, str]:
        data = b""
        with socket.create_connection(addr, timeout=read_s) as sock:
            try:
                if expect_100:
                    sock.sendall(chunks[0])
                    data = sock.recv(65536)
                    assert data.startswith(b"HTTP/1.1 100"), data
                for chunk in chunks[1:] if expect_100 else chunks:
                    sock.sendall(chunk)
                    time.sleep(pause)
                    try:  # what came meanwhile (b"": the server's half-close)
                        data += sock.recv(65536, socket.MSG_DONTWAIT)
                    except BlockingIOError:
                        pass
                while got := sock.recv(65536):
                    data += got
                return data, "closed"
            except TimeoutError:
                return data, "open"
            except OSError as e:  # ConnectionResetError, BrokenPipeError
                return data, type(e).__name__

    async with _Server(http, linger_s=2.0) as addr:
        return await asyncio.to_thread(client, addr)


@pytest.mark.parametrize("http", PARSERS)
@pytest.mark.parametrize("version", ["HTTP/1.1", "HTTP/1.0"])
def test_a_whole_body_sent_before_reading_on_a_closing_connection_gets_its_413(http, version):
    """A client that sends its whole oversized body before it reads (Python's urllib, which
    sends ``Connection: close``; or HTTP/1.0) gets the early 413, not a connection reset: the
    server half-closes after the response and drops the rest of the body (closing with it
    unread reset the connection, and the client lost the 413)."""
    body = b"a" * (16 << 20)  # more than the sockets buffer: unread when the server answers
    head = b"POST /big %s\r\nHost: x\r\nConnection: close\r\n" % version.encode()
    head += b"Content-Length: %d\r\n\r\n" % len(body)
    data, end = asyncio.run(_send_all_then_read(http, [head + body], read_s=10.0))
    assert data.startswith(b"HTTP/1.1 413") and end == "closed", (end, data[:200])


@pytest.mark.parametrize("http", PARSERS)
def test_a_chunked_body_sent_after_100_continue_gets_its_413(http):
    """``Expect: 100-continue`` with a chunked body on ``Connection: close``: the server asks
    for the body (its size is not declared), stops reading it past the limit and answers 413;
    the client, still sending, gets the 413 and a clean close, not a reset."""
    head = b"POST /big HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
    head += b"Expect: 100-continue\r\nTransfer-Encoding: chunked\r\n\r\n"
    chunk = b"%x\r\n%s\r\n" % (1 << 20, b"a" * (1 << 20))
    chunks = [head] + [chunk] * 16 + [b"0\r\n\r\n"]
    data, end = asyncio.run(_send_all_then_read(http, chunks, read_s=10.0, expect_100=True))
    assert b"HTTP/1.1 413" in data and end == "closed", (end, data[:300])


@pytest.mark.parametrize("http", PARSERS)
def test_a_lingering_close_is_bounded(http):
    """An early 413 on ``Connection: close`` for a declared 100 MB body that the client keeps
    trickling: the server drops what comes and closes at its linger bound (2 s here), not at
    the end of the body."""
    head = b"POST /big HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
    head += b"Content-Length: 99999999\r\n\r\n"
    t0 = time.monotonic()
    data, end = asyncio.run(
        _send_all_then_read(http, [head] + [b"a" * 1000] * 100, read_s=10.0, pause=0.05)
    )
    assert data.startswith(b"HTTP/1.1 413") and end != "open", (end, data[:200])
    assert time.monotonic() - t0 < 4.5


@pytest.mark.parametrize("http", PARSERS)
def test_a_quiet_lingering_connection_is_dropped_at_the_idle_bound(http):
    """The early 413 on ``Connection: close``, then the client neither sends its body nor
    closes: the server drops the connection (its slot) at the idle bound (0.5 s here), not at
    the whole linger bound (30 s)."""
    head = b"POST /big HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
    head += b"Content-Length: 99999999\r\n\r\n"

    async def run():
        srv = _Server(http, linger_idle_s=0.5)
        async with srv as addr:
            reader, writer = await asyncio.open_connection(*addr)
            writer.write(head)
            data = await asyncio.wait_for(reader.read(), 2.0)  # to the server's half-close
            open_before = len(srv.server.server_state.connections)
            await asyncio.sleep(1.5)
            open_after = len(srv.server.server_state.connections)
            writer.close()
            return data, open_before, open_after

    data, open_before, open_after = asyncio.run(run())
    assert data.startswith(b"HTTP/1.1 413") and (open_before, open_after) == (1, 0), (
        open_before,
        open_after,
        data[:100],
    )


@pytest.mark.parametrize("http", PARSERS)
def test_a_closing_request_that_waits_for_100_continue_gets_its_413_at_once(http):
    """``Expect: 100-continue`` with a declared oversized body: the 413 comes at once, without
    ``100 Continue`` (the client then sends no body), and the connection closes."""
    head = b"POST /big HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
    head += b"Expect: 100-continue\r\nContent-Length: 5000\r\n\r\n"
    data, end = asyncio.run(_send_all_then_read(http, [head], read_s=2.0))
    assert data.startswith(b"HTTP/1.1 413") and end == "closed", (end, data)


@pytest.mark.parametrize("http", PARSERS)
def test_a_connection_quiet_after_an_early_413_and_its_body_is_closed(http):
    """413 before the body, then the whole body, then nothing: the keep-alive wait (1 s)
    applies again once the body is in, so the connection does not stay open untimed."""
    head = b"POST /big HTTP/1.1\r\nHost: x\r\nContent-Length: 2000\r\n\r\n"
    data, still_open = asyncio.run(_exchange(http, [head, b"a" * 2000], read_s=4.0, keep_alive_s=1))
    assert data.startswith(b"HTTP/1.1 413") and not still_open, data


@pytest.mark.parametrize("http", PARSERS)
def test_an_upgrade_header_last_in_the_block_is_dropped_cleanly(http):
    head = b"POST /p HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nContent-Length: 2\r\n"
    data, _ = asyncio.run(_exchange(http, [head + b"Upgrade: h2c\r\n\r\n{}"], read_s=1.0))
    assert b"/p 2" in data and b" 400 " not in data, data


@pytest.mark.parametrize("http", PARSERS)
def test_a_request_beginning_after_a_large_body_in_one_read_is_not_over_counted(http):
    """A 20 KB body and the first line of the next request in one read: the bytes of the read
    in which a request begins are not counted against its header bound."""
    chunks = [
        b"POST /p HTTP/1.1\r\nHost: x\r\nContent-Length: 20000\r\n\r\n"
        + b"a" * 20000
        + b"GET /next HTTP/1.1\r\n",
        b"Host: x\r\n\r\n",
    ]
    data, _ = asyncio.run(_exchange(http, chunks, read_s=1.0, body_limit=100000))
    assert b"/p 20000" in data and b"/next 0" in data and b" 400 " not in data, data
