"""uvicorn's h11 HTTP protocol with deadlines for reading a request (slow-client guard).

uvicorn bounds the idle time between requests (``timeout_keep_alive``) and, with
``limit_concurrency``, answers 503 past a number of connections, but nothing bounds how long a
client may take to send a request: its keep-alive timer is cancelled by every byte received, and
a connection that has sent nothing, or sends its headers a byte at a time (slowloris), is held
forever -- and counts against ``limit_concurrency``, so a few hundred such sockets lock everyone
out. ASGI middleware cannot help: the app is called only once the headers are complete.

:func:`guarded_protocol` subclasses :class:`uvicorn.protocols.http.h11_impl.H11Protocol` with two
deadlines (as nginx's ``client_header_timeout`` / ``client_body_timeout`` and Apache's
``mod_reqtimeout``, but absolute rather than per read, so trickling bytes does not extend them):

* headers: from the connection's start, or from the first byte of the next request on a
  keep-alive connection, the request line and headers must be complete within
  ``header_timeout`` seconds;
* body: from the end of the headers, the body must be complete within ``body_timeout`` seconds.

On expiry the client gets ``408 Request Timeout`` (an OpenAI error body) and the connection is
closed; an app waiting for the rest of the body sees a disconnect. A request that has been read
is never timed: responses (streams included) take as long as they take.
"""

from __future__ import annotations

import json
import logging

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("server.http")


def _timeout_response(what: str, seconds: float) -> bytes:
    body = json.dumps(
        {
            "error": {
                "message": f"the request {what} took longer than {seconds:g} s to arrive",
                "type": "invalid_request_error",
                "param": None,
                "code": "request_timeout",
            }
        }
    ).encode()
    head = (
        "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
        f"connection: close\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def guarded_protocol(header_timeout: float, body_timeout: float) -> type[H11Protocol]:
    """An h11 protocol class for ``uvicorn.Config(http=...)`` with the two read deadlines
    (seconds, > 0)."""

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            self._read_timer = None
            self._reading = None  # "headers" / "body" while a deadline runs
            super().connection_made(transport)
            self._arm("headers", header_timeout)

        def data_received(self, data: bytes) -> None:
            if self._read_timer is None and (self.cycle is None or self.cycle.response_complete):
                self._arm("headers", header_timeout)  # the next request on a kept-alive socket
            before = self.cycle
            super().data_received(data)
            cycle = self.cycle
            if cycle is not None and cycle is not before:  # its headers are in: a new request
                self._cancel()
                if cycle.more_body:
                    self._arm("body", body_timeout)
            elif self._reading == "body" and cycle is not None and not cycle.more_body:
                self._cancel()

        def on_response_complete(self) -> None:
            self._cancel()  # idle until the next request: the keep-alive timeout applies
            super().on_response_complete()

        def connection_lost(self, exc) -> None:
            self._cancel()
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
            cycle = self.cycle
            if what == "headers" or (cycle is not None and not cycle.response_started):
                self.transport.write(_timeout_response(what, seconds))
            self.transport.close()

    return GuardedH11Protocol
