"""The block-FP8 tile tables (``kernels/fp8_configs.py``): M buckets, the lookup of a measured
entry, the built-in configuration where there is none, and clear errors for malformed entries.
Tables are written to a temporary ``CONFIG_DIR`` under an invented device name."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

import kernels.configs as configs
import kernels.fp8_configs as fc
from kernels.fp8_configs import Fp8Config, default_fp8_config, fp8_config, fp8_table_config

DEVICE = "Test GPU"
ROW_GEMM = dict(kind="gemm", block_m=16, block_n=64, num_warps=4, num_stages=5, split_k=4,
                group_m=1, fuse_quant=True, fp8_us=9.5, bf16_us=10.1)  # fmt: skip
ROW_GEMV = dict(kind="gemv", block_m=64, block_n=64, num_warps=4, num_stages=4, split_k=6)
ROW_BIG = {"kind": "gemm", "block_m": 128, "block_n": 256, "num_warps": 8, "num_stages": 3}


@pytest.fixture
def table(tmp_path, monkeypatch):
    """Write ``{shape: {bucket: row}}`` as the table of DEVICE; returns the writer."""
    monkeypatch.setattr(configs, "CONFIG_DIR", tmp_path)

    def write(content):
        configs.kernel_table.cache_clear()
        fc._table_entry.cache_clear()
        fc.table_fallback.cache_clear()
        configs.table_path("fp8_gemm", DEVICE).write_text(json.dumps(content))

    yield write
    configs.kernel_table.cache_clear()
    fc._table_entry.cache_clear()
    fc.table_fallback.cache_clear()


def test_m_buckets():
    assert [fc.m_bucket(m) for m in (0, 1)] == [1, 1]  # batch-1 decode: its own bucket
    assert [fc.m_bucket(m) for m in (2, 9, 16)] == [16, 16, 16]  # the other decode sizes: one
    assert [fc.m_bucket(m) for m in (17, 32, 33, 64, 65, 200, 256, 2049, 4096)] == [
        32, 32, 64, 64, 128, 256, 256, 4096, 4096,
    ]  # fmt: skip
    assert fc.m_bucket(100_000) == 4096  # the last bucket serves every larger M


def test_lookup_picks_the_bucket_and_kind(table):
    table({"4096,4096": {"64": ROW_GEMV, "128": ROW_GEMM, "4096": ROW_BIG}})
    want_gemm = Fp8Config("gemm", 16, 64, 4, 5, split_k=4, group_m=1, fuse_quant=True)
    want_gemv = Fp8Config("gemv", 64, 64, 4, 4, split_k=6)
    for m in (33, 50, 64):
        assert fp8_table_config(DEVICE, m, 4096, 4096) == want_gemv
    for m in (65, 128):
        assert fp8_table_config(DEVICE, m, 4096, 4096) == want_gemm
    assert fp8_table_config(DEVICE, 9000, 4096, 4096) == Fp8Config("gemm", 128, 256, 8, 3)
    # a forced kind other than the entry's, a missing bucket / shape / device: none
    assert fp8_table_config(DEVICE, 64, 4096, 4096, kind="gemm") is None
    assert fp8_table_config(DEVICE, 64, 4096, 4096, kind="gemv") == want_gemv
    assert fp8_table_config(DEVICE, 256, 4096, 4096) is None
    assert fp8_table_config(DEVICE, 128, 4096, 12288) is None
    assert fp8_table_config("Other GPU", 128, 4096, 4096) is None
    assert fp8_table_config(DEVICE, 16, 4096, 4096) is None  # no "16" entry here
    table({"4096,4096": {"16": {**ROW_GEMV, "block_m": 16}}})
    for m in (1, 7, 16):  # the decode sizes read the "16" bucket (M = 1 too: no "1" entry)
        assert fp8_table_config(DEVICE, m, 4096, 4096) == replace(want_gemv, block_m=16)
    assert fp8_table_config(DEVICE, 17, 4096, 4096) is None


def test_batch_one_bucket_takes_the_cuda_core_product(table):
    """A "1" entry serves M = 1 alone (here the fma variant); M = 2..16 keep the "16" entry;
    the fallback of a shape without a "1" entry is the "16" entry, as before the bucket."""
    fma_row = {**ROW_GEMV, "block_m": 1, "block_n": 32, "split_k": 2, "fma": True}
    table({"4096,4096": {"1": fma_row, "16": {**ROW_GEMV, "block_m": 16}}})
    assert fp8_table_config(DEVICE, 1, 4096, 4096) == Fp8Config(
        "gemv", 1, 32, 4, 4, split_k=2, fma=True
    )
    for m in (2, 16):
        assert fp8_table_config(DEVICE, m, 4096, 4096) == Fp8Config("gemv", 16, 64, 4, 4, 6)
    assert fc.table_fallback(DEVICE, 4096, 4096, 1) is None  # not a cublas entry


def test_small_m_options_parse_and_default_off(table):
    """The small-M kernel's options (block_k, x_groups, scale_ahead, prefetch, bit_cvt) are
    read from a table entry; an entry without them (every table written before they existed)
    is the configuration it was."""
    bd = {**ROW_GEMV, "block_m": 1, "block_n": 128, "x_groups": 16, "block_k": 256,
          "prefetch": True}  # fmt: skip
    fma = {**ROW_GEMV, "block_m": 1, "block_n": 16, "fma": True, "block_k": 512, "bit_cvt": True}
    ahead = {**ROW_GEMV, "block_m": 16, "scale_ahead": True}
    table({"4096,4096": {"1": bd, "16": ahead}, "6144,4096": {"1": fma, "16": ROW_GEMV}})
    assert fp8_table_config(DEVICE, 1, 4096, 4096) == Fp8Config(
        "gemv", 1, 128, 4, 4, split_k=6, block_k=256, x_groups=16, prefetch=True
    )
    assert fp8_table_config(DEVICE, 1, 6144, 4096) == Fp8Config(
        "gemv", 1, 16, 4, 4, split_k=6, fma=True, block_k=512, bit_cvt=True
    )
    assert fp8_table_config(DEVICE, 9, 4096, 4096) == Fp8Config(
        "gemv", 16, 64, 4, 4, split_k=6, scale_ahead=True
    )
    old = fp8_table_config(DEVICE, 16, 6144, 4096)
    assert old == Fp8Config("gemv", 64, 64, 4, 4, split_k=6)
    assert (old.block_k, old.x_groups, old.scale_ahead, old.prefetch, old.bit_cvt) == (
        128, 0, False, False, False,
    )  # fmt: skip


def test_batch_one_without_its_entry_takes_the_decode_buckets_cublas_fallback(table, monkeypatch):
    """No "1" entry and a "cublas" "16" entry whose load-time probe failed: M = 1 runs that
    entry's recorded Triton fallback, as M = 16 does."""
    fallback = {**ROW_GEMV, "block_m": 16, "block_n": 128, "split_k": 2, "fp8_us": 9.0}
    table({"4096,4096": {"16": {"kind": "cublas", "fp8_us": 8.0, "fallback": fallback}}})
    monkeypatch.setattr(fc, "interpreting", lambda: False)
    monkeypatch.setattr(fc, "device_name", lambda device: DEVICE)
    monkeypatch.setitem(fc.CUBLAS_USABLE, (DEVICE, 4096, 4096), False)
    want = Fp8Config("gemv", 16, 128, 4, 4, split_k=2)
    assert fc.table_fallback(DEVICE, 4096, 4096, 1) == want
    for m in (1, 16):
        assert fp8_config(m, 4096, 4096, device=torch.device("cuda")) == want


