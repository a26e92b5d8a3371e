"""Qwen3 / Qwen2 decoder-only transformer reading and writing the paged KV cache.

Follows the Hugging Face reference (transformers' ``modeling_qwen3.py`` / ``modeling_qwen2.py``):
RMSNorm (Zhang & Sennrich 2019), rotary position embedding with the rotate-half (GPT-NeoX)
layout (Su et al. 2021), grouped-query attention (Ainslie et al. 2023), SwiGLU MLP
(Shazeer 2020). Qwen3 adds per-head RMSNorm on q and k; Qwen2 has a bias on q/k/v.

Parameter names are Hugging Face's, except two fused projections: ``qkv_proj``
(q_proj, k_proj, v_proj stacked on the output dim) and ``gate_up_proj`` (gate_proj, up_proj);
:attr:`Qwen3ForCausalLM.packed_modules_mapping` is the one mapping the weight loader uses.

Tensor parallelism (``tp``, Megatron-LM's split, Shoeybi et al. 2019): q/k/v and gate/up are
column-parallel (a rank holds its heads and its MLP features), o_proj and down_proj
row-parallel followed by an all-reduce, the embedding and the LM head vocab-parallel (the
logits' columns are gathered on rank 0 once per step, for the sampler). Norms, rotary tables
and Qwen3's q/k norms (per head) are replicated. Without ``tp`` the model calls no collective.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.layer import PagedAttention
from engine.attention.metadata import AttentionMetadata
from engine.core.config import ModelConfig
from engine.layers import kernel_switches
from engine.layers.embedding import VocabParallelEmbedding
from engine.layers.fused_linear import (
    merge_linear,
    merge_tiles,
    norm_linear,
    norm_qkv_rope,
    qkv_rope_tiles,
    swiglu_linear,
)
from engine.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from engine.layers.norm import RMSNorm
from engine.layers.parallel import TensorParallel
from engine.layers.pointwise import PointwiseOps
from engine.layers.quantization import finalize_quantization
from engine.layers.rotary import RotaryEmbedding
from engine.models.compile import COMPILE_MODES, CompiledForward


def _split_args(tp: TensorParallel | None) -> dict:
    """The ``tp_rank``/``tp_size`` keywords of the parallel linear layers."""
    return {} if tp is None else {"tp_rank": tp.rank, "tp_size": tp.size}


class Qwen3Attention(nn.Module):
    """Self-attention of one layer: this rank's query and KV heads (all of them without ``tp``),
    ``o_proj``'s partial sums all-reduced over the ranks.

    ``fuse_qk_rope``: hand the attention layer the raw q/k/v views with the q/k norm weights
    and the rotary rows (:meth:`PagedAttention.forward_qk_rope`: the Triton backend normalizes,
    rotates and stores in one launch); False: q/k norm + rotary through ``ops`` here, then
    :meth:`PagedAttention.forward`. ``fuse_merge_gemv`` (with ``fuse_qk_rope``, pure decode
    steps): the attention layer stops at the split-KV partials and ``o_proj``'s small-M kernel
    merges them (:func:`engine.layers.fused_linear.merge_linear`; mode None auto, True, False).
    ``fuse_qkv_rope_gemv`` (with ``fuse_qk_rope`` and a backend that attends over stored k/v):
    :meth:`forward_norm` runs the input norm, q/k/v, the q/k norm + rotary and the KV store as
    one small-M kernel (:func:`engine.layers.fused_linear.norm_qkv_rope`; same modes); the split
    merge is then not fused.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        ops: PointwiseOps,
        attention_backend: str,
        custom_op: bool,
        tp: TensorParallel | None = None,
        fuse_qk_rope: bool = False,
        fuse_merge_gemv: bool | None = None,
        fuse_qkv_rope_gemv: bool | None = None,
    ):
        super().__init__()
        self.ops = ops
        self.tp = tp
        self.fuse_qk_rope = fuse_qk_rope
        self.fuse_merge_gemv = fuse_merge_gemv
        self.fuse_qkv_rope_gemv = fuse_qkv_rope_gemv
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size,
            cfg.head_dim,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            bias=cfg.attention_bias,
            quant_config=cfg.quantization,
            **_split_args(tp),
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(
            cfg.num_attention_heads * cfg.head_dim,
            cfg.hidden_size,
            bias=False,
            quant_config=cfg.quantization,
            **_split_args(tp),
        )
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.attn = PagedAttention(
            self.num_heads, self.num_kv_heads, self.head_dim, attention_backend, custom_op
        )

    def forward(self, x, rope, kv_cache, meta: AttentionMetadata):
        return self.attend(self.qkv_proj(x), rope, kv_cache, meta)

    def forward_norm(self, x, residual, norm, norm_mode, rope, kv_cache, meta: AttentionMetadata):
        """The layer's input norm (``norm``, with the residual add) and attention: ``(attention
        output after o_proj [T, H], residual [T, H])``. The norm, q/k/v, q/k norm + rotary and
        the KV store are one kernel where :func:`qkv_rope_tiles` says so (the attention then
        reads the stored cache), else the norm is fused into q/k/v as ``norm_mode`` says
        (:func:`norm_linear`) and :meth:`attend` does the rest."""
        tiles = None
        if self.fuse_qk_rope and self.attn.has_stored_attend():
            mode = self.fuse_qkv_rope_gemv
            tiles = qkv_rope_tiles(x, residual, norm, self.qkv_proj, self.head_dim, mode, norm_mode)
        if tiles is None:
            qkv, residual = norm_linear(x, residual, norm, self.qkv_proj, self.ops, norm_mode)
            return self.attend(qkv, rope, kv_cache, meta), residual
        heads = (self.num_heads, self.num_kv_heads)
        qkv, residual = norm_qkv_rope(
            x, residual, norm, self.qkv_proj, tiles, heads, kv_cache, meta.slot_mapping, rope,
            self.q_norm, self.k_norm,
        )  # fmt: skip
        t = qkv.shape[0]
        q = qkv[:, : self.q_size].view(t, self.num_heads, self.head_dim)
        attn = self.attn.forward_stored(q, kv_cache, meta)
        o = self.o_proj(attn.reshape(t, self.q_size))
        return (o if self.tp is None else self.tp.all_reduce(o)), residual

    def attend(self, qkv, rope, kv_cache, meta: AttentionMetadata):
        """Attention from the q/k/v projection's output ``qkv [T, (Hq + 2 Hkv) D]`` (the
        decoder layer computes it, fused with the norm before it where that applies)."""
        t = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        cos, sin = rope
        if self.fuse_qk_rope:
            q_w = None if self.q_norm is None else self.q_norm.weight
            k_w = None if self.k_norm is None else self.k_norm.weight
            eps = 0.0 if self.q_norm is None else self.q_norm.eps
            tiles = None
            if meta.is_decode and self.attn.has_decode_partials():
                tiles = merge_tiles(qkv[:, : self.q_size], self.o_proj, self.fuse_merge_gemv)
            if tiles is not None:  # the split merge inside o_proj's kernel
                po, plse = self.attn.decode_partials_qk_rope(
                    q, k, v, kv_cache, meta, cos, sin, q_w, k_w, eps
                )
                o = merge_linear(po, plse, self.o_proj, tiles)
                return o if self.tp is None else self.tp.all_reduce(o)
            attn = self.attn.forward_qk_rope(q, k, v, kv_cache, meta, cos, sin, q_w, k_w, eps)
        else:
            if self.q_norm is not None:
                q, k = self.ops.qk_norm_rope(
                    q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, cos, sin
                )
            else:
                q, k = self.ops.rope(q, k, cos, sin)
            attn = self.attn(q, k, v.contiguous(), kv_cache, meta)
        o = self.o_proj(attn.reshape(t, self.q_size))
        return o if self.tp is None else self.tp.all_reduce(o)


