"""Attention metadata of one engine step and the attention backends that consume it.

The model runner builds one :class:`AttentionMetadata` per step and passes it explicitly to
every layer (no global context). A backend stores the step's new keys/values into the paged
cache and computes attention for the packed queries; see ``kernels/reference.py`` for the
tensor layouts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class AttentionMetadata:
    """Flat tensors describing the sequences of one step (all on the model's device).

    Attributes:
        slot_mapping: int64 ``[T]`` cache slot of every new token (``-1`` = padding, not stored).
        block_tables: int32 ``[B, max_blocks_per_seq]`` physical block ids per sequence.
        seq_lens: int32 ``[B]`` tokens in the cache per sequence after this step's store.
        cu_seqlens_q: int32 ``[B + 1]`` offsets of each sequence's new tokens in the packed batch.
        max_query_len: an upper bound of the new tokens of one sequence in this step (the
            padded token count inside a CUDA graph); no kernel reads it (the Triton kernels
            size their grids from tensor shapes), the runner uses it to tell decode steps apart.
        max_seq_len: an upper bound of the ``seq_lens`` entries (``max_model_len`` inside a
            CUDA graph); sizes the decode kernel's KV split count.
        is_decode: True when every sequence contributes exactly one new token; the backend may
            then use the paged-decode path (queries ``[B, H_q, D]``).
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    max_query_len: int
    max_seq_len: int
    is_decode: bool


class AttentionBackend(Protocol):
    """Stores k/v into the paged cache and attends; implemented by the torch and Triton backends."""

    name: str

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Attention of one layer for one step.

        Args:
            q: ``[T, H_q, D]``; k, v: ``[T, H_kv, D]`` (this step's new tokens, packed).
            k_cache, v_cache: ``[num_blocks, block_size, H_kv, D]`` of this layer, updated in place.
            meta: the step's metadata; scale: softmax scale.

        Returns:
            ``[T, H_q, D]`` attention output in ``q.dtype``.
        """
        ...


class TorchAttentionBackend:
    """Pure-torch backend (CPU and CUDA): the reference implementations in ``kernels.reference``."""

    name = "torch"

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        from kernels.reference import (
            decode_attention_ref,
            prefill_attention_ref,
            store_kv_cache_ref,
        )

        store_kv_cache_ref(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        if meta.is_decode:
            return decode_attention_ref(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, out, scale)
        return prefill_attention_ref(
            q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q, meta.seq_lens, out, scale
        )


#: The process-wide backend instance of each name. The ``qwen_serve::paged_attention`` custom op
#: receives only the backend's *name* (a custom op cannot take a Python object), so this is the
#: one place that maps a name to an instance; :func:`get_attention_backend` fills it. Sharing one
#: instance per name is safe: the torch backend is stateless and the Triton backend's state is
#: its decode scratch, reused by every layer and step already (one engine per process; two
#: engines on concurrent CUDA streams in one process would share that scratch).
_BACKENDS: dict[str, AttentionBackend] = {}


def get_attention_backend(name: str | None, device: torch.device) -> AttentionBackend:
    """The backend ``"torch"``, ``"triton"``, or None for Triton on CUDA and torch elsewhere.

    Returns the process-wide instance of that name (see ``_BACKENDS``), created on first use.

    Raises:
        ValueError: unknown name.
    """
    if name is None:
        name = "triton" if device.type == "cuda" else "torch"
    backend = _BACKENDS.get(name)
    if backend is not None:
        return backend
    if name == "torch":
        backend = TorchAttentionBackend()
    elif name == "triton":
        from engine.triton_backend import TritonAttentionBackend

        backend = TritonAttentionBackend()
    else:
        raise ValueError(f"unknown attention backend {name!r}; expected 'triton' or 'torch'")
    _BACKENDS[name] = backend
    return backend


# ---------------------------------------------------------------------------------------------
# Attention as an opaque custom op, so that torch.compile can trace the whole model as one graph.
#
# vLLM does the same (``vllm.unified_attention`` / ``unified_attention_with_output`` are
# ``torch.library`` custom ops): Dynamo and Inductor see only the op's schema and its fake
# implementation, the real kernel launches (Triton, or the torch reference with its host-side
# loops over sequences) stay outside the graph, and everything around them -- projections,
# RMSNorm, rotary, SwiGLU, residual adds -- compiles into fused Inductor kernels and direct
# cuBLAS calls.
# ---------------------------------------------------------------------------------------------


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
    """Store this step's k/v into the paged cache and attend (``torch.ops.qwen_serve.paged_attention``).

    Args:
        q: ``[T, H_q, D]``; k, v: ``[T, H_kv, D]`` in the cache dtype.
        k_cache, v_cache: ``[num_blocks, block_size, H_kv, D]``, updated in place (declared
            mutated, so Inductor orders the op correctly and never copies the caches).
        slot_mapping, block_tables, seq_lens, cu_seqlens_q, max_query_len, max_seq_len,
            is_decode: the fields of :class:`AttentionMetadata`.
        scale: softmax scale; backend: a name accepted by :func:`get_attention_backend`.

    Returns:
        A new ``[T, H_q, D]`` tensor in ``q.dtype`` (never a view of an input).

    Raises:
        ValueError: unknown backend name, or what the backend raises.
    """
    meta = AttentionMetadata(slot_mapping, block_tables, seq_lens, cu_seqlens_q, max_query_len, max_seq_len, is_decode)
    return get_attention_backend(backend, q.device).forward(q, k, v, k_cache, v_cache, meta, scale)


@paged_attention_op.register_fake
def _paged_attention_fake(q, k, v, k_cache, v_cache, slot_mapping, block_tables, seq_lens, cu_seqlens_q,
                          max_query_len, max_seq_len, is_decode, scale, backend):
    return torch.empty_like(q)


def paged_attention(q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, backend: str) -> torch.Tensor:
    """:func:`paged_attention_op` with the metadata unpacked (what the compiled model calls)."""
    return paged_attention_op(
        q, k, v, k_cache, v_cache, meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q,
        meta.max_query_len, meta.max_seq_len, meta.is_decode, scale, backend,
    )