def test_fp8_config_uses_the_table_else_the_builtin_tiles(table, monkeypatch):
    """On a CUDA device (its name faked; the interpreter's small tiles switched off), an entry
    wins; without one the result is the built-in configuration, exactly."""
    table({"4096,4096": {"128": ROW_GEMM}})
    monkeypatch.setattr(fc, "interpreting", lambda: False)
    monkeypatch.setattr(fc, "device_name", lambda device: DEVICE)
    cuda = torch.device("cuda")
    assert fp8_config(100, 4096, 4096, device=cuda) == fp8_table_config(DEVICE, 100, 4096, 4096)
    for m in (1, 16, 32, 64, 256, 300, 4096):
        for n, k in ((4096, 4096), (6144, 4096), (4096, 12288)):
            if (m, n, k) == (100, 4096, 4096):
                continue
            assert fp8_config(m, n, k, device=cuda) == default_fp8_config(m, n, k)
    assert fp8_config(100, 4096, 4096, device="cpu") == default_fp8_config(100, 4096, 4096)
    assert fp8_config(100, 4096, 4096) == default_fp8_config(100, 4096, 4096)  # no device


def test_split_k_entry_of_the_last_bucket_runs_unsplit_past_the_launch_limits(table, monkeypatch):
    """The last bucket serves every larger M: a split-K entry there keeps its tiles but runs
    unsplit once the output has more tiles than arrival counters (or 2^31 partials)."""
    split_row = {**ROW_BIG, "block_m": 64, "block_n": 64, "split_k": 2}
    table({"4096,4096": {"4096": split_row}})
    monkeypatch.setattr(fc, "interpreting", lambda: False)
    monkeypatch.setattr(fc, "device_name", lambda device: DEVICE)
    cuda = torch.device("cuda")
    assert fp8_config(4096, 4096, 4096, device=cuda).split_k == 2  # 4096 tiles: fits
    big = fp8_config(70_000, 4096, 4096, device=cuda)  # 70,000 tiles > 65,536 counters
    assert big == Fp8Config("gemm", 64, 64, 8, 3, split_k=1)


