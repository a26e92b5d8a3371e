"""Runs one API request through the async engine: n choices, detokenization, stop strings, aborts.

Everything the chat and text endpoints share lives here; the endpoints only shape responses.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from engine.core.request import FinishReason, SamplingParams
from engine.core.stats import RequestStats
from engine.core.structured_output import GRAMMAR_ERROR_PREFIX
from engine.frontend.async_engine import AsyncEngine, RequestStream
from engine.frontend.detokenizer import IncrementalDetokenizer
from engine.frontend.tokenizer import Tokenizer
from server.errors import APIError, error_body
from server.stream import sse


async def merge(iterators: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """Interleave async iterators as their items arrive, yielding ``(iterator index, item)``.

    An exception in one iterator is re-raised to the consumer; leaving early cancels the rest.
    """
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(i: int, it: AsyncIterator):
        try:
            async for item in it:
                await queue.put((i, item))
        except Exception as exc:  # noqa: BLE001 - forwarded to the consumer
            await queue.put((i, exc))
        await queue.put((i, end))

    tasks = [asyncio.create_task(pump(i, it)) for i, it in enumerate(iterators)]
    try:
        done = 0
        while done < len(tasks):
            i, item = await queue.get()
            if item is end:
                done += 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


class EngineError(RuntimeError):
    """The engine failed while running a request (HTTP 500 / an error chunk)."""


class GrammarFailed(EngineError):
    """The request's own grammar failed while it ran (llguidance could not continue it, e.g. a
    recursion too deep to follow): the request's error (HTTP 400 / an error chunk, code
    ``grammar_error``), not the engine's."""


class ServerAborted(EngineError):
    """The server ended the request: it is shutting down and the graceful timeout expired
    (HTTP 503 / an error chunk, code ``server_shutting_down``)."""


def engine_api_error(exc: EngineError) -> APIError:
    """The OpenAI error for a request the engine failed or the server ended."""
    if isinstance(exc, ServerAborted):
        return APIError(503, str(exc), None, "server_shutting_down")
    if isinstance(exc, GrammarFailed):
        return APIError(400, str(exc), None, "grammar_error")
    return APIError(500, f"engine error: {exc}")


def engine_error_event(exc: EngineError) -> str:
    """The SSE error event ending a stream the engine failed or the server ended (``[DONE]``
    follows it)."""
    err = engine_api_error(exc)
    return sse(error_body(err.status, err.message, err.param, err.code))


@dataclass
class ChoiceEvent:
    """New output of one choice.

    Attributes:
        text: new text (already cut at a stop string, UTF-8 safe).
        token_ids: new token ids; logprobs: matching engine logprob entries (may be empty).
        finish_reason: "stop" | "length" | "abort" on the choice's last event.
        prompt_logprobs: on the choice's first event when the request asked for them: engine
            entries (:data:`~engine.core.outputs.PromptLogprob`) of prompt tokens 1..P-1.
        stop_reason: vLLM's field, on a "stop" event: the stop string that matched, or the
            stop token id that ended it (one of ``stop_token_ids``, or an EOS id that
            generation_config adds to the tokenizer's); ``None`` for the tokenizer's own EOS
            token unless ``ignore_eos`` (also when listed in ``stop_token_ids``: vLLM checks
            it first) and for every other finish. As vLLM's ``check_stop`` and
            ``SamplingParams.update_from_generation_config``.
    """

    index: int
    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    prompt_logprobs: list | None = None
    stop_reason: int | str | None = None


