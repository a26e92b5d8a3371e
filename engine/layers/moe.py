"""Sparse mixture-of-experts layer: a router and routed experts whose weights are stacked per
layer, run by the fused Triton kernel (``kernels.fused_moe``) or its torch reference.

Shazeer et al. 2017 (sparsely-gated MoE), top-k softmax routing as in Qwen3-MoE / Mixtral:
``out[t] = sum_{j<k} p[t, j] * expert_{e_j}(x[t])`` with ``(p, e)`` the top-k of
``softmax(router(x[t]))``, renormalised when ``renormalize`` (``norm_topk_prob``), and every
expert a SwiGLU MLP. The experts' weights live in two tensors per layer, ``w13 [E, 2I, H]``
(gate rows, then up rows) and ``w2 [E, H, I]``, filled expert by expert from the checkpoint's
``experts.{e}.gate_proj/up_proj/down_proj`` tensors by :meth:`FusedMoE.weight_loader`.

Parallelism: tensor parallelism within experts (Megatron's MLP split applied to every expert):
each of ``tp`` ranks holds ``I / tp`` gate/up rows and down columns of every expert, routes
every token itself (the router is replicated), and :class:`SparseMoE` sums the ranks' partial
outputs with one all-reduce, as after a dense MLP. Every rank does the same share of every
expert's work, so no token is dispatched between ranks and load stays balanced whatever the
routing. Expert parallelism (a range of experts per rank, tokens exchanged all-to-all) is not
implemented; block-quantized (FP8, 128-wide blocks) experts would need it once ``I / tp`` stops
being a multiple of the block (Qwen3-30B-A3B: 768 / 4 = 192), which
``ModelConfig.check_tensor_parallel`` refuses (docs/architecture.md).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.linear import ReplicatedLinear, _split, default_weight_loader
from engine.layers.parallel import TensorParallel
from kernels.reference import fused_moe_ref

#: how the experts run: the fused Triton kernel (CUDA, or the Triton interpreter), or the torch
#: reference (a loop over experts; syncs with the host, so no CUDA graphs)
MOE_BACKENDS = ("triton", "torch")


def run_moe(
    hidden: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalize: bool,
    backend: str,
) -> torch.Tensor:
    """Routed experts of ``hidden [T, H]`` given ``router_logits [T, E]``; ``[T, H]``, a new
    tensor in hidden's dtype. ``backend`` is one of :data:`MOE_BACKENDS`.

    The Triton path allocates its workspace here (sizes from ``T`` only, so a CUDA-graph capture
    takes it from the graph's pool and every replay reuses it).

    Raises:
        ValueError: unknown backend, or what the kernel's launcher raises.
    """
    if backend == "triton":
        from kernels.fused_moe import fused_moe, moe_workspace  # here: CPU runs import no Triton

        e, h, i = w13.shape[0], hidden.shape[1], w2.shape[2]
        ws = moe_workspace(hidden.shape[0], e, top_k, h, i, hidden.dtype, hidden.device)
        return fused_moe(hidden, router_logits, w13, w2, renormalize, torch.empty_like(hidden), ws)
    if backend == "torch":
        return fused_moe_ref(hidden, router_logits, w13, w2, top_k, renormalize)
    raise ValueError(f"unknown MoE backend {backend!r}; expected one of {MOE_BACKENDS}")


@torch.library.custom_op("qwen_serve::fused_moe", mutates_args=())
def fused_moe_op(
    hidden: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalize: bool,
    backend: str,
) -> torch.Tensor:
    """:func:`run_moe` as an opaque op (``torch.ops.qwen_serve.fused_moe``), so a whole-model
    ``torch.compile`` (``compile_mode="model"``) sees the experts as one node, as it sees
    attention (``qwen_serve::paged_attention``). Returns a new ``[T, H]`` tensor."""
    return run_moe(hidden, router_logits, w13, w2, top_k, renormalize, backend)


@fused_moe_op.register_fake
def _fused_moe_fake(hidden, router_logits, w13, w2, top_k, renormalize, backend):
    return torch.empty_like(hidden)


class FusedMoE(nn.Module):
    """The routed experts of one sparse layer, weights stacked over experts.

    Args:
        num_experts: E; top_k: experts per token; hidden_size: H;
        intermediate_size: I of one expert (all ranks together);
        renormalize: divide the top-k probabilities by their sum (``norm_topk_prob``);
        backend: one of :data:`MOE_BACKENDS`;
        custom_op: call through ``qwen_serve::fused_moe`` (whole-model torch.compile);
        tp_rank, tp_size: tensor-parallel split of the intermediate features.

    Parameters: ``w13_weight`` ``[E, 2 I/tp, H]`` and ``w2_weight`` ``[E, H, I/tp]``; their
    ``weight_loader`` takes one expert's checkpoint tensor with shard id ``("gate", e)``,
    ``("up", e)`` or ``("down", e)``.

    Raises:
        ValueError: unknown backend, ``top_k`` outside ``[1, E]``, I not divisible by tp.
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        backend: str,
        custom_op: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
    ):
        super().__init__()
        if backend not in MOE_BACKENDS:
            raise ValueError(f"unknown MoE backend {backend!r}; expected one of {MOE_BACKENDS}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
        self.num_experts, self.top_k = num_experts, top_k
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.renormalize, self.backend, self.custom_op = renormalize, backend, custom_op
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.intermediate_per_rank = _split(intermediate_size, tp_size, "expert features")
        i = self.intermediate_per_rank
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * i, hidden_size))
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, i))
        experts = range(num_experts)
        self.w13_weight.shard_ids = tuple((k, e) for k in ("gate", "up") for e in experts)
        self.w2_weight.shard_ids = tuple(("down", e) for e in experts)
        full_i = intermediate_size
        self.w13_weight.checkpoint_shapes = {
            s: (full_i, hidden_size) for s in self.w13_weight.shard_ids
        }
        self.w2_weight.checkpoint_shapes = {
            s: (hidden_size, full_i) for s in self.w2_weight.shard_ids
        }
        for p in (self.w13_weight, self.w2_weight):
            p.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, tensor, shard_id) -> None:
        """Copy this rank's slice of one expert's checkpoint tensor (or lazy file slice) into its
        place.

        ``shard_id`` is ``(kind, expert)``: "gate"/"up" take an ``[I, H]`` tensor into rows
        ``0..I/tp`` / ``I/tp..2I/tp`` of ``w13[expert]``; "down" an ``[H, I]`` tensor into
        ``w2[expert]``.

        Raises:
            ValueError: an unknown shard, an expert out of range, a shape mismatch.
        """
        kind, expert = shard_id
        if tensor.dim() != 2:
            raise ValueError(f"one expert's weight is 2-D, got shape {tuple(tensor.shape)}")
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} out of range [0, {self.num_experts})")
        n = self.intermediate_per_rank
        if kind in ("gate", "up") and param is self.w13_weight:
            dst = param.data[expert].narrow(0, 0 if kind == "gate" else n, n)
            src = tensor.narrow(0, self.tp_rank * n, n)
        elif kind == "down" and param is self.w2_weight:
            dst = param.data[expert]
            src = tensor.narrow(1, self.tp_rank * n, n)
        else:
            raise ValueError(f"unknown expert shard {shard_id!r} for this parameter")
        default_weight_loader(dst, src)

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """``hidden [T, H]``, ``router_logits [T, E]`` -> ``[T, H]`` (hidden's dtype)."""
        args = (
            hidden,
            router_logits,
            self.w13_weight,
            self.w2_weight,
            self.top_k,
            self.renormalize,
            self.backend,
        )
        if self.custom_op:
            return fused_moe_op(*args)
        return run_moe(*args)

    def extra_repr(self) -> str:
        i, h = self.intermediate_per_rank, self.hidden_size
        return (
            f"experts={self.num_experts}, top_k={self.top_k}, w13=[E, {2 * i}, {h}], "
            f"w2=[E, {h}, {i}], renormalize={self.renormalize}, backend={self.backend}"
        )


class SparseMoE(nn.Module):
    """A sparse MoE MLP: the router ``gate`` (``[E, H]``, no bias, output in the model dtype,
    replicated on every rank) and the routed ``experts`` (:class:`FusedMoE`); Hugging Face's
    module names (``mlp.gate``, ``mlp.experts``). Arguments as :class:`FusedMoE`, and ``tp``:
    the tensor-parallel group (experts split within, partial outputs all-reduced), or None."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        backend: str,
        custom_op: bool = False,
        tp: TensorParallel | None = None,
    ):
        super().__init__()
        self.tp = tp
        self.gate = ReplicatedLinear(hidden_size, num_experts, bias=False)
        self.experts = FusedMoE(
            num_experts,
            top_k,
            hidden_size,
            intermediate_size,
            renormalize,
            backend,
            custom_op,
            tp_rank=tp.rank if tp is not None else 0,
            tp_size=tp.size if tp is not None else 1,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, H]`` -> ``[T, H]`` (summed over the ranks)."""
        out = self.experts(x, self.gate(x))
        return out if self.tp is None else self.tp.all_reduce(out)
