"""Programmatic dependent launch (``kernels/pdl.py``): off where it cannot run (CPU, the
interpreter, the switch), the switch's parsing, and on a CUDA device of compute capability 9.0+
every kernel that takes it gives the same bits with and without it, also chained back to back
inside a CUDA graph (where a read before ``griddepcontrol.wait`` would race with the previous
kernel's writes)."""

from __future__ import annotations

import pytest
import torch

import kernels.gemv as gemv_module
import kernels.pdl as pdl
from bench.pdl_probe import capture_graph
from kernels.decode_attention import choose_num_splits, decode_attention, decode_scratch
from kernels.gemv import GemvConfig, gemv, pdl_launch_args, prefetchable
from kernels.gemv_fused import gemv_rms_norm, gemv_swiglu
from kernels.interpreter import interpreting
from kernels.qk_norm_rope import qk_norm_rope_store

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
needs_hopper = pytest.mark.skipif(
    not HOPPER, reason="PDL needs a CUDA device of compute capability 9.0+ (none here)"
)


@pytest.fixture
def compiled():
    """The Hopper tests need compiled kernels: the interpreter has no ``griddepcontrol`` (the
    root conftest turns it on unless ``TRITON_INTERPRET=0``). Asserts that PDL is really on,
    so that a comparison of switch on against off cannot pass with both plain."""
    if interpreting():
        pytest.skip("PDL runs only in compiled kernels: set TRITON_INTERPRET=0")
    assert pdl.pdl_enabled(torch.device("cuda")), "PDL is off on this Hopper GPU"


