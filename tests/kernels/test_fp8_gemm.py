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

from dataclasses import replace

import pytest
import torch
import triton
import triton.language as tl

from kernels.fp8_gemm import (
    Fp8Config,
    _fp8_bits_to_f16,
    _interpreting,
    fp8_config,
    fp8_gemm,
    fp8_gemv,
    fp8_group_quant,
    fp8_linear,
)
from kernels.gemv import gemv_counters
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


@pytest.mark.parametrize("m, pad", [(5, 16), (16, 16), (17, 4), (1, 16)])
def test_group_quant_pads_rows_with_quantized_zeros(m, pad):
    """``pad_rows_to`` (the cuBLASLt path's aligned M): the first M rows are the unpadded
    result bit for bit, the padding rows quantize zeros (zero codes, the zero-group scale), and
    the scales stay column-major with the padded leading dimension."""
    x = _x(m, 300, dtype=torch.bfloat16)
    q, s = fp8_group_quant(x, pad_rows_to=pad)
    m_pad = -(-m // pad) * pad
    assert q.shape == (m_pad, 300) and s.shape == (m_pad, 3)
    assert s.stride() == (1, m_pad)
    qr, sr = fp8_group_quant_ref(
        torch.cat([x, torch.zeros(m_pad - m, 300, dtype=x.dtype, device=x.device)])
    )
    assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8))
    assert torch.equal(s, sr)
    assert not q[m:].view(torch.uint8).any()


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


@pytest.mark.parametrize("m", [1, 3, 16, 32, 50])
@pytest.mark.parametrize("split_k", [1, 2, 3])
@pytest.mark.parametrize("n, k", [(200, 300), (256, 512)])
def test_gemv_matches_reference(m, split_k, n, k):
    """Unaligned N and K, 1..3 splits (one uneven), bias, rows up to block_m (64: the largest a
    table may give the small-M kernel)."""
    w, ws = _weights(n, k)
    x = _x(m, k)
    bias = torch.randn(n, device=DEVICE)
    cfg = Fp8Config("gemv", max(16, 1 << (m - 1).bit_length()), 32, 4, 1, split_k=split_k)
    out = torch.empty(m, n, device=DEVICE)
    fp8_gemv(x, w, ws, bias, out, cfg)
    assert _rel(out, fp8_linear_ref(x, w, ws, bias)) < 1e-6


@pytest.mark.parametrize("block_n", [16, 32])
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("n, k", [(200, 300), (256, 512)])
def test_gemv_fma_matches_reference_and_the_dot(block_n, split_k, n, k):
    """The CUDA-core product (``fma``) of one row: unaligned N and K, uneven splits, bias;
    equal to the reference and, up to fp32 rounding, to the tensor-core dot."""
    w, ws = _weights(n, k)
    x = _x(1, k)
    bias = torch.randn(n, device=DEVICE)
    out = torch.empty(1, n, device=DEVICE)
    fp8_gemv(x, w, ws, bias, out, Fp8Config("gemv", 1, block_n, 4, 1, split_k, fma=True))
    assert _rel(out, fp8_linear_ref(x, w, ws, bias)) < 1e-6
    dot = torch.empty_like(out)
    fp8_gemv(x, w, ws, bias, dot, Fp8Config("gemv", 16, block_n, 4, 1, split_k))
    assert _rel(out, dot) < 1e-6
    assert int(gemv_counters(torch.device(DEVICE)).abs().sum()) == 0


def test_gemv_fma_refuses_what_it_cannot_run():
    w, ws = _weights(64, 128)
    out = torch.empty(2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="at most block_m=1 rows"):
        fp8_gemv(_x(2, 128), w, ws, None, out, Fp8Config("gemv", 1, 32, 4, 1, fma=True))
    for bm, bn in ((2, 32), (1, 256)):
        with pytest.raises(ValueError, match="the fma product takes block_m 1"):
            fp8_gemv(_x(1, 128), w, ws, None, out[:1], Fp8Config("gemv", bm, bn, 4, 1, fma=True))


