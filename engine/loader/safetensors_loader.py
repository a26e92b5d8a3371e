"""Load Hugging Face safetensors checkpoints (or the GGUF file a prepared GGUF model directory
names, see :mod:`engine.loader.gguf_loader`) into an engine model through its parameters'
weight loaders (fused q/k/v and gate/up shards, tensor-parallel slices)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from engine.layers.linear import default_weight_loader


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: ``model.safetensors`` or the shards its index lists.

    Raises:
        FileNotFoundError: neither a single file nor an index is present.
    """
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [d / s for s in shards]
    single = d / "model.safetensors"
    if single.exists():
        return [single]
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {d}")
    return files


def checkpoint_tensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) of every checkpoint tensor, one at a time: from the GGUF file
    that the directory's config.json names in ``"gguf_file"`` (dequantized to float32, see
    :func:`engine.loader.gguf_loader.gguf_tensors`), else from its safetensors files (stored
    dtype, CPU).

    Raises:
        FileNotFoundError: no weights. ValueError: a GGUF tensor type that cannot be dequantized,
            or a GGUF tensor with no Hugging Face counterpart.
    """
    from engine.loader.gguf_loader import gguf_file_of, gguf_tensors

    gguf_file = gguf_file_of(model_dir)
    if gguf_file is not None:
        yield from gguf_tensors(gguf_file)
        return
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def parameter_target(model: nn.Module, name: str) -> tuple[str, object]:
    """(parameter name, shard id) a checkpoint tensor loads into, through the model's
    ``packed_modules_mapping`` (fragment -> (fused fragment, shard id)); shard None if unfused."""
    for frag, (fused, shard) in model.packed_modules_mapping.items():
        if f".{frag}." in name:
            return name.replace(f".{frag}.", f".{fused}."), shard
    return name, None


def checkpoint_shards(
    model: nn.Module, name: str, tensor: torch.Tensor
) -> list[tuple[str, object, torch.Tensor]]:
    """The (parameter name, shard id, tensor) loads of one checkpoint tensor: the model's
    ``checkpoint_shards(name, tensor)`` when it has one and it returns a list (stacked expert
    weights), else one load through :func:`parameter_target`."""
    hook = getattr(model, "checkpoint_shards", None)
    shards = hook(name, tensor) if hook is not None else None
    if shards is None:
        target, shard = parameter_target(model, name)
        return [(target, shard, tensor)]
    return shards


def _check_quantized_dtype(name: str, tensor: torch.Tensor, param: nn.Parameter) -> None:
    """A float8 checkpoint tensor goes only into a float8 parameter (scales are checked by
    their quantized layer's loader)."""
    if name.endswith("_scale_inv"):
        return
    if tensor.element_size() == 1 and tensor.is_floating_point() and param.element_size() != 1:
        raise ValueError(
            f"checkpoint tensor {name} is {tensor.dtype}, but the engine keeps this parameter in "
            f"{param.dtype}: quantized embeddings, LM heads, norms and MoE experts are not "
            "supported, and FP8 linear layers need the checkpoint's quantization_config"
        )


@torch.no_grad()
def load_weights(model: nn.Module, model_dir: str | Path) -> None:
    """Copy every checkpoint tensor into its (possibly fused, stacked or sharded) parameter.

    The model provides ``packed_modules_mapping``, ``skip_checkpoint_tensor(name)`` and
    optionally ``checkpoint_shards(name, tensor)`` (see :func:`checkpoint_shards`); each
    parameter's ``weight_loader(param, tensor, shard_id)`` copies its part (cast to the
    parameter's dtype and device), and its ``shard_ids`` say which shards it expects.

    Raises:
        KeyError: a checkpoint tensor with no matching parameter (e.g. a ``weight_scale_inv``
            of a layer the engine does not quantize).
        ValueError: a shape mismatch, a shard loaded twice, parameters the checkpoint does
            not provide, or a float8 tensor for a parameter that is not float8 (the weight
            would be silently cast without its scales).
    """
    params = dict(model.named_parameters())
    loaded: dict[str, list] = {}
    for name, full in checkpoint_tensors(model_dir):
        if model.skip_checkpoint_tensor(name):
            continue
        for target, shard, tensor in checkpoint_shards(model, name, full):
            param = params.get(target)
            if param is None:
                raise KeyError(f"checkpoint tensor {name} matches no model parameter ({target})")
            if shard in loaded.setdefault(target, []):
                raise ValueError(f"checkpoint tensor {name} loaded twice")
            _check_quantized_dtype(name, tensor, param)
            loader = getattr(param, "weight_loader", default_weight_loader)
            try:
                loader(param, tensor, shard)
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None
            loaded[target].append(shard)
    missing = [
        n
        for n, p in params.items()
        if sorted(map(str, loaded.get(n, []))) != sorted(map(str, getattr(p, "shard_ids", (None,))))
    ]
    if missing:
        raise ValueError(
            f"checkpoint {model_dir} lacks parameters: "
            f"{missing[:8]}{'...' if len(missing) > 8 else ''}"
        )
