"""The norm/SwiGLU-fused small-M GEMVs in the model (``engine/layers/fused_linear.py``) against
the unfused ops, on the CPU under the Triton interpreter (``fuse_*_gemv=True`` forces the fused
kernels there; auto mode fuses on CUDA only):

* eager model, float32 and bfloat16, decode batches of 1-4 and prefill chunks (a chunk of more
  than 16 tokens keeps the unfused ops): same hidden states within rounding, and the fused
  kernels really ran (counted) for every step of at most 16 tokens;
* the whole-model compiled forward: the batch-1 graph calls the fused custom ops, the graphs of
  a symbolic token count keep the unfused ops, results equal the eager unfused model's;
* auto mode on the CPU fuses nothing (today's CPU path exactly);
* the engine: greedy tokens and prompt logits of the tiny bf16 checkpoint the same with the
  fusions on and off;
* tensor parallelism: two ranks' fused shards against the full unfused layers.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

import kernels.gemv_fused as gf
from engine.core.config import EngineConfig
from engine.core.request import SamplingParams
from engine.loader.dummy import init_random_weights
from engine.models.qwen3 import Qwen3ForCausalLM
from engine.worker.build import build_engine
from tests.engine_helpers import logits_for
from tests.unit.test_model_compile import _caches, _config, _step


@pytest.fixture
def counted(monkeypatch):
    """Counts of the fused kernels' launches: ``{"rms_norm": n, "swiglu": n}``."""
    counts = {"rms_norm": 0, "swiglu": 0}
    for kind, name in (("rms_norm", "gemv_rms_norm"), ("swiglu", "gemv_swiglu")):
        real = getattr(gf, name)

        def wrapper(*args, _real=real, _kind=kind, **kwargs):
            counts[_kind] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(gf, name, wrapper)
    return counts


def _pair(dtype: str, compile_mode: str = "none", backend: str = "torch", **cfg_changes):
    """(unfused, fused) models with the same random weights."""
    cfg = dataclasses.replace(_config(), dtype=dtype, **cfg_changes)
    torch_dtype = getattr(torch, dtype)
    unfused = Qwen3ForCausalLM(cfg, 512, backend, fuse_norm_gemv=False, fuse_swiglu_gemv=False)
    init_random_weights(unfused, 0, std=0.08)
    fused = Qwen3ForCausalLM(
        cfg, 512, backend, compile_mode, fuse_norm_gemv=True, fuse_swiglu_gemv=True
    )
    fused.load_state_dict(unfused.state_dict())
    return unfused.to(torch_dtype).eval(), fused.to(torch_dtype).eval()