#: the block-diagonal operand (``x_groups``): (m, block_m, block_n, x_groups, block_k, split_k,
#: n, k). K = 300: three groups, the last one partial; 640: five (an odd count against two
#: groups an iteration); 2200: 18 groups, more than 16 a program, so at least two splits
#: whatever split_k says; block_n 256 spans two weight-scale rows; N tails everywhere
X_GROUPS_CASES = [
    (1, 1, 32, 16, 128, 1, 200, 300),
    (1, 1, 32, 16, 256, 2, 136, 640),
    (1, 1, 16, 32, 512, 1, 200, 300),
    (1, 1, 32, 16, 128, 1, 72, 2200),
    (5, 16, 32, 2, 256, 1, 136, 640),
    (3, 4, 32, 8, 128, 3, 200, 300),
    (2, 2, 256, 8, 128, 2, 300, 640),
]


@pytest.mark.parametrize("m, bm, bn, groups, bk, split_k, n, k", X_GROUPS_CASES)
def test_gemv_x_groups_matches_reference_and_the_dot(m, bm, bn, groups, bk, split_k, n, k):
    """The block-diagonal activation operand (``x_groups``): rows, groups, splits and tails as
    the cases say, bias; equal to the reference and, up to fp32 rounding, to the plain
    tensor-core kernel; split-K counters left zero. On the GPU each group's column also takes
    the FP8 tensor cores' (zero) products of the other groups' iterations, whose accumulation
    precision PTX leaves open (DeepSeek-V3's report, section 3.3.2, measured about 14 retained
    bits in Hopper's FP8 MMA accumulation): a looser bound there, 5e-4 (the H200 gave 1.43e-4 on
    the last case on 2026-12-04; the FP8 quantization itself is off by ~1.7e-3 from bf16, and a
    wrong kernel by 1e-1 or more)."""
    w, ws = _weights(n, k, seed=13)
    x = _x(m, k, seed=14)
    bias = torch.randn(n, device=DEVICE)
    cfg = Fp8Config("gemv", bm, bn, 4, 1, split_k, block_k=bk, x_groups=groups)
    out = torch.empty(m, n, device=DEVICE)
    fp8_gemv(x, w, ws, bias, out, cfg)
    tol = 1e-6 if _interpreting() else 5e-4
    assert _rel(out, fp8_linear_ref(x, w, ws, bias)) < tol
    dot = torch.empty_like(out)
    fp8_gemv(x, w, ws, bias, dot, Fp8Config("gemv", 16, bn, 4, 1, split_k))
    assert _rel(out, dot) < tol
    assert int(gemv_counters(torch.device(DEVICE)).abs().sum()) == 0


def test_gemv_x_groups_splits_so_that_a_program_takes_at_most_its_groups():
    """``gemv_k_split``: at most ``x_groups`` groups a split (more splits than asked where
    needed), each a multiple of an iteration's groups; the plain kernels' split unchanged."""
    from kernels.fp8_configs import gemv_k_split

    plain = Fp8Config("gemv", 16, 64, 4, 4, split_k=6)
    assert gemv_k_split(4096, plain) == (6, 6)  # 32 groups: 6 splits of 6 (the last 2)
    assert gemv_k_split(384, plain) == (3, 1)  # never an empty split
    bd = Fp8Config("gemv", 1, 128, 4, 4, split_k=1, x_groups=16)
    assert gemv_k_split(4096, bd) == (2, 16)
    assert gemv_k_split(12288, bd) == (6, 16)
    assert gemv_k_split(12288, replace(bd, split_k=8)) == (8, 12)
    assert gemv_k_split(640, replace(bd, block_k=256, split_k=2)) == (2, 4)
    assert gemv_k_split(640, replace(plain, fma=True, block_m=1, block_n=16, block_k=512)) == (
        2, 4,
    )  # fmt: skip


@triton.jit
def _convert_codes(src, dst):
    r = tl.arange(0, 256)
    tl.store(dst + r, _fp8_bits_to_f16(tl.load(src + r)))


