"""One engine loop shared by all requests, with a per-request async output stream.

The engine loop (``engine.engine_loop``) runs in an *engine core*: a thread of this process
(:class:`ThreadCore`) or a separate process (``engine.engine_process.ProcessCore``, so the
engine's Python work never competes with the HTTP server for the GIL). Requests and aborts go
to the core as commands; each step's outputs come back to the event loop with
``call_soon_threadsafe`` into one ``asyncio.Queue`` per request.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import Protocol

from engine.engine import LLMEngine, RequestOutput
from engine.engine_loop import Emit, run_engine_loop
from engine.limits import EngineLimits
from engine.request import FinishReason, SamplingParams
from engine.stats import StepStats

log = logging.getLogger(__name__)

#: GIL switch interval while an engine thread runs in this process (seconds)
SWITCH_INTERVAL_S = 0.0005


class EngineUnavailable(RuntimeError):
    """The engine core is not running (it died or was shut down)."""


class EngineCore(Protocol):
    """Where the engine loop runs. ``engine`` is the in-process LLMEngine, or None."""

    limits: EngineLimits
    engine: LLMEngine | None

    def start(self, emit: Emit, on_death: Callable[[], None]) -> None: ...
    def send(self, command: tuple) -> None: ...
    def shutdown(self, timeout: float) -> None: ...
    def is_alive(self) -> bool: ...


class ThreadCore:
    """The engine loop in a thread of this process (CPU default; tests can reach ``engine``).

    Lowers the interpreter's thread switch interval to 0.5 ms while running: the engine thread
    and the event loop hand the GIL back and forth every step, and the default 5 ms wait for it
    would add directly to the time per output token.
    """

    def __init__(self, engine: LLMEngine, log_interval: float = 10.0):
        self.engine = engine
        self.limits = engine.limits
        self.log_interval = log_interval
        self._lock = threading.Lock()
        self._commands: list[tuple] = []
        self._wakeup = threading.Event()
        self._thread: threading.Thread | None = None

    def _next(self, timeout: float) -> list[tuple]:
        if timeout and not self._commands:
            self._wakeup.wait(timeout)
        self._wakeup.clear()
        with self._lock:
            commands, self._commands = self._commands, []
        return commands

    def start(self, emit: Emit, on_death: Callable[[], None] | None = None) -> None:
        sys.setswitchinterval(SWITCH_INTERVAL_S)

        def run() -> None:
            try:
                run_engine_loop(self.engine, self._next, emit, self.log_interval)
            except Exception:  # noqa: BLE001 - logged; the front end fails what is in flight
                log.exception("engine loop died")
                if on_death is not None:
                    on_death()

        self._thread = threading.Thread(target=run, name="engine-loop", daemon=True)
        self._thread.start()

    def send(self, command: tuple) -> None:
        with self._lock:
            self._commands.append(command)
        self._wakeup.set()

    def shutdown(self, timeout: float = 30.0) -> None:
        if self._thread is not None:
            self.send(("shutdown",))
            self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()


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
        tokens instead of once per token."""
        if self.finished:
            raise StopAsyncIteration
        out = await self.queue.get()
        while not out.finished and out.error is None and not self.queue.empty():
            nxt = self.queue.get_nowait()
            out = RequestOutput(
                out.request_id, out.new_token_ids + nxt.new_token_ids, out.logprobs + nxt.logprobs,
                finished=nxt.finished, finish_reason=nxt.finish_reason, num_prompt_tokens=nxt.num_prompt_tokens,
                num_cached_tokens=nxt.num_cached_tokens, error=nxt.error,
                scheduled_time=out.scheduled_time if out.scheduled_time is not None else nxt.scheduled_time,
            )
        if out.finished:
            self.finished = True
        return out


class AsyncEngine:
    """The front end of an engine core: request streams, validation, aborts.

    Args:
        core: a :class:`ThreadCore` or ``ProcessCore``; an :class:`LLMEngine` is wrapped in a
            ThreadCore.
        on_step: called on the event loop with each step's :class:`StepStats`.
    """

    def __init__(self, core: EngineCore | LLMEngine, on_step: Callable[[StepStats], None] | None = None):
        self.core = ThreadCore(core) if isinstance(core, LLMEngine) else core
        self.limits: EngineLimits = self.core.limits
        self.on_step = on_step
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self.last_stats: StepStats | None = None

    @property
    def engine(self) -> LLMEngine | None:
        """The in-process engine (thread core only; for tests and tools)."""
        return self.core.engine

    # -------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start the engine core; must be called from the running event loop."""
        self._loop = asyncio.get_running_loop()
        loop = self._loop
        self.core.start(self._emit, lambda: loop.call_soon_threadsafe(self.fail_all, "the engine process died"))

    async def shutdown(self) -> None:
        """Stop the engine core (in-flight requests get no further output)."""
        await asyncio.to_thread(self.core.shutdown, 30.0)

    @property
    def is_running(self) -> bool:
        return self.core.is_alive()

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # --------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> RequestStream:
        """Validate and queue a request; returns its output stream.

        Raises:
            RequestRejected: the request can never be served (see EngineLimits.validate).
            ValueError: duplicate id.
            EngineUnavailable: the engine core is not running.
        """
        if not self.core.is_alive():
            raise EngineUnavailable("the engine is not running")
        if request_id in self._streams:
            raise ValueError(f"duplicate request id {request_id!r}")
        self.limits.validate(prompt_token_ids)
        stream = RequestStream(request_id, len(prompt_token_ids))
        self._streams[request_id] = stream
        self.core.send(("add", request_id, list(prompt_token_ids), params))
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request: its blocks are freed at the start of the next engine iteration.

        The stream ends with a finished ``abort`` output. Unknown or finished ids are ignored.
        """
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        self.core.send(("abort", request_id))
        # end the stream for anyone still reading it
        stream._put(RequestOutput(request_id, [], finished=True, finish_reason=FinishReason.ABORT))

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
        if stats is not None:
            self.last_stats = stats
            if self.on_step is not None:
                self.on_step(stats)
