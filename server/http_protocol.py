"""uvicorn's HTTP protocols (httptools, or h11) with deadlines for reading a request
(slow-client guard), a header size bound and the connection cap.

The parser is uvicorn's choice for ``--http auto``: httptools (llhttp, in C) where it is
installed, as in ``uvicorn[standard]``, which vLLM and SGLang serve on; h11 (pure Python)
otherwise, or with ``--http h11``. The HTTP process pays the protocol's cost for every streamed
token (one SSE chunk each): the protocol's own code took 16.6 % of the loop's CPU time with h11
and 9.2 % with httptools in ``bench/frontend_tokens.py`` on the CPU, and on the H200 the p99
inter-token latency at concurrency 64 fell from 22.7 to 12.4 ms with one API server
(docs/benchmarks.md, 2026-12-05, seventh session).

uvicorn bounds the idle time between requests (``timeout_keep_alive``) and, with
``limit_concurrency``, answers 503 past a number of connections, but nothing bounds how long a
client may take to send a request: its keep-alive timer is cancelled by every byte received, and
a connection that has sent nothing, or sends its headers a byte at a time (slowloris), is held
forever -- and counts against ``limit_concurrency``, so a few hundred such sockets lock everyone
out. ASGI middleware cannot help: the app is called only once the headers are complete.

:func:`guarded_protocol` subclasses the chosen protocol class
(:class:`uvicorn.protocols.http.httptools_impl.HttpToolsProtocol` or
:class:`uvicorn.protocols.http.h11_impl.H11Protocol`; both keep the request in ``self.cycle``
and parse in ``data_received``) with two deadlines (as nginx's ``client_header_timeout`` /
``client_body_timeout`` and Apache's ``mod_reqtimeout``, but absolute rather than per read, so
trickling bytes does not extend them):

* headers: from the connection's start, or from the first byte of the next request on a
  keep-alive connection, the request line and headers must be complete within
  ``header_timeout`` seconds;
* body: from the end of the headers, the body must be complete within ``body_timeout`` seconds.

On expiry the client gets ``408 Request Timeout`` (an OpenAI error body) and the connection is
closed; an app waiting for the rest of the body sees a disconnect. A request that has been read
is never timed: responses (streams included) take as long as they take.

Header size: h11 refuses a request line + headers still incomplete past
``h11_max_incomplete_event_size`` bytes after a read; llhttp has no such bound, so with httptools
the guard holds each request's header block until it is complete (``_header_block``) and applies
the same bound (``max_header_bytes``) to what it holds. Either way the client gets ``400`` with
an OpenAI error body, as for anything the parser refuses. The held block is also parsed without
its ``Upgrade`` lines: this server never upgrades, and llhttp, offered an upgrade on a request
with a body (Java clients offer ``h2c`` on ordinary POSTs), stops parsing at the headers and
the body is lost (uvicorn issue 2722).

Pipelined requests: a request's body deadline starts when its request starts (h11 parses a
pipelined request only when the response before it is complete; httptools parses it at once and
queues it), so a queued request neither times out while it waits nor escapes the deadline once
it runs; a 400 for a request that cannot be parsed is written only where no response is under
way.

Lingering close: a response may come before its request's body (a 413 from the declared
size, a 401 from the headers). When the connection then closes (``Connection: close``, as
Python's ``urllib`` sends, or HTTP/1.0, or h11's rule for an unread body), closing the socket
with body bytes unread resets it (TCP RST, RFC 9293 3.6.1), and a client that sends its whole
body before it reads loses the response. So the guard half-closes instead (the response, then
FIN), reads and drops what still comes, and closes when the client does, after
:data:`LINGER_IDLE_S` without a byte, or after :data:`LINGER_S` in all (:func:`guarded_protocol`'s
``linger_idle_s`` and ``linger_s``; nginx's ``lingering_close``); at those bounds the connection
is aborted (reset), so a client that also stops reading cannot hold it open.

The connection cap (``--limit-concurrency N``) is admission per connection
(:class:`ConnectionSlots`): the first N open connections are served; a connection opened while N
are open gets ``503`` (an OpenAI error body, ``connection: close``) for its request and is
closed. uvicorn's own ``limit_concurrency`` is not used: it compares the open connections,
the asking one included, with the limit at every request, so at most N - 1 connections are
served and a burst of more than N new connections gets 503 on every one of them, and its
503 is plain text. With several API-server processes (``--api-server-count``) the slots are one
count shared by the processes, so the cap stays one limit for the whole server.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("server.http")

#: the ``--http`` choices: uvicorn's names of its HTTP/1.1 protocol implementations
HTTP_PARSERS = ("auto", "httptools", "h11")
#: seconds a refused connection (over --limit-concurrency) that sends nothing waits for its 503
REFUSE_WAIT_S = 1.0
#: seconds a refused connection is still read from (and what it sends dropped) after its 503
REFUSE_LINGER_S = 2.0
#: the most seconds a connection that closes with its request's body still arriving (an early
#: 413 or 401 on ``Connection: close``) is still read from, and what it sends dropped, after
#: its response (nginx's ``lingering_time`` is 30 s) ...
LINGER_S = 30.0
#: ... and the most seconds it may send nothing meanwhile (nginx's ``lingering_timeout``, 5 s)
LINGER_IDLE_S = 5.0


def _error_response(status: str, message: str, kind: str, code: str, headers: str = "") -> bytes:
    """A whole HTTP/1.1 response written by the protocol itself (no app involved): ``status``
    like "408 Request Timeout", an OpenAI error body, ``connection: close``."""
    body = json.dumps(
        {"error": {"message": message, "type": kind, "param": None, "code": code}}
    ).encode()
    head = (
        f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\n{headers}"
        f"connection: close\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def _timeout_response(what: str, seconds: float) -> bytes:
    return _error_response(
        "408 Request Timeout",
        f"the request {what} took longer than {seconds:g} s to arrive",
        "invalid_request_error",
        "request_timeout",
    )


def _bad_request_response(msg: str) -> bytes:
    return _error_response(
        "400 Bad Request",
        f"{msg} (malformed request line or headers, or headers larger than the server's limit)",
        "invalid_request_error",
        "invalid_http_request",
    )


def _unavailable_response(limit: int) -> bytes:
    return _error_response(
        "503 Service Unavailable",
        f"the server has {limit} open connections, its --limit-concurrency: retry later",
        "service_unavailable",
        "too_many_connections",
        "retry-after: 1\r\n",
    )


class _LingeringTransport:
    """A request cycle's view of its connection's transport (uvicorn's ``RequestResponseCycle``
    closes the connection through it): ``close()`` with the response complete and the
    request's body still arriving lingers instead (``protocol._linger()``); everything else is
    the transport's."""

    def __init__(self, transport, protocol, cycle):
        self._transport, self._protocol, self._cycle = transport, protocol, cycle

    def close(self) -> None:
        cycle = self._cycle
        if cycle.response_complete and cycle.more_body and not self._transport.is_closing():
            self._protocol._linger()
        else:
            self._transport.close()

    def __getattr__(self, name):
        return getattr(self._transport, name)


