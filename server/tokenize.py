"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's request and response shapes.

``/tokenize`` takes a ``prompt`` (encoded as ``/v1/completions`` encodes it; with
``add_special_tokens`` the tokenizer's post-processor runs, which adds nothing for Qwen) or chat
``messages`` (rendered by the chat template exactly as ``/v1/chat/completions`` renders them, so
``count`` is that request's ``usage.prompt_tokens``) and returns ``tokens``, ``count``,
``max_model_len`` and, with ``return_token_strs``, the tokens' vocabulary strings.
``/detokenize`` turns ids back into text (special tokens kept).
"""

from __future__ import annotations

import json

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from server.chat import check_tool_choice, render_prompt_async
from server.context import ServerContext
from server.errors import APIError, body_parse_error
from server.params import shown
from server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from server.text_check import check_request_text


async def parse_body(raw: Request, model_for):
    """Read and validate a JSON body with the model ``model_for(body)`` picks.

    Raises:
        RequestValidationError: not JSON, or invalid for that model (the app's handler turns it
            into a 400 naming the parameter).
        APIError: 400 for bytes that are not UTF-8, JSON nested too deeply or an integer literal
            too long to parse (as :func:`~server.errors.body_parse_error` words them).
    """
    data = await raw.body()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise body_parse_error(exc) from None
    try:
        body = json.loads(data)
    except json.JSONDecodeError:
        raise RequestValidationError(
            [{"type": "json_invalid", "loc": ("body",), "msg": "invalid JSON"}]
        ) from None
    except (ValueError, RecursionError) as exc:  # an integer too long, nesting too deep
        raise body_parse_error(exc) from None
    cls = model_for(body)
    try:
        return cls.model_validate(body)
    except ValidationError as exc:
        errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]
        raise RequestValidationError(errors) from None


def _tokenize_model(body) -> type:
    """The request shape of a ``/tokenize`` body: chat (``messages``) or completion.

    Raises:
        APIError: 400 naming ``messages`` when the body has both ``prompt`` and ``messages``
            (either shape would call the other field unknown).
    """
    if isinstance(body, dict) and "messages" in body:
        if "prompt" in body:
            raise APIError(
                400,
                "send either prompt (text or token ids) or messages (a chat), not both",
                "messages",
            )
        return TokenizeChatRequest
    return TokenizeCompletionRequest


class Tokenization:
    """The two endpoints' logic, bound to a :class:`ServerContext`."""

    def __init__(self, ctx: ServerContext):
        self.ctx = ctx

    async def tokenize(self, raw: Request) -> TokenizeResponse:
        """Raises APIError (400 / 404) or RequestValidationError."""
        ctx = self.ctx
        req = await parse_body(raw, _tokenize_model)
        check_request_text(req)
        ctx.check_model(req.model)
        if isinstance(req, TokenizeChatRequest):
            check_tool_choice(req)  # as chat completions checks it
            body_bytes = getattr(raw.state, "body_bytes", 0)
            text = await render_prompt_async(ctx.tokenizer, req, ctx.render_pool, body_bytes)
            param = "messages"
        else:
            text, param = req.prompt, "prompt"
        ids = await ctx.encode_request_prompt(text, param, req.add_special_tokens)
        strs = ctx.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return TokenizeResponse(
            count=len(ids), max_model_len=ctx.max_model_len, tokens=ids, token_strs=strs
        )

    async def detokenize(self, raw: Request) -> DetokenizeResponse:
        """Raises APIError (400 for an id outside the vocabulary, 404) or
        RequestValidationError."""
        ctx = self.ctx
        req = await parse_body(raw, lambda _: DetokenizeRequest)
        check_request_text(req)
        ctx.check_model(req.model)
        bad = next((t for t in req.tokens if not 0 <= t < ctx.vocab_size), None)
        if bad is not None:
            raise APIError(
                400,
                f"token id {shown(bad)} is outside the vocabulary [0, {ctx.vocab_size})",
                "tokens",
            )
        return DetokenizeResponse(
            prompt=ctx.tokenizer.decode(req.tokens, skip_special_tokens=False)
        )
