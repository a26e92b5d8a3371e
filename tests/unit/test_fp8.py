"""Block-FP8 checkpoints (the Qwen3-FP8 layout) on the CPU: the engine against an independent
W8A8 reference built from transformers, ``--quantization fp8``, FP8 dummy weights, refusals.

On the CPU the FP8 layers take the reference path (``kernels.reference.fp8_linear_ref``); the
Triton kernels are tested against it in ``tests/kernels/test_fp8_gemm.py`` and on the GPU by
``bench/fp8.py``.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.core.config import EngineConfig, ModelConfig, QuantizationConfig
from engine.core.request import SamplingParams
from engine.worker.build import build_engine
from tests.engine_helpers import logits_for
from tests.fp8_checkpoint import (
    QUANTIZATION_CONFIG,
    fp8_reference_model,
    write_fp8_checkpoint,
    write_hf_qwen3,
)

#: prompts whose logits are compared whole. Longer ones eventually meet a rounding flip: an
#: activation that float32 summation order (attention, norms) puts on the other side of an FP8
#: rounding boundary differs by one FP8 ulp, and attention spreads that to later positions
#: (seen at position 21 of a 70-token prompt, 1e-2 afterwards), so the layer-level test below
#: checks every quantized layer on its own inputs instead.
PROMPT_LENGTHS = [1, 9, 33]


@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory):
    """(float32 dir, FP8 dir, transformers float32 model, W8A8 reference model)."""
    root = tmp_path_factory.mktemp("fp8")
    hf = write_hf_qwen3(root / "src")
    write_fp8_checkpoint(root / "src", root / "fp8")
    return root / "src", root / "fp8", hf, fp8_reference_model(root / "src", root / "fp8")


def _engine(path, **kw):
    cfg = dict(model=str(path), num_kv_blocks=64, block_size=16, max_num_batched_tokens=4096)
    cfg.update(kw)
    return build_engine(EngineConfig(**cfg), eos_token_ids=frozenset())


def _prompts():
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, 384, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def _prefill_logits(eng, prompts):
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=1))
    logits = logits_for(eng, eng.scheduler.schedule())
    out, offset = [], 0
    for p in prompts:
        out.append(logits[offset : offset + len(p)])
        offset += len(p)
    return out


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_fp8_checkpoint_loads_in_fp8(fp8_ckpt):
    _, fp8_dir, _, _ = fp8_ckpt
    model = _engine(fp8_dir).executor.model
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    for layer in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
        assert layer.weight.dtype == torch.float8_e4m3fn
        assert layer.weight_scale_inv.dtype == torch.float32
    # fused q/k/v: rows 0..255 q, 256..383 k, 384..511 v; scale blocks 2 + 1 + 1
    assert attn.qkv_proj.weight.shape == (512, 256)
    assert attn.qkv_proj.weight_scale_inv.shape == (4, 2)
    stored = load_file(str(fp8_dir / "model.safetensors"))
    prefix = "model.layers.0.self_attn"
    expect_s = torch.cat([stored[f"{prefix}.{p}_proj.weight_scale_inv"] for p in "qkv"])
    expect_w = torch.cat([stored[f"{prefix}.{p}_proj.weight"].view(torch.uint8) for p in "qkv"])
    assert torch.equal(attn.qkv_proj.weight_scale_inv, expect_s)
    assert torch.equal(attn.qkv_proj.weight.view(torch.uint8), expect_w)
    assert model.lm_head.weight.dtype == torch.float32  # the LM head stays unquantized


def test_fp8_logits_equal_w8a8_reference_and_are_close_to_unquantized(fp8_ckpt):
    """The engine's logits equal the reference that dequantizes the same stored weights and
    quantizes activations per token group (float32 summation order only), and stay close to
    the unquantized model (same argmax at most positions)."""
    _, fp8_dir, hf, ref = fp8_ckpt
    eng = _engine(fp8_dir)
    prompts = _prompts()
    agree = total = 0
    for p, got in zip(prompts, _prefill_logits(eng, prompts)):
        with torch.no_grad():
            want = ref(torch.tensor([p])).logits[0]
            full = hf(torch.tensor([p])).logits[0]
        assert _rel(got, want) < 2e-6, f"prompt of {len(p)}: {_rel(got, want):.2e}"
        assert _rel(got, full) < 0.25
        cos = torch.nn.functional.cosine_similarity(got, full, dim=-1)
        assert cos.min() > 0.97
        agree += (got.argmax(-1) == full.argmax(-1)).sum().item()
        total += len(p)
    assert agree / total > 0.6  # a random model: its top logits are close together


def test_every_fp8_layer_equals_the_reference_on_its_inputs(fp8_ckpt):
    """Each quantized layer of the engine, given the inputs it saw in a 70-token prefill, gives
    the reference W8A8 projection's outputs (fused layers: the reference's q/k/v or gate/up
    outputs side by side)."""
    _, fp8_dir, _, ref = fp8_ckpt
    eng = _engine(fp8_dir)
    model = eng.executor.model
    seen = {}
    hooks = [
        m.register_forward_hook(lambda mod, inp, out, n=n: seen.__setitem__(n, (inp[0], out)))
        for n, m in model.named_modules()
        if getattr(m, "quant_method", None) is not None
    ]
    gen = torch.Generator().manual_seed(9)
    _prefill_logits(eng, [torch.randint(0, 384, (70,), generator=gen).tolist()])
    for h in hooks:
        h.remove()
    parts = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    assert len(seen) == 8
    for name, (x, y) in seen.items():
        prefix, _, leaf = name.rpartition(".")
        with torch.no_grad():
            want = torch.cat(
                [ref.get_submodule(f"{prefix}.{p}")(x) for p in parts.get(leaf, (leaf,))], dim=-1
            )
        assert _rel(y, want) < 1e-6, name


def test_fp8_decode_matches_reference(fp8_ckpt):
    """Greedy decoding through the paged cache (prefill, then token by token) equals greedy
    decoding of the W8A8 reference."""
    _, fp8_dir, _, ref = fp8_ckpt
    eng = _engine(fp8_dir)
    prompt = _prompts()[2]
    got = eng.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12))[0]
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(12):
            ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
    assert got == ids[len(prompt) :]


def test_quantization_flag_quantizes_a_float_checkpoint_like_the_fp8_release(fp8_ckpt):
    """``--quantization fp8`` on the float32 checkpoint gives the weights transformers'
    Fp8Quantize wrote (scales within one float32 ulp: torch's CPU division of small tensors)
    and the same logits."""
    src, fp8_dir, _, _ = fp8_ckpt
    online, stored = _engine(src, quantization="fp8"), _engine(fp8_dir)
    a = dict(online.executor.model.named_parameters())
    b = dict(stored.executor.model.named_parameters())
    assert a.keys() == b.keys()
    for name, p in a.items():
        if p.dtype == torch.float8_e4m3fn:
            same = (p.view(torch.uint8) == b[name].view(torch.uint8)).float().mean().item()
            assert same > 0.999, name
        else:
            torch.testing.assert_close(p, b[name], rtol=3e-7, atol=0)
    prompts = _prompts()
    for x, y in zip(_prefill_logits(online, prompts), _prefill_logits(stored, prompts)):
        assert _rel(x, y) < 1e-2


def test_dummy_fp8_weights(fp8_ckpt):
    src, fp8_dir, _, _ = fp8_ckpt
    for path, quant in ((src, "fp8"), (fp8_dir, None)):
        eng = _engine(path, load_format="dummy", quantization=quant, seed=3)
        qkv = eng.executor.model.model.layers[1].self_attn.qkv_proj
        assert qkv.weight.dtype == torch.float8_e4m3fn
        w = qkv.weight.float() * qkv.weight_scale_inv.repeat_interleave(128, 0).repeat_interleave(
            128, 1
        )
        assert 0.015 < w.std().item() < 0.025  # N(0, 0.02), quantized
        out = eng.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=3))[0]
        assert len(out) == 3


def test_modules_to_not_convert(tmp_path, fp8_ckpt):
    """Layers the config leaves unquantized load in the model dtype; the rest in FP8."""
    src, _, _, _ = fp8_ckpt
    keep = ("model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj", "lm_head")
    fp8_dir = write_fp8_checkpoint(src, tmp_path / "fp8", keep=keep)
    eng = _engine(fp8_dir)
    layers = eng.executor.model.model.layers
    assert layers[1].mlp.gate_up_proj.weight.dtype == torch.float32
    assert layers[1].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    assert layers[0].mlp.gate_up_proj.weight.dtype == torch.float8_e4m3fn
    ref = fp8_reference_model(src, fp8_dir)
    p = _prompts()[2]
    (got,) = _prefill_logits(eng, [p])
    with torch.no_grad():
        assert _rel(got, ref(torch.tensor([p])).logits[0]) < 2e-6


# ------------------------------------------------------------------------------ refusals
def _with_config(tmp_path, fp8_dir, **qc):
    d = tmp_path / "ckpt"
    shutil.copytree(fp8_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {**QUANTIZATION_CONFIG, **qc}
    cfg["quantization_config"] = {k: v for k, v in cfg["quantization_config"].items() if v != "-"}
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize(
    "qc, message",
    [
        ({"quant_method": "gptq"}, "quantization method 'gptq' is not supported"),
        ({"quant_method": "compressed-tensors"}, "'compressed-tensors' is not supported"),
        ({"fmt": "e5m2"}, "format 'e5m2' is not supported"),
        ({"activation_scheme": "static"}, "activation_scheme 'static' is not supported"),
        ({"weight_block_size": [64, 64]}, r"weight_block_size \[64, 64\] is not supported"),
        ({"weight_block_size": "-"}, "weight_block_size None is not supported"),
        ({"scale_fmt": "ue8m0"}, "scale_fmt 'ue8m0' is not supported"),
    ],
)
def test_unsupported_quantization_configs_are_refused(tmp_path, fp8_ckpt, qc, message):
    d = _with_config(tmp_path, fp8_ckpt[1], **qc)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf(d)
    with pytest.raises(ValueError, match=message):
        _engine(d)


def _rewrite(tmp_path, fp8_dir, edit):
    d = tmp_path / "ckpt"
    shutil.copytree(fp8_dir, d)
    tensors = load_file(str(d / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(d / "model.safetensors"))
    return d


def test_wrong_tensor_types_are_refused(tmp_path, fp8_ckpt):
    src, fp8_dir, _, _ = fp8_ckpt
    name = "model.layers.0.mlp.down_proj"

    def bf16_weight(t):
        t[f"{name}.weight"] = t[f"{name}.weight"].to(torch.bfloat16)

    d = _rewrite(tmp_path / "a", fp8_dir, bf16_weight)
    with pytest.raises(ValueError, match=f"{name}.weight: torch.bfloat16 weight, but the"):
        _engine(d)

    def e8m0_scale(t):
        t[f"{name}.weight_scale_inv"] = t[f"{name}.weight_scale_inv"].to(torch.float8_e8m0fnu)

    d = _rewrite(tmp_path / "b", fp8_dir, e8m0_scale)
    with pytest.raises(ValueError, match="weight_scale_inv of dtype torch.float8_e8m0fnu"):
        _engine(d)

    def bad_scale_shape(t):
        t[f"{name}.weight_scale_inv"] = torch.ones(2, 2)

    d = _rewrite(tmp_path / "c", fp8_dir, bad_scale_shape)
    with pytest.raises(ValueError, match=r"weight_scale_inv of shape \(2, 2\) does not match"):
        _engine(d)

    def missing_scale(t):
        del t[f"{name}.weight_scale_inv"]

    d = _rewrite(tmp_path / "d", fp8_dir, missing_scale)
    with pytest.raises(ValueError, match="lacks parameters.*down_proj.weight_scale_inv"):
        _engine(d)

    # FP8 tensors in a checkpoint whose config does not say so
    d = tmp_path / "e"
    shutil.copytree(fp8_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["quantization_config"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="float8_e4m3fn, but the engine keeps this parameter"):
        _engine(d)
    with pytest.raises(ValueError, match="--quantization fp8 quantizes high-precision weights"):
        _engine(d, quantization="fp8")

    # a quantized LM head
    def fp8_head(t):
        t["lm_head.weight"] = t["lm_head.weight"].to(torch.float8_e4m3fn)

    d = _rewrite(tmp_path / "f", fp8_dir, fp8_head)
    with pytest.raises(ValueError, match="lm_head.weight is torch.float8_e4m3fn"):
        _engine(d)


def test_misaligned_shards_and_partial_exclusions_are_refused(tmp_path, fp8_ckpt):
    write_hf_qwen3(tmp_path / "small", head_dim=64)  # k/v shards of 64 rows
    with pytest.raises(ValueError, match="64 output features are not a multiple of the FP8 block"):
        _engine(tmp_path / "small", quantization="fp8")
    keep = ("model.layers.0.self_attn.q_proj",)
    d = write_fp8_checkpoint(fp8_ckpt[0], tmp_path / "part", keep=keep)
    with pytest.raises(ValueError, match="excludes only part of the fused layer"):
        _engine(d)


def test_fp8_moe_is_refused(tmp_path):
    from tests.conftest import write_tiny_moe_checkpoint

    write_tiny_moe_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="quantization of Qwen3-MoE is not supported"):
        _engine(tmp_path, quantization="fp8")


def test_resolve_quantization():
    from engine.core.config import resolve_quantization

    base = dict(
        architecture="Qwen3ForCausalLM",
        model_type="qwen3",
        vocab_size=8,
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=8,
        rms_norm_eps=1e-6,
        rope_theta=1e4,
        max_position_embeddings=8,
        tie_word_embeddings=True,
        attention_bias=False,
        qk_norm=True,
        dtype="bfloat16",
    )
    plain = ModelConfig(**base)
    assert resolve_quantization(plain, None) is None
    online = resolve_quantization(plain, "fp8")
    assert online.method == "fp8" and not online.checkpoint_quantized
    stored = QuantizationConfig("fp8")
    fp8 = ModelConfig(**base, quantization=stored)
    assert resolve_quantization(fp8, None) is stored
    assert resolve_quantization(fp8, "fp8") is stored
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(model="x", quantization="int4")
