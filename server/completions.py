"""POST /v1/completions: text prompts (or token ids), echo, logprobs, streaming."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from engine.core.limits import RequestRejected
from server.context import ServerContext
from server.errors import APIError, rejected
from server.generation import ChoiceEvent, EngineError, Generation, engine_error_event, merge
from server.logprobs import TokenNames, completion_logprobs, prompt_logprobs_list
from server.params import check_stream_options, to_sampling_params
from server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Usage,
    new_id,
)
from server.stream import DONE, ChunkWriter
from server.structured_outputs import grammar_from_request
from server.text_check import check_request_text


class Completions:
    """The text-completion endpoint's logic, bound to a :class:`ServerContext`."""

    def __init__(self, ctx: ServerContext):
        self.ctx = ctx

    async def _prompts(self, req: CompletionRequest) -> list[list[int]]:
        p = req.prompt
        encode = self.ctx.encode_request_prompt
        special = req.add_special_tokens
        if isinstance(p, str):
            return [await encode(p, "prompt", special)]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        if all(isinstance(x, str) for x in p):
            return [await encode(x, f"prompt.{i}", special) for i, x in enumerate(p)]
        return [list(x) for x in p]

    async def start(self, req: CompletionRequest) -> tuple[list[Generation], str]:
        """Validate and queue every prompt's choices. Raises APIError (400/404)."""
        ctx = self.ctx
        check_request_text(req)
        ctx.check_model(req.model)
        check_stream_options(req)
        if req.suffix:
            raise APIError(400, "suffix is not supported", "suffix")
        if req.max_tokens == 0 and not req.echo and req.prompt_logprobs is None:
            raise APIError(
                400,
                "max_tokens 0 scores the prompt without generating: it needs echo (with logprobs) "
                "or prompt_logprobs",
                "max_tokens",
            )
        if req.stream and req.prompt_logprobs is not None:
            raise APIError(
                400,
                "prompt_logprobs are not available when stream is true "
                "(echo with logprobs streams the prompt's log-probabilities)",
                "prompt_logprobs",
            )
        rid = new_id("cmpl")
        grammar, param = grammar_from_request(req)
        spec = await ctx.structured_output(grammar, param)
        prompts = await self._prompts(req)
        if len(prompts) * req.n > 64:
            raise APIError(
                400,
                f"at most 64 choices (prompts x n) per request, got {len(prompts)} x {req.n}",
                "n" if req.n > 1 else "prompt",
                "invalid_value",
            )
        # every prompt is checked before any is queued: a bad later prompt must not leave the
        # earlier ones started and aborted (counted in the metrics as aborts)
        checked = []
        try:
            for i, ids in enumerate(prompts):
                if not ids:
                    where = f" (element {i} is empty)" if len(prompts) > 1 else ""
                    raise APIError(
                        400, f"prompt must not be empty{where}", "prompt", "invalid_value"
                    )
                ctx.check_prompt_length(len(ids), "prompt")
                params = to_sampling_params(
                    req,
                    max_tokens=req.max_tokens if req.max_tokens is not None else 16,
                    logprobs=req.logprobs,
                    prompt_logprobs=self._engine_prompt_logprobs(req),
                    num_prompt_tokens=len(ids),
                    max_model_len=ctx.max_model_len,
                    vocab_size=ctx.vocab_size,
                    defaults=ctx.defaults,
                    prompt_param="prompt",
                    max_tokens_sent=req.max_tokens is not None,
                )
                params.structured_output = spec
                ctx.engine.limits.validate(ids, params.max_tokens)
                checked.append((ids, params))
        except RequestRejected as exc:
            raise rejected(exc, "prompt") from None
        gens: list[Generation] = []
        try:
            for i, (ids, params) in enumerate(checked):
                gens.append(
                    Generation(
                        ctx.engine,
                        ctx.tokenizer,
                        f"{rid}-p{i}",
                        ids,
                        params,
                        req.n,
                        on_finished=ctx.request_finished,
                        on_tokens=ctx.metrics.count_tokens,
                    )
                )
        except BaseException as exc:
            for g in gens:  # do not leave the prompts already queued running
                g.abort()
            if isinstance(exc, RequestRejected):
                raise rejected(exc, "prompt") from None
            raise
        return gens, rid

    @staticmethod
    def _engine_prompt_logprobs(req: CompletionRequest) -> int | None:
        """Alternatives per prompt token the engine computes: ``prompt_logprobs``, and
        ``logprobs`` when the prompt is echoed with log-probabilities (the larger of the two)."""
        asked = [req.prompt_logprobs] if req.prompt_logprobs is not None else []
        if req.echo and req.logprobs is not None:
            asked.append(req.logprobs)
        return max(asked) if asked else None

    @staticmethod
    def _prompt_entries(gen: Generation, entries: list | None) -> list:
        """The engine's prompt entries of a choice; their absence is an engine error, never a
        silent omission."""
        if entries is None or len(entries) != gen.num_prompt_tokens - 1:
            raise EngineError("the engine returned no prompt log-probabilities")
        return entries

    def _choice_logprobs(
        self, req: CompletionRequest, gen: Generation, r, names: TokenNames, prefix: str
    ) -> CompletionLogprobs | None:
        if req.logprobs is None:
            return None
        if req.echo:
            return completion_logprobs(
                names,
                r.token_ids,
                r.logprobs,
                req.logprobs,
                0,
                gen.prompt_ids,
                self._prompt_entries(gen, r.prompt_logprobs),
            )[0]
        return completion_logprobs(names, r.token_ids, r.logprobs, req.logprobs, len(prefix))[0]

    def _echo(self, gen: Generation) -> str:
        return self.ctx.tokenizer.decode(gen.prompt_ids, skip_special_tokens=False)

    async def complete(
        self, req: CompletionRequest, gens: list[Generation], rid: str
    ) -> CompletionResponse:
        results = await asyncio.gather(*(g.collect() for g in gens))
        names = TokenNames(self.ctx.tokenizer, req.return_tokens_as_token_ids)
        choices = []
        prompt_tokens = completion = 0
        for p_idx, (gen, res) in enumerate(zip(gens, results)):
            prompt_tokens += gen.num_prompt_tokens
            prefix = self._echo(gen) if req.echo else ""
            for r in res:
                completion += len(r.token_ids)
                prompt_lps = None
                if req.prompt_logprobs is not None:
                    prompt_lps = prompt_logprobs_list(
                        names,
                        gen.prompt_ids,
                        self._prompt_entries(gen, r.prompt_logprobs),
                        req.prompt_logprobs,
                    )
                choices.append(
                    CompletionChoice(
                        index=p_idx * req.n + r.index,
                        text=prefix + r.text,
                        logprobs=self._choice_logprobs(req, gen, r, names, prefix),
                        finish_reason=r.finish_reason,
                        stop_reason=r.stop_reason,
                        prompt_logprobs=prompt_lps,
                    )
                )
        return CompletionResponse(
            id=rid,
            model=self.ctx.model_name,
            choices=choices,
            usage=Usage(
                prompt_tokens=prompt_tokens,
                completion_tokens=completion,
                total_tokens=prompt_tokens + completion,
            ),
        )

    async def stream(
        self, req: CompletionRequest, gens: list[Generation], rid: str
    ) -> AsyncIterator[str]:
        created = int(time.time())
        model = self.ctx.model_name
        completion = 0
        writer = ChunkWriter(rid, "text_completion", created, model)

        def chunk(index: int, text: str, finish: str | None, lps=None, stop_reason=None) -> str:
            return writer.choice(
                {
                    "index": index,
                    "text": text,
                    "logprobs": lps.model_dump() if lps is not None else None,
                    "finish_reason": finish,
                    "stop_reason": stop_reason,  # vLLM's, on every chunk (null until the end)
                }
            )

        names = TokenNames(self.ctx.tokenizer, req.return_tokens_as_token_ids)
        offsets: dict[int, int] = {}
        echo_with_logprobs: set[int] = set()  # choices whose echo waits for the prompt entries
        if req.echo:
            for p_idx, gen in enumerate(gens):
                for i in range(req.n):
                    if req.logprobs is not None:
                        echo_with_logprobs.add(p_idx * req.n + i)
                        continue
                    yield chunk(p_idx * req.n + i, self._echo(gen), None)
        try:
            async for p_idx, ev in merge([g.events() for g in gens]):
                ev: ChoiceEvent
                index = p_idx * req.n + ev.index
                if index in echo_with_logprobs:  # the choice's first event: echo the prompt first
                    echo_with_logprobs.discard(index)
                    gen = gens[p_idx]
                    text = self._echo(gen)
                    entries = self._prompt_entries(gen, ev.prompt_logprobs)
                    lps, offsets[index] = completion_logprobs(
                        names, [], [], req.logprobs, 0, gen.prompt_ids, entries
                    )
                    yield chunk(index, text, None, lps)
                completion += len(ev.token_ids)
                lps = None
                if req.logprobs is not None and ev.token_ids:
                    lps, offsets[index] = completion_logprobs(
                        names, ev.token_ids, ev.logprobs, req.logprobs, offsets.get(index, 0)
                    )
                if ev.text or ev.finish_reason or lps:
                    yield chunk(index, ev.text, ev.finish_reason, lps, ev.stop_reason)
        except EngineError as exc:
            yield engine_error_event(exc)
            yield DONE
            return
        finally:
            for g in gens:
                g.abort()
        if req.stream_options is not None and req.stream_options.include_usage:
            prompt_tokens = sum(g.num_prompt_tokens for g in gens)
            yield writer.usage(
                {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion,
                    "total_tokens": prompt_tokens + completion,
                }
            )
        yield DONE