#: (q_lens, cached) per step: a 5-token prefill, decodes of 1, 3 and 4 rows, a 20-token chunk
STEPS = [
    ([5], [0]),
    ([1], [5]),
    ([1, 1, 1], [6, 10, 30]),
    ([1, 1, 1, 1], [7, 11, 31, 2]),
    ([20], [0]),
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("bias", [False, True], ids=["qwen3", "qwen2_bias"])
def test_fused_model_matches_unfused(counted, dtype, bias):
    unfused, fused = _pair(dtype, attention_bias=bias, qk_norm=not bias)
    caches_u, caches_f = _caches(), _caches()
    caches_u = [(k.to(getattr(torch, dtype)), v.to(getattr(torch, dtype))) for k, v in caches_u]
    caches_f = [(k.to(getattr(torch, dtype)), v.to(getattr(torch, dtype))) for k, v in caches_f]
    gen = torch.Generator().manual_seed(5)
    layers = unfused.config.num_hidden_layers
    with torch.inference_mode():
        for q_lens, cached in STEPS:
            ids, pos, meta = _step(gen, q_lens, cached)
            before = dict(counted)
            want = unfused(ids, pos, caches_u, meta)
            assert counted == before, "the unfused model ran a fused kernel"
            got = fused(ids, pos, caches_f, meta)
            t = sum(q_lens)
            runs = 2 * layers if t <= 16 else 0  # q/k/v and gate/up per layer
            assert counted["rms_norm"] - before["rms_norm"] == runs, q_lens
            assert counted["swiglu"] - before["swiglu"] == runs // 2, q_lens
            if dtype == "float32":
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            else:
                rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
                assert rel < 2e-2, f"{q_lens}: relative difference {rel:.2e}"


def test_auto_mode_fuses_nothing_on_the_cpu(counted):
    cfg = dataclasses.replace(_config(), dtype="bfloat16")
    model = Qwen3ForCausalLM(cfg, 512, "torch").to(torch.bfloat16).eval()
    init_random_weights(model, 0, std=0.08)
    ids, pos, meta = _step(torch.Generator().manual_seed(1), [1], [3])
    caches = [(k.bfloat16(), v.bfloat16()) for k, v in _caches()]
    with torch.inference_mode():
        model(ids, pos, caches, meta)
    assert counted == {"rms_norm": 0, "swiglu": 0}


def test_compiled_model_uses_the_fused_ops_for_one_token(counted, one_torch_thread):
    """compile_mode="model" with the fusions forced, float32: the T == 1 graph runs the fused
    custom ops (counted at run time), the T >= 2 graph (symbolic T) the unfused ops; both
    match the eager unfused model."""
    torch._dynamo.reset()
    try:
        unfused, fused = _pair("float32", compile_mode="model")
        caches_u, caches_f = _caches(), _caches()
        gen = torch.Generator().manual_seed(9)
        layers = unfused.config.num_hidden_layers
        with torch.inference_mode():
            for q_lens, cached in [([6], [0]), ([1], [6]), ([1, 1], [7, 3]), ([1], [7])]:
                ids, pos, meta = _step(gen, q_lens, cached)
                want = unfused(ids, pos, caches_u, meta)
                before = dict(counted)
                got = fused(ids, pos, caches_f, meta)
                runs = 2 * layers if sum(q_lens) == 1 else 0
                assert counted["rms_norm"] - before["rms_norm"] == runs, q_lens
                assert counted["swiglu"] - before["swiglu"] == runs // 2, q_lens
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert fused._compiled._compiled is not None, "compilation failed and fell back to eager"
    finally:
        torch._dynamo.reset()


@pytest.fixture
def merges(monkeypatch):
    """Row counts of the merge-fused o projection's launches (``kernels/gemv_merge.py``)."""
    import kernels.gemv_merge as gm

    rows = []
    real = gm.gemv_attn_merge

    def wrapper(partial_out, *args, **kwargs):
        rows.append(partial_out.shape[0])
        return real(partial_out, *args, **kwargs)

    monkeypatch.setattr(gm, "gemv_attn_merge", wrapper)
    return rows


@pytest.mark.parametrize("compile_mode", ["none", "model"])
def test_merge_fused_o_proj_matches_attention_then_projection(
    merges, compile_mode, one_torch_thread
):
    """The Triton backend, float32: with ``fuse_merge_gemv=True`` pure decode steps stop the
    attention at the split-KV partials and the o projection merges them -- eagerly in every
    decode step of at most 16 rows, compiled only in the T == 1 graph (a symbolic T keeps the
    merged attention); the hidden states match the unfused model's, prompt steps included."""
    torch._dynamo.reset()
    try:
        cfg = _config()
        unfused = Qwen3ForCausalLM(cfg, 512, "triton", fuse_merge_gemv=False)
        init_random_weights(unfused, 0, std=0.08)
        fused = Qwen3ForCausalLM(cfg, 512, "triton", compile_mode, fuse_merge_gemv=True)
        fused.load_state_dict(unfused.state_dict())
        caches_u, caches_f = _caches(), _caches()
        gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
        layers = cfg.num_hidden_layers
        with torch.inference_mode():
            for q_lens, cached in [([6], [0]), ([1], [6]), ([1, 1], [7, 3]), ([1], [7])]:
                ids, pos, meta = _step(gen, q_lens, cached)
                want = unfused.eval()(ids, pos, caches_u, meta)
                before = len(merges)
                got = fused.eval()(ids, pos, caches_f, meta)
                decode = max(q_lens) == 1
                fuses = decode and (compile_mode == "none" or len(q_lens) == 1)
                assert merges[before:] == ([len(q_lens)] * layers if fuses else []), q_lens
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for (ku, vu), (kf, vf) in zip(caches_u, caches_f):  # the same k/v stored
            torch.testing.assert_close(kf, ku, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(vf, vu, rtol=1e-5, atol=1e-5)
        if compile_mode == "model":
            assert fused._compiled._compiled is not None, "compilation fell back to eager"
    finally:
        torch._dynamo.reset()


def test_merge_fusion_stays_off_for_the_torch_backend_and_in_auto_mode_on_the_cpu(merges):
    ids, pos, meta = _step(torch.Generator().manual_seed(2), [1], [4])
    for backend, mode in (("torch", True), ("triton", None)):
        model = Qwen3ForCausalLM(_config(), 512, backend, fuse_merge_gemv=mode).eval()
        init_random_weights(model, 0, std=0.08)
        with torch.inference_mode():
            model(ids, pos, _caches(), meta)
    assert merges == []


@pytest.fixture
def qkv_ropes(monkeypatch):
    """Row counts of the fused q/k/v + q/k norm + rotary + store launches
    (``kernels/gemv_qk_rope.py``)."""
    import kernels.gemv_qk_rope as gq

    rows = []
    real = gq.gemv_rms_norm_qk_rope

    def wrapper(x, *args, **kwargs):
        rows.append(x.shape[0])
        return real(x, *args, **kwargs)

    monkeypatch.setattr(gq, "gemv_rms_norm_qk_rope", wrapper)
    return rows


@pytest.mark.parametrize(
    "compile_mode, dtype, bias",
    [("none", "float32", False), ("none", "bfloat16", True), ("model", "float32", False)],
    ids=["eager", "eager_bf16_qwen2", "compiled"],
)
def test_qkv_rope_fused_model_matches_unfused(
    qkv_ropes, compile_mode, dtype, bias, one_torch_thread
):
    """The Triton backend with ``fuse_qkv_rope_gemv=True``: the input norm, q/k/v, q/k norm +
    rotary and KV store of each layer run as one kernel -- eagerly in every step of at most 16
    tokens (prompt steps included), compiled only in the T == 1 graph -- and the hidden states
    and the stored k/v match the unfused model's (Qwen3, and Qwen2's bias without the q/k
    norm)."""
    torch._dynamo.reset()
    try:
        cfg = dataclasses.replace(_config(), dtype=dtype, attention_bias=bias, qk_norm=not bias)
        tdt = getattr(torch, dtype)
        unfused = Qwen3ForCausalLM(cfg, 512, "triton", fuse_qkv_rope_gemv=False)
        init_random_weights(unfused, 0, std=0.08)
        g = torch.Generator().manual_seed(3)
        for layer in unfused.model.layers:  # norm weights of their own (the init sets ones)
            attn = layer.self_attn
            for norm in (layer.input_layernorm, attn.q_norm, attn.k_norm):
                if norm is not None:
                    norm.weight.data = 1 + 0.2 * torch.randn(norm.weight.shape, generator=g)
        fused = Qwen3ForCausalLM(cfg, 512, "triton", compile_mode, fuse_qkv_rope_gemv=True)
        fused.load_state_dict(unfused.state_dict())
        unfused, fused = unfused.to(tdt).eval(), fused.to(tdt).eval()
        caches_u = [(k.to(tdt), v.to(tdt)) for k, v in _caches()]
        caches_f = [(k.to(tdt), v.to(tdt)) for k, v in _caches()]
        gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
        layers = cfg.num_hidden_layers
        tol = 1e-5 if dtype == "float32" else 2e-2
        with torch.inference_mode():
            for q_lens, cached in [
                ([6], [0]),
                ([1], [6]),
                ([1, 1], [7, 3]),
                ([1], [7]),
                ([20], [0]),
                ([1], [0]),  # a one-token prompt
            ]:
                ids, pos, meta = _step(gen, q_lens, cached)
                want = unfused(ids, pos, caches_u, meta)
                before = len(qkv_ropes)
                got = fused(ids, pos, caches_f, meta)
                t = sum(q_lens)
                fuses = t <= 16 and (compile_mode == "none" or t == 1)
                assert qkv_ropes[before:] == ([t] * layers if fuses else []), q_lens
                rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
                assert rel < tol, f"{q_lens}: relative difference {rel:.2e}"
        for (ku, vu), (kf, vf) in zip(caches_u, caches_f):  # the same k/v stored
            for a, b in ((kf, ku), (vf, vu)):
                rel = ((a.float() - b.float()).norm() / b.float().norm()).item()
                assert rel < tol, f"stored k/v differ by {rel:.2e}"
        if compile_mode == "model":
            assert fused._compiled._compiled is not None, "compilation fell back to eager"
    finally:
        torch._dynamo.reset()


def test_qkv_rope_fusion_stays_off_for_the_torch_backend_and_in_auto_mode_on_the_cpu(qkv_ropes):
    """No fused q/k/v + rotary launch with the torch backend, in auto mode on the CPU, or with
    the norm fusion off (the kernel's prologue is that norm)."""
    ids, pos, meta = _step(torch.Generator().manual_seed(2), [1], [4])
    cases = (("torch", True, None), ("triton", None, None), ("triton", True, False))
    for backend, mode, norm in cases:
        model = Qwen3ForCausalLM(
            _config(), 512, backend, fuse_qkv_rope_gemv=mode, fuse_norm_gemv=norm
        ).eval()
        init_random_weights(model, 0, std=0.08)
        with torch.inference_mode():
            model(ids, pos, _caches(), meta)
    assert qkv_ropes == []


def _set_fusions(engine, on: bool) -> None:
    for layer in engine.executor.model.model.layers:
        layer.fuse_norm_gemv = on
        layer.mlp.fuse_swiglu_gemv = on


@pytest.mark.parametrize("tiny_checkpoint", [("qwen3", True)], indirect=True)
def test_engine_greedy_tokens_and_logits_same_with_fusions_on_and_off(tiny_checkpoint, counted):
    """The tiny checkpoint served in bf16 by two engines, one with the fused kernels forced
    (under the interpreter): the logits of an 11-token prompt (one fused step) agree within
    bf16 rounding and 8 greedy tokens of 3 prompts (prefill of 22 tokens unfused, decodes of
    1-3 rows fused) are the same."""
    path, _ = tiny_checkpoint
    gen = torch.Generator().manual_seed(21)
    prompts = [torch.randint(0, 384, (n,), generator=gen).tolist() for n in (4, 11, 7)]
    cfg = EngineConfig(
        model=path,
        dtype="bfloat16",
        num_kv_blocks=64,
        block_size=16,
        max_num_batched_tokens=256,
        compile_mode="none",
        async_scheduling=False,
    )
    tokens, logits = {}, {}
    for on in (False, True):  # (the q/k/v + rotary fusion follows the norm fusion's mode)
        eng = build_engine(cfg, eos_token_ids=frozenset())
        _set_fusions(eng, on)
        eng.add_request("probe", prompts[1], SamplingParams(max_tokens=1))
        logits[on] = logits_for(eng, eng.scheduler.schedule())
        eng = build_engine(cfg, eos_token_ids=frozenset())
        _set_fusions(eng, on)
        tokens[on] = eng.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8))
    assert counted["rms_norm"] > 0 and counted["swiglu"] > 0
    rel = ((logits[True] - logits[False]).norm() / logits[False].norm()).item()
    assert rel < 2e-2, f"prompt logits differ by {rel:.2e}"
    assert tokens[True] == tokens[False]


