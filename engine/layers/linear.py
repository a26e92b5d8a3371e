"""Linear layers that know how their weight is split across tensor-parallel ranks and how to
load their slice of a checkpoint tensor.

Megatron-LM's partitioning (Shoeybi et al. 2019), with vLLM's class names: a column-parallel
layer splits its output features across ranks, a row-parallel one its input features (its
partial outputs are summed across ranks by the caller's all-reduce). Fused projections (q/k/v,
gate/up) are column-parallel layers made of shards that the checkpoint stores as separate
tensors: each shard is split on its own, so a rank holds its heads of q, k and v.

Every parameter gets a ``weight_loader(param, tensor, shard_id)`` that copies the rank's slice
of a full checkpoint tensor into it (vLLM's and nano-vllm's convention), ``shard_ids``, the
shards it expects (the loader checks that each was loaded once), and ``checkpoint_shapes``, the
full (unsplit) checkpoint shape of each shard (``load_format="dummy"`` draws those, so random
weights are the same model at every tensor-parallel size). With ``tp_size == 1`` every layer is
a plain ``F.linear`` (cuBLAS, or the small-M kernel of ``engine.layers.dense_linear``).

A checkpoint tensor handed to a weight loader is a ``torch.Tensor`` or a lazy window of a file
(``engine.loader.safetensors_loader.CheckpointSlice``: ``shape``, ``dim()``, ``narrow()``,
``materialize()``); the loaders only narrow it, so a rank reads just its slice from disk, and
:func:`default_weight_loader` materialises what is left.

``quant_config`` (an ``engine.core.config.QuantizationConfig`` or None): a quantized layer's
``quant_method`` (``engine.layers.quantization``) creates its parameters (block FP8: a float8
``weight`` and a float32 ``weight_scale_inv``), loads checkpoint tensors into them through the
layer's own ``weight_loader`` and runs its forward. Quantized layers are built with
``tp_size == 1`` only (``ModelConfig.check_tensor_parallel`` refuses the rest: the scales are
not split per rank).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.dense_linear import dense_linear
from engine.layers.quantization import make_quant_method


def default_weight_loader(param: nn.Parameter, tensor, shard_id=None) -> None:
    """Copy a whole checkpoint tensor (or lazy slice, read now) into ``param`` (cast to its dtype
    and device).

    Raises:
        ValueError: a shape mismatch.
    """
    if param.shape != tensor.shape:
        raise ValueError(
            f"checkpoint shape {tuple(tensor.shape)} != parameter shape {tuple(param.shape)}"
        )
    param.data.copy_(tensor if isinstance(tensor, torch.Tensor) else tensor.materialize())


def checkpoint_shapes(param: nn.Parameter) -> dict:
    """Shard id -> full checkpoint shape of each tensor ``param`` loads (its own shape, shard
    None, for a parameter without ``checkpoint_shapes``)."""
    shapes = getattr(param, "checkpoint_shapes", None)
    return shapes if shapes is not None else {None: tuple(param.shape)}


def _full(tensor, dim: int, expected: int):
    """``tensor`` after checking its size along ``dim`` (the unsplit checkpoint size)."""
    if tensor.dim() <= dim or tensor.shape[dim] != expected:
        raise ValueError(
            f"checkpoint shape {tuple(tensor.shape)}: expected {expected} along dim {dim}"
        )
    return tensor


def _split(size: int, tp_size: int, what: str) -> int:
    if size % tp_size:
        raise ValueError(f"{what} = {size} is not divisible by the tensor-parallel size {tp_size}")
    return size // tp_size


class LinearBase(nn.Module):
    """``y = x W^T + b`` with ``W`` ``[out_per_rank, in_per_rank]`` (Hugging Face's layout).

    Args:
        input_size, output_size: the full layer's features; bias: whether it has one.
        tp_rank, tp_size: this rank and the number of ranks (1: not split).
        quant_config: the model's quantization or None (see the module docstring).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        tp_rank: int = 0,
        tp_size: int = 1,
        *,
        in_per_rank: int,
        out_per_rank: int,
        quant_config=None,
    ):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.quant_method = make_quant_method(quant_config)
        if self.quant_method is None:
            self.weight = nn.Parameter(torch.empty(out_per_rank, in_per_rank))
            self.weight.weight_loader = self.weight_loader
        else:
            self.quant_method.create_weights(self, out_per_rank, in_per_rank)
        self.weight.shard_ids = (None,)
        self.weight.checkpoint_shapes = {None: (output_size, input_size)}
        if bias:
            self.bias = nn.Parameter(torch.empty(out_per_rank))
            self.bias.weight_loader = self.weight_loader
            self.bias.shard_ids = (None,)
            self.bias.checkpoint_shapes = {None: (output_size,)}
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., in_per_rank]`` -> ``[..., out_per_rank]`` in x's dtype."""
        if self.quant_method is not None:
            return self.quant_method.apply(self, x, self.bias)
        return dense_linear(x, self.weight, self.bias)

    def weight_loader(self, param: nn.Parameter, tensor, shard_id=None) -> None:
        default_weight_loader(param, tensor)


