"""POST /v1/completions: text prompts (or token ids), echo, logprobs, streaming."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from engine.core.limits import RequestRejected
from server.context import ServerContext
from server.errors import APIError, error_body, rejected
from server.generation import ChoiceEvent, EngineError, Generation, merge
from server.params import to_sampling_params
from server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Usage,
    new_id,
)
from server.stream import DONE, ChunkWriter, sse
from server.structured_outputs import grammar_from_request


class Completions:
    """The text-completion endpoint's logic, bound to a :class:`ServerContext`."""

    def __init__(self, ctx: ServerContext):
        self.ctx = ctx

    async def _prompts(self, req: CompletionRequest) -> list[list[int]]:
        p = req.prompt
        encode = self.ctx.encode_prompt_async
        if isinstance(p, str):
            return [await encode(p)]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        if all(isinstance(x, str) for x in p):
            return [await encode(x) for x in p]
        return [list(x) for x in p]

    async def start(self, req: CompletionRequest) -> tuple[list[Generation], str]:
        """Validate and queue every prompt's choices. Raises APIError (400/404)."""
        ctx = self.ctx
        ctx.check_model(req.model)
        if req.suffix:
            raise APIError(400, "suffix is not supported", "suffix")
        rid = new_id("cmpl")
        grammar, param = grammar_from_request(req)
        spec = await ctx.structured_output(grammar, param)
        prompts = await self._prompts(req)
        if len(prompts) * req.n > 64:
            raise APIError(400, "at most 64 choices (prompts x n) per request", "prompt")
        gens: list[Generation] = []
        try:
            for i, ids in enumerate(prompts):
                if not ids:
                    raise APIError(400, "prompt must not be empty", "prompt")
                ctx.check_prompt_length(len(ids), "prompt")
                params = to_sampling_params(
                    req,
                    max_tokens=req.max_tokens if req.max_tokens is not None else 16,
                    logprobs=req.logprobs,
                    num_prompt_tokens=len(ids),
                    max_model_len=ctx.max_model_len,
                    vocab_size=ctx.vocab_size,
                    defaults=ctx.defaults,
                    prompt_param="prompt",
                )
                params.structured_output = spec
                gens.append(
                    Generation(
                        ctx.engine,
                        ctx.tokenizer,
                        f"{rid}-p{i}",
                        ids,
                        params,
                        req.n,
                        on_finished=ctx.request_finished,
                    )
                )
        except BaseException as exc:
            for g in gens:  # do not leave the prompts already queued running
                g.abort()
            if isinstance(exc, RequestRejected):
                raise rejected(exc, "prompt") from None
            raise
        return gens, rid

    def _logprobs(self, token_ids: list[int], entries: list, offset: int) -> CompletionLogprobs:
        tok = self.ctx.tokenizer
        out = CompletionLogprobs()
        for t, e in zip(token_ids, entries):
            text = tok.decode([t], skip_special_tokens=False)
            out.tokens.append(text)
            out.token_logprobs.append(e[0] if e else None)
            out.top_logprobs.append(
                {tok.decode([i], skip_special_tokens=False): lp for i, lp in e[1]} if e else None
            )
            out.text_offset.append(offset)
            offset += len(text)
        return out

    def _echo(self, gen: Generation) -> str:
        return self.ctx.tokenizer.decode(gen.prompt_ids, skip_special_tokens=False)

    async def complete(
        self, req: CompletionRequest, gens: list[Generation], rid: str
    ) -> CompletionResponse:
        results = await asyncio.gather(*(g.collect() for g in gens))
        choices = []
        prompt_tokens = completion = 0
        for p_idx, (gen, res) in enumerate(zip(gens, results)):
            prompt_tokens += gen.num_prompt_tokens
            prefix = self._echo(gen) if req.echo else ""
            for r in res:
                completion += len(r.token_ids)
                lps = (
                    self._logprobs(r.token_ids, r.logprobs, len(prefix))
                    if req.logprobs is not None
                    else None
                )
                choices.append(
                    CompletionChoice(
                        index=p_idx * req.n + r.index,
                        text=prefix + r.text,
                        logprobs=lps,
                        finish_reason=r.finish_reason,
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

        def chunk(index: int, text: str, finish: str | None, lps=None) -> str:
            return writer.choice(
                {
                    "index": index,
                    "text": text,
                    "logprobs": lps.model_dump() if lps is not None else None,
                    "finish_reason": finish,
                }
            )

        offsets: dict[int, int] = {}
        if req.echo:
            for p_idx, gen in enumerate(gens):
                for i in range(req.n):
                    text = self._echo(gen)
                    offsets[p_idx * req.n + i] = len(text)
                    yield chunk(p_idx * req.n + i, text, None)
        try:
            async for p_idx, ev in merge([g.events() for g in gens]):
                ev: ChoiceEvent
                index = p_idx * req.n + ev.index
                completion += len(ev.token_ids)
                lps = None
                if req.logprobs is not None and ev.token_ids:
                    lps = self._logprobs(ev.token_ids, ev.logprobs, offsets.get(index, 0))
                offsets[index] = offsets.get(index, 0) + len(ev.text)
                if ev.text or ev.finish_reason or lps:
                    yield chunk(index, ev.text, ev.finish_reason, lps)
        except EngineError as exc:
            yield sse(error_body(500, f"engine error: {exc}"))
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
