"""Qwen3 / Qwen2 decoder-only transformer reading and writing the paged KV cache.

Follows the Hugging Face reference (transformers' ``modeling_qwen3.py`` / ``modeling_qwen2.py``):
RMSNorm (Zhang & Sennrich 2019), rotary position embedding with the rotate-half (GPT-NeoX)
layout (Su et al. 2021), grouped-query attention (Ainslie et al. 2023), SwiGLU MLP
(Shazeer 2020). Qwen3 adds per-head RMSNorm on q and k; Qwen2 has a bias on q/k/v.

Parameter names are Hugging Face's, except two fused projections: ``qkv_proj``
(q_proj, k_proj, v_proj stacked on the output dim) and ``gate_up_proj`` (gate_proj, up_proj);
:data:`PACKED_MODULES` is the one mapping the weight loader uses.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionBackend, AttentionMetadata
from engine.config import ModelConfig
from engine.models.ops import PointwiseOps

#: checkpoint name fragment -> (fused module fragment, shard index)
PACKED_MODULES = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class RMSNorm(nn.Module):
    """Holds an RMSNorm weight and epsilon; the math is :func:`engine.models.ops.rms_norm`."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps


class RotaryEmbedding(nn.Module):
    """Rotary embedding with a precomputed float32 cos/sin table ``[max_positions, head_dim]``."""

    def __init__(self, head_dim: int, max_positions: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[T, 1, D]`` in ``dtype`` for int64 positions ``[T]`` (once per forward)."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: PointwiseOps):
        super().__init__()
        self.ops = ops
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, rope, kv_cache, meta, backend):
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        cos, sin = rope
        if self.q_norm is not None:
            q, k = self.ops.qk_norm_rope(q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, cos, sin)
        else:
            q, k = self.ops.rope(q, k, cos, sin)
        o = backend.forward(q, k, v.contiguous(), kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(o.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: PointwiseOps):
        super().__init__()
        self.ops = ops
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: PointwiseOps):
        super().__init__()
        self.ops = ops
        self.self_attn = Attention(cfg, ops)
        self.mlp = MLP(cfg, ops)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, rope, kv_cache, meta, backend):
        """``x``: the previous layer's output (not yet added to ``residual``; None residual for
        the first layer). Returns (this layer's MLP output, residual stream)."""
        ln = self.input_layernorm
        if residual is None:
            h, residual = self.ops.rms_norm(x, ln.weight, ln.eps), x
        else:
            h, residual = self.ops.add_rms_norm(x, residual, ln.weight, ln.eps)
        h = self.self_attn(h, rope, kv_cache, meta, backend)
        ln = self.post_attention_layernorm
        h, residual = self.ops.add_rms_norm(h, residual, ln.weight, ln.eps)
        return self.mlp(h), residual


class Qwen3Model(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, ops: PointwiseOps):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, ops) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta)


class Qwen3ForCausalLM(nn.Module):
    """Qwen3 (and Qwen2) causal LM over a paged KV cache.

    Args:
        cfg: the architecture.
        max_positions: size of the rotary table (the engine's max_model_len).
        compile_ops: fuse the elementwise pieces with torch.compile (see ``engine.models.ops``).
    """

    def __init__(self, cfg: ModelConfig, max_positions: int, compile_ops: bool = False):
        super().__init__()
        self.config = cfg
        self.ops = PointwiseOps(compile_ops)
        self.model = Qwen3Model(cfg, max_positions, self.ops)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` for packed tokens.

        Args:
            input_ids, positions: int64 ``[T]``.
            kv_caches: per layer (k_cache, v_cache), each ``[num_blocks, block_size, H_kv, D]``.
            meta: the step's attention metadata; backend: the attention implementation.
        """
        x = self.model.embed_tokens(input_ids)
        rope = self.model.rotary_emb.lookup(positions, x.dtype)
        residual = None
        for layer, kv in zip(self.model.layers, kv_caches):
            x, residual = layer(x, residual, rope, kv, meta, backend)
        norm = self.model.norm
        return self.ops.add_rms_norm(x, residual, norm.weight, norm.eps)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, vocab]`` in the model dtype for hidden states ``[N, hidden]`` (the
        sampler upcasts what it processes; a float32 copy of every row would cost a pass)."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight)

    @torch.no_grad()
    def init_random_weights(self, seed: int, std: float = 0.02) -> None:
        """Fill weights with N(0, std) from a fixed seed and norms with ones (benchmarks)."""
        gen = torch.Generator(device="cpu").manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)
