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
        max_query_len: longest run of new tokens of one sequence in this step.
        max_seq_len: largest ``seq_lens`` entry.
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
        from kernels.reference import decode_attention_ref, prefill_attention_ref, store_kv_cache_ref

        store_kv_cache_ref(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        if meta.is_decode:
            return decode_attention_ref(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, out, scale)
        return prefill_attention_ref(
            q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q, meta.seq_lens, out, scale
        )


def get_attention_backend(name: str | None, device: torch.device) -> AttentionBackend:
    """Pick the backend: ``"torch"``, ``"triton"``, or None for Triton on CUDA and torch elsewhere.

    Raises:
        ValueError: unknown name, or ``"triton"`` requested on a CPU device without
            ``TRITON_INTERPRET=1``.
    """
    if name is None:
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        return TorchAttentionBackend()
    if name == "triton":
        from engine.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; expected 'triton' or 'torch'")