@pytest.mark.parametrize("bk", [256, 512])
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("n, k", [(200, 300), (136, 1024)])
def test_gemv_fma_block_k_matches_reference_and_bit_cvt_is_exact(bk, split_k, n, k):
    """The one-row CUDA-core product with ``block_k`` inputs an iteration: equal to the
    reference; with ``bit_cvt`` (float8 -> float16 by shifts, 2^8 folded into the scale) the
    same bits as with the conversion instruction."""
    w, ws = _weights(n, k, seed=15)
    x = _x(1, k, seed=16)
    bias = torch.randn(n, device=DEVICE)
    cfg = Fp8Config("gemv", 1, 16, 4, 1, split_k, fma=True, block_k=bk)
    out = torch.empty(1, n, device=DEVICE)
    fp8_gemv(x, w, ws, bias, out, cfg)
    assert _rel(out, fp8_linear_ref(x, w, ws, bias)) < 1e-6
    bits = torch.empty_like(out)
    fp8_gemv(x, w, ws, bias, bits, replace(cfg, bit_cvt=True))
    assert torch.equal(bits, out)
    assert int(gemv_counters(torch.device(DEVICE)).abs().sum()) == 0


def test_fp8_bits_to_f16_is_exact_for_every_code():
    """Every float8_e4m3fn code but the two NaNs -- zeros of both signs, the 14 subnormals,
    normals up to 448 -- becomes exactly its value times 2^-8 in float16."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(DEVICE)
    out = torch.empty(256, dtype=torch.float16, device=DEVICE)
    _convert_codes[(1,)](codes, out)
    finite = ~torch.isnan(codes.float())
    assert int(finite.sum()) == 254
    want = codes.float() * 2.0**-8
    assert torch.equal(out.float()[finite], want[finite])
    assert torch.equal(out[finite].view(torch.int16) < 0, codes[finite].view(torch.int8) < 0)


@pytest.mark.parametrize("m, split_k", [(1, 1), (3, 3), (16, 2)])
def test_gemv_scale_ahead_gives_the_same_bits(m, split_k):
    """``scale_ahead`` (the next block's weight scales loaded an iteration early) changes when
    a value is loaded, not the arithmetic."""
    w, ws = _weights(200, 640, seed=17)
    x = _x(m, 640, seed=18)
    cfg = Fp8Config("gemv", 16, 32, 4, 1, split_k)
    a = torch.empty(m, 200, device=DEVICE)
    b = torch.empty_like(a)
    fp8_gemv(x, w, ws, None, a, cfg)
    fp8_gemv(x, w, ws, None, b, replace(cfg, scale_ahead=True))
    assert torch.equal(a, b)
    assert _rel(a, fp8_linear_ref(x, w, ws)) < 1e-6


@pytest.mark.parametrize(
    "cfg, match",
    [
        (Fp8Config("gemv", 16, 32, 4, 1, block_k=256), "block_k 256 needs fma or x_groups"),
        (Fp8Config("gemv", 1, 32, 4, 1, x_groups=8), "block_m \\* x_groups in 16..128, got 8"),
        (Fp8Config("gemv", 1, 32, 4, 1, x_groups=16, block_k=384), "block_k 384 is not one of"),
        (Fp8Config("gemv", 16, 32, 4, 1, x_groups=1, block_k=256), "spans more than x_groups"),
        (Fp8Config("gemv", 1, 32, 4, 1, fma=True, x_groups=16), "x_groups is an option of"),
        (Fp8Config("gemv", 16, 32, 4, 1, prefetch=True), "prefetch is an option of x_groups"),
        (Fp8Config("gemv", 16, 32, 4, 1, bit_cvt=True), "bit_cvt is an option of the gemv's fma"),
        (Fp8Config("gemv", 16, 32, 4, 1, x_groups=2, scale_ahead=True), "scale_ahead is an"),
    ],
)
def test_gemv_refuses_options_it_cannot_run(cfg, match):
    w, ws = _weights(64, 256)
    with pytest.raises(ValueError, match=match):
        fp8_gemv(_x(1, 256), w, ws, None, torch.empty(1, 64, device=DEVICE), cfg)


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


#: GEMM options: (block_m, block_n, group_m, split_k, fuse_quant); block_n 256 spans two
#: weight-scale blocks (per-column scales), <= 128 one (one scale per K block)
GEMM_OPTIONS = [
    (16, 64, 1, 1, False),
    (16, 256, 3, 1, False),
    (32, 32, 2, 2, False),  # split-K, reduced by the last-arriving program
    (16, 64, 1, 8, False),  # more splits asked than K blocks
    (32, 32, 2, 1, True),  # activations quantized in the GEMM
    (16, 128, 2, 3, True),  # both
]


@pytest.mark.parametrize("bm, bn, group_m, split_k, fuse", GEMM_OPTIONS)
@pytest.mark.parametrize("m, n, k", [(33, 200, 300), (70, 256, 512), (5, 136, 640)])
def test_gemm_options_match_reference(bm, bn, group_m, split_k, fuse, m, n, k):
    """M, N and K that are not multiples of the tiles (K tails, N past the last scale block),
    bias; fp8_linear with the configuration against the quantize-then-dequantize reference, and
    fp8_gemm on pre-quantized inputs (which ignores ``fuse_quant``)."""
    w, ws = _weights(n, k, seed=6)
    x = _x(m, k, seed=7)
    bias = torch.randn(n, device=DEVICE)
    cfg = Fp8Config("gemm", bm, bn, 4, 1, split_k=split_k, group_m=group_m, fuse_quant=fuse)
    out = fp8_linear(x, w, ws, bias, config=cfg)
    assert _rel(out, fp8_linear_ref(x, w, ws, bias)) < 1e-6
    xq, xs = fp8_group_quant(x)
    out2 = fp8_gemm(xq, xs, w, ws, bias, torch.empty(m, n, device=DEVICE), cfg)
    assert _rel(out2, fp8_block_matmul_ref(xq, xs, w, ws, bias=bias, out_dtype=out2.dtype)) < 1e-6
    assert int(gemv_counters(x.device).abs().sum()) == 0, "split-K counters left non-zero"


def test_gemm_split_k_is_deterministic_and_fused_quant_is_exact():
    """Split-K twice on the same counters gives the same bits (stale counts would misroute the
    reduction) and the unsplit result within bf16 rounding; the fused quantization gives what
    fp8_group_quant + the GEMM give."""
    n, k, m = 96, 512, 40
    w, ws = _weights(n, k, seed=8)
    x = _x(m, k, seed=9, dtype=torch.bfloat16)
    split = Fp8Config("gemm", 16, 32, 4, 1, split_k=3, group_m=2)
    a = fp8_linear(x, w, ws, config=split)
    assert torch.equal(a, fp8_linear(x, w, ws, config=split))
    fused = Fp8Config("gemm", 16, 32, 4, 1, group_m=2, fuse_quant=True)
    plain = Fp8Config("gemm", 16, 32, 4, 1, group_m=2)
    assert _rel(fp8_linear(x, w, ws, config=fused), fp8_linear(x, w, ws, config=plain)) < 1e-6
    # split-K adds its float32 partials in another order than one program does, so a bf16
    # output may differ in its last bit (one bf16 ulp is 2**-8 relative; the interpreter's
    # float32 dot itself rounds differently on different CPUs); a misrouted reduction is O(1)
    assert _rel(a, fp8_linear(x, w, ws, config=plain)) < 2**-8


def test_gemm_split_k_refuses_more_tiles_than_counters():
    """A split launch needs one arrival counter per output tile (checked before any launch)."""
    xq = torch.zeros(4112, 256, device=DEVICE).to(torch.float8_e4m3fn)
    xs = torch.ones(4112, 2, device=DEVICE)
    w, ws = _weights(4096, 256)
    out = torch.empty(4112, 4096, dtype=torch.bfloat16, device=DEVICE)
    cfg = Fp8Config("gemm", 16, 16, 4, 1, split_k=2)
    with pytest.raises(ValueError, match="split-K 2 of a 4112x4096 output: 65792 tiles"):
        fp8_gemm(xq, xs, w, ws, None, out, cfg)


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
    # one bf16 ulp of the element, or of the output's scale for elements near zero: on the GPU
    # the tensor cores sum in another order than the float32 reference, and an element that
    # nearly cancels differs by more than its own ulp (1.5-3 % of them, up to 1.5e-3 absolute)
    scale = ref.float().abs().max().item()
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=2**-8 * scale)
    assert _rel(out, ref) < 2**-7  # bf16 output rounding: ~3e-3 relative (norm)


def test_fp8_linear_refuses_bad_inputs():
    w, ws = _weights(128, 128)
    with pytest.raises(ValueError, match="float8_e4m3fn weight"):
        fp8_linear(_x(2, 128), w.float(), ws)
    with pytest.raises(ValueError, match="x has 256 features"):
        fp8_linear(_x(2, 256), w, ws)
    with pytest.raises(ValueError, match="at most block_m=16 rows"):
        fp8_gemv(_x(17, 128), w, ws, None, torch.empty(17, 128), Fp8Config("gemv", 16, 32, 4, 1))


def test_cublas_path_refuses_what_cublaslt_cannot_take():
    """The cuBLASLt kind writes bf16/fp16 only and needs K / 128 a multiple of 4 (unpadded
    weight scales): other inputs are refused by name before any device call."""
    from kernels.fp8_configs import CUBLAS_CONFIG

    w, ws = _weights(256, 384)
    with pytest.raises(ValueError, match="K a multiple of 512, got K=384"):
        fp8_linear(_x(64, 384, dtype=torch.bfloat16), w, ws, config=CUBLAS_CONFIG)
    w, ws = _weights(256, 512)
    with pytest.raises(ValueError, match="writes bf16/fp16"):
        fp8_linear(_x(64, 512), w, ws, config=CUBLAS_CONFIG)
    from kernels.fp8_cublas import fp8_cublas_gemm

    xq, xs = fp8_group_quant(_x(97, 512))  # unpadded M: refused by name, not by cuBLASLt
    with pytest.raises(ValueError, match="M padded to a multiple of 16, got M=97"):
        fp8_cublas_gemm(xq, xs, w, ws, None, torch.bfloat16)


@pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
    reason="cuBLASLt's block-scaled FP8 GEMM runs on sm_90 only (the H200 checks it)",
)
@pytest.mark.parametrize("m", [64, 200, 97, 1, 4097])
def test_cublas_path_matches_the_reference(m):
    """cuBLASLt's 1x128 / 128x128 block-scaled GEMM computes what the Triton kernels compute:
    the same quantized activations times the dequantized weight, within bf16 rounding."""
    from kernels.fp8_configs import CUBLAS_CONFIG

    n, k = 384, 1024
    w, ws = _weights(n, k, seed=11)
    x = _x(m, k, seed=12, dtype=torch.bfloat16)
    bias = torch.randn(n, device=DEVICE).to(torch.bfloat16)
    out = fp8_linear(x, w, ws, bias, config=CUBLAS_CONFIG)
    ref = fp8_linear_ref(x, w, ws, bias)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    scale = ref.float().abs().max().item()
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=2**-8 * scale)


def test_cublas_probe_records_the_answer_per_device(monkeypatch):
    """The load-time probe (``kernels.fp8_cublas.probe_cublas``) stores its answer once per
    device name; off sm_90 (this CPU) it says no with a reason, on the H200 yes."""
    import kernels.fp8_configs as fc
    from kernels.configs import device_name
    from kernels.fp8_cublas import probe_cublas

    monkeypatch.setattr(fc, "CUBLAS_USABLE", {})
    import kernels.fp8_cublas as fcb

    monkeypatch.setattr(fcb, "CUBLAS_USABLE", fc.CUBLAS_USABLE)
    device = torch.device(DEVICE)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # as while a model is built and its layers checked
    try:
        usable, reason = probe_cublas(device, 384, 1024)
        refused, why = probe_cublas(device, 384, 384)  # K / 128 not a multiple of 4
    finally:
        torch.set_default_dtype(default)
    sm90 = device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)
    assert usable == sm90 and (reason == "") == sm90, reason
    assert not refused and why
    name = device_name(device)
    assert fc.CUBLAS_USABLE == {(name, 384, 1024): usable, (name, 384, 384): False}
    assert probe_cublas(device, 384, 1024) == (usable, "")  # answered from the record