class ReplicatedLinear(LinearBase):
    """A linear layer every rank holds whole."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, quant_config=None):
        super().__init__(
            input_size,
            output_size,
            bias,
            in_per_rank=input_size,
            out_per_rank=output_size,
            quant_config=quant_config,
        )


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks: rank ``r`` holds rows ``r * out/tp .. (r+1) * out/tp``.

    Raises:
        ValueError: ``output_size`` not divisible by ``tp_size``.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
        quant_config=None,
    ):
        super().__init__(
            input_size,
            output_size,
            bias,
            tp_rank,
            tp_size,
            in_per_rank=input_size,
            out_per_rank=_split(output_size, tp_size, "output features"),
            quant_config=quant_config,
        )

    def weight_loader(self, param: nn.Parameter, tensor, shard_id=None) -> None:
        n = param.shape[0]
        default_weight_loader(
            param, _full(tensor, 0, n * self.tp_size).narrow(0, self.tp_rank * n, n)
        )


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel layers of the same input stacked on the output (gate/up):
    ``shard_id`` ``i`` is checkpoint tensor ``i`` of ``output_sizes``; each is split on its own.

    Raises:
        ValueError: an output size not divisible by ``tp_size``.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
        quant_config=None,
    ):
        self.output_sizes = [_split(s, tp_size, "output features") for s in output_sizes]
        super().__init__(input_size, sum(output_sizes), bias, tp_rank, tp_size, quant_config)
        shards = tuple(range(len(output_sizes)))
        self.weight.shard_ids = shards
        self.weight.checkpoint_shapes = {i: (s, input_size) for i, s in enumerate(output_sizes)}
        if self.bias is not None:
            self.bias.shard_ids = shards
            self.bias.checkpoint_shapes = {i: (s,) for i, s in enumerate(output_sizes)}

    def weight_loader(self, param: nn.Parameter, tensor, shard_id=None) -> None:
        """Copy this rank's slice of shard ``shard_id`` (an index) into its place."""
        size = self.output_sizes[shard_id]
        offset = sum(self.output_sizes[:shard_id])
        default_weight_loader(
            param.narrow(0, offset, size),
            _full(tensor, 0, size * self.tp_size).narrow(0, self.tp_rank * size, size),
        )


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections stacked on the output, split by heads: a rank holds
    ``num_heads / tp`` query heads and ``num_kv_heads / tp`` KV heads, or one KV head replicated
    on ``tp / num_kv_heads`` ranks when there are fewer KV heads than ranks (as in vLLM).
    ``shard_id`` is "q", "k" or "v".

    Raises:
        ValueError: heads not divisible by ``tp_size`` (or ``tp_size`` not by the KV heads).
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
        quant_config=None,
    ):
        self.head_dim = head_dim
        self.num_heads = _split(num_heads, tp_size, "attention heads")
        if num_kv_heads >= tp_size:
            self.num_kv_heads = _split(num_kv_heads, tp_size, "key/value heads")
            self.kv_replicas = 1
        else:
            self.num_kv_heads = 1
            self.kv_replicas = _split(
                tp_size, num_kv_heads, "tensor-parallel size over key/value heads"
            )
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        LinearBase.__init__(
            self,
            hidden_size,
            (num_heads + 2 * num_kv_heads) * head_dim,
            bias,
            tp_rank,
            tp_size,
            in_per_rank=hidden_size,
            out_per_rank=self.q_size + 2 * self.kv_size,
            quant_config=quant_config,
        )
        self.weight.shard_ids = ("q", "k", "v")
        full = {"q": num_heads * head_dim, "k": num_kv_heads * head_dim}
        full["v"] = full["k"]
        self.weight.checkpoint_shapes = {k: (n, hidden_size) for k, n in full.items()}
        if self.bias is not None:
            self.bias.shard_ids = ("q", "k", "v")
            self.bias.checkpoint_shapes = {k: (n,) for k, n in full.items()}

    def weight_loader(self, param: nn.Parameter, tensor, shard_id=None) -> None:
        """Copy this rank's heads of the ``shard_id`` ("q", "k" or "v") checkpoint tensor."""
        if shard_id == "q":
            offset, size, start = 0, self.q_size, self.tp_rank * self.q_size
        elif shard_id in ("k", "v"):
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            size = self.kv_size
            start = (self.tp_rank // self.kv_replicas) * self.kv_size
        else:
            raise ValueError(f"unknown q/k/v shard {shard_id!r}")
        full = (
            self.q_size * self.tp_size
            if shard_id == "q"
            else self.kv_size * self.tp_size // self.kv_replicas
        )
        default_weight_loader(
            param.narrow(0, offset, size), _full(tensor, 0, full).narrow(0, start, size)
        )


class RowParallelLinear(LinearBase):
    """Input features split across ranks: rank ``r`` holds columns ``r * in/tp .. (r+1) * in/tp``
    and computes a partial sum of the output; the caller sums the ranks' outputs (all-reduce).
    A bias is held by rank 0 only, so the sum adds it once.

    Raises:
        ValueError: ``input_size`` not divisible by ``tp_size``.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
        quant_config=None,
    ):
        super().__init__(
            input_size,
            output_size,
            bias and tp_rank == 0,
            tp_rank,
            tp_size,
            in_per_rank=_split(input_size, tp_size, "input features"),
            out_per_rank=output_size,
            quant_config=quant_config,
        )

    def weight_loader(self, param: nn.Parameter, tensor, shard_id=None) -> None:
        if param.dim() == 1:  # the bias (rank 0)
            default_weight_loader(param, tensor)
            return
        n = param.shape[1]
        default_weight_loader(
            param, _full(tensor, 1, n * self.tp_size).narrow(1, self.tp_rank * n, n)
        )
