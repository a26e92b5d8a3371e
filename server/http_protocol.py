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

With several API-server processes (``--api-server-count``) ``limit_concurrency`` stays one
limit for the whole server: each protocol counts its connection in a count shared by the
processes (:class:`SharedConnections`), and uvicorn's check compares that count with the limit.
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


class SharedConnections:
    """One process's open connections (uvicorn's set) counted into a count shared by all API
    servers: ``len()`` is the server-wide number of open connections, which is what uvicorn
    compares with ``limit_concurrency`` before it answers a request (503 at the limit).

    Args:
        local: uvicorn's ``server_state.connections`` of this process (added to and discarded
            from as uvicorn does; its own shutdown waits on it).
        shared: a ``multiprocessing.Value`` of a signed integer type, made by the API-server
            supervisor and passed to every API server (0 at start).
    """

    def __init__(self, local: set, shared):
        self.local = local
        self.shared = shared

    def add(self, conn) -> None:
        if conn not in self.local:
            self.local.add(conn)
            with self.shared.get_lock():
                self.shared.value += 1

    def discard(self, conn) -> None:
        if conn in self.local:
            self.local.discard(conn)
            with self.shared.get_lock():
                self.shared.value -= 1

    def __len__(self) -> int:
        return self.shared.value

    def __contains__(self, conn) -> bool:
        return conn in self.local

    def __iter__(self):
        return iter(self.local)


def guarded_protocol(
    header_timeout: float, body_timeout: float, shared_connections=None
) -> type[H11Protocol]:
    """An h11 protocol class for ``uvicorn.Config(http=...)`` with the two read deadlines
    (seconds, > 0). ``shared_connections``: the ``multiprocessing.Value`` the API servers count
    their open connections in (:class:`SharedConnections`), None for a server of one process."""

    class GuardedH11Protocol(H11Protocol):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            if shared_connections is not None:
                self.connections = SharedConnections(self.connections, shared_connections)

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