class ConnectionSlots:
    """The connection cap: ``limit`` slots, one taken by each served connection while it is
    open.

    Args:
        limit: the most connections served at once (>= 1).
        shared: a ``multiprocessing.Value`` of a signed integer type (0 at start) that the API
            servers of one server share (made by the supervisor), or None for a server of one
            process (its event loop is the only user).
    """

    def __init__(self, limit: int, shared=None):
        self.limit = limit
        self._shared = shared
        self._taken = 0

    def acquire(self) -> bool:
        """Take a slot; False when all are taken."""
        if self._shared is None:
            if self._taken >= self.limit:
                return False
            self._taken += 1
            return True
        with self._shared.get_lock():
            if self._shared.value >= self.limit:
                return False
            self._shared.value += 1
            return True

    def release(self) -> None:
        """Give a slot back (once per successful :meth:`acquire`)."""
        if self._shared is None:
            self._taken -= 1
            return
        with self._shared.get_lock():
            self._shared.value -= 1

    def __len__(self) -> int:
        """Slots taken (over all processes sharing them)."""
        return self._taken if self._shared is None else self._shared.value


def protocol_base(http: str = "auto") -> type[asyncio.Protocol]:
    """uvicorn's protocol class for ``http`` (one of :data:`HTTP_PARSERS`): "auto" is
    httptools where the package is installed (uvicorn's own rule), else h11.

    Raises:
        ValueError: an unknown name, or "httptools" without the package.
    """
    if http not in HTTP_PARSERS:
        raise ValueError(f"unknown HTTP parser {http!r}; one of {', '.join(HTTP_PARSERS)}")
    has_httptools = importlib.util.find_spec("httptools") is not None
    if http == "h11" or (http == "auto" and not has_httptools):
        return H11Protocol
    if not has_httptools:
        raise ValueError("--http httptools needs the httptools package (pip install httptools)")
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    return HttpToolsProtocol


