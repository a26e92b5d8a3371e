"""Layers: tensor-parallel linear layers and their weight loaders, the safetensors loader's error
paths, and the rotary table's dtype."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from engine.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from engine.layers.rotary import RotaryEmbedding
from engine.loader.safetensors_loader import load_weights
from engine.models.qwen3 import Qwen3ForCausalLM
from engine.worker.model_runner import _default_dtype
from tests.unit.test_model_compile import _config


def _load(layer, tensor, shard=None):
    with torch.no_grad():
        layer.weight.weight_loader(layer.weight, tensor, shard)


@pytest.mark.parametrize("tp", [2, 4])
def test_column_and_row_shards_recombine_to_the_full_layer(tp):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 16, generator=g, dtype=torch.float64)
    w_col = torch.randn(32, 16, generator=g, dtype=torch.float64)
    w_row = torch.randn(16, 32, generator=g, dtype=torch.float64)
    with _default_dtype(torch.float64):
        cols = [ColumnParallelLinear(16, 32, tp_rank=r, tp_size=tp) for r in range(tp)]
        rows = [RowParallelLinear(32, 16, tp_rank=r, tp_size=tp) for r in range(tp)]
    for c, r in zip(cols, rows):
        _load(c, w_col)
        _load(r, w_row)
    h = torch.cat([c(x) for c in cols], dim=-1)
    torch.testing.assert_close(h, x @ w_col.T)
    h_parts = h.split(32 // tp, dim=-1)
    y = sum(r(part) for r, part in zip(rows, h_parts))  # the all-reduce
    torch.testing.assert_close(y, h @ w_row.T)


@pytest.mark.parametrize("tp,kv_heads", [(2, 2), (4, 2), (2, 1)])
def test_qkv_and_merged_shards_hold_their_heads(tp, kv_heads):
    g = torch.Generator().manual_seed(1)
    hd, heads, hidden = 4, 4, 8
    wq = torch.randn(heads * hd, hidden, generator=g)
    wk = torch.randn(kv_heads * hd, hidden, generator=g)
    wv = torch.randn(kv_heads * hd, hidden, generator=g)
    layers = [
        QKVParallelLinear(hidden, hd, heads, kv_heads, tp_rank=r, tp_size=tp) for r in range(tp)
    ]
    for layer in layers:
        for shard, w in (("q", wq), ("k", wk), ("v", wv)):
            _load(layer, w, shard)
    q = torch.cat([layer.weight[: layer.q_size] for layer in layers])
    assert torch.equal(q, wq)
    for r, layer in enumerate(layers):
        kv_head = r // layer.kv_replicas
        k = layer.weight[layer.q_size : layer.q_size + layer.kv_size]
        assert torch.equal(k, wk[kv_head * hd : (kv_head + 1) * hd])
    gate, up = torch.randn(12, hidden, generator=g), torch.randn(12, hidden, generator=g)
    merged = [
        MergedColumnParallelLinear(hidden, [12, 12], tp_rank=r, tp_size=tp) for r in range(tp)
    ]
    for m in merged:
        _load(m, gate, 0)
        _load(m, up, 1)
    n = 12 // tp
    for r, m in enumerate(merged):
        assert torch.equal(m.weight[:n], gate[r * n : (r + 1) * n])
        assert torch.equal(m.weight[n:], up[r * n : (r + 1) * n])


def test_indivisible_shapes_are_refused_with_the_dimension_named():
    with pytest.raises(ValueError, match="attention heads"):
        QKVParallelLinear(8, 4, 6, 2, tp_size=4)
    with pytest.raises(ValueError, match="output features"):
        ColumnParallelLinear(8, 10, tp_size=4)
    with pytest.raises(ValueError, match="input features"):
        RowParallelLinear(10, 8, tp_size=4)


def _checkpoint(tmp_path, model, edit=None):
    sd = {}
    for name, p in model.named_parameters():
        if ".qkv_proj." in name:
            q, k, v = p.detach().split(
                [
                    model.model.layers[0].self_attn.q_size,
                    model.model.layers[0].self_attn.kv_size,
                    model.model.layers[0].self_attn.kv_size,
                ]
            )
            for frag, t in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                sd[name.replace("qkv_proj", frag)] = t.clone()
        elif ".gate_up_proj." in name:
            gate, up = p.detach().chunk(2)
            sd[name.replace("gate_up_proj", "gate_proj")] = gate.clone()
            sd[name.replace("gate_up_proj", "up_proj")] = up.clone()
        else:
            sd[name] = p.detach().clone()
    if edit is not None:
        edit(sd)
    save_file(sd, str(tmp_path / "model.safetensors"))
    return tmp_path


def _model():
    torch.manual_seed(0)
    m = Qwen3ForCausalLM(_config(), 64, "torch")
    for p in m.parameters():
        torch.nn.init.normal_(p.data)
    return m


def test_load_weights_round_trips_and_rejects_broken_checkpoints(tmp_path):
    src = _model()
    (tmp_path / "good").mkdir()
    good = _checkpoint(tmp_path / "good", src)
    dst = Qwen3ForCausalLM(_config(), 64, "torch")
    load_weights(dst, good)
    for (n, a), (_, b) in zip(src.named_parameters(), dst.named_parameters()):
        assert torch.equal(a, b), n
    k = "model.layers.0.self_attn.k_proj.weight"
    cases = {
        "bigger": (
            lambda sd: sd.__setitem__(k, torch.randn(sd[k].shape[0] * 2, sd[k].shape[1])),
            "k_proj",
        ),
        "smaller": (lambda sd: sd.__setitem__(k, sd[k][:-1].clone()), "k_proj"),
        "down": (
            lambda sd: sd.__setitem__("model.layers.0.mlp.down_proj.weight", torch.randn(64, 256)),
            "down_proj",
        ),
        "missing": (lambda sd: sd.pop("model.layers.1.mlp.up_proj.weight"), "lacks parameters"),
        "unknown": (
            lambda sd: sd.__setitem__("model.layers.0.mlp.extra.weight", torch.zeros(1)),
            "matches no model parameter",
        ),
    }
    for label, (edit, message) in cases.items():
        d = tmp_path / label
        d.mkdir()
        _checkpoint(d, src, edit)
        with pytest.raises((ValueError, KeyError), match=message):
            load_weights(Qwen3ForCausalLM(_config(), 64, "torch"), d)
    tied = tmp_path / "tied"
    tied.mkdir()
    _checkpoint(tied, src, lambda sd: sd.__setitem__("lm_head.weight", torch.zeros(300, 64)))
    load_weights(Qwen3ForCausalLM(_config(), 64, "torch"), tied)  # tied embeddings: ignored


def test_rotary_table_stays_float32_when_the_model_is_built_in_bf16():
    ref = RotaryEmbedding(16, 128, 10000.0)
    with _default_dtype(torch.bfloat16):
        rot = RotaryEmbedding(16, 128, 10000.0)
        lin = ColumnParallelLinear(4, 4)
    assert (
        rot.cos.dtype == torch.float32
        and torch.equal(rot.cos, ref.cos)
        and torch.equal(rot.sin, ref.sin)
    )
    assert lin.weight.dtype == torch.bfloat16
    assert torch.get_default_dtype() == torch.float32
