"""One engine loop shared by all requests, with a per-request async output stream.

The engine loop (``engine.core.engine_loop``) runs in an *engine core*: a thread of this process
(``engine.frontend.core_client.ThreadCore``) or a separate process
(``engine.frontend.process_core.ProcessCore``, so the engine's Python work never competes with
the HTTP server for the GIL). Requests and aborts go to the core as typed commands
(``engine.core.commands``); each step's outputs come back to the event loop with
``call_soon_threadsafe`` into one ``asyncio.Queue`` per request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from engine.core.commands import AbortRequest, AddRequest
from engine.core.limits import EngineLimits
from engine.core.llm_engine import LLMEngine
from engine.core.outputs import RequestOutput
from engine.core.request import FinishReason, SamplingParams
from engine.core.stats import StepStats
from engine.frontend.core_client import EngineCoreClient

log = logging.getLogger(__name__)


class EngineUnavailable(RuntimeError):
    """The engine core is not running (it died or was shut down): HTTP 503 with the error code
    :attr:`code`."""

    code = "engine_unavailable"


class ServerShuttingDown(EngineUnavailable):
    """The server is shutting down and ended its in-flight requests (:meth:`AsyncEngine.abort_all`):
    new requests are refused (HTTP 503, code ``server_shutting_down``)."""

    code = "server_shutting_down"

    def __init__(self, message: str = "the server is shutting down"):
        super().__init__(message)


class RequestStream:
    """Async iterator over one request's outputs; ends after the output with ``finished``.

    Attributes:
        arrival_time, first_token_time, last_token_time: monotonic seconds.
        itls: gaps between consecutive token outputs (seconds).
        scheduled_time: when the engine first scheduled the request (monotonic), if it did.
    """

    def __init__(self, request_id: str, num_prompt_tokens: int):
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._held: RequestOutput | None = None  # an error output taken off the queue early
        self.finished = False
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.scheduled_time: float | None = None
        self.itls: list[float] = []

    def _put(self, out: RequestOutput) -> None:
        now = time.monotonic()
        if out.new_token_ids:
            if self.first_token_time is None:
                self.first_token_time = now
            else:
                self.itls.append(now - self.last_token_time)
            self.last_token_time = now
        if out.scheduled_time is not None:
            self.scheduled_time = out.scheduled_time
        self.queue.put_nowait(out)

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        """The next output; when the consumer fell behind, all queued outputs merged into one
        (their tokens concatenated), so a busy server does its per-chunk work once per batch of
        tokens instead of once per token. An output with an ``error`` is never merged into
        the tokens before it: those come first, then the error (a consumer that stops at the
        error still delivers every token generated before it)."""
        if self.finished:
            raise StopAsyncIteration
        if self._held is not None:
            out, self._held = self._held, None
        else:
            out = await self.queue.get()
        while not out.finished and out.error is None and not self.queue.empty():
            nxt = self.queue.get_nowait()
            if nxt.error is not None:
                self._held = nxt  # the next call returns it
                break
            out = RequestOutput(
                out.request_id,
                out.new_token_ids + nxt.new_token_ids,
                out.logprobs + nxt.logprobs,
                prompt_logprobs=out.prompt_logprobs
                if out.prompt_logprobs is not None
                else nxt.prompt_logprobs,
                finished=nxt.finished,
                finish_reason=nxt.finish_reason,
                num_prompt_tokens=nxt.num_prompt_tokens,
                num_cached_tokens=nxt.num_cached_tokens,
                scheduled_time=out.scheduled_time
                if out.scheduled_time is not None
                else nxt.scheduled_time,
            )
        if out.finished:
            self.finished = True
        return out


class AsyncEngine:
    """The front end of an engine core: request streams, validation, aborts.

    Args:
        core: an engine core client (``ThreadCore`` or ``ProcessCore``).
        on_step: called on the event loop with each step's :class:`StepStats`.
    """

    def __init__(self, core: EngineCoreClient, on_step: Callable[[StepStats], None] | None = None):
        self.core = core
        self.limits: EngineLimits = self.core.limits
        self.on_step = on_step
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._refusing = False  # set by abort_all: new requests get ServerShuttingDown

    @property
    def engine(self) -> LLMEngine | None:
        """The in-process engine (thread core only; for tests and tools)."""
        return self.core.engine

    # -------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start the engine core; must be called from the running event loop."""
        self._loop = asyncio.get_running_loop()
        loop = self._loop
        self.core.start(
            self._emit, lambda: loop.call_soon_threadsafe(self.fail_all, "the engine process died")
        )

    async def shutdown(self) -> None:
        """Stop the engine core (in-flight requests get no further output)."""
        await asyncio.to_thread(self.core.shutdown, 30.0)

    @property
    def is_running(self) -> bool:
        return self.core.is_alive()

    @property
    def in_flight(self) -> list[RequestStream]:
        """The streams of the engine requests in flight (one per choice), in arrival order."""
        return list(self._streams.values())

    @property
    def num_in_flight(self) -> int:
        """How many engine requests (one per choice) are in flight."""
        return len(self._streams)

    # --------------------------------------------------------------- requests
    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> RequestStream:
        """Validate and queue a request; returns its output stream.

        Raises:
            RequestRejected: the request can never be served (see EngineLimits.validate).
            ValueError: duplicate id.
            EngineUnavailable: the engine core is not running.
            ServerShuttingDown: :meth:`abort_all` ended the in-flight requests (a subclass of
                EngineUnavailable).
        """
        if self._refusing:
            raise ServerShuttingDown()
        if not self.core.is_alive():
            raise EngineUnavailable("the engine is not running")
        if request_id in self._streams:
            raise ValueError(f"duplicate request id {request_id!r}")
        self.limits.validate(prompt_token_ids, params.max_tokens)
        stream = RequestStream(request_id, len(prompt_token_ids))
        self._streams[request_id] = stream
        self.core.send(AddRequest(request_id, list(prompt_token_ids), params))
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request: its blocks are freed at the start of the next engine iteration.

        The stream ends with a finished ``abort`` output. Unknown or finished ids are ignored.
        """
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        self.core.send(AbortRequest(request_id))
        # end the stream for anyone still reading it
        stream._put(RequestOutput(request_id, [], finished=True, finish_reason=FinishReason.ABORT))

    def abort_all(self, message: str) -> int:
        """End every in-flight request because the server is going away (the graceful-shutdown
        timeout expired, or a second signal came) and refuse new ones
        (:class:`ServerShuttingDown`).

        Each stream first gets a finished ``abort`` output whose ``error`` is ``message`` (an
        abort the server decided, not the client), then the request is aborted in the core (its
        KV blocks are freed at the start of the next engine iteration). A core that cannot take
        the abort (a broken pipe to a dead engine process) is logged once; every stream is
        ended regardless. Returns how many engine requests (one per choice) were ended.
        """
        self._refusing = True
        streams, self._streams = self._streams, {}
        for rid, stream in streams.items():
            stream._put(
                RequestOutput(
                    rid, [], finished=True, finish_reason=FinishReason.ABORT, error=message
                )
            )
        if self.core.is_alive():
            try:
                for rid in streams:
                    self.core.send(AbortRequest(rid))
            except Exception:  # noqa: BLE001 - the streams are ended; the core is going away
                log.warning(
                    "could not send the aborts of %d request(s) to the engine core",
                    len(streams),
                    exc_info=True,
                )
        return len(streams)

    def fail_all(self, message: str) -> None:
        """Finish every in-flight stream with an error (the engine core died)."""
        self._dispatch([RequestOutput.failed(rid, message) for rid in list(self._streams)], None)

    # ------------------------------------------------------- from the engine core
    def _emit(self, outputs: list[RequestOutput], stats: StepStats | None) -> None:
        """Called on the core's thread: hand a step's results to the event loop."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._dispatch, outputs, stats)
        except RuntimeError:  # loop closed during shutdown
            pass

    def _dispatch(self, outputs: list[RequestOutput], stats: StepStats | None) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted meanwhile
            stream._put(out)
            if out.finished:
                del self._streams[out.request_id]
        if stats is not None and self.on_step is not None:
            self.on_step(stats)
