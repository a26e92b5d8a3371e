"""The small-M linear kernel (``kernels/gemv.py``) against a float32 torch product, under the
Triton interpreter on the CPU (or on a GPU when one is present): tiling, masking of N and K
tails, split-K with the last-arriving program reducing, counter reset, bias, and the
``qwen_serve::linear`` op's dispatch."""

from __future__ import annotations

import pytest
import torch

from kernels.gemv import GEMV_MAX_M, GEMV_WIDE_MAX_M, GemvConfig, gemv, gemv_counters

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.bfloat16] if DEVICE == "cuda" else [torch.float32, torch.bfloat16]


def _inputs(m, n, k, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) / k**0.5
    b = torch.randn(n, generator=g)
    return x.to(DEVICE, dtype), w.to(DEVICE, dtype), b.to(DEVICE, dtype)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "m, n, k, cfg",
    [
        (1, 64, 128, GemvConfig(16, 32, 1, 4, 1)),  # one split, even K
        (3, 80, 200, GemvConfig(16, 32, 3, 4, 1)),  # N and K tails, three splits
        (16, 48, 96, GemvConfig(32, 32, 2, 4, 1)),  # full 16 rows, N tile past N
        (5, 33, 64, GemvConfig(16, 16, 4, 4, 1)),  # split-K of single K tiles
        (17, 40, 96, GemvConfig(16, 32, 2, 4, 1)),  # a 32-row tile, 15 rows masked
        (64, 48, 80, GemvConfig(32, 32, 3, 4, 1)),  # a full 64-row tile, K tail, splits
        (33, 24, 64, GemvConfig(16, 32, 1, 4, 1)),  # a 64-row tile, 31 rows masked
    ],
)
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_float32_product(m, n, k, cfg, dtype, bias):
    x, w, b = _inputs(m, n, k, dtype, seed=m * 1000 + n + k)
    out = gemv(x, w, b if bias else None, cfg)
    ref = x.float() @ w.float().T + (b.float() if bias else 0)
    assert out.shape == (m, n) and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert _rel(out, ref) < tol
    assert int(gemv_counters(x.device).abs().sum()) == 0, "arrival counters left non-zero"


def test_split_k_result_is_deterministic_and_counters_reset():
    """Two launches in a row on the same counters give the same bits (the second one would read
    stale counts if the first had not reset them), and split-K equals one split closely."""
    x, w, _ = _inputs(4, 96, 192, torch.float32, seed=3)
    cfg = GemvConfig(16, 32, 3, 4, 1)
    a = gemv(x, w, None, cfg)
    b = gemv(x, w, None, cfg)
    assert torch.equal(a, b)
    one = gemv(x, w, None, GemvConfig(16, 32, 1, 4, 1))
    assert _rel(a, one) < 1e-6
    assert int(gemv_counters(x.device).abs().sum()) == 0


def test_gemv_refuses_too_many_rows_and_mismatched_k():
    x, w, _ = _inputs(GEMV_WIDE_MAX_M + 1, 32, 64, torch.float32, seed=4)
    with pytest.raises(ValueError, match="at most"):
        gemv(x, w)
    with pytest.raises(ValueError, match="features"):
        gemv(x[:2], w[:, :32])


