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

import logging

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionBackend, AttentionMetadata, paged_attention
from engine.config import ModelConfig
from engine.models.ops import PointwiseOps

log = logging.getLogger(__name__)

#: values of ``Qwen3ForCausalLM(compile_mode=...)`` / ``EngineConfig.compile_mode``
COMPILE_MODES = ("model", "ops", "none")

#: Graphs a healthy engine compiles for the whole-model forward: prefill/mixed steps, decode steps
#: of 2+ sequences, and T == 1 (one decode or a 1-token prompt; 0/1 sizes are specialised), plus
#: one spare. More than this means something recompiles per step; each one is logged at WARNING.
EXPECTED_GRAPHS = 4

_graphs_compiled = 0


def compiled_graph_count() -> int:
    """Graphs Inductor compiled for :class:`Qwen3ForCausalLM`'s whole-model forward in this process.

    Process-wide, like Dynamo's cache: compiled code is cached per Python code object, so model
    instances of one architecture share it (the weights are graph inputs, not constants). A GPU
    benchmark can read it before and after its timed steps: any increase is a recompile.
    """
    return _graphs_compiled


def _inductor_counting(gm: torch.fx.GraphModule, example_inputs):
    """The Inductor backend, counting and logging each graph it compiles (runs only at compile time)."""
    global _graphs_compiled
    from torch._inductor.compile_fx import compile_fx

    _graphs_compiled += 1
    level = logging.INFO if _graphs_compiled <= EXPECTED_GRAPHS else logging.WARNING
    log.log(level, "torch.compile: model forward graph %d (expected at most %d; TORCH_LOGS=recompiles "
            "names the guard that failed)", _graphs_compiled, EXPECTED_GRAPHS)
    return compile_fx(gm, example_inputs)


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
        if isinstance(backend, str):  # whole-model compile: attention is an opaque custom op
            o = paged_attention(q, k, v.contiguous(), kv_cache[0], kv_cache[1], meta, self.scale, backend)
        else:
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
        compile_mode: how ``torch.compile`` is used (see :data:`COMPILE_MODES`):

            * ``"model"``: the whole :meth:`forward` is one Dynamo frame compiled by Inductor
              (``dynamic=True, fullgraph=True``) with attention as the opaque custom op
              ``qwen_serve::paged_attention`` (:mod:`engine.attention`) -- vLLM's approach. One
              guard check and one compiled call per step instead of one per fused function;
              Inductor fuses norms, rotary, SwiGLU and residual adds and calls the GEMMs
              directly. If compilation fails the model logs a warning and runs eagerly.
            * ``"ops"``: only the elementwise functions of :mod:`engine.models.ops` are compiled,
              each separately (the engine's CUDA default: faster decode, quick start-up).
            * ``"none"``: eager.

    Raises:
        ValueError: unknown ``compile_mode``.
    """

    def __init__(self, cfg: ModelConfig, max_positions: int, compile_mode: str = "none"):
        super().__init__()
        if compile_mode not in COMPILE_MODES:
            raise ValueError(f"compile_mode must be one of {COMPILE_MODES}, got {compile_mode!r}")
        self.config = cfg
        self.compile_mode = compile_mode
        self.ops = PointwiseOps(compile_mode == "ops")
        self.model = Qwen3Model(cfg, max_positions, self.ops)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self._compiled_forward = None
        self._marked_caches = None
        if compile_mode == "model":
            # dynamic=True: the token count T and the metadata ints (max_query_len, max_seq_len)
            # are symbolic from the first compile; values 0/1 are still specialised, so T == 1
            # and max_query_len == 1 (decode) get their own graphs. B and the block-table width
            # are unbacked (see _mark_shapes). The weights are graph inputs, not constants.
            self._compiled_forward = torch.compile(self._forward_impl, backend=_inductor_counting, dynamic=True,
                                                   fullgraph=True)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` (model dtype) for packed tokens.

        Args:
            input_ids, positions: int64 ``[T]``.
            kv_caches: per layer (k_cache, v_cache), each ``[num_blocks, block_size, H_kv, D]``,
                updated in place with this step's keys/values.
            meta: the step's attention metadata; backend: the attention implementation (in
                ``"model"`` mode only its ``name`` reaches the compiled graph; the custom op
                finds the instance through :func:`engine.attention.get_attention_backend`).

        Raises:
            Whatever the backend raises (e.g. ValueError for Triton on a CPU without the
            interpreter). Compilation errors are not raised: they switch the model to eager.
        """
        if self._compiled_forward is not None:
            self._mark_shapes(kv_caches, meta)
            try:
                return self._compiled_forward(input_ids, positions, kv_caches, meta, backend.name)
            except torch._dynamo.exc.TorchDynamoException as e:  # compile failure: nothing ran yet
                log.warning("torch.compile of the model failed, running eagerly from now on: %s", e)
                self._compiled_forward = None
        return self._forward_impl(input_ids, positions, kv_caches, meta, backend)

    def _mark_shapes(self, kv_caches, meta: AttentionMetadata) -> None:
        """Shape hints for Dynamo that keep the number of compiled graphs small (about 1 us each).

        * The KV caches never change shape: ``mark_static`` makes their sizes constants instead
          of symbols (no duck-sizing coincidence such as ``block_size == T`` can specialise a
          graph). Done once per cache list.
        * The batch size B and the block-table width only reach the attention op, so they are
          marked *unbacked*: no 0/1 specialisation, hence no extra graph for one sequence or one
          KV block. The marks live on the step's tensors, so they are set on every call.

        The token count T stays an ordinary (backed) dynamic size: its value guides Inductor,
        and T == 1 (a batch-1 decode) gets its own graph.
        """
        if self._marked_caches is not kv_caches:
            for k_cache, v_cache in kv_caches:
                torch._dynamo.mark_static(k_cache)
                torch._dynamo.mark_static(v_cache)
            self._marked_caches = kv_caches
        mark_unbacked = torch._dynamo.decorators.mark_unbacked
        mark_unbacked(meta.block_tables, 0)
        mark_unbacked(meta.block_tables, 1)
        mark_unbacked(meta.seq_lens, 0)
        mark_unbacked(meta.cu_seqlens_q, 0)

    def _forward_impl(self, input_ids, positions, kv_caches, meta, backend) -> torch.Tensor:
        """The forward pass; ``backend`` is a backend object (eager attention calls) or a backend
        name (attention through the ``qwen_serve::paged_attention`` custom op, traceable)."""
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