class Qwen3MLP(nn.Module):
    """SwiGLU MLP: this rank's features of gate/up, ``down_proj``'s partial sums all-reduced.

    ``fuse_swiglu_gemv``: SwiGLU inside the down projection's small-M kernel
    (:func:`engine.layers.fused_linear.swiglu_linear`'s mode: None auto, True, False).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        ops: PointwiseOps,
        tp: TensorParallel | None = None,
        fuse_swiglu_gemv: bool | None = None,
    ):
        super().__init__()
        self.ops = ops
        self.tp = tp
        self.fuse_swiglu_gemv = fuse_swiglu_gemv
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size,
            [cfg.intermediate_size] * 2,
            bias=False,
            quant_config=cfg.quantization,
            **_split_args(tp),
        )
        self.down_proj = RowParallelLinear(
            cfg.intermediate_size,
            cfg.hidden_size,
            bias=False,
            quant_config=cfg.quantization,
            **_split_args(tp),
        )

    def forward(self, x):
        return self.down(self.gate_up_proj(x))

    def down(self, gate_up):
        """SwiGLU, the down projection and its all-reduce, from the gate/up projection's output
        ``[T, 2I]`` (the decoder layer computes it, fused with the norm before it where that
        applies)."""
        out = swiglu_linear(gate_up, self.down_proj, self.ops, self.fuse_swiglu_gemv)
        return out if self.tp is None else self.tp.all_reduce(out)


class Qwen3DecoderLayer(nn.Module):
    """Attention then MLP, each after an RMSNorm, with the residual stream carried between layers.

    ``mlp``: the MLP module, any ``[T, H] -> [T, H]`` (default: the dense :class:`Qwen3MLP`;
    Qwen3-MoE passes a sparse MoE block). ``tp``: the tensor-parallel group or None.
    ``fuse_qk_rope``, ``fuse_merge_gemv``, ``fuse_qkv_rope_gemv``: see :class:`Qwen3Attention`.
    ``fuse_norm_gemv``: each RMSNorm (with its residual add) inside the small-M kernel of the
    projection after it, q/k/v and (dense MLP) gate/up
    (:func:`engine.layers.fused_linear.norm_linear`'s mode: None auto, True, False);
    ``fuse_swiglu_gemv``: see :class:`Qwen3MLP`.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        ops: PointwiseOps,
        attention_backend: str,
        custom_op: bool,
        mlp: nn.Module | None = None,
        tp: TensorParallel | None = None,
        fuse_qk_rope: bool = False,
        fuse_norm_gemv: bool | None = None,
        fuse_swiglu_gemv: bool | None = None,
        fuse_merge_gemv: bool | None = None,
        fuse_qkv_rope_gemv: bool | None = None,
    ):
        super().__init__()
        self.ops = ops
        self.fuse_norm_gemv = fuse_norm_gemv
        self.self_attn = Qwen3Attention(
            cfg, ops, attention_backend, custom_op, tp, fuse_qk_rope, fuse_merge_gemv,
            fuse_qkv_rope_gemv,
        )  # fmt: skip
        self.mlp = mlp if mlp is not None else Qwen3MLP(cfg, ops, tp, fuse_swiglu_gemv)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, rope, kv_cache, meta):
        """``x``: the previous layer's output (not yet added to ``residual``; None residual for
        the first layer). Returns (this layer's MLP output, residual stream)."""
        mode = self.fuse_norm_gemv
        h, residual = self.self_attn.forward_norm(
            x, residual, self.input_layernorm, mode, rope, kv_cache, meta
        )
        ln = self.post_attention_layernorm
        if isinstance(self.mlp, Qwen3MLP):
            gate_up, residual = norm_linear(h, residual, ln, self.mlp.gate_up_proj, self.ops, mode)
            return self.mlp.down(gate_up), residual
        h, residual = self.ops.add_rms_norm(h, residual, ln.weight, ln.eps)
        return self.mlp(h), residual


