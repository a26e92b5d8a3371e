"""One engine loop shared by all requests, with a per-request async output stream.

The synchronous :class:`LLMEngine` runs in a dedicated thread (model steps release the GIL, so
the asyncio event loop stays responsive). Requests and aborts cross into that thread through a
locked inbox; outputs come back to the event loop with ``call_soon_threadsafe`` into one
``asyncio.Queue`` per request.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
from collections.abc import Callable

from engine.engine import LLMEngine, RequestOutput
from engine.request import FinishReason, SamplingParams
from engine.stats import StepStats

log = logging.getLogger(__name__)

#: GIL switch interval while the engine thread runs (seconds)
SWITCH_INTERVAL_S = 0.0005


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
    """Owns the engine thread.

    Args:
        engine: the synchronous engine (used only from the engine thread after :meth:`start`).
        on_step: called on the event loop with each step's :class:`StepStats`.
        log_interval: seconds between periodic engine log lines (0 = never).
    """

    def __init__(self, engine: LLMEngine, on_step: Callable[[StepStats], None] | None = None, log_interval: float = 10.0):
        self.engine = engine
        self.on_step = on_step
        self.log_interval = log_interval
        self._inbox_lock = threading.Lock()
        self._adds: list[tuple[str, list[int], SamplingParams]] = []
        self._aborts: list[str] = []
        self._wakeup = threading.Event()
        self._stop = threading.Event()
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.last_stats: StepStats | None = None
        self.errored: BaseException | None = None

    # -------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start the engine thread; must be called from the running event loop.

        Lowers the interpreter's thread switch interval (default 5 ms) to 0.5 ms: the engine
        thread and the event loop hand the GIL back and forth every step, and a 5 ms wait for
        it would add directly to the time per output token.
        """
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """Stop the loop thread (in-flight requests get no further output)."""
        self._stop.set()
        self._wakeup.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # --------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> RequestStream:
        """Validate and queue a request; returns its output stream.

        Raises:
            RequestRejected: the request can never be served (see LLMEngine.validate).
            ValueError: duplicate id.
        """
        if request_id in self._streams:
            raise ValueError(f"duplicate request id {request_id!r}")
        self.engine.validate(prompt_token_ids, params)
        stream = RequestStream(request_id, len(prompt_token_ids))
        self._streams[request_id] = stream
        with self._inbox_lock:
            self._adds.append((request_id, list(prompt_token_ids), params))
        self._wakeup.set()
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request: its blocks are freed at the start of the next engine iteration.

        The stream gets no further output. Unknown or finished ids are ignored.
        """
        if self._streams.pop(request_id, None) is None:
            return
        with self._inbox_lock:
            self._aborts.append(request_id)
        self._wakeup.set()

    # ------------------------------------------------------------ engine thread
    def _drain_inbox(self) -> bool:
        """Apply queued adds and aborts; True when anything changed."""
        with self._inbox_lock:
            adds, self._adds = self._adds, []
            aborts, self._aborts = self._aborts, []
        aborted = set(aborts)
        for rid, ids, params in adds:
            if rid in aborted:
                continue
            try:
                self.engine.add_request(rid, ids, params)
            except ValueError as exc:  # validated already; a race would land here
                self._emit([RequestOutput(rid, [], finished=True, finish_reason=FinishReason.ERROR, error=str(exc))], None)
        for rid in aborts:
            self.engine.abort(rid)
        return bool(adds or aborts)

    def _run(self) -> None:
        last_log = time.monotonic()
        tokens_since = [0, 0]
        while not self._stop.is_set():
            changed = self._drain_inbox()
            if not self.engine.has_unfinished():
                if changed:  # e.g. the last requests were aborted: publish the emptied state
                    self._emit([], self.engine.idle_stats())
                self._wakeup.wait(timeout=0.5)
                self._wakeup.clear()
                continue
            try:
                outputs, stats = self.engine.step()
            except Exception as exc:  # noqa: BLE001 - a bug outside the model step: fail everyone, keep serving
                log.exception("engine step crashed; failing all in-flight requests")
                outputs = []
                for rid in list(self.engine.requests):
                    self.engine.abort(rid)
                    outputs.append(RequestOutput(rid, [], finished=True, finish_reason=FinishReason.ERROR, error=str(exc)))
                stats = None
            tokens_since[0] += stats.num_prompt_tokens if stats else 0
            tokens_since[1] += stats.num_generation_tokens if stats else 0
            self._emit(outputs, stats)
            now = time.monotonic()
            if stats and self.log_interval and now - last_log >= self.log_interval:
                dt = now - last_log
                log.info(
                    "engine: running %d, waiting %d, KV usage %.1f%%, prompt %.1f tok/s, generation %.1f tok/s",
                    stats.num_running, stats.num_waiting, 100 * stats.kv_usage,
                    tokens_since[0] / dt, tokens_since[1] / dt,
                )
                last_log, tokens_since = now, [0, 0]

    def _emit(self, outputs: list[RequestOutput], stats: StepStats | None) -> None:
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
