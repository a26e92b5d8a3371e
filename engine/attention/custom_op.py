"""Attention as an opaque custom op, so that torch.compile can trace the whole model as one graph.

vLLM does the same (``vllm.unified_attention`` / ``unified_attention_with_output`` are
``torch.library`` custom ops): Dynamo and Inductor see only the op's schema and its fake
implementation, the real kernel launches (Triton, or the torch reference with its host-side
loops over sequences) stay outside the graph, and everything around them -- projections,
RMSNorm, rotary, SwiGLU, residual adds -- compiles into fused Inductor kernels and direct
cuBLAS calls.

``qwen_serve::paged_attention_qk_rope`` takes the raw q/k/v projections instead, with the
rotary rows and Qwen3's q/k norm weights: the backend normalizes, rotates and stores them
itself (the Triton backend in one launch, ``kernels/qk_norm_rope.py``), so the compiled graph
no longer holds the q/k norm + rotary kernels of each layer.
"""

from __future__ import annotations

import torch

from engine.attention.metadata import AttentionMetadata
from engine.attention.registry import get_attention_backend


def _meta_fields(meta: AttentionMetadata) -> tuple:
    """The metadata's fields in their declared order, as the ops below take them (and
    ``AttentionMetadata(*fields)`` rebuilds it): the custom ops' schema has no dataclass."""
    return (
        meta.slot_mapping,
        meta.block_tables,
        meta.seq_lens,
        meta.cu_seqlens_q,
        meta.max_query_len,
        meta.max_seq_len,
        meta.is_decode,
    )


@torch.library.custom_op("qwen_serve::paged_attention", mutates_args=("k_cache", "v_cache"))
def paged_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    is_decode: bool,
    scale: float,
    backend: str,
) -> torch.Tensor:
    """Store this step's k/v into the paged cache and attend
    (``torch.ops.qwen_serve.paged_attention``).

    Args:
        q: ``[T, H_q, D]``; k, v: ``[T, H_kv, D]`` in the cache dtype.
        k_cache, v_cache: ``[num_blocks, block_size, H_kv, D]``, updated in place (declared
            mutated, so Inductor orders the op correctly and never copies the caches).
        slot_mapping, block_tables, seq_lens, cu_seqlens_q, max_query_len, max_seq_len,
            is_decode: the fields of :class:`AttentionMetadata`.
        scale: softmax scale; backend: a name of :mod:`engine.attention.registry`.

    Returns:
        A new ``[T, H_q, D]`` tensor in ``q.dtype`` (never a view of an input).

    Raises:
        ValueError: unknown backend name, or what the backend raises.
    """
    meta = AttentionMetadata(
        slot_mapping, block_tables, seq_lens, cu_seqlens_q, max_query_len, max_seq_len, is_decode
    )
    return get_attention_backend(backend).forward(q, k, v, k_cache, v_cache, meta, scale)


@paged_attention_op.register_fake
def _paged_attention_fake(
    q,
    k,
    v,
    k_cache,
    v_cache,
    slot_mapping,
    block_tables,
    seq_lens,
    cu_seqlens_q,
    max_query_len,
    max_seq_len,
    is_decode,
    scale,
    backend,
):
    return torch.empty_like(q)


def paged_attention(
    q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, backend: str
) -> torch.Tensor:
    """:func:`paged_attention_op` with the metadata unpacked (what a compiled model calls)."""
    return paged_attention_op(
        q,
        k,
        v,
        k_cache,
        v_cache,
        *_meta_fields(meta),
        scale,
        backend,
    )


@torch.library.custom_op("qwen_serve::paged_attention_qk_rope", mutates_args=("k_cache", "v_cache"))
def paged_attention_qk_rope_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    is_decode: bool,
    scale: float,
    backend: str,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    """:func:`paged_attention_op` on the raw q/k/v projections: the backend's
    ``forward_qk_rope`` normalizes q and k per head (Qwen3; not when the weights are None),
    rotates them, stores k/v and attends (``torch.ops.qwen_serve.paged_attention_qk_rope``).

    Args:
        q: ``[T, H_q, D]``; k, v: ``[T, H_kv, D]``, any strides (views of the qkv output).
        cos, sin: ``[T, 1, D]`` rotary rows; q_weight, k_weight: ``[D]`` or both None; eps:
            the RMSNorm epsilon. The other arguments as in :func:`paged_attention_op`.

    Returns:
        A new contiguous ``[T, H_q, D]`` tensor in ``q.dtype``.

    Raises:
        ValueError: unknown backend name, or what the backend raises.
    """
    meta = AttentionMetadata(
        slot_mapping, block_tables, seq_lens, cu_seqlens_q, max_query_len, max_seq_len, is_decode
    )
    return get_attention_backend(backend).forward_qk_rope(
        q, k, v, k_cache, v_cache, meta, scale, cos, sin, q_weight, k_weight, eps
    )