def test_table_rows_serve_their_row_counts(monkeypatch):
    """``gemv_config`` reads "m1" for one row, "m16" for 2-16, "m64" for 17-64, and says cuBLAS
    (None) past 64 rows, where the bucket's row is missing, or where cuBLAS won."""
    import kernels.gemv as kg

    def row(block_n, faster=False):
        return {**GemvConfig(block_n=block_n).__dict__, "cublas_faster": faster}

    table = {"96,64": {"m1": row(16), "m16": row(32), "m64": row(64)}, "48,64": {"m1": row(16)}}
    table["80,64"] = {"m64": row(64, faster=True)}
    monkeypatch.setattr(kg, "_interpreting", lambda: False)  # read the table, not tiny tiles
    monkeypatch.setattr(kg, "kernel_table", lambda kernel, name: table)
    monkeypatch.setattr(kg, "device_name", lambda device: "test")
    cpu = torch.device("cpu")
    widths = {m: kg.gemv_config(m, 96, 64, cpu) for m in (1, 2, 16, 17, 33, 64, 65)}
    assert {m: c.block_n if c else None for m, c in widths.items()} == {
        1: 16, 2: 32, 16: 32, 17: 64, 33: 64, 64: 64, 65: None
    }  # fmt: skip
    assert kg.gemv_config(1, 48, 64, cpu) is not None and kg.gemv_config(20, 48, 64, cpu) is None
    assert kg.gemv_config(20, 80, 64, cpu) is None
    assert [kg.block_m(m) for m in (1, 16, 17, 32, 33, 64)] == [16, 16, 32, 32, 64, 64]
    assert GemvConfig.from_row({"cublas_faster": True, "block_n": 64}) is None  # no whole tiles
    assert GemvConfig.from_row(row(64)) == GemvConfig(block_n=64)


def test_gemv_strided_rows():
    """A row-strided ``x`` (a slice of a wider activation) is read through its stride."""
    x, w, _ = _inputs(3, 40, 160, torch.float32, seed=5)
    wide = torch.zeros(3, 320, device=x.device, dtype=x.dtype)
    wide[:, :160] = x
    out = gemv(wide[:, :160], w, None, GemvConfig(16, 32, 2, 4, 1))
    assert _rel(out, x @ w.T) < 1e-5


def test_linear_op_dispatch_matches_f_linear():
    """``qwen_serve::linear`` (the op the model's linear layers call on CUDA) gives F.linear's
    result for small and large M; on the CPU ``dense_linear`` is F.linear itself."""
    from engine.layers.dense_linear import dense_linear, linear_op

    for m in (1, 7, GEMV_MAX_M + 9, GEMV_WIDE_MAX_M + 9):
        x, w, b = _inputs(m, 64, 96, torch.float32, seed=m)
        ref = torch.nn.functional.linear(x, w, b)
        assert _rel(linear_op(x, w, b), ref) < 1e-5
        assert torch.equal(dense_linear(x, w, b), ref) or DEVICE == "cuda"


def test_gemv_refuses_operands_it_would_misread():
    """A weight with K stride != 1, a strided or mis-shaped bias, or mixed dtypes: gemv raises
    (the kernel would read them wrongly) and the op falls back to F.linear's result."""
    from engine.layers.dense_linear import linear_op

    x, w, b = _inputs(3, 48, 64, torch.float32, seed=6)
    wt = w.T.contiguous().T  # same values, K stride 48
    wide_b = torch.zeros(96, device=x.device, dtype=x.dtype)
    wide_b[::2] = b
    cases = {
        "weight K stride": (x, wt, None),
        "strided bias": (x, w, wide_b[::2]),
        "bias shape": (x, w, b[:-1]),
        "mixed dtypes": (x.to(torch.bfloat16), w, None),
    }
    for name, (xx, ww, bb) in cases.items():
        with pytest.raises(ValueError):
            gemv(xx, ww, bb, GemvConfig(16, 32, 2, 4, 1))
        if name in ("weight K stride", "strided bias"):
            ref = torch.nn.functional.linear(xx, ww, bb)
            assert _rel(linear_op(xx, ww, bb), ref) < 1e-5, name


def test_counters_made_inside_inference_mode_reset_outside(monkeypatch):
    """The shared arrival counters are first made wherever a launch first needs them -- often
    inside an engine forward's inference mode; a reset outside it (the FP8 sweep's, after a
    failed launch) must still work."""
    import kernels.arrival_counters as ac
    import kernels.gemv as gv

    monkeypatch.setattr(ac, "_BUFFERS", {})
    with torch.inference_mode():
        buf = gv.gemv_counters(torch.device("cpu"))
    assert not buf.is_inference()
    gv.gemv_counters(torch.device("cpu")).zero_()
    with torch.inference_mode():
        gv.gemv_counters(torch.device("cpu")).zero_()  # and inside it