def test_tensor_parallel_shards_fused_equal_the_full_layers(counted):
    """Two tensor-parallel ranks' shards (column-parallel gate/up after the norm, row-parallel
    down after SwiGLU), fused and forced, float32: each rank's gate/up equals its unfused
    shard's, the new residual the same on both, and the sum of the down partials (the
    all-reduce) equals the full unfused MLP."""
    from engine.layers.fused_linear import norm_linear, swiglu_linear
    from engine.layers.linear import MergedColumnParallelLinear, RowParallelLinear
    from engine.layers.norm import RMSNorm
    from engine.layers.pointwise import PointwiseOps

    g = torch.Generator().manual_seed(13)
    h, inter, tp = 64, 96, 2
    ops = PointwiseOps(False)
    norm = RMSNorm(h, 1e-6)
    norm.weight.data = 1 + 0.1 * torch.randn(h, generator=g)
    gate, up = torch.randn(inter, h, generator=g) / 8, torch.randn(inter, h, generator=g) / 8
    down_w = torch.randn(h, inter, generator=g) / 10

    def mlp(rank, size):
        gu = MergedColumnParallelLinear(h, [inter, inter], tp_rank=rank, tp_size=size)
        gu.weight_loader(gu.weight, gate, 0)
        gu.weight_loader(gu.weight, up, 1)
        dn = RowParallelLinear(inter, h, tp_rank=rank, tp_size=size)
        dn.weight_loader(dn.weight, down_w)
        return gu, dn

    x, res = torch.randn(3, h, generator=g), torch.randn(3, h, generator=g)
    with torch.inference_mode():
        gu, dn = mlp(0, 1)
        full_gu, full_res = norm_linear(x, res, norm, gu, ops, False)
        want = swiglu_linear(full_gu, dn, ops, False)
        partials = []
        for rank in range(tp):
            gu, dn = mlp(rank, tp)
            shard, new_res = norm_linear(x, res, norm, gu, ops, True)
            ref_shard, _ = norm_linear(x, res, norm, gu, ops, False)
            torch.testing.assert_close(shard, ref_shard, rtol=1e-5, atol=1e-5)
            assert torch.equal(new_res, full_res)
            partials.append(swiglu_linear(shard, dn, ops, True))
    assert counted == {"rms_norm": tp, "swiglu": tp}
    torch.testing.assert_close(sum(partials), want, rtol=1e-5, atol=1e-5)


