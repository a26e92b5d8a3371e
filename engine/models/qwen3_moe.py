"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): the Qwen3 decoder with sparse mixture-of-experts
MLPs, over the paged KV cache.

Follows transformers' ``modeling_qwen3_moe.py``: attention as Qwen3 (q/k RMSNorm, GQA, rotary),
and in each sparse layer (:meth:`ModelConfig.is_moe_layer`: not in ``mlp_only_layers`` and
``(i + 1) % decoder_sparse_step == 0``) a router ``mlp.gate`` ``[E, H]`` whose softmax top-k
experts (renormalised when ``norm_topk_prob``) each run a SwiGLU MLP of
``moe_intermediate_size``; the other layers keep a dense MLP of ``intermediate_size``. The
router's auxiliary loss (``router_aux_loss_coef``) only matters in training and is not computed.

Checkpoint layouts accepted (:meth:`Qwen3MoeForCausalLM.checkpoint_shards`): the Hub's one
tensor per expert, ``mlp.experts.{e}.gate_proj/up_proj/down_proj.weight`` (also what
``save_pretrained`` of transformers 5 writes), and transformers 5's in-memory stacked tensors
``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` / ``mlp.experts.down_proj`` ``[E, H, I]``. Both load
expert by expert into ``mlp.experts.w13_weight`` ``[E, 2I, H]`` and ``w2_weight`` ``[E, H, I]``
(:class:`~engine.layers.moe.FusedMoE`).

The experts run in the fused Triton MoE kernel when attention runs in Triton (``"triton"``
backend, CUDA or the interpreter) and in the torch reference otherwise (the CPU engine).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from engine.layers.moe import SparseMoE
from engine.models.qwen3 import Qwen3ForCausalLM

_EXPERT_TENSOR = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_STACKED_TENSOR = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_KIND = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3-MoE causal LM; arguments, forward and logits as :class:`Qwen3ForCausalLM`.

    Raises:
        ValueError: a config without experts, a quantized config (FP8 experts are not
            supported by the fused MoE kernel), or what :class:`Qwen3ForCausalLM` raises.
    """

    def __init__(
        self,
        cfg,
        max_positions,
        attention_backend,
        compile_mode="none",
        tp=None,
        fuse_qk_rope=None,
    ):
        if cfg.num_experts < 1:
            raise ValueError("Qwen3MoeForCausalLM needs a config with num_experts >= 1")
        cfg.check_quantization(cfg.quantization)
        self.moe_backend = "triton" if attention_backend == "triton" else "torch"
        super().__init__(cfg, max_positions, attention_backend, compile_mode, tp, fuse_qk_rope)

    def make_mlp(self, layer: int) -> nn.Module | None:
        cfg = self.config
        if not cfg.is_moe_layer(layer):
            return None
        return SparseMoE(
            cfg.num_experts,
            cfg.num_experts_per_tok,
            cfg.hidden_size,
            cfg.moe_intermediate_size,
            cfg.norm_topk_prob,
            self.moe_backend,
            custom_op=self.compile_mode == "model",
            tp=self.tp,
        )

    def checkpoint_shards(
        self, name: str, tensor: torch.Tensor
    ) -> list[tuple[str, object, torch.Tensor]] | None:
        """(parameter, shard id, tensor) loads of an expert checkpoint tensor: one expert's
        tensor goes to the stacked ``w13_weight`` / ``w2_weight`` with shard ``(kind, expert)``;
        a stacked ``gate_up_proj`` / ``down_proj`` is split expert by expert. None for other
        names (the loader maps them through ``packed_modules_mapping``).

        Raises:
            ValueError: a stacked tensor that is not ``[E, ., .]``.
        """
        m = _EXPERT_TENSOR.match(name)
        if m:
            prefix, expert, kind = m.group(1), int(m.group(2)), _KIND[m.group(3)]
            param = "w2_weight" if kind == "down" else "w13_weight"
            return [(f"{prefix}.{param}", (kind, expert), tensor)]
        m = _STACKED_TENSOR.match(name)
        if not m:
            return None
        if tensor.dim() != 3:
            raise ValueError(f"{name}: a stacked expert tensor is [E, ., .], got {tensor.shape}")
        prefix = m.group(1)
        if m.group(2) == "down_proj":
            return [(f"{prefix}.w2_weight", ("down", e), t) for e, t in enumerate(tensor)]
        inter = tensor.shape[1] // 2
        out = []
        for e, t in enumerate(tensor):
            out.append((f"{prefix}.w13_weight", ("gate", e), t[:inter]))
            out.append((f"{prefix}.w13_weight", ("up", e), t[inter:]))
        return out

    def weight_summary(self) -> str:
        """Total weight bytes, the experts' share and their layout."""
        cfg = self.config
        total = sum(p.numel() * p.element_size() for p in self.parameters())
        experts = [m for m in self.modules() if isinstance(m, SparseMoE)]
        expert_bytes = sum(
            p.numel() * p.element_size() for m in experts for p in m.experts.parameters()
        )
        tp = self.tp.size if self.tp is not None else 1
        i, h = cfg.moe_intermediate_size // tp, cfg.hidden_size
        embed = self.model.embed_tokens.weight
        # per token: all but the embedding table (one row) and the experts not routed to
        active = (
            total
            - embed.numel() * embed.element_size()
            - expert_bytes * (1 - cfg.num_experts_per_tok / cfg.num_experts)
        )
        return (
            f"weights {total / 2**30:.2f} GiB, of which experts {expert_bytes / 2**30:.2f} GiB: "
            f"{len(experts)} sparse layers x {cfg.num_experts} experts "
            f"{f'(1/{tp} of each expert on this rank) ' if tp > 1 else ''}stacked as gate_up "
            f"[E={cfg.num_experts}, 2I={2 * i}, H={h}] + down [E, H={h}, I={i}], "
            f"top-{cfg.num_experts_per_tok}"
            f"{' renormalised' if cfg.norm_topk_prob else ''}, kernel {self.moe_backend}; "
            f"{cfg.num_hidden_layers - len(experts)} dense MLP layers; "
            f"{active / 2**30:.2f} GiB read per token (batch 1)"
        )
