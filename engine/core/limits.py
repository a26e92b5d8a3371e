"""What a front end needs to validate requests without touching the engine (picklable constants)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.layout import RankLayout


class RequestRejected(ValueError):
    """A request that can never be served.

    Attributes:
        reason: "too_long" (over the model length or the KV cache), "invalid_token" (an id
            outside the vocabulary), "empty" or "duplicate".
    """

    def __init__(self, message: str, reason: str = "too_long"):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class EngineLimits:
    """Constants of a running engine.

    Attributes:
        max_model_len: prompt + output limit in tokens (after fitting the KV cache).
        vocab_size: valid token ids are ``[0, vocab_size)``.
        eos_token_ids: ids that end generation unless ``ignore_eos``.
        num_kv_blocks, block_size: the paged KV cache.
        max_num_batched_tokens, enable_chunked_prefill: the scheduler's step budget.
        dtype: model dtype name ("float32", "bfloat16", ...).
        ranks: where the model lives, one entry per tensor-parallel rank (start-up log, metrics).
    """

    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    num_kv_blocks: int
    block_size: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    dtype: str
    ranks: tuple[RankLayout, ...] = ()

    def validate(self, prompt_token_ids: list[int], max_tokens: int | None = None) -> None:
        """Reject a prompt that can never be served.

        A prompt must leave room for one generated token (positions ``0 .. max_model_len -
        1``), except with ``max_tokens == 0``: a request that only scores its prompt keeps no
        token, so its prompt may fill the whole ``max_model_len`` (its step computes the
        prompt's positions only).

        Raises:
            RequestRejected: empty prompt, ids outside the vocabulary, prompt at or over
                max_model_len (over it with ``max_tokens == 0``), a prompt the KV cache can
                never hold, or (chunked prefill off) one over the step budget.
        """
        n = len(prompt_token_ids)
        if not n:
            raise RequestRejected("the prompt is empty", "empty")
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= self.vocab_size:
            raise RequestRejected(
                f"prompt token ids must be in [0, {self.vocab_size})", "invalid_token"
            )
        generated = 0 if max_tokens == 0 else 1
        if n + generated > self.max_model_len:
            raise RequestRejected(
                f"prompt has {n} tokens; this model's maximum context length is "
                f"{self.max_model_len} tokens"
                + (" including at least one generated token" if generated else "")
            )
        blocks = -(-(n + generated) // self.block_size)
        if blocks > self.num_kv_blocks:
            raise RequestRejected(
                f"prompt of {n} tokens needs {blocks} KV blocks; the cache has {self.num_kv_blocks}"
            )
        if not self.enable_chunked_prefill and n > self.max_num_batched_tokens:
            raise RequestRejected(
                f"prompt of {n} tokens exceeds "
                f"max_num_batched_tokens={self.max_num_batched_tokens} "
                "with chunked prefill off"
            )
