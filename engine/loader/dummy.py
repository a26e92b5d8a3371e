"""Random weights from a seed instead of a checkpoint (``--load-format dummy``, benchmarks).

Any architecture the registry builds from its ``config.json`` gets weights without reading a
file, drawn directly on the parameters' device, so the shapes of large checkpoints (e.g.
Qwen3-30B-A3B, 61 GB in bfloat16) can be benchmarked without downloading or writing them. The
outputs are meaningless; the compute and memory traffic are those of the real model.

The draws are of the checkpoint's tensors, not of the parameters: each full (unsplit) tensor a
parameter loads (``checkpoint_shapes``: a q, k or v projection, one expert's gate) is drawn
from its own seed and handed to the parameter's weight loader, which keeps this rank's slice.
So a tensor-parallel engine of any size holds the slices of the same random model as the
single-device engine (what the tensor-parallel correctness runs compare), at the cost of one
full tensor drawn at a time on each rank.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn

from engine.layers.linear import checkpoint_shapes, default_weight_loader

#: Knuth's multiplicative constant, mixes the run's seed into each parameter's seed
_MIX = 0x9E3779B97F4A7C15


def parameter_seed(seed: int, name: str) -> int:
    """The generator seed of parameter ``name``: a function of ``(seed, name)`` only, so the
    draw of a parameter does not depend on the order or number of the others."""
    return (seed * _MIX + zlib.crc32(name.encode())) % (1 << 63)


@torch.no_grad()
def init_random_weights(model: nn.Module, seed: int, std: float = 0.02) -> None:
    """Fill every parameter with N(0, std) and every norm weight with ones, in place.

    Each checkpoint tensor of a parameter (shard id ``s`` of ``checkpoint_shapes``) is drawn in
    full on the parameter's device (no host copy) by a generator seeded with
    :func:`parameter_seed` of ``name`` (``name[s]`` for a fused or stacked parameter), then
    loaded through the parameter's ``weight_loader``: one seed on one device type gives the
    same weights in every run and at every tensor-parallel size (CPU and CUDA generators
    differ, so a CPU and a GPU build do not match each other).

    A quantized linear layer (a ``quant_method`` with ``init_random``, e.g. block FP8) draws
    its whole weight N(0, std) in float32 from the weight's seed and stores the quantized
    weight and scales (quantized layers exist only with tensor-parallel size 1, see
    ``ModelConfig.check_tensor_parallel``, so this draw needs no per-shard form).
    """
    quantized = set()
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is None:
            continue
        weight = f"{name}.weight" if name else "weight"
        gen = torch.Generator(device=module.weight.device)
        gen.manual_seed(parameter_seed(seed, weight))
        method.init_random(module, gen, std)
        quantized.update((weight, f"{name}.weight_scale_inv" if name else "weight_scale_inv"))
    for name, p in model.named_parameters():
        if name in quantized:
            continue
        if name.endswith("norm.weight"):
            p.fill_(1.0)
            continue
        loader = getattr(p, "weight_loader", default_weight_loader)
        for shard, shape in checkpoint_shapes(p).items():
            gen = torch.Generator(device=p.device)
            gen.manual_seed(parameter_seed(seed, name if shard is None else f"{name}[{shard!r}]"))
            full = torch.empty(shape, dtype=p.dtype, device=p.device)
            loader(p, full.normal_(0.0, std, generator=gen), shard)