def test_builtin_tiles_are_unchanged():
    """The configuration every device without a table runs (as before the tables existed)."""
    assert default_fp8_config(1, 4096, 4096) == Fp8Config("gemv", 16, 64, 4, 4, split_k=6)
    assert default_fp8_config(32, 6144, 4096) == Fp8Config("gemv", 32, 64, 4, 4, split_k=4)
    assert default_fp8_config(33, 4096, 4096) == Fp8Config("gemm", 64, 128, 4, 4, group_m=8)
    assert default_fp8_config(256, 24576, 4096) == Fp8Config("gemm", 64, 128, 4, 4, group_m=8)
    assert default_fp8_config(257, 4096, 12288) == Fp8Config("gemm", 128, 128, 8, 3, group_m=8)
    assert default_fp8_config(8, 4096, 4096, kind="gemm").kind == "gemm"


@pytest.mark.parametrize(
    "row, match",
    [
        ({**ROW_GEMM, "block_size_m": 16}, r"unknown keys \['block_size_m'\]"),
        ({k: v for k, v in ROW_GEMM.items() if k != "num_warps"}, r"missing \['num_warps'\]"),
        ({**ROW_GEMM, "block_m": "16"}, "block_m must be int, got '16'"),
        ({**ROW_GEMM, "fuse_quant": 1}, "fuse_quant must be bool"),
        ({**ROW_GEMM, "split_k": True}, "split_k must be int"),
        ({**ROW_GEMM, "kind": "mma"}, "kind must be 'gemm', 'gemv' or 'cublas'"),
        ({**ROW_GEMM, "block_n": 96}, "block_n 96 is not a power of two"),
        ({**ROW_GEMM, "num_warps": 3}, "num_warps 3 is not 2, 4 or 8"),
        ({**ROW_GEMM, "num_stages": 0}, "num_stages 0 is outside"),
        ({**ROW_GEMM, "split_k": 0}, "split_k 0 and group_m 1 must be >= 1"),
        ({**ROW_GEMV, "block_m": 32}, "bucket 128 <= block_m 32"),
        ({**ROW_GEMV, "fuse_quant": True}, "fuse_quant is a gemm option"),
        ({**ROW_GEMV, "fma": 1}, "fma must be bool"),
        ({**ROW_GEMV, "fma": True}, "fma is a gemv option for block_m a power of two in 1..1"),
        ({**ROW_GEMV, "block_m": 1, "block_n": 256, "fma": True}, "and block_n <= 128"),
        ({**ROW_GEMM, "block_m": 2, "fma": True}, "fma is a gemv option"),
        ({**ROW_GEMV, "block_m": 2}, "block_m 2 is not a power of two in 16..256"),
        ({**ROW_GEMV, "block_k": 256}, "block_k 256 needs fma or x_groups"),
        ({**ROW_GEMV, "block_k": 1024, "x_groups": 2}, "block_k 1024 is not one of"),
        ({**ROW_GEMV, "x_groups": 3}, "x_groups 3 must be a power of two"),
        ({**ROW_GEMV, "x_groups": 4}, r"block_m \* x_groups in 16..128, got 256"),
        ({**ROW_GEMV, "block_m": 32, "x_groups": 2}, "x_groups takes block_m a power of two"),
        ({**ROW_GEMM, "x_groups": 1}, "x_groups is an option of the gemv's tensor-core"),
        ({**ROW_GEMV, "prefetch": True}, "prefetch is an option of x_groups"),
        ({**ROW_GEMV, "scale_ahead": 1}, "scale_ahead must be bool"),
        ({**ROW_GEMV, "x_groups": True}, "x_groups must be int"),
        ({**ROW_GEMM, "scale_ahead": True}, "scale_ahead is an option of the gemv's tensor-core"),
        ({**ROW_GEMV, "bit_cvt": True}, "bit_cvt is an option of the gemv's fma product"),
        ([16, 64], "expected an object of tile fields, got list"),
    ],
)
def test_malformed_entry_raises_naming_file_shape_and_bucket(table, row, match):
    table({"4096,4096": {"128": row}})
    with pytest.raises(ValueError, match=match) as err:
        fp8_table_config(DEVICE, 100, 4096, 4096)
    assert "fp8_gemm_Test_GPU.json entry 4096,4096, bucket 128" in str(err.value)