@dataclass
class ChoiceResult:
    """Accumulated output of one choice."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    prompt_logprobs: list | None = None
    stop_reason: int | str | None = None


class Generation:
    """One API request (``n`` engine requests) in flight.

    Args:
        engine: the shared async engine; tokenizer: for detokenization.
        request_id: the API request id; prompt_ids: the prompt tokens.
        params: sampling parameters; n: number of choices (seeds are ``seed + i``).
        on_finished: called with :class:`RequestStats` for every finished engine request.
        on_tokens: called with ``(prompt tokens, generated tokens)`` as they are accounted: each
            engine request's whole prompt once (at its first output, or when it finishes without
            one), and every token delivered to the client (those cut by a stop string or arriving
            after an abort are not). The totals therefore equal the sums of the finished
            requests' ``num_prompt_tokens`` / ``num_generation_tokens``.

    Raises (from the constructor):
        RequestRejected: the prompt can never be served.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        tokenizer: Tokenizer,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        n: int = 1,
        on_finished=None,
        on_tokens=None,
    ):
        self.engine = engine
        self.tokenizer = tokenizer
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.on_finished = on_finished
        self.on_tokens = on_tokens
        self.prompt_counted: list[bool] = [False] * n
        self.prompt_opens_thinking = False  # set by the chat endpoint for the reasoning parser
        self.streams: list[RequestStream] = []
        self.finished: list[bool] = [False] * n
        self.num_tokens: list[int] = [0] * n
        if n > 1:  # refuse before any choice is queued (add_request checks each one again)
            engine.limits.validate(prompt_ids, params.max_tokens)
        try:
            for i in range(n):
                p = params
                if n > 1 and params.seed is not None:
                    p = dataclasses.replace(params, seed=params.seed + i)
                self.streams.append(engine.add_request(f"{request_id}-{i}", prompt_ids, p))
        except BaseException:
            for s in self.streams:  # do not leave the choices already queued running
                engine.abort(s.request_id)
            raise

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    async def _choice(self, index: int) -> AsyncIterator[ChoiceEvent]:
        stream = self.streams[index]
        p = self.params
        detok = IncrementalDetokenizer(
            self.tokenizer,
            self.prompt_ids,
            skip_special_tokens=p.skip_special_tokens,
            stop=p.stop,
            include_stop_str_in_output=p.include_stop_str_in_output,
            min_tokens=p.min_tokens,
        )
        eos_ids = set() if p.ignore_eos else set(self.engine.limits.eos_token_ids)
        stop_ids = set(p.stop_token_ids) | eos_ids
        # the token ids whose stop is reported as stop_reason: all but the tokenizer's own EOS
        primary_eos = None if p.ignore_eos else self.tokenizer.eos_token_id
        reported_stop_ids = stop_ids - {primary_eos}
        async for out in stream:
            if self.finished[index]:
                return  # aborted meanwhile: nothing more is delivered or counted
            self._count_prompt(index)
            if out.error is not None:
                # the tokens generated before the error came in earlier outputs (a RequestStream
                # never merges an error into them) and were delivered; deliver the text the
                # detokenizer still holds back too (an unfinished character, a possible start
                # of a stop string), so the text sent is the decode of every token generated
                tail = detok.finish()
                if tail:
                    yield ChoiceEvent(index, tail)
                if out.finish_reason == FinishReason.ABORT:  # the server ended it (shutdown)
                    self._finish(index, "abort")
                    raise ServerAborted(out.error)
                self._finish(index, "error")
                if out.error.startswith(GRAMMAR_ERROR_PREFIX):
                    raise GrammarFailed(out.error)
                raise EngineError(out.error)
            ids, logprobs, prompt_lps = out.new_token_ids, out.logprobs, out.prompt_logprobs
            text_ids = ids
            if (
                out.finish_reason == FinishReason.STOP
                and ids
                and ids[-1] in stop_ids
                and not p.include_stop_str_in_output
            ):
                text_ids = ids[:-1]  # the stop token itself is not part of the text
            if p.stop and len(ids) > 1:
                # several tokens at once (a merged output, or a token and the stop token after
                # it): feed them one by one so the tokens after a stop string are neither
                # counted nor reported (vLLM's one-token steps end the request at the string)
                text = ""
                for used, tok in enumerate(text_ids, 1):
                    text += detok.step([tok])
                    if detok.stop_reason is not None:
                        ids, logprobs = ids[:used], logprobs[:used]
                        break
            else:
                text = detok.step(text_ids) if text_ids else ""
            self.num_tokens[index] += len(ids)
            if ids and self.on_tokens is not None:
                self.on_tokens(0, len(ids))
            if detok.stop_reason is not None:
                self.engine.abort(stream.request_id)
                self._finish(index, "stop")
                yield ChoiceEvent(index, text, ids, logprobs, "stop", prompt_lps, detok.stop_reason)
                return
            reason = stop_reason = None
            if out.finished:
                text += detok.finish()
                reason = out.finish_reason.value
                if detok.stop_reason is not None:
                    # a stop string completed only by the text held back until the end (the
                    # last token ended inside a UTF-8 character): the text is cut there
                    reason, stop_reason = "stop", detok.stop_reason
                elif (
                    out.finish_reason == FinishReason.STOP and ids and ids[-1] in reported_stop_ids
                ):
                    stop_reason = ids[-1]
                self._finish(index, reason)
            yield ChoiceEvent(index, text, ids, logprobs, reason, prompt_lps, stop_reason)

    def _count_prompt(self, index: int) -> None:
        """Account the choice's prompt tokens, once."""
        if not self.prompt_counted[index]:
            self.prompt_counted[index] = True
            if self.on_tokens is not None:
                self.on_tokens(len(self.prompt_ids), 0)

    def _finish(self, index: int, reason: str) -> None:
        if self.finished[index]:
            return
        self._count_prompt(index)
        self.finished[index] = True
        if self.on_finished is None:
            return
        s = self.streams[index]
        now = time.monotonic()
        self.on_finished(
            RequestStats(
                request_id=s.request_id,
                finish_reason=reason,
                num_prompt_tokens=s.num_prompt_tokens,
                num_generation_tokens=self.num_tokens[index],
                num_cached_tokens=0,
                queue_time=None if s.scheduled_time is None else s.scheduled_time - s.arrival_time,
                ttft=None if s.first_token_time is None else s.first_token_time - s.arrival_time,
                e2e_latency=now - s.arrival_time,
            ),
            s.itls,
        )

    async def events(self) -> AsyncIterator[ChoiceEvent]:
        """Events of all choices, interleaved as they arrive. Aborts unfinished choices on exit."""
        try:
            if len(self.streams) == 1:
                async for ev in self._choice(0):
                    yield ev
                return
            async for _, ev in merge([self._choice(i) for i in range(len(self.streams))]):
                yield ev
        finally:
            self.abort()

    def abort(self) -> None:
        """Abort every unfinished choice (client gone); idempotent."""
        for i, s in enumerate(self.streams):
            if not self.finished[i]:
                self.engine.abort(s.request_id)
                self._finish(i, "abort")

    async def collect(self) -> list[ChoiceResult]:
        """Run to completion and return each choice's full output (non-streaming)."""
        results = [ChoiceResult(i) for i in range(len(self.streams))]
        async for ev in self.events():
            r = results[ev.index]
            r.text += ev.text
            r.token_ids += ev.token_ids
            r.logprobs += ev.logprobs
            if ev.prompt_logprobs is not None:
                r.prompt_logprobs = ev.prompt_logprobs
            if ev.finish_reason is not None:
                r.finish_reason, r.stop_reason = ev.finish_reason, ev.stop_reason
        return results
