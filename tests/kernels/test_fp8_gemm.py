"""The block-FP8 Triton kernels (``kernels/fp8_gemm.py``) against their torch reference, under
the Triton interpreter on the CPU (or on a GPU when one is present).

The interpreter handles float8e4nv loads, stores, the FP8 ``tl.dot`` and float8 -> float32
exactly, but its float32 -> float8 cast is not round-to-nearest-even (ties go up, mantissa
carries are lost: 7.76 becomes 4.0); the kernels therefore round to the FP8 grid in float32
first under the interpreter (``EMULATE_CAST``) and use the hardware cast on the GPU. So these
tests check the kernels' tiling, masking, split-K, scale indexing and quantization arithmetic
bit for bit, and ``bench/fp8.py`` checks the hardware cast (quantized activations byte-equal to
the reference) and the speed on the H200.
"""

from __future__ import annotations

import pytest
import torch

from kernels.fp8_gemm import (
    Fp8Config,
    _interpreting,
    fp8_config,
    fp8_gemm,
    fp8_gemv,
    fp8_group_quant,
    fp8_linear,
)
from kernels.reference import (
    fp8_block_matmul_ref,
    fp8_group_quant_ref,
    fp8_linear_ref,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _weights(n, k, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=gen) * 2).to(torch.float8_e4m3fn)
    ws = torch.rand(-(-n // 128), -(-k // 128), generator=gen) * 0.01 + 0.001
    return w.to(DEVICE), ws.to(DEVICE)


def _x(m, k, seed=1, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.logspace(-2, 1, k)[torch.randperm(k)]
    return x.to(DEVICE, dtype)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


def test_interpreter_cast_is_emulated():
    assert _interpreting() == (DEVICE == "cpu")


@pytest.mark.parametrize("m, k", [(1, 128), (5, 300), (16, 1024), (3, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_group_quant_is_bit_exact(m, k, dtype):
    x = _x(m, k, dtype=dtype)
    x[0, :7] = 0.0  # a partly zero group
    if m > 2:
        x[2] = 0.0  # an all-zero row: finite scales, zero codes
    q, s = fp8_group_quant(x)
    qr, sr = fp8_group_quant_ref(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (m, k)
    assert s.shape == (m, -(-k // 128)) and s.stride(0) == 1  # column-major scales
    assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8))
    assert torch.equal(s, sr)


def test_group_quant_rounds_to_nearest_even_at_ties_and_saturates():
    # scale 1 for the group (amax 448): the codes are the values rounded to FP8
    vals = [448.0, 1.0625, 1.1875, 17.0, 19.0, 7.76, -7.76, 2.0**-10, 3 * 2.0**-10, -0.0]
    x = torch.zeros(1, 128)
    x[0, : len(vals)] = torch.tensor(vals)
    q, s = fp8_group_quant(x.to(DEVICE))
    assert s.item() == 1.0
    want = torch.tensor(vals).to(torch.float8_e4m3fn).float()
    assert torch.equal(q[0, : len(vals)].float().cpu(), want)
    assert want[1:5].tolist() == [1.0, 1.25, 16.0, 20.0]  # ties to even


@pytest.mark.parametrize("m", [1, 3, 16, 32])
@pytest.mark.parametrize("split_k", [1, 2, 3])
@pytest.mark.parametrize("n, k", [(200, 300), (256, 512)])
def test_gemv_matches_reference(m, split_k, n, k):
    """Unaligned N and K, 1..3 splits (one uneven), bias, rows up to block_m."""
    w, ws = _weights(n, k)
    x = _x(m, k)
    bias = torch.randn(n, device=DEVICE)
    cfg = Fp8Config("gemv", max(16, 1 << (m - 1).bit_length()), 32, 4, 1, split_k=split_k)
    out = torch.empty(m, n, device=DEVICE)
    fp8_gemv(x, w, ws, bias, out, cfg)
    assert _rel(out, fp8_linear_ref(x, w, ws, bias)) < 1e-6


@pytest.mark.parametrize("m", [1, 33, 70])
@pytest.mark.parametrize("n, k", [(200, 300), (256, 512)])
def test_gemm_matches_reference(m, n, k):
    w, ws = _weights(n, k, seed=2)
    x = _x(m, k, seed=3)
    xq, xs = fp8_group_quant(x)
    for bias in (None, torch.randn(n, device=DEVICE)):
        out = torch.empty(m, n, device=DEVICE)
        fp8_gemm(xq, xs, w, ws, bias, out, Fp8Config("gemm", 32, 32, 4, 1, group_m=2))
        assert _rel(out, fp8_block_matmul_ref(xq, xs, w, ws, bias=bias, out_dtype=out.dtype)) < 1e-6


@pytest.mark.parametrize("m", [1, 7, 40])
def test_fp8_linear_bf16(m):
    """bf16 activations and outputs through both kernels (picked by M): within one bf16 ulp."""
    n, k = 256, 384
    w, ws = _weights(n, k, seed=4)
    x = _x(m, k, seed=5, dtype=torch.bfloat16)
    out = fp8_linear(x, w, ws)
    ref = fp8_linear_ref(x, w, ws)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    assert fp8_config(m, n, k).kind == ("gemv" if m <= 32 else "gemm")
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=1e-6)


def test_fp8_linear_refuses_bad_inputs():
    w, ws = _weights(128, 128)
    with pytest.raises(ValueError, match="float8_e4m3fn weight"):
        fp8_linear(_x(2, 128), w.float(), ws)
    with pytest.raises(ValueError, match="x has 256 features"):
        fp8_linear(_x(2, 256), w, ws)
    with pytest.raises(ValueError, match="at most block_m=16 rows"):
        fp8_gemv(_x(17, 128), w, ws, None, torch.empty(17, 128), Fp8Config("gemv", 16, 32, 4, 1))
