"""The fused small-M GEMVs (``kernels/gemv_fused.py``) against the unfused ops they replace, on
fresh random inputs under the Triton interpreter (or on a GPU when one is present):

* ``gemv_swiglu`` against ``silu_and_mul`` then a float32 ``F.linear``, and bit for bit (where
  the elementwise float32 math agrees) against ``silu_and_mul`` then :func:`kernels.gemv.gemv`;
* ``gemv_rms_norm`` against ``F.rms_norm`` (float32) and the project's RMSNorm
  (``add_rms_norm``) then ``F.linear``, the new residual bit for bit;

with N and K tails, N tiles past N, 1-3 K splits, M = 1..16, bias or none."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from engine.layers.activation import silu_and_mul
from engine.layers.norm import add_rms_norm, rms_norm
from kernels.gemv import GemvConfig, gemv, gemv_counters
from kernels.gemv_fused import fused_gemv_config, gemv_rms_norm, gemv_swiglu

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.bfloat16] if DEVICE == "cuda" else [torch.float32, torch.bfloat16]
EPS = 1e-6

#: (M, N, K, tiles, bias): K tails, N tiles past N, single and split K, all 16 rows
CASES = [
    (1, 64, 128, GemvConfig(16, 32, 1, 4, 1), False),
    (1, 40, 96, GemvConfig(16, 32, 2, 4, 1), True),
    (3, 80, 200, GemvConfig(16, 32, 3, 4, 1), True),
    (16, 48, 96, GemvConfig(32, 32, 2, 4, 1), False),
    (7, 33, 64, GemvConfig(16, 16, 4, 4, 1), True),
    (12, 40, 160, GemvConfig(16, 64, 2, 4, 1), False),
]


def _seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _tol(dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 1e-2


def _close_bits(a: torch.Tensor, b: torch.Tensor, dtype) -> None:
    """``a`` and ``b`` from the same products (same tiles) of activations rounded the same way:
    equal up to an ulp of float32 in the elementwise math, which may flip a rounding of
    ``dtype``. Under the interpreter (numpy's float32 math, round-to-nearest emulated) nearly
    every output is bit-equal; on the GPU (approximate exp / rsqrt / division) one flipped
    activation moves the whole row's outputs by a little, so only their distance is bounded."""
    if dtype == torch.float32:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        return
    if a.device.type != "cuda":
        frac = (a != b).float().mean().item()
        assert frac < 0.02, f"{frac:.1%} of the outputs differ from the unfused kernel's"
    assert _rel(a, b) < 4e-3


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, n, k, cfg, bias", CASES)
def test_gemv_swiglu_matches_silu_and_mul_then_linear(m, n, k, cfg, dtype, bias):
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(m, 2 * k, generator=g) * 2).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=g).to(DEVICE, dtype) if bias else None
    out = gemv_swiglu(gate_up, w, b, cfg)
    act = silu_and_mul(gate_up)
    ref = F.linear(act.float(), w.float(), None if b is None else b.float())
    assert out.shape == (m, n) and out.dtype == dtype
    assert _rel(out, ref) < _tol(dtype), f"seed {seed}"
    _close_bits(out, gemv(act, w, b, cfg), dtype)
    assert int(gemv_counters(out.device).abs().sum()) == 0, "arrival counters left non-zero"


def test_gemv_swiglu_strided_gate_up():
    """A row-strided gate_up (a view of a wider buffer) is read through its row stride; a
    column-strided one is copied."""
    g = torch.Generator().manual_seed(_seed())
    wide = torch.randn(4, 300, generator=g).to(DEVICE)
    w = (torch.randn(24, 96, generator=g) / 10).to(DEVICE)
    cfg = GemvConfig(16, 32, 2, 4, 1)
    ref = F.linear(silu_and_mul(wide[:, :192]), w)
    assert _rel(gemv_swiglu(wide[:, :192], w, None, cfg), ref) < 1e-5
    cols = wide[:, :192].T.contiguous().T  # column stride 4
    assert _rel(gemv_swiglu(cols, w, None, cfg), ref) < 1e-5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, n, k, cfg, bias", CASES)
