"""What the route handlers share: the engine, tokenizer and server settings (explicit, no
globals)."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property

from engine.core.stats import RequestStats
from engine.core.structured_output import StructuredOutputSpec
from engine.frontend.async_engine import AsyncEngine
from engine.frontend.tokenizer import Tokenizer
from server.errors import APIError
from server.metrics import ServerMetrics
from server.prompt_encoder import PromptEncoder
from server.structured_outputs import GrammarValidator

log = logging.getLogger("server.requests")


def _unencodable(param: str, exc: Exception) -> APIError:
    return APIError(
        400,
        f"the text of '{param}' cannot be tokenized ({type(exc).__name__})",
        param,
        "invalid_text",
    )


@dataclass(frozen=True)
class CorsPolicy:
    """Cross-origin resource sharing of the API (Starlette's ``CORSMiddleware`` applies it):
    the origins, methods and request headers browsers may use (``"*"``: any), and whether
    they may send credentials. Empty ``allowed_origins`` (the default): no CORS headers at
    all, so browsers refuse cross-origin calls; vLLM's default is any origin (``["*"]``),
    which lets every web page a user opens use a server without an API key."""

    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False


@dataclass
class ServerContext:
    """Attributes:
    engine: the shared async engine; tokenizer: the checkpoint's tokenizer.
    model_name: the served model id (requests naming another model get 404).
    defaults: sampling defaults from generation_config.json.
    reasoning_parser: "qwen3" to split <think> into reasoning_content, or None.
    api_key: bearer token required on /v1 routes, or None.
    max_body_bytes: request bodies above this get 413.
    max_prompt_tokens: prompts above this get 400 (defaults to the model length).
    encoder: encodes prompts (fastokens where exact, see :mod:`server.prompt_encoder`);
        None: ``tokenizer.encode``.
    grammar_validator: compiles structured-output grammars before a request is queued
        (None: structured outputs are refused with a 400).
    cors: the API's CORS policy (:class:`CorsPolicy`).
    render_pool: the one thread that renders long conversations' chat templates off the event
        loop (:func:`server.chat.render_prompt_async`).
    """

    engine: AsyncEngine
    tokenizer: Tokenizer
    model_name: str
    metrics: ServerMetrics
    defaults: dict = field(default_factory=dict)
    reasoning_parser: str | None = None
    api_key: str | None = None
    max_body_bytes: int = 4 << 20
    max_prompt_tokens: int | None = None
    protect_metrics: bool = False
    encoder: PromptEncoder | None = None
    grammar_validator: GrammarValidator | None = None
    cors: CorsPolicy = field(default_factory=CorsPolicy)
    #: the thread that renders long conversations' chat templates
    #: (:func:`server.chat.render_prompt_async`; started on first use)
    render_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="chat-template")
    )

    #: prompts of at least this many characters are encoded in a worker thread, shorter ones
    #: inline, by ``tokenizers`` (its worst case on the dev VM at 2,047 characters: ~5 ms)...
    ENCODE_IN_THREAD_CHARS = 2048
    #: ... and by fastokens (~0.5 ms for a 1,024-token random-token prompt of ~5,500 characters
    #: in the server on the dev VM, where the thread hop costs ~0.15-0.25 ms; its worst cases at
    #: 8,191 characters, random rare CJK or a whitespace run, take 5-8 ms: the same order as
    #: tokenizers' at 2,047; docs/benchmarks.md, 2026-12-05, fourth session)
    FAST_ENCODE_IN_THREAD_CHARS = 8192

    def _inline(self, text: str, fast: bool) -> bool:
        """Whether to encode ``text`` on the event loop (``fast``: by the fastokens encoder)."""
        limit = self.FAST_ENCODE_IN_THREAD_CHARS if fast else self.ENCODE_IN_THREAD_CHARS
        return len(text) < limit

    def encode_prompt(self, text: str, param: str = "prompt") -> list[int]:
        """Token ids of a prompt text (no special tokens added; those written in it are kept).

        Raises:
            APIError: 400 naming ``param`` when the tokenizer refuses the text (request strings
                are checked for lone surrogates when they are parsed, see
                :mod:`server.protocol`; this catches anything else a tokenizer rejects).
        """
        try:
            if self.encoder is not None:
                return self.encoder.encode(text)
            return self.tokenizer.encode(text)
        except (TypeError, ValueError, UnicodeError) as exc:
            raise _unencodable(param, exc) from None

    def encode_with_special_tokens(self, text: str, param: str) -> list[int]:
        """Like :meth:`encode_prompt`, with the tokenizer's post-processor (``/tokenize``'s
        ``add_special_tokens``)."""
        try:
            return self.tokenizer.encode(text, add_special_tokens=True)
        except (TypeError, ValueError, UnicodeError) as exc:
            raise _unencodable(param, exc) from None

    @cached_property
    def special_tokens_added(self) -> bool:
        """Whether the tokenizer's post-processor adds tokens (``add_special_tokens``); Qwen's adds
        none, so the flag changes no id there and the fast encoder keeps serving it."""
        return self.tokenizer.encode("a", add_special_tokens=True) != self.tokenizer.encode("a")

    async def encode_request_prompt(
        self, text: str, param: str, add_special_tokens: bool
    ) -> list[int]:
        """A request's prompt ids: :meth:`encode_prompt_async`, or with ``add_special_tokens``
        (vLLM's request field) the tokenizer's post-processor where it adds anything.

        Raises:
            APIError: as :meth:`encode_prompt`.
        """
        if add_special_tokens and self.special_tokens_added:
            if self._inline(text, fast=False):  # the post-processor: tokenizers
                return self.encode_with_special_tokens(text, param)
            return await asyncio.to_thread(self.encode_with_special_tokens, text, param)
        return await self.encode_prompt_async(text, param)

    async def encode_prompt_async(self, text: str, param: str = "prompt") -> list[int]:
        """:meth:`encode_prompt` off the event loop for long prompts.

        Both encoders release the GIL while they work (fastokens, and ``tokenizers`` through
        ``encode_batch``), so a burst of long prompts no longer stalls every stream's token
        delivery (it set the p99 inter-token latency at concurrency 64: docs/benchmarks.md,
        third session). Short prompts are encoded inline: the thread hand-off would cost more
        than the encoding.
        """
        fast = self.encoder is not None and self.encoder.backend == "fastokens"
        if self._inline(text, fast):
            return self.encode_prompt(text, param)
        return await asyncio.to_thread(self.encode_prompt, text, param)

    async def structured_output(
        self, grammar: str | None, param: str, start_after_token: int | None = None
    ) -> StructuredOutputSpec | None:
        """The validated spec of a request's grammar (None for none).

        Raises:
            APIError: 400 naming ``param`` when the grammar does not compile in time, or when
                this server has no grammar engine.
        """
        if grammar is None:
            return None
        if self.grammar_validator is None:
            raise APIError(400, "structured outputs are not available on this server", param)
        await self.grammar_validator.validate(grammar, param)
        return StructuredOutputSpec(grammar, start_after_token)

    def check_model(self, model: str | None) -> None:
        """Raises APIError 404 when a request names a model this server does not serve."""
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"The model '{model}' does not exist; this server serves '{self.model_name}'.",
                "model",
                "model_not_found",
            )

    def check_prompt_length(self, num_tokens: int, param: str) -> None:
        """Raises APIError 400 when a prompt exceeds ``--max-prompt-tokens``."""
        limit = self.max_prompt_tokens
        if limit is not None and num_tokens > limit:
            raise APIError(400, f"prompt has {num_tokens} tokens; the limit is {limit}", param)

    def request_finished(self, stats: RequestStats, itls: list[float]) -> None:
        """Record a finished engine request in the metrics and log one line for it."""
        self.metrics.on_request_finished(stats, itls)
        ttft = f"{1e3 * stats.ttft:.1f}ms" if stats.ttft is not None else "-"
        log.info(
            "finished %s: prompt %d tokens, generated %d, TTFT %s, total %.1fms, reason %s",
            stats.request_id,
            stats.num_prompt_tokens,
            stats.num_generation_tokens,
            ttft,
            1e3 * stats.e2e_latency,
            stats.finish_reason,
        )

    def end_in_flight(self, graceful_timeout: float, early: bool = False) -> int:
        """The server is shutting down and its in-flight requests must end now: the graceful
        timeout (``graceful_timeout`` seconds) expired, or (``early``) a second signal came
        first. Streams end with an error event (503, code ``server_shutting_down``) and
        ``[DONE]``, other requests get that 503; the engine aborts them (their KV blocks are
        freed) and refuses new ones. Returns how many engine requests (one per choice) were
        ended."""
        if early:
            why = f"a second shutdown signal ended the request before the {graceful_timeout:g} s"
            why += " graceful timeout"
        else:
            why = f"the request did not finish within the {graceful_timeout:g} s graceful timeout"
        n = self.engine.abort_all(f"the server is shutting down: {why}")
        if n:
            log.warning(
                "%s: aborting %d in-flight engine request(s) (choices)",
                "second shutdown signal"
                if early
                else f"graceful timeout ({graceful_timeout:g} s) expired",
                n,
            )
        return n

    @property
    def max_model_len(self) -> int:
        return self.engine.limits.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.limits.vocab_size
