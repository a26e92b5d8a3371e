"""The attention layer the models hold: paged attention through one backend, chosen at build
time."""

from __future__ import annotations

import torch
from torch import nn

from engine.attention.custom_op import (
    paged_attention,
    paged_attention_qk_rope,
    paged_attention_stored,
    paged_decode_partials_qk_rope,
)
from engine.attention.metadata import AttentionMetadata
from engine.attention.registry import get_attention_backend


class PagedAttention(nn.Module):
    """Stores a step's keys/values into this layer's paged KV cache and attends.

    Args:
        num_heads, num_kv_heads, head_dim: the layer's query heads, KV heads (GQA) and head size.
        backend: registry name of the attention backend ("torch", "triton").
        custom_op: call the backend through the ``qwen_serve::paged_attention`` custom op, so a
            whole-model ``torch.compile`` traces the layer as one opaque node (``compile_mode
            "model"``); otherwise call the backend directly.

    Raises:
        ValueError: unknown backend name.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        backend: str,
        custom_op: bool = False,
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.backend = get_attention_backend(backend)
        self.backend_name = backend
        self.custom_op = custom_op

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """``q`` ``[T, H_q, D]``, ``k``/``v`` ``[T, H_kv, D]``; ``kv_cache`` this layer's (k, v)
        caches ``[num_blocks, block_size, H_kv, D]``, updated in place. Returns ``[T, H_q, D]``."""
        if self.custom_op:
            return paged_attention(
                q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, self.backend_name
            )
        return self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)

    def forward_qk_rope(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        cos: torch.Tensor,
        sin: torch.Tensor,
        q_weight: torch.Tensor | None,
        k_weight: torch.Tensor | None,
        eps: float,
    ) -> torch.Tensor:
        """:meth:`forward` on the raw projections: the backend applies the per-head q/k RMSNorm
        (``q_weight``/``k_weight`` ``[D]``, both None: none) and the rotary embedding (``cos``,
        ``sin`` ``[T, 1, D]``) before storing k/v and attending (``forward_qk_rope`` of
        :class:`engine.attention.backend.AttentionBackend`). ``q`` ``[T, H_q, D]``, ``k``/``v``
        ``[T, H_kv, D]`` may be strided views. Returns ``[T, H_q, D]``.

        Raises:
            ValueError: what the backend raises (shapes, dtypes, device).
        """
        k_cache, v_cache = kv_cache
        if self.custom_op:
            return paged_attention_qk_rope(
                q,
                k,
                v,
                k_cache,
                v_cache,
                meta,
                self.scale,
                self.backend_name,
                cos,
                sin,
                q_weight,
                k_weight,
                eps,
            )
        return self.backend.forward_qk_rope(
            q, k, v, k_cache, v_cache, meta, self.scale, cos, sin, q_weight, k_weight, eps
        )

    def has_stored_attend(self) -> bool:
        """Whether the backend attends over caches the q/k/v projection already filled
        (:meth:`forward_stored`; the Triton backend)."""
        return hasattr(self.backend, "forward_stored")

    def forward_stored(
        self, q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        """Attention of ``q`` ``[T, H_q, D]`` (normalized and rotated, any strides) over this
        layer's caches, which already hold this step's k/v (``kernels.gemv_qk_rope`` stored
        them). Returns ``[T, H_q, D]``.

        Raises:
            ValueError: a backend without it (:meth:`has_stored_attend`), or what it raises.
        """
        k_cache, v_cache = kv_cache
        if self.custom_op:
            return paged_attention_stored(q, k_cache, v_cache, meta, self.scale, self.backend_name)
        if not self.has_stored_attend():
            name = self.backend_name
            raise ValueError(f"attention backend {name!r} cannot attend over stored k/v")
        return self.backend.forward_stored(q, k_cache, v_cache, meta, self.scale)

    def has_decode_partials(self) -> bool:
        """Whether the backend can stop a pure decode step at the split-KV partials
        (:meth:`decode_partials_qk_rope`; the Triton backend)."""
        return hasattr(self.backend, "decode_partials_qk_rope")

    def decode_partials_qk_rope(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        cos: torch.Tensor,
        sin: torch.Tensor,
        q_weight: torch.Tensor | None,
        k_weight: torch.Tensor | None,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward_qk_rope` of a pure decode step (one new token per sequence) up to the
        split-KV partials, for an output projection that merges them
        (:func:`kernels.gemv_merge.gemv_attn_merge`). The split count is the backend's
        ``partial_splits`` for ``T`` sequences: host ints only, constant in a traced graph.

        Returns:
            float32 ``(partial_out [T, H_q, S, D], partial_lse [T, H_q, S])``.

        Raises:
            ValueError: a backend without partials (:meth:`has_decode_partials`), not a pure
                decode step, or what the backend raises.
        """
        if not self.has_decode_partials():
            raise ValueError(f"attention backend {self.backend_name!r} has no decode partials")
        splits = self.backend.partial_splits(q.shape[0], self.num_kv_heads, q.device)
        k_cache, v_cache = kv_cache
        args = (q, k, v, k_cache, v_cache, meta, self.scale)
        rest = (cos, sin, q_weight, k_weight, eps, splits)
        if self.custom_op:
            return paged_decode_partials_qk_rope(*args, self.backend_name, *rest)
        return self.backend.decode_partials_qk_rope(*args, *rest)