def guarded_protocol(
    header_timeout: float,
    body_timeout: float,
    slots: ConnectionSlots | None = None,
    http: str = "auto",
    max_header_bytes: int = 16384,
    linger_s: float = LINGER_S,
    linger_idle_s: float = LINGER_IDLE_S,
) -> type[asyncio.Protocol]:
    """A protocol class for ``uvicorn.Config(http=...)``: :func:`protocol_base` of ``http``
    with the two read deadlines (seconds, > 0), the header size bound (bytes; h11 applies its
    own, ``uvicorn.Config(h11_max_incomplete_event_size=...)``, which should be the same), the
    bounds of a lingering close (``linger_s`` seconds in all, ``linger_idle_s`` without a byte)
    and, with ``slots``, the connection cap (see the module docstring).

    Raises:
        ValueError: as :func:`protocol_base`.
    """
    base = protocol_base(http)
    own_header_block = base is not H11Protocol  # httptools: the guard bounds and filters it

    class GuardedProtocol(base):
        def connection_made(self, transport) -> None:
            self._read_timer = None
            self._reading = None  # "headers" / "body" while a deadline runs
            # httptools (own_header_block): the parser's position, from its callbacks
            self._at_start = True  # between requests: the next byte starts one
            self._in_headers = False  # a request began and its headers are not complete
            self._head = b""  # a request's header block, held until complete
            self._header_bytes = 0  # bytes fed to the parser while its headers are incomplete
            self._begun = False  # a request began inside the read being parsed
            self._active = None  # the cycle whose ASGI task runs (self.cycle is the newest
            # parsed one: a pipelined request is parsed at once and queued behind it)
            self._has_slot = slots is None or slots.acquire()
            self._refused = False  # the 503 was written
            self._lingering = False  # closing after a response, the request's body unread
            super().connection_made(transport)
            if not self._has_slot:
                log.warning(
                    "refusing %s:%s: %d connections open (--limit-concurrency)",
                    *(self.client or ("?", "?")),
                    slots.limit,
                )
                # the 503 answers its first bytes, or comes after a second if it sends none
                self._read_timer = self.loop.call_later(REFUSE_WAIT_S, self._refuse)
                return
            self._arm("headers", header_timeout)

        def data_received(self, data: bytes) -> None:
            if self._lingering:  # the rest of a body whose response is written: dropped
                self._linger_wait()
                return
            if not self._has_slot:  # its request (whatever of it arrived) gets the 503
                self._refuse()
                return
            if own_header_block:
                self._httptools_data(data)
                return
            if self._read_timer is None and (self.cycle is None or self.cycle.response_complete):
                self._arm("headers", header_timeout)  # the next request on a kept-alive socket
            before = self.cycle
            super().data_received(data)
            cycle = self.cycle
            if cycle is not None and cycle is not before:  # its headers are in: a new request
                self._watch(cycle)
                self._cancel()
                if cycle.more_body:
                    self._arm("body", body_timeout)
            elif self._reading == "body" and cycle is not None and not cycle.more_body:
                self._cancel()

        def _httptools_data(self, data: bytes) -> None:
            """httptools: hold a request's header block until it is complete (bounded), parse
            it without its ``Upgrade`` lines, and keep the deadlines on the parser's position.

            llhttp, offered an upgrade on a request with a body (``Upgrade: h2c`` on an
            ordinary POST, as Java clients send), stops parsing at the headers and the body is
            lost (uvicorn issue 2722); this server never upgrades, so it never shows llhttp the
            offer. A request that begins inside a read the parser already has (pipelined behind
            another) is parsed as it comes, its incomplete header bytes counted against the
            same bound."""
            self._unset_keepalive_if_required()  # any byte: the keep-alive wait is over
            if self._read_timer is None and self._idle() and (self._at_start or self._in_headers):
                self._arm("headers", header_timeout)  # the next request's first bytes
            if self._at_start:
                data = self._header_block(data)
                if data is None:  # incomplete (held), or refused
                    return
            before = self.cycle
            self._begun = False
            super().data_received(data)
            cycle = self.cycle
            if self.transport.is_closing():
                return
            # a request that began inside this read: its bytes here are bounded by the read
            # size (and may be the body of the one before); counted from the next read on
            if self._in_headers and not self._begun:
                self._header_bytes += len(data)
                if self._header_bytes > max_header_bytes:
                    self._too_large()
                    return
            if cycle is not None and cycle is not before:  # its headers are in: a new request
                if self._reading == "headers":
                    self._cancel()
                if cycle.more_body and cycle is self._active:  # a queued one: when it starts
                    self._arm("body", body_timeout)
            elif self._reading == "body" and cycle is not None and not cycle.more_body:
                self._cancel()
            if self._read_timer is None and self._idle():  # nothing runs, nothing is timed
                if self._in_headers or self._head:
                    self._arm("headers", header_timeout)
                elif self.timeout_keep_alive_task is None:  # between requests: uvicorn's wait
                    self.timeout_keep_alive_task = self.loop.call_later(
                        self.timeout_keep_alive, self.timeout_keep_alive_handler
                    )

        def _header_block(self, data: bytes) -> bytes | None:
            """The bytes to parse once the held header block is complete (its ``Upgrade``
            lines dropped), or None while it is not (held, at most ``max_header_bytes``; past
            that the 400). Empty lines before a request line (HTTP allows them) are skipped
            when looking for the block's end."""
            old = len(self._head)
            head = self._head + data
            lead = len(head) - len(head.lstrip(b"\r\n"))
            if lead == len(head):  # empty lines only, so far
                end = -1
            else:
                start = max(lead, old - 3)
                ends = (head.find(b"\r\n\r\n", start), head.find(b"\n\n", start))
                end = min((i for i in ends if i >= 0), default=-1)
            if end < 0:
                self._head = head
                if len(head) > max_header_bytes:
                    self._head = b""
                    self._too_large()
                return None
            self._head = b""
            self._at_start = False
            end += 2 if head[end : end + 1] == b"\r" else 1  # the last header line's ending
            block, rest = head[:end], head[end:]
            if b"upgrade:" not in block.lower():
                return head
            lines = block.split(b"\n")  # each line keeps its \r; the last is empty
            kept = [ln for ln in lines if not ln.lower().startswith(b"upgrade:")]
            return b"\n".join(kept) + rest

        def _too_large(self) -> None:
            self._cancel()
            self.send_400_response(f"the request line and headers exceed {max_header_bytes} bytes")

        def on_message_begin(self) -> None:  # httptools' parser callbacks (h11 has none)
            super().on_message_begin()
            self._at_start, self._in_headers, self._header_bytes = False, True, 0
            self._begun = True

        def _unsupported_upgrade_warning(self) -> None:
            """httptools met an upgrade offer it parsed itself (a request pipelined inside a
            read, or CONNECT): llhttp then reads nothing more of the connection, so it closes
            after the responses under way instead of waiting for a deadline."""
            super()._unsupported_upgrade_warning()
            for cycle in (self._active, self.cycle):
                if cycle is not None:
                    cycle.keep_alive = False
            if self._idle():
                self.transport.close()

        def on_headers_complete(self) -> None:
            self._in_headers = False
            super().on_headers_complete()
            self._watch(self.cycle)

        def _watch(self, cycle) -> None:
            """Give ``cycle`` the transport view that lingers on close
            (:class:`_LingeringTransport`), before its ASGI task runs."""
            if not isinstance(cycle.transport, _LingeringTransport):
                cycle.transport = _LingeringTransport(self.transport, self, cycle)

        def _linger(self) -> None:
            """Close after a response whose request's body is still arriving (module
            docstring, lingering close): half-close and drop what comes; the connection ends
            when the client closes it, or is aborted at the bounds (``linger_idle_s`` without
            a byte, ``linger_s`` in all)."""
            if self._lingering:
                return
            self._cancel()
            if not self.transport.can_write_eof():
                self.transport.close()
                return
            self._lingering = True
            self._unset_keepalive_if_required()
            self.transport.write_eof()
            self.flow.resume_reading()  # (paused by the body's high-water mark)
            self._linger_end = self.loop.time() + linger_s
            self._linger_wait()

        def _linger_wait(self) -> None:
            """(Re)arm the lingering close's timer: ``linger_idle_s`` from now, or less where
            the whole ``linger_s`` ends first; at expiry the connection is aborted."""
            if self._read_timer is not None:
                self._read_timer.cancel()
            wait = min(linger_idle_s, self._linger_end - self.loop.time())
            self._read_timer = self.loop.call_later(max(wait, 0.0), self.transport.abort)

        def on_message_complete(self) -> None:
            super().on_message_complete()  # returns early for a body read after its response
            self._at_start = True
            if self._reading == "body":  # that body, dropped, is in: no deadline left
                self._cancel()

        def _start_asgi_task(self, cycle, app) -> None:  # httptools: a request's task starts
            self._active = cycle
            super()._start_asgi_task(cycle, app)

        def _in_flight(self):
            """The request whose ASGI task runs, or None."""
            return self._active if own_header_block else self.cycle

        def _idle(self) -> bool:
            """No request runs, or its response is complete."""
            cycle = self._in_flight()
            return cycle is None or cycle.response_complete

        def on_response_complete(self) -> None:
            if self._lingering:  # closing: no keep-alive wait, the linger's timer stands
                super().on_response_complete()
                self._unset_keepalive_if_required()
                return
            self._cancel()  # idle until the next request: the keep-alive timeout applies
            before = self._in_flight()
            super().on_response_complete()
            cycle = self._in_flight()
            if cycle is not None:  # (h11 parses a pipelined request only now)
                self._watch(cycle)
            if cycle is not before and cycle is not None:
                # a pipelined request starts now (h11 parses it only now; httptools dequeues
                # it): its body, if still to come, has the body deadline from here
                if cycle.more_body:
                    self._arm("body", body_timeout)
            elif own_header_block and before is not None and before.more_body:
                # answered before its body arrived (a 413): the rest of the body, which
                # httptools reads and drops, must still come within the body deadline
                self._arm("body", body_timeout)
            elif own_header_block and (self._head or self._in_headers):
                # the next request's first bytes came while this response was under way
                self._unset_keepalive_if_required()
                self._arm("headers", header_timeout)

        def _refuse(self) -> None:
            """Write the 503 once, then half-close and keep reading (and dropping) what the
            client still sends for :data:`REFUSE_LINGER_S` seconds: closing at once with
            unread bytes would reset the connection, and the client could lose the 503."""
            if self._refused or self.transport.is_closing():
                return
            self._refused = True
            self._cancel()
            self.transport.write(_unavailable_response(slots.limit))
            if self.transport.can_write_eof():
                self.transport.write_eof()
                self._read_timer = self.loop.call_later(REFUSE_LINGER_S, self.transport.close)
            else:
                self.transport.close()

        def _should_upgrade(self) -> bool:
            """Never: the app has no WebSocket route, and an upgrade would hand the connection
            to another protocol object, whose end would not give its slot back."""
            return False

        def send_400_response(self, msg: str) -> None:
            """uvicorn's answer to a request the parser cannot parse (a malformed request
            line or header, headers still incomplete past --h11-max-incomplete-event-size), as
            an OpenAI error body instead of plain text. Written only where it answers the
            request that failed: no request runs, or the running one's response is complete, or
            the error is in the running one's own body and nothing of its response was sent;
            otherwise (a pipelined request fails behind one not yet answered) the connection is
            just closed, as a 400 there would be read as the earlier request's answer."""
            cycle = self._in_flight()
            if self._idle() or (cycle.more_body and not cycle.response_started):
                self.transport.write(_bad_request_response(msg))
            self.transport.close()

        def connection_lost(self, exc) -> None:
            self._cancel()
            if self._has_slot and slots is not None:
                self._has_slot = False
                slots.release()
            super().connection_lost(exc)

        def _arm(self, what: str, seconds: float) -> None:
            self._cancel()
            self._reading = what
            self._read_timer = self.loop.call_later(seconds, self._expire, what, seconds)

        def _cancel(self) -> None:
            if self._read_timer is not None:
                self._read_timer.cancel()
            self._read_timer, self._reading = None, None

        def _expire(self, what: str, seconds: float) -> None:
            self._read_timer, self._reading = None, None
            if self.transport.is_closing():
                return
            log.info(
                "dropping %s:%s: request %s not received within %g s",
                *(self.client or ("?", "?")),
                what,
                seconds,
            )
            cycle = self._in_flight()
            if (what == "headers" and self._idle()) or (
                what == "body" and cycle is not None and not cycle.response_started
            ):
                self.transport.write(_timeout_response(what, seconds))
            self.transport.close()

    GuardedProtocol.__name__ = GuardedProtocol.__qualname__ = f"Guarded{base.__name__}"
    return GuardedProtocol