@paged_attention_qk_rope_op.register_fake
def _paged_attention_qk_rope_fake(
    q,
    k,
    v,
    k_cache,
    v_cache,
    slot_mapping,
    block_tables,
    seq_lens,
    cu_seqlens_q,
    max_query_len,
    max_seq_len,
    is_decode,
    scale,
    backend,
    cos,
    sin,
    q_weight,
    k_weight,
    eps,
):
    # contiguous whatever q's strides (q is a view of the projection output here)
    return q.new_empty(q.shape)


def paged_attention_qk_rope(
    q,
    k,
    v,
    k_cache,
    v_cache,
    meta: AttentionMetadata,
    scale: float,
    backend: str,
    cos,
    sin,
    q_weight,
    k_weight,
    eps: float,
) -> torch.Tensor:
    """:func:`paged_attention_qk_rope_op` with the metadata unpacked."""
    return paged_attention_qk_rope_op(
        q,
        k,
        v,
        k_cache,
        v_cache,
        *_meta_fields(meta),
        scale,
        backend,
        cos,
        sin,
        q_weight,
        k_weight,
        eps,
    )


@torch.library.custom_op("qwen_serve::paged_attention_stored", mutates_args=())
def paged_attention_stored_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    is_decode: bool,
    scale: float,
    backend: str,
) -> torch.Tensor:
    """Attention over caches that already hold this step's k/v (the backend's
    ``forward_stored``; the q/k/v projection stored them). Reads the caches, which the
    projection's op declares mutated, so Inductor orders this op after it.

    Returns:
        A new ``[T, H_q, D]`` tensor in ``q.dtype``.

    Raises:
        ValueError: unknown backend name, a backend without ``forward_stored``, or what it
            raises.
    """
    meta = AttentionMetadata(
        slot_mapping, block_tables, seq_lens, cu_seqlens_q, max_query_len, max_seq_len, is_decode
    )
    impl = get_attention_backend(backend)
    if not hasattr(impl, "forward_stored"):
        raise ValueError(f"attention backend {backend!r} cannot attend over stored k/v")
    return impl.forward_stored(q, k_cache, v_cache, meta, scale)


@paged_attention_stored_op.register_fake
def _paged_attention_stored_fake(q, k_cache, v_cache, *rest):
    return q.new_empty(q.shape)  # contiguous whatever q's strides


def paged_attention_stored(q, k_cache, v_cache, meta: AttentionMetadata, scale, backend):
    """:func:`paged_attention_stored_op` with the metadata unpacked."""
    return paged_attention_stored_op(q, k_cache, v_cache, *_meta_fields(meta), scale, backend)


@torch.library.custom_op(
    "qwen_serve::paged_decode_partials_qk_rope", mutates_args=("k_cache", "v_cache")
)
def paged_decode_partials_qk_rope_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    is_decode: bool,
    scale: float,
    backend: str,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    num_splits: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`paged_attention_qk_rope_op` of a pure decode step up to the split-KV partials
    (the backend's ``decode_partials_qk_rope``; the Triton backend only): the output projection
    merges them (``qwen_serve::gemv_attn_merge``).

    Args:
        num_splits: host int >= 1, the partials' split count (the backend's
            ``partial_splits``); the others as in :func:`paged_attention_qk_rope_op`.

    Returns:
        New float32 ``(partial_out [T, H_q, num_splits, D], partial_lse [T, H_q, num_splits])``.

    Raises:
        ValueError: unknown backend name, a backend without partials, or what it raises.
    """
    meta = AttentionMetadata(
        slot_mapping, block_tables, seq_lens, cu_seqlens_q, max_query_len, max_seq_len, is_decode
    )
    impl = get_attention_backend(backend)
    if not hasattr(impl, "decode_partials_qk_rope"):
        raise ValueError(f"attention backend {backend!r} has no split-KV decode partials")
    return impl.decode_partials_qk_rope(
        q, k, v, k_cache, v_cache, meta, scale, cos, sin, q_weight, k_weight, eps, num_splits
    )


@paged_decode_partials_qk_rope_op.register_fake
def _paged_decode_partials_qk_rope_fake(
    q,
    k,
    v,
    k_cache,
    v_cache,
    slot_mapping,
    block_tables,
    seq_lens,
    cu_seqlens_q,
    max_query_len,
    max_seq_len,
    is_decode,
    scale,
    backend,
    cos,
    sin,
    q_weight,
    k_weight,
    eps,
    num_splits,
):
    t, h, d = q.shape
    f32 = torch.float32
    return q.new_empty((t, h, num_splits, d), dtype=f32), q.new_empty((t, h, num_splits), dtype=f32)


def paged_decode_partials_qk_rope(
    q,
    k,
    v,
    k_cache,
    v_cache,
    meta: AttentionMetadata,
    scale: float,
    backend: str,
    cos,
    sin,
    q_weight,
    k_weight,
    eps: float,
    num_splits: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`paged_decode_partials_qk_rope_op` with the metadata unpacked."""
    return paged_decode_partials_qk_rope_op(
        q,
        k,
        v,
        k_cache,
        v_cache,
        *_meta_fields(meta),
        scale,
        backend,
        cos,
        sin,
        q_weight,
        k_weight,
        eps,
        num_splits,
    )
