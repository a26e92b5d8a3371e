"""Prompt attention of a lone prompt with no cached prefix, through cuDNN's fused attention.

When a step holds one whole prompt and nothing else (the scheduler's whole-prompt step on an
idle engine, ``EngineConfig.lone_prompt_min_tokens``), its attention is plain causal
self-attention over the step's own keys: no paged prefix, no bottom-right offset. On the H200,
cuDNN's fused attention (reached through ``torch.nn.functional.scaled_dot_product_attention``)
runs that shape at 566-591 TFLOP/s where the Triton prefill kernel reaches 482-497; with this
module's gather, GQA repeat and padding the path takes 0.88-0.96x the Triton kernel's time at
16-32k tokens and is slower at 8k (docs/benchmarks.md, 2026-12-04, both sessions: Triton 3.6 does
not express FlashAttention-3's overlap of softmax with the tensor-core work; Shah et al.,
"FlashAttention-3", 2024). Every other prefill
launch (chunks over cached keys, several sequences, CUDA graphs) keeps the Triton kernel, which
is faster than SDPA on chunks over a cached prefix.

The step's keys and values are read back from the paged cache (the fused q/k norm + rotary +
store kernel writes the rotated keys only there): one gather of the sequence's blocks, then
SDPA on ``[1, H, T_pad, D]`` views of zero-padded buffers with the KV heads repeated for GQA
(T_pad: :func:`padded_length`, so that cuDNN's per-shape plans are built at start-up).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.metadata import AttentionMetadata

__all__ = [
    "DENSE_BUCKET",
    "dense_causal_attention",
    "is_lone_fresh_prompt",
    "padded_length",
    "warm_up",
]

#: prompt lengths are padded to a multiple of this many tokens (:func:`padded_length`)
DENSE_BUCKET = 2048


def is_lone_fresh_prompt(meta: AttentionMetadata, num_tokens: int) -> bool:
    """Whether a step is one prompt with nothing in the cache before it, from host ints only.

    Args:
        meta: the step's metadata; its ``max_query_len`` / ``max_seq_len`` are exact outside
            CUDA graphs (where this is asked only while not capturing).
        num_tokens: rows of the step's queries (``q.shape[0]``).

    Returns:
        True when the step has one sequence whose ``num_tokens`` new tokens are all its tokens
        (``seq_len == query_len == num_tokens``). Raises nothing.
    """
    return (
        meta.block_tables.shape[0] == 1
        and not meta.is_decode
        and meta.max_query_len == num_tokens
        and meta.max_seq_len == num_tokens
    )


def padded_length(num_tokens: int, bucket: int = DENSE_BUCKET) -> int:
    """``num_tokens`` rounded up to a multiple of ``bucket``: the length cuDNN sees.

    cuDNN builds an execution plan for every shape it meets, about 74 ms on the H200 (torch keeps
    them per thread); padding to a few lengths lets start-up build them all
    (:func:`warm_up`) so that no request pays for one. Padded query rows come after every real
    row and padded keys after every real key, so under the causal mask no real row sees them.
    """
    return -(-num_tokens // bucket) * bucket


def dense_causal_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    bucket: int = DENSE_BUCKET,
) -> torch.Tensor:
    """Causal attention of one prompt over its own keys, read from the paged cache.

    Args:
        q: ``[T, H_q, D]`` queries of the prompt's tokens 0..T-1 (bf16/fp16), any strides.
        k_cache, v_cache: ``[num_blocks, block_size, H_kv, D]`` with the prompt's keys/values
            already stored in the blocks of ``block_table``; ``H_q % H_kv == 0``.
        block_table: int32 ``[>= ceil(T / block_size)]`` the prompt's block ids, in order.
        out: ``[T, H_q, D]`` written in place; scale: the softmax scale.
        bucket: q, k and v are zero-padded to :func:`padded_length` rows (``[1, T_pad, H_q, D]``
            buffers, passed to SDPA as ``[1, H_q, T_pad, D]`` views).

    Returns:
        ``out``: row ``i`` attends to keys ``0..i`` (the mask of
        :func:`kernels.reference.prefill_attention_ref` for a sequence with no cached prefix).

    Raises:
        RuntimeError: from SDPA when no allowed backend takes the inputs (the caller's backend
            selection, ``torch.nn.attention.sdpa_kernel``, is around it).
    """
    t, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    t_pad = padded_length(t, bucket)
    blocks = block_table[: -(-t // block_size)].long()
    group = num_heads // num_kv_heads

    def padded(rows: torch.Tensor, grouped: bool) -> torch.Tensor:
        buf = rows.new_empty(1, t_pad, num_heads, head_dim)
        if grouped:  # head h reads KV head h // group (repeat_interleave)
            buf[0, :t].view(t, num_kv_heads, group, head_dim).copy_(
                rows.unsqueeze(2).expand(t, num_kv_heads, group, head_dim)
            )
        else:
            buf[0, :t] = rows
        buf[0, t:] = 0
        return buf.transpose(1, 2)  # [1, H_q, T_pad, D]

    def cached(cache: torch.Tensor) -> torch.Tensor:
        rows = cache.index_select(0, blocks).view(-1, num_kv_heads, head_dim)[:t]
        return padded(rows, grouped=True)

    o = F.scaled_dot_product_attention(
        padded(q, grouped=False), cached(k_cache), cached(v_cache), is_causal=True, scale=scale
    )
    out.copy_(o.transpose(1, 2)[0, :t])
    return out


def warm_up(
    max_tokens: int,
    min_tokens: int,
    num_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    scale: float,
    bucket: int = DENSE_BUCKET,
) -> int:
    """Build cuDNN's plans for every padded length a lone prompt of ``min_tokens`` to
    ``max_tokens`` tokens can take, on the calling thread (torch caches them per thread: call it
    from the thread that runs the steps).

    Args:
        max_tokens, min_tokens: the range of prompt lengths taking the cuDNN path.
        num_heads, head_dim, dtype, device, scale: as the attention layers will call it.

    Returns:
        The number of lengths built (0 when the range is empty).

    Raises:
        RuntimeError: cuDNN refuses the shape (the caller then keeps the Triton kernel).
    """
    lengths = range(
        padded_length(min_tokens, bucket), padded_length(max_tokens, bucket) + 1, bucket
    )
    for t_pad in lengths:
        x = torch.zeros(1, t_pad, num_heads, head_dim, dtype=dtype, device=device).transpose(1, 2)
        F.scaled_dot_product_attention(x, x, x, is_causal=True, scale=scale)
    return len(lengths)
