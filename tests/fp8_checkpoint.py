"""Tiny Qwen3 checkpoints in the exact Qwen3-FP8 file layout, and an independent reference.

:func:`write_fp8_checkpoint` writes a random Qwen3 with transformers, then quantizes its decoder
linear weights with transformers' own ``Fp8Quantize`` (the op transformers runs to save an FP8
model): ``*.weight`` float8_e4m3fn plus ``*.weight_scale_inv`` float32 per 128x128 block, every
other tensor as transformers saved it, and config.json's ``quantization_config`` as Qwen's
``-FP8`` releases have it.

:func:`fp8_reference_model` is the oracle: transformers' ``Qwen3ForCausalLM`` (float32) whose
seven projections per layer are replaced by :class:`W8A8Linear`, written here from the format's
definition (DeepSeek-V3's fine-grained FP8): the weight dequantized from the same file, the
input quantized per token in groups of 128 (amax / 448 scales, round to nearest even) and
dequantized, then a float32 matmul. Nothing of the engine is imported.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

#: decoder linear weights the Qwen3-FP8 releases store in FP8
FP8_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

#: a tiny Qwen3 whose q/k/v and gate/up shards are whole 128-blocks (as the real ones are)
TINY_FP8 = dict(
    vocab_size=384,
    hidden_size=256,
    intermediate_size=384,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=128,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    rope_theta=10000.0,
)

QUANTIZATION_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}


def _fp8_quantize_op():
    from types import SimpleNamespace

    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    cfg = FineGrainedFP8Config(weight_block_size=(128, 128))
    return Fp8Quantize(SimpleNamespace(quantization_config=cfg))


def write_hf_qwen3(path, seed: int = 1234, std: float = 0.08, **overrides):
    """A random float32 Qwen3 saved by transformers at ``path``; returns the model (eval)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**{**TINY_FP8, **overrides})).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, std)
    model.save_pretrained(path)
    return model


def write_fp8_checkpoint(
    src_dir, out_dir, keep: tuple[str, ...] = (), quantization_config: dict | None = None
) -> Path:
    """Quantize the checkpoint at ``src_dir`` into the Qwen3-FP8 layout at ``out_dir``.

    Args:
        keep: module names left unquantized (written to ``modules_to_not_convert``).
        quantization_config: config.json's entry (default :data:`QUANTIZATION_CONFIG`).
    """
    from safetensors.torch import load_file, save_file

    src, out = Path(src_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    quantize = _fp8_quantize_op()
    tensors = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in FP8_LINEARS:
            if module not in keep:
                tensors.update(quantize.convert({name: t}))
                continue
        tensors[name] = t
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    qc = dict(quantization_config or QUANTIZATION_CONFIG)
    if keep:
        qc["modules_to_not_convert"] = list(keep)
    cfg["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in ("generation_config.json",):
        if (src / f).exists():
            (out / f).write_text((src / f).read_text())
    return out


def quant_dequant_activations(x: torch.Tensor, group: int = 128) -> torch.Tensor:
    """Per-token-group FP8 quantization of ``x [..., K]`` (K a multiple of ``group``), returned
    dequantized in float32: ``scale = 1 / (448 / amax)`` per group of ``group`` features."""
    shape = x.shape
    g = x.float().reshape(-1, shape[-1] // group, group)
    amax = g.abs().amax(dim=-1, keepdim=True).clamp(min=1e-10)
    inv = torch.full_like(amax, 448.0) / amax
    q = (g * inv).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return (q.float() * (torch.ones_like(inv) / inv)).reshape(shape)


class W8A8Linear(nn.Module):
    """``y = quant_dequant(x) @ (W_fp8 * scale)^T`` in float32 (scales per 128x128 block)."""

    def __init__(self, weight: torch.Tensor, scale_inv: torch.Tensor, bias=None):
        super().__init__()
        n, k = weight.shape
        s = scale_inv.float().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
        self.register_buffer("w", weight.float() * s)
        self.bias = bias

    def forward(self, x):
        y = quant_dequant_activations(x) @ self.w.t()
        return y if self.bias is None else y + self.bias


def fp8_reference_model(src_dir, fp8_dir):
    """transformers' float32 model of ``src_dir`` with the projections that ``fp8_dir`` stores
    in FP8 replaced by :class:`W8A8Linear` on those stored weights; returns it (eval)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src_dir), dtype=torch.float32).eval()
    stored = load_file(str(Path(fp8_dir) / "model.safetensors"))
    for name, module in list(model.named_modules()):
        scale = stored.get(f"{name}.weight_scale_inv")
        if scale is None:
            continue
        model.set_submodule(name, W8A8Linear(stored[f"{name}.weight"], scale, module.bias))
    return model