def test_tensor_parallel_qkv_rope_shards_equal_the_full_layer(qkv_ropes):
    """Two tensor-parallel ranks' q/k/v shards (column-parallel: a rank holds its q heads and
    its KV heads), fused and forced, float32: each rank's rotated q and the k/v it stores in its
    own cache equal the heads the full unfused layer computes for that rank."""
    from engine.layers.fused_linear import norm_linear, norm_qkv_rope
    from engine.layers.linear import QKVParallelLinear
    from engine.layers.norm import RMSNorm
    from engine.layers.pointwise import PointwiseOps
    from kernels.reference import qk_norm_rope_store_ref

    g = torch.Generator().manual_seed(17)
    h, d, hq, hkv, tp, t = 64, 16, 4, 2, 2, 3
    ops = PointwiseOps(False)
    norm = RMSNorm(h, 1e-6)
    norm.weight.data = 1 + 0.1 * torch.randn(h, generator=g)
    q_norm, k_norm = RMSNorm(d, 1e-6), RMSNorm(d, 1e-6)
    q_norm.weight.data = 1 + 0.2 * torch.randn(d, generator=g)
    k_norm.weight.data = 1 + 0.2 * torch.randn(d, generator=g)
    wq, wk, wv = (torch.randn(n * d, h, generator=g) / 8 for n in (hq, hkv, hkv))

    def qkv(rank, size):
        layer = QKVParallelLinear(h, d, hq, hkv, tp_rank=rank, tp_size=size)
        for w, shard in ((wq, "q"), (wk, "k"), (wv, "v")):
            layer.weight_loader(layer.weight, w, shard)
        return layer

    x, res = torch.randn(t, h, generator=g), torch.randn(t, h, generator=g)
    ang = torch.randn(t, 1, d // 2, generator=g).repeat(1, 1, 2)
    rope = (ang.cos(), ang.sin())
    slots = torch.tensor([5, 17, 2])
    with torch.inference_mode():
        full, full_res = norm_linear(x, res, norm, qkv(0, 1), ops, False)
        q, k, v = full.split([hq * d, hkv * d, hkv * d], dim=1)
        caches = [torch.zeros(2, 16, hkv, d) for _ in "kv"]
        q_ref = qk_norm_rope_store_ref(
            q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d), *caches, slots, *rope,
            q_norm.weight, k_norm.weight, 1e-6,
        )  # fmt: skip
        for rank in range(tp):
            layer = qkv(rank, tp)
            tiles = [d, 32, 2, 4, 1]
            mine = [torch.zeros(2, 16, hkv // tp, d) for _ in "kv"]
            heads = (hq // tp, hkv // tp)
            y, new_res = norm_qkv_rope(
                x, res, norm, layer, tiles, heads, mine, slots, rope, q_norm, k_norm
            )
            qs, ks = slice(rank * hq // tp, (rank + 1) * hq // tp), slice(rank, rank + 1)
            got_q = y[:, : hq // tp * d].view(t, hq // tp, d)
            torch.testing.assert_close(got_q, q_ref[:, qs], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(mine[0], caches[0][:, :, ks], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(mine[1], caches[1][:, :, ks], rtol=1e-5, atol=1e-5)
            assert torch.equal(new_res, full_res)
    assert qkv_ropes == [t] * tp