def test_gating_by_capability_switch_and_triton(monkeypatch):
    """``pdl_enabled``: True only for compute capability 9.0+ with the switch on and Triton's
    ``gdc`` intrinsics present; the answer is cached per device index, the switch is not."""
    monkeypatch.setattr(pdl, "interpreting", lambda: False)
    monkeypatch.setattr(pdl, "_SUPPORTED", {})
    caps = {0: (9, 0), 1: (8, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: caps[index])
    monkeypatch.setattr(pdl, "PDL_SWITCH", True)
    assert pdl.pdl_enabled(torch.device("cuda", 0))
    assert not pdl.pdl_enabled(torch.device("cuda", 1))
    assert pdl._SUPPORTED == {0: True, 1: False}
    caps[1] = (10, 0)  # cached: not asked again
    assert not pdl.pdl_enabled(torch.device("cuda", 1))
    monkeypatch.setattr(pdl, "PDL_SWITCH", False)
    assert not pdl.pdl_enabled(torch.device("cuda", 0))
    assert pdl.pdl_kwargs(torch.device("cuda", 0)) == {"PDL": False}
    monkeypatch.setattr(pdl, "PDL_SWITCH", True)
    assert pdl.pdl_kwargs(torch.device("cuda", 0)) == {"PDL": True, "launch_pdl": True}
    monkeypatch.setattr(pdl, "_SUPPORTED", {})
    real_import = pdl.importlib.import_module

    def import_without_gdc(name):  # a Triton without triton.language.extra.cuda
        if name == "triton.language.extra.cuda":
            raise ImportError(name)
        return real_import(name)

    monkeypatch.setattr(pdl.importlib, "import_module", import_without_gdc)
    assert not pdl.pdl_enabled(torch.device("cuda", 0))  # a Triton without the intrinsics


def test_off_on_cpu_and_under_the_interpreter(monkeypatch):
    assert not pdl.pdl_enabled(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl.pdl_enabled(torch.device("cuda", 0))  # no griddepcontrol in the interpreter
    assert pdl.launch_options(False) == {}
    assert pdl.launch_options(True) == {"launch_pdl": True}


@pytest.mark.parametrize(
    "value, expected", [("1", True), ("on", True), ("0", False), (" Off ", False)]
)
def test_switch_values(monkeypatch, value, expected):
    monkeypatch.setenv("QWEN_SERVE_PDL", value)
    assert pdl._switch() is expected


def test_switch_refuses_other_values(monkeypatch):
    monkeypatch.setenv("QWEN_SERVE_PDL", "maybe")
    with pytest.raises(ValueError, match="QWEN_SERVE_PDL"):
        pdl._switch()


def test_prefetch_only_for_16_bit_weights_and_whole_lines():
    """The kernels prefetch 64-element (128-byte) lines of 16-bit weights: a float32 weight or a
    K tile shorter than a line never asks for the prefetch (it would compile a zero-width
    ``arange``)."""
    bf16 = torch.empty(4, 4, dtype=torch.bfloat16)
    assert prefetchable(bf16, 64) and prefetchable(bf16, 256)
    assert not prefetchable(bf16, 32)
    assert not prefetchable(torch.empty(4, 4, dtype=torch.float32), 32)
    assert not prefetchable(torch.empty(4, 4, dtype=torch.float32), 128)
    cpu = torch.device("cpu")
    off = {"PDL": False, "PREFETCH": False}
    assert pdl_launch_args(cpu, True) == off
    assert pdl_launch_args(cpu, True, pdl=2) == off  # never where PDL cannot run


def test_gemv_launch_levels(monkeypatch):
    """Where PDL runs: None means PDL with the prefetch (where the weight allows it), 1 PDL
    alone, 0 a plain launch."""
    monkeypatch.setattr(gemv_module, "pdl_enabled", lambda device: True)
    dev = torch.device("cuda", 0)
    on = {"PDL": True, "PREFETCH": True, "launch_pdl": True}
    assert pdl_launch_args(dev, True) == on
    assert pdl_launch_args(dev, True, pdl=2) == on
    assert pdl_launch_args(dev, False)["PREFETCH"] is False
    assert pdl_launch_args(dev, True, pdl=1) == {**on, "PREFETCH": False}
    assert pdl_launch_args(dev, True, pdl=0) == {"PDL": False, "PREFETCH": False}


def _graph_run(fn):
    """``fn()``'s result replayed from a CUDA graph (warmed up on a side stream first)."""
    return capture_graph(fn)[1]


@needs_hopper
@pytest.mark.parametrize("split_k", [1, 4])
def test_gemv_chain_same_bits_with_pdl(compiled, split_k):
    """Eight GEMVs, each reading the last one's output, in one graph: PDL with and without the
    weight prefetch equal plain launches bit for bit."""
    torch.manual_seed(0)
    ws = [torch.randn(512, 512, device="cuda", dtype=torch.bfloat16) / 23 for _ in range(8)]
    x = torch.randn(1, 512, device="cuda", dtype=torch.bfloat16)
    cfg = GemvConfig(block_n=32, block_k=128, split_k=split_k, num_warps=4, num_stages=3)

    def chain(level):
        h = x
        for w in ws:
            h = gemv(h, w, config=cfg, pdl=level)
        return h

    ref = _graph_run(lambda: chain(0)).clone()
    for level in (1, 2):
        assert torch.equal(_graph_run(lambda level=level: chain(level)), ref), level


@needs_hopper
def test_fused_gemvs_and_attention_same_bits_with_pdl(compiled, monkeypatch):
    """A decode layer's kernels chained in a graph (norm+qkv GEMV, q/k norm + rotary + cache
    store, split-KV decode and its reduce, o GEMV, norm+gate_up, SwiGLU+down): with the switch
    on, the same bits as with it off."""
    torch.manual_seed(1)
    dev, bf = "cuda", torch.bfloat16
    hid, hq, hkv, d, inter, bs, ctx = 256, 4, 2, 64, 512, 16, 300
    blocks = (ctx + bs - 1) // bs
    t = dict(
        x=torch.randn(1, hid, device=dev, dtype=bf),
        res=torch.randn(1, hid, device=dev, dtype=bf),
        n1=torch.rand(hid, device=dev, dtype=bf) + 0.5,
        n2=torch.rand(hid, device=dev, dtype=bf) + 0.5,
        wqkv=torch.randn((hq + 2 * hkv) * d, hid, device=dev, dtype=bf) / 16,
        wo=torch.randn(hid, hq * d, device=dev, dtype=bf) / 16,
        wgu=torch.randn(2 * inter, hid, device=dev, dtype=bf) / 16,
        wd=torch.randn(hid, inter, device=dev, dtype=bf) / 23,
        qn=torch.rand(d, device=dev, dtype=bf) + 0.5,
        kn=torch.rand(d, device=dev, dtype=bf) + 0.5,
        cos=torch.rand(1, d, device=dev, dtype=bf),
        sin=torch.rand(1, d, device=dev, dtype=bf),
        bt=torch.randperm(blocks, device=dev, dtype=torch.int32).view(1, blocks),
        sl=torch.tensor([ctx], device=dev, dtype=torch.int32),
    )
    last = ctx - 1  # the new token's slot: its block through the block table, then the offset
    t["slot"] = (t["bt"][0, last // bs].long() * bs + last % bs).view(1)
    kc0 = torch.randn(blocks, bs, hkv, d, device=dev, dtype=bf)
    vc0 = torch.randn(blocks, bs, hkv, d, device=dev, dtype=bf)
    splits = choose_num_splits(1, hkv, ctx, 132)
    po, plse = decode_scratch(1, hq, d, splits, dev)
    cfg = GemvConfig(block_n=32, block_k=128, split_k=2, num_warps=4, num_stages=3)

    def layer(kc, vc):
        qkv, h = gemv_rms_norm(t["x"], t["n1"], 1e-6, t["wqkv"], residual=t["res"], config=cfg)
        q, k, v = qkv.view(1, hq + 2 * hkv, d).split([hq, hkv, hkv], dim=1)
        q = qk_norm_rope_store(
            q, k, v, kc, vc, t["slot"], t["cos"], t["sin"], t["qn"], t["kn"], 1e-6
        )
        attn = torch.empty_like(q)
        decode_attention(q, kc, vc, t["bt"], t["sl"], attn, d**-0.5, po, plse, splits)
        o = gemv(attn.view(1, hq * d), t["wo"], config=cfg)
        gu, h2 = gemv_rms_norm(o, t["n2"], 1e-6, t["wgu"], residual=h, config=cfg)
        return gemv_swiglu(gu, t["wd"], config=cfg), h2, kc, vc

    outs = {}
    for on in (False, True):
        monkeypatch.setattr(pdl, "PDL_SWITCH", on)
        kc, vc = kc0.clone(), vc0.clone()
        outs[on] = [o.clone() for o in _graph_run(lambda kc=kc, vc=vc: layer(kc, vc))]
    for a, b in zip(outs[False], outs[True]):
        assert torch.equal(a, b)


@needs_hopper
@pytest.mark.parametrize("split_k", [1, 3])
def test_fp8_gemv_chain_same_bits_with_pdl(compiled, monkeypatch, split_k):
    """Six block-scaled FP8 GEMVs (quantization fused), each reading the last one's output, in
    one graph: with the switch on (PDL), the bits of plain launches."""
    from kernels.fp8_configs import Fp8Config
    from kernels.fp8_gemm import fp8_gemv

    gen = torch.Generator().manual_seed(2)
    n = k = 384
    ws_ = [(torch.randn(n, k, generator=gen) * 2).to(torch.float8_e4m3fn).cuda() for _ in range(6)]
    scales = [(torch.rand(3, 3, generator=gen) * 0.01 + 0.001).cuda() for _ in range(6)]
    x = torch.randn(1, k, generator=gen).cuda()
    cfg = Fp8Config("gemv", 16, 32, 4, 1, split_k=split_k)

    def chain():
        h = x
        for w, s in zip(ws_, scales):
            h = fp8_gemv(h, w, s, None, torch.empty(1, n, device="cuda"), cfg)
        return h

    outs = {}
    for on in (False, True):
        monkeypatch.setattr(pdl, "PDL_SWITCH", on)
        outs[on] = _graph_run(chain).clone()
    assert torch.isfinite(outs[False]).all()
    assert torch.equal(outs[False], outs[True])