@pytest.mark.parametrize("with_residual", [True, False], ids=["add", "first_layer"])
def test_gemv_rms_norm_matches_rms_norm_then_linear(m, n, k, cfg, dtype, with_residual, bias):
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * 3).to(DEVICE, dtype)
    residual = torch.randn(m, k, generator=g).to(DEVICE, dtype) if with_residual else None
    norm_w = (1 + 0.2 * torch.randn(k, generator=g)).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=g).to(DEVICE, dtype) if bias else None
    out, new_res = gemv_rms_norm(x, norm_w, EPS, w, b, residual, cfg)
    if with_residual:
        normed, h = add_rms_norm(x, residual, norm_w, EPS)
        assert torch.equal(new_res, h), "the new residual is not x + residual"
    else:
        normed, h = rms_norm(x, norm_w, EPS), x
        assert new_res is None
    b32 = None if b is None else b.float()
    # independent reference: torch's own RMSNorm in float32 on the rounded sum
    ref32 = F.linear(F.rms_norm(h.float(), (k,), norm_w.float(), EPS), w.float(), b32)
    assert _rel(out, ref32) < _tol(dtype), f"seed {seed}"
    # the project's RMSNorm (the unfused path's rounding) then a float32 product
    assert _rel(out, F.linear(normed.float(), w.float(), b32)) < _tol(dtype), f"seed {seed}"
    _close_bits(out, gemv(normed, w, b, cfg), dtype)
    assert int(gemv_counters(out.device).abs().sum()) == 0


def test_gemv_rms_norm_row_strided_inputs_and_no_rows():
    g = torch.Generator().manual_seed(_seed())
    wide = torch.randn(5, 256, generator=g).to(DEVICE)
    x, res = wide[:, :128], wide[:, 128:]
    norm_w = torch.rand(128, generator=g).to(DEVICE) + 0.5
    w = (torch.randn(40, 128, generator=g) / 12).to(DEVICE)
    out, new_res = gemv_rms_norm(x, norm_w, EPS, w, None, res, GemvConfig(16, 32, 2, 4, 1))
    normed, h = add_rms_norm(x, res, norm_w, EPS)
    assert torch.equal(new_res, h)
    assert _rel(out, F.linear(normed, w)) < 1e-5
    empty, empty_res = gemv_rms_norm(x[:0], norm_w, EPS, w, None, res[:0])
    assert empty.shape == (0, 40) and empty_res.shape == (0, 128)


def test_fused_gemvs_refuse_operands_they_would_misread():
    x = torch.randn(3, 64, device=DEVICE)
    w = torch.randn(32, 64, device=DEVICE)
    nw = torch.ones(64, device=DEVICE)
    with pytest.raises(ValueError, match="2K"):
        gemv_swiglu(torch.randn(3, 100, device=DEVICE), w)
    with pytest.raises(ValueError, match="at most"):
        gemv_swiglu(torch.randn(17, 128, device=DEVICE), w)
    with pytest.raises(ValueError, match="K stride"):
        gemv_swiglu(torch.randn(3, 128, device=DEVICE), w.T.contiguous().T)
    with pytest.raises(ValueError, match="norm weight"):
        gemv_rms_norm(x, nw[:32], EPS, w)
    with pytest.raises(ValueError, match="residual"):
        gemv_rms_norm(x, nw, EPS, w, None, x[:2])
    with pytest.raises(ValueError, match="features"):
        gemv_rms_norm(x[:, :32], nw[:32], EPS, w)
    with pytest.raises(ValueError, match="at most"):
        gemv_rms_norm(torch.randn(17, 64, device=DEVICE), nw, EPS, w)


def test_fused_config_table_lookup(monkeypatch):
    """Off the interpreter the fused tiles come only from a table entry whose fusion won; no
    entry, a lost entry or M > 16 means no fusion; an unknown kind is refused."""
    import kernels.gemv_fused as gf

    with pytest.raises(ValueError, match="unknown"):
        fused_gemv_config("gelu", 1, 64, 64, torch.device(DEVICE))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    row = dict(block_n=64, block_k=256, split_k=2, num_warps=4, num_stages=3)
    table = {
        "rms_norm:4096,1024": {"m1": {**row, "fused_faster": True}},
        "swiglu:1024,3072": {"m1": {**row, "fused_faster": False}, "m16": row},
    }
    monkeypatch.setattr(
        gf, "kernel_table", lambda kernel, name: table if kernel == "gemv_fused" else {}
    )
    dev = torch.device("cpu")
    assert fused_gemv_config("rms_norm", 1, 4096, 1024, dev) == GemvConfig(64, 256, 2, 4, 3)
    assert fused_gemv_config("rms_norm", 2, 4096, 1024, dev) is None  # no m16 row
    assert fused_gemv_config("rms_norm", 17, 4096, 1024, dev) is None
    assert fused_gemv_config("swiglu", 1, 1024, 3072, dev) is None  # the pair was faster
    assert fused_gemv_config("swiglu", 8, 1024, 3072, dev) is None  # no fused_faster: not won
    assert fused_gemv_config("rms_norm", 1, 6144, 1024, dev) is None  # never timed