class Qwen3Model(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        max_positions: int,
        ops: PointwiseOps,
        attention_backend: str,
        custom_op: bool,
        make_mlp: Callable[[int], nn.Module | None] = lambda layer: None,
        tp: TensorParallel | None = None,
        fuse_qk_rope: bool = False,
        fuse_norm_gemv: bool | None = None,
        fuse_swiglu_gemv: bool | None = None,
        fuse_merge_gemv: bool | None = None,
        fuse_qkv_rope_gemv: bool | None = None,
    ):
        super().__init__()
        if tp is None:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        else:
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(
            Qwen3DecoderLayer(
                cfg,
                ops,
                attention_backend,
                custom_op,
                make_mlp(i),
                tp,
                fuse_qk_rope,
                fuse_norm_gemv,
                fuse_swiglu_gemv,
                fuse_merge_gemv,
                fuse_qkv_rope_gemv,
            )
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling
        )


class Qwen3ForCausalLM(nn.Module):
    """Qwen3 (and Qwen2) causal LM over a paged KV cache.

    Build it under the model's default dtype and device (parameters are created there; see
    ``engine.worker.model_runner``).

    Args:
        cfg: the architecture.
        max_positions: size of the rotary table (the engine's max_model_len).
        attention_backend: registry name of the attention backend (``engine.attention.registry``).
        compile_mode: how ``torch.compile`` is used (see :data:`COMPILE_MODES`): ``"model"``
            compiles the whole forward (:class:`~engine.models.compile.CompiledForward`, the
            attention layers then call the custom op), ``"ops"`` only the elementwise functions
            (:class:`~engine.layers.pointwise.PointwiseOps`), ``"none"`` runs eagerly.
        tp: this rank's tensor-parallel group (the model holds its shards and calls the
            collectives); None: the whole model on one device.
        fuse_qk_rope: the attention backend applies Qwen3's q/k RMSNorm and the rotary
            embedding together with the KV-cache store (``PagedAttention.forward_qk_rope``; one
            Triton launch per layer instead of the norm/rotary kernels plus the store); None:
            on with the ``"triton"`` backend only (the torch backend would run them eagerly
            inside the opaque attention op, where the unfused path compiles them) unless
            ``QWEN_SERVE_FUSED_QK_ROPE=0`` (:mod:`engine.layers.kernel_switches`).
        fuse_norm_gemv, fuse_swiglu_gemv: residual add + RMSNorm inside the q/k/v and gate/up
            small-M kernels, SwiGLU inside the down projection's
            (:mod:`engine.layers.fused_linear`); None (auto): on CUDA for bf16/fp16 batches of
            at most 16 tokens where the device's fused table says the kernel wins, unless
            ``QWEN_SERVE_FUSED_NORM_GEMV=0`` / ``QWEN_SERVE_FUSED_SWIGLU_GEMV=0`` /
            ``QWEN_SERVE_SMALL_M_GEMV=0``; True: wherever the kernels run (the Triton
            interpreter on the CPU included: tests); False: never.
        fuse_merge_gemv: split-KV decode attention's merge inside the output projection's
            small-M kernel in pure decode steps (``kernels/gemv_merge.py``; needs
            ``fuse_qk_rope`` and the Triton backend); None (auto) as above, with the
            ``attn_merge`` table entries and ``QWEN_SERVE_FUSED_MERGE_GEMV=0``.
        fuse_qkv_rope_gemv: the input norm, q/k/v projection, q/k norm + rotary and KV store of
            each layer in one small-M kernel (``kernels/gemv_qk_rope.py``; needs
            ``fuse_qk_rope`` and the Triton backend); None (auto) as above, with the
            ``qkv_rope`` table entries and ``QWEN_SERVE_FUSED_QKV_ROPE_GEMV=0``.

    ``cfg.quantization`` (block FP8 or None) quantizes the decoder's linear layers (q/k/v, o,
    gate/up, down); the embeddings, norms and LM head stay in the model dtype.

    Raises:
        ValueError: unknown ``compile_mode`` or attention backend; a shape that does not split
            over ``tp.size`` ranks (naming it); FP8 layers whose shards are not block-aligned
            (``engine.layers.quantization.finalize_quantization``).
    """

    #: checkpoint name fragment -> (fused parameter fragment, shard id of its weight loader)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(
        self,
        cfg: ModelConfig,
        max_positions: int,
        attention_backend: str,
        compile_mode: str = "none",
        tp: TensorParallel | None = None,
        fuse_qk_rope: bool | None = None,
        fuse_norm_gemv: bool | None = None,
        fuse_swiglu_gemv: bool | None = None,
        fuse_merge_gemv: bool | None = None,
        fuse_qkv_rope_gemv: bool | None = None,
    ):
        super().__init__()
        if compile_mode not in COMPILE_MODES:
            raise ValueError(f"compile_mode must be one of {COMPILE_MODES}, got {compile_mode!r}")
        self.config = cfg
        self.tp = tp
        self.compile_mode = compile_mode
        self.attention_backend = attention_backend
        if fuse_qk_rope is None:
            fuse_qk_rope = attention_backend == "triton" and kernel_switches.FUSED_QK_ROPE
        self.fuse_qk_rope = fuse_qk_rope
        self.ops = PointwiseOps(compile_mode == "ops")
        self.model = Qwen3Model(
            cfg,
            max_positions,
            self.ops,
            attention_backend,
            custom_op=compile_mode == "model",
            make_mlp=self.make_mlp,
            tp=tp,
            fuse_qk_rope=fuse_qk_rope,
            fuse_norm_gemv=fuse_norm_gemv,
            fuse_swiglu_gemv=fuse_swiglu_gemv,
            fuse_merge_gemv=fuse_merge_gemv,
            fuse_qkv_rope_gemv=fuse_qkv_rope_gemv,
        )
        if cfg.tie_word_embeddings:
            self.lm_head = None
        elif tp is None:
            self.lm_head = ReplicatedLinear(cfg.hidden_size, cfg.vocab_size, bias=False)
        else:  # vocab-parallel: this rank's rows of the [V, H] head
            self.lm_head = ColumnParallelLinear(
                cfg.hidden_size, cfg.vocab_size, bias=False, **_split_args(tp)
            )
        self._compiled = CompiledForward(self._forward_impl) if compile_mode == "model" else None
        #: one-token decode steps of one sequence whose ``meta.max_seq_len`` is within its
        #: ``max_context`` through one launch for all layers when set
        #: (:meth:`enable_persistent_decode`); None: the layer loop
        self.persistent_decode = None
        finalize_quantization(self)

    def make_mlp(self, layer: int) -> nn.Module | None:
        """The MLP of decoder layer ``layer``; None: the dense :class:`Qwen3MLP` (subclasses
        with other MLPs override this; it runs inside ``__init__``, after ``config``, ``tp``,
        ``ops`` and ``attention_backend`` are set)."""
        return None

    def weight_summary(self) -> str:
        """One line for the start-up log: parameter bytes by kind and their layout."""
        total = sum(p.numel() * p.element_size() for p in self.parameters())
        quant = self.config.quantization
        fp8 = sum(1 for m in self.modules() if getattr(m, "quant_method", None) is not None)
        how = f", {fp8} linear layers in block FP8" if quant is not None else ""
        return (
            f"weights {total / 2**30:.2f} GiB ({self.config.num_hidden_layers} dense layers{how})"
        )

    def skip_checkpoint_tensor(self, name: str) -> bool:
        """Checkpoint tensors this model does not load: rotary tables, a tied LM head."""
        return name.endswith("rotary_emb.inv_freq") or (
            name == "lm_head.weight" and self.lm_head is None
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` (model dtype) for packed tokens.

        Args:
            input_ids, positions: int64 ``[T]``.
            kv_caches: per layer (k_cache, v_cache), each ``[num_blocks, block_size, H_kv, D]``,
                updated in place with this step's keys/values.
            meta: the step's attention metadata.

        Raises:
            Whatever the attention backend raises (e.g. ValueError for Triton on a CPU without
            the interpreter). Compilation errors are not raised: they switch the model to eager.
        """
        if (
            self.persistent_decode is not None
            and meta.is_decode
            and input_ids.shape[0] == 1
            and meta.seq_lens.shape[0] == 1
            and meta.max_seq_len <= self.persistent_decode.max_context
        ):
            return self.persistent_decode.forward(self, input_ids, positions, meta)
        if self._compiled is not None:
            return self._compiled(input_ids, positions, kv_caches, meta)
        return self._forward_impl(input_ids, positions, kv_caches, meta)

    def enable_persistent_decode(self, kv_caches, block_size: int, **options) -> str | None:
        """Send one-token decode steps through one persistent launch for all layers
        (:mod:`engine.models.persistent_decode`) over these ``kv_caches`` (which must not be
        reallocated afterwards); call before CUDA graphs are captured. ``options``: the
        keyword options of :func:`engine.models.persistent_decode.build`. Returns None when
        enabled, else why not (the layer loop stays: a path enabled before is dropped)."""
        from engine.models import persistent_decode

        self.persistent_decode = None
        reason = persistent_decode.unsupported_reason(self, kv_caches)
        if reason is None:
            try:
                self.persistent_decode = persistent_decode.build(
                    self, kv_caches, block_size, **options
                )
            except ValueError as exc:  # e.g. its programs cannot all be resident on this GPU
                reason = str(exc)
        return reason

    def _forward_impl(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        rope = self.model.rotary_emb.lookup(positions, x.dtype)
        residual = None
        for layer, kv in zip(self.model.layers, kv_caches):
            x, residual = layer(x, residual, rope, kv, meta)
        norm = self.model.norm
        return self.ops.add_rms_norm(x, residual, norm.weight, norm.eps)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits ``[N, vocab]`` in the model dtype for hidden states ``[N, hidden]`` (the
        sampler upcasts what it processes; a float32 copy of every row would cost a pass).

        Tensor-parallel: every rank computes its vocab shard's columns and the shards are
        gathered on rank 0 (the one that samples); the other ranks return None."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(hidden, weight)
        return logits if self.tp is None else self.tp.gather_columns(logits)
