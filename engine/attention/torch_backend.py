"""Pure-torch attention backend (CPU and CUDA): the reference implementations in
``kernels.reference``."""

from __future__ import annotations

import torch

from engine.attention.metadata import AttentionMetadata
from kernels.reference import (
    decode_attention_ref,
    prefill_attention_ref,
    qk_norm_rope_store_ref,
    store_kv_cache_ref,
)


class TorchAttentionBackend:
    """Stores k/v with :func:`store_kv_cache_ref` (``forward_qk_rope``: q/k norm and rotary
    first, :func:`qk_norm_rope_store_ref`), then the decode or prefill reference.

    Stateless. Shapes as in :class:`engine.attention.backend.AttentionBackend`.
    """

    name = "torch"

    def forward(
        self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        store_kv_cache_ref(k, v, k_cache, v_cache, meta.slot_mapping)
        return self._attend(q, k_cache, v_cache, meta, scale)

    def forward_qk_rope(
        self,
        q,
        k,
        v,
        k_cache,
        v_cache,
        meta: AttentionMetadata,
        scale: float,
        cos,
        sin,
        q_weight,
        k_weight,
        eps: float,
    ) -> torch.Tensor:
        """:func:`qk_norm_rope_store_ref` (rms_norm -> rope -> store), then attention as
        :meth:`forward`."""
        q = qk_norm_rope_store_ref(
            q, k, v, k_cache, v_cache, meta.slot_mapping, cos, sin, q_weight, k_weight, eps
        )
        return self._attend(q, k_cache, v_cache, meta, scale)

    def _attend(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        out = torch.empty_like(q)
        if meta.is_decode:
            return decode_attention_ref(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, out, scale
            )
        return prefill_attention_ref(
            q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q, meta.seq_lens, out, scale
        )
