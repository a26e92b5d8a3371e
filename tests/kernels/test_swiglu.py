"""kernels/swiglu.py: the Triton SwiGLU against eager torch (``silu_and_mul``), and its wiring
behind ``QWEN_SERVE_TRITON_SWIGLU``."""

from __future__ import annotations

import pytest
import torch

from engine.layers.activation import silu_and_mul as silu_and_mul_ref
from kernels.swiglu import silu_and_mul

#: an upper bound of one unit in the last place relative to the value, and the smallest
#: difference that counts (subnormal outputs), per dtype
ULP = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 2**-23}
TINY = {torch.bfloat16: 1e-30, torch.float16: 1e-7, torch.float32: 1e-35}


def _check(x, out):
    """Within 4 ulps of eager torch, and on the GPU (bf16/fp16) nearly always bit-equal.

    Eager torch rounds twice (silu, then the product), as the kernel does. The Triton
    interpreter truncates float32 to bfloat16 instead of rounding to nearest (checked
    2026-12-05, Triton 3.6), so there a bf16 result may sit two ulps below eager's, one per
    rounding; exp may differ by an ulp in float32 between the kernel and torch."""
    ref = silu_and_mul_ref(x)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    tol = 4 * ULP[x.dtype] * ref.float().abs() + TINY[x.dtype]
    assert ((out.float() - ref.float()).abs() <= tol).all()
    if x.dtype == torch.float16 or (x.dtype == torch.bfloat16 and x.is_cuda):
        exact = (out == ref).float().mean().item()
        assert exact > 0.98, exact  # nearly every element bit-equal to eager torch


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("t,inter", [(1, 16), (5, 48), (33, 100), (7, 257)])
def test_matches_eager_torch(device, dtype, t, inter):
    g = torch.Generator(device="cpu").manual_seed(t * 1000 + inter)
    x = (torch.randn(t, 2 * inter, generator=g) * 4).to(dtype).to(device)
    _check(x, silu_and_mul(x, block=16))
    _check(x, silu_and_mul(x, block=32, num_warps=1))


def test_strided_rows_and_out(device):
    """A row stride larger than 2I (a view of a wider buffer) and a given ``out``."""
    g = torch.Generator(device="cpu").manual_seed(3)
    wide = torch.randn(9, 200, generator=g).to(torch.bfloat16).to(device)
    x = wide[:, :96]  # [9, 96], row stride 200
    out = torch.full((9, 48), 7.0, dtype=torch.bfloat16, device=device)
    assert silu_and_mul(x, out=out, block=16) is out
    _check(x, out)


def test_edge_values(device):
    x = torch.tensor(
        [[0.0, -0.0, 30.0, -30.0, 88.0, -88.0, 1.0, -1.0] + [2.0] * 8], dtype=torch.float32
    ).to(device)
    _check(x, silu_and_mul(x, block=16))


def test_empty_and_bad_shapes(device):
    x = torch.empty(0, 32, dtype=torch.bfloat16, device=device)
    assert silu_and_mul(x).shape == (0, 16)
    with pytest.raises(ValueError, match="2I"):
        silu_and_mul(torch.zeros(4, 33, device=device))
    with pytest.raises(ValueError, match="2I"):
        silu_and_mul(torch.zeros(2, 4, 32, device=device))
    with pytest.raises(ValueError, match="contiguous"):
        silu_and_mul(torch.zeros(32, 4, device=device).t())
    with pytest.raises(ValueError, match="out must be"):
        silu_and_mul(torch.zeros(4, 32, device=device), out=torch.zeros(4, 15, device=device))
    with pytest.raises(ValueError, match="power of two"):
        silu_and_mul(torch.zeros(4, 32, device=device), block=24)


def test_switch_routes_to_the_kernel(device, monkeypatch):
    """With the switch on, ``PointwiseOps.silu_and_mul`` sends [T, 2I] tensors to the custom op
    (the Triton kernel: on CUDA, here under the interpreter) and keeps the composition for
    what the kernel does not take (3-D, a strided last dimension); off, it is the composition
    itself; a CPU tensor outside the tests takes the composition."""
    from engine.layers import activation, kernel_switches
    from engine.layers.pointwise import PointwiseOps

    monkeypatch.setattr(kernel_switches, "TRITON_SWIGLU", True)
    monkeypatch.setattr(activation, "takes_kernel", lambda x: True)  # CUDA, or the interpreter
    calls = []
    real = activation.silu_and_mul_triton_op
    monkeypatch.setattr(activation, "silu_and_mul_triton_op", lambda x: calls.append(1) or real(x))
    ops = PointwiseOps(compiled=False)
    x = (torch.randn(6, 64) * 3).to(torch.bfloat16).to(device)
    _check(x, ops.silu_and_mul(x))
    assert calls == [1]
    odd = torch.randn(4, 2, 32, device=device)  # 3-D: the composition
    torch.testing.assert_close(ops.silu_and_mul(odd), silu_and_mul_ref(odd))
    strided = torch.randn(64, 6, device=device).t()  # last dimension not contiguous
    torch.testing.assert_close(ops.silu_and_mul(strided), silu_and_mul_ref(strided))
    assert calls == [1]
    monkeypatch.undo()
    cpu = torch.randn(3, 32)
    monkeypatch.setattr(kernel_switches, "TRITON_SWIGLU", True)
    monkeypatch.setattr(activation, "silu_and_mul_triton_op", lambda x: calls.append(2) or x)
    torch.testing.assert_close(
        PointwiseOps(compiled=False).silu_and_mul(cpu), silu_and_mul_ref(cpu)
    )
    assert calls == [1]  # the CPU engine never runs the kernel, interpreter or not
    monkeypatch.setattr(kernel_switches, "TRITON_SWIGLU", False)
    assert PointwiseOps(compiled=False).silu_and_mul is activation.silu_and_mul


def test_custom_op_registration(device):
    """torch.library's checks of the op (schema, fake tensor, dynamic shapes) on the kernel."""
    from engine.layers.activation import silu_and_mul_triton_op

    x = torch.randn(5, 64, device=device, dtype=torch.bfloat16)
    torch.library.opcheck(silu_and_mul_triton_op, (x,))
    with pytest.raises(ValueError, match="2I"):
        silu_and_mul_triton_op(torch.zeros(3, 33, device=device))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the custom op's CUDA path")
def test_custom_op_on_cuda_matches_and_compiles():
    from engine.layers.activation import silu_and_mul_triton_op, triton_or

    x = torch.randn(64, 2 * 3072, device="cuda", dtype=torch.bfloat16)
    _check(x, silu_and_mul_triton_op(x))
    compiled = torch.compile(triton_or(silu_and_mul_ref), fullgraph=True, dynamic=True)
    _check(x, compiled(x))
