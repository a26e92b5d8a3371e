"""Load Hugging Face safetensors checkpoints into the engine's model (fusing q/k/v, gate/up)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from engine.models.qwen3 import PACKED_MODULES


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


@torch.no_grad()
def load_weights(model: nn.Module, model_dir: str | Path) -> None:
    """Copy every checkpoint tensor into the matching (possibly fused) parameter.

    q/k/v and gate/up shards are written into their slice of the fused ``qkv_proj`` /
    ``gate_up_proj`` parameter; tensors are cast to the parameter's dtype and device.
    ``lm_head.weight`` is ignored when embeddings are tied.

    Raises:
        KeyError: a checkpoint tensor with no matching parameter.
        ValueError: a shape mismatch, or parameters the checkpoint does not provide.
    """
    params = dict(model.named_parameters())
    loaded: dict[str, int] = {}
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if name.endswith("rotary_emb.inv_freq"):
                    continue
                if name == "lm_head.weight" and "lm_head.weight" not in params:
                    continue  # tied embeddings
                tensor = f.get_tensor(name)
                _load_one(params, loaded, name, tensor)
    missing = []
    for name, p in params.items():
        expected = 1
        if any(f".{frag}." in name for frag, _ in PACKED_MODULES.values()):
            expected = 3 if "qkv_proj" in name else 2
        if loaded.get(name, 0) != expected:
            missing.append(name)
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks parameters: {missing[:8]}{'...' if len(missing) > 8 else ''}")


def _load_one(params: dict, loaded: dict, name: str, tensor: torch.Tensor) -> None:
    for frag, (fused, shard) in PACKED_MODULES.items():
        if f".{frag}." in name:
            target = name.replace(f".{frag}.", f".{fused}.")
            param = params.get(target)
            if param is None:
                raise KeyError(f"checkpoint tensor {name} has no parameter {target}")
            sizes = _shard_sizes(param.shape[0], fused, params, target)
            start = sum(sizes[:shard])
            dst = param.data.narrow(0, start, sizes[shard])
            if dst.shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(dst.shape)}")
            dst.copy_(tensor)
            loaded[target] = loaded.get(target, 0) + 1
            return
    param = params.get(name)
    if param is None:
        raise KeyError(f"checkpoint tensor {name} matches no model parameter")
    if param.shape != tensor.shape:
        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(param.shape)}")
    param.data.copy_(tensor)
    loaded[name] = loaded.get(name, 0) + 1


def _shard_sizes(total: int, fused: str, params: dict, target: str) -> list[int]:
    if fused == "gate_up_proj":
        return [total // 2, total // 2]
    # qkv: q is num_heads * head_dim, k and v are num_kv_heads * head_dim each
    o_proj = params[target.split(".self_attn.")[0] + ".self_attn.o_proj.weight"]
    q_size = o_proj.shape[1]
    kv = (total - q_size) // 2
    return [q_size, kv, kv]