def test_malformed_shape_entry_raises(table):
    table({"4096,4096": {"100": ROW_GEMM}})
    with pytest.raises(ValueError, match=r"unknown M buckets \['100'\]"):
        fp8_table_config(DEVICE, 100, 4096, 4096)
    table({"4096,4096": [ROW_GEMM]})
    with pytest.raises(ValueError, match="expected an object keyed by M bucket"):
        fp8_table_config(DEVICE, 100, 4096, 4096)
    table({"6144,4096": {"100": ROW_GEMM}})  # another shape's error does not touch this one
    assert fp8_table_config(DEVICE, 100, 4096, 4096) is None


def test_check_fp8_table_reads_every_bucket_of_a_shape(table, monkeypatch):
    """The engine's start-up check parses all buckets of a layer's shape: a malformed bucket
    that no warm-up step would reach still fails there, naming it."""
    table({"4096,4096": {"128": ROW_GEMM, "2048": {**ROW_BIG, "num_warps": 3}}})
    monkeypatch.setattr(fc, "device_name", lambda device: DEVICE)
    fc.check_fp8_table("cpu", 4096, 4096)  # no table on the CPU: nothing read
    fc.check_fp8_table(torch.device("cuda"), 6144, 4096)  # shape without an entry
    with pytest.raises(ValueError, match="bucket 2048: num_warps 3"):
        fc.check_fp8_table(torch.device("cuda"), 4096, 4096)


def test_cublas_entries_carry_no_tiles(table, monkeypatch):
    """A "cublas" entry is the kind plus measurements; tile fields in it are refused."""
    table({"4096,4096": {"256": {"kind": "cublas", "fp8_us": 20.0, "bf16_us": 25.0}}})
    monkeypatch.setattr(fc, "interpreting", lambda: False)
    monkeypatch.setattr(fc, "device_name", lambda device: DEVICE)
    assert fp8_config(200, 4096, 4096, device=torch.device("cuda")) == fc.CUBLAS_CONFIG
    assert fp8_table_config(DEVICE, 200, 4096, 4096, kind="gemm") is None
    assert fc.check_fp8_table(torch.device("cuda"), 4096, 4096)  # the caller must probe it
    # a device whose load-time probe failed runs the built-in Triton tiles for those M
    monkeypatch.setitem(fc.CUBLAS_USABLE, (DEVICE, 4096, 4096), False)
    assert fp8_config(200, 4096, 4096, device=torch.device("cuda")) == default_fp8_config(
        200, 4096, 4096
    )
    monkeypatch.setitem(fc.CUBLAS_USABLE, (DEVICE, 4096, 4096), True)
    assert fp8_config(200, 4096, 4096, device=torch.device("cuda")) == fc.CUBLAS_CONFIG
    # float32 activations never go to cuBLASLt (it writes bf16/fp16 only)
    cuda = torch.device("cuda")
    assert fp8_config(200, 4096, 4096, device=cuda, dtype=torch.bfloat16) == fc.CUBLAS_CONFIG
    assert fp8_config(200, 4096, 4096, device=cuda, dtype=torch.float32) == default_fp8_config(
        200, 4096, 4096
    )
    # with the bucket's fastest Triton tiles recorded, a failed probe runs those
    table({"4096,4096": {"256": {"kind": "cublas", "fp8_us": 20.0, "fallback": ROW_GEMM}}})
    monkeypatch.setitem(fc.CUBLAS_USABLE, (DEVICE, 4096, 4096), False)
    want = Fp8Config("gemm", 16, 64, 4, 5, split_k=4, group_m=1, fuse_quant=True)
    assert fp8_config(200, 4096, 4096, device=torch.device("cuda")) == want
    monkeypatch.setitem(fc.CUBLAS_USABLE, (DEVICE, 4096, 4096), True)
    assert fp8_config(200, 4096, 4096, device=cuda, dtype=torch.float32) == want
    monkeypatch.setitem(fc.CUBLAS_USABLE, (DEVICE, 4096, 4096), False)
    assert fp8_config(200, 4096, 4096, kind="gemv", device=torch.device("cuda")) == (
        default_fp8_config(200, 4096, 4096, "gemv")
    )
    for bad, match in (
        ({"kind": "cublas"}, "fallback of a cublas entry must be a Triton kernel"),
        ({**ROW_GEMM, "num_warps": 3}, r"\(fallback\), bucket 256: num_warps 3"),
    ):
        table({"4096,4096": {"256": {"kind": "cublas", "fallback": bad}}})
        with pytest.raises(ValueError, match=match):
            fp8_table_config(DEVICE, 200, 4096, 4096)
    table({"4096,4096": {"256": {"kind": "cublas", "block_m": 64}}})
    with pytest.raises(ValueError, match="a cublas entry takes no tile fields"):
        fp8_table_config(DEVICE, 200, 4096, 4096)
