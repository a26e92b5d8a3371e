"""``bench/fp8_sweep.py``'s candidate logic: the per-(shape, M) cap, the shared memory limit,
the built-in configuration always timed, every candidate compiled beforehand, and a table that
``kernels.fp8_configs`` accepts; its --gemv-variants mode (candidates, the per-family table, and
a whole --tiny run on the interpreter); and ``bench/fp8_compile_check.py --quick``, which
compiles the built-in configurations and one of each option for sm_90 without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from bench import fp8_sweep as sw
from kernels.fp8_configs import M_BUCKETS, Fp8Config, default_fp8_config, fp8_table_config
from tests.compile_checks import run_compile_check

REPO = Path(__file__).resolve().parents[2]


def test_candidates_are_capped_fit_and_precompiled():
    keys = {sw.compile_key(c) for c in sw.compile_set(sw.SHAPES, M_BUCKETS)}
    for _, n, k in sw.SHAPES:
        for m in M_BUCKETS:
            first = sw.stage_a(m, n, k)
            assert first[0] == default_fp8_config(m, n, k)
            assert len(first) == len(set(first))
            # stage B after a made-up ranking: the slowest first (any order may happen)
            second = sw.stage_b(m, n, k, first[::-1], set(first), sw.MAX_CANDIDATES - len(first))
            everything = first + second
            assert len(everything) <= sw.MAX_CANDIDATES and not set(first) & set(second)
            for cfg in everything[1:]:
                assert sw.smem_bytes(cfg) <= sw.SMEM_LIMIT, cfg
                assert cfg.kind == "gemm" or m <= 64
            assert {sw.compile_key(c) for c in everything} <= keys


def test_variants_change_one_thing_and_skip_splits_that_launch_alike():
    cfg = Fp8Config("gemm", 16, 64, 4, 5, split_k=2, group_m=8)
    vs = sw.variants(64, 4096, 4096, cfg)
    assert replace(cfg, fuse_quant=True) in vs
    assert {v.split_k for v in vs if v.split_k != 2} == {1, 4, 8}
    assert {v.group_m for v in vs if v.group_m != 8} == {1, 16, 32, 64}  # 4 M tiles
    gemv = Fp8Config("gemv", 32, 64, 4, 4, split_k=4)
    # K = 384: 3 K blocks, so splits 3, 4, 6, 8, 12 all make 3 launches' worth
    assert [v.split_k for v in sw.variants(32, 4096, 384, gemv)] == [1, 2]


def test_table_of_writes_entries_fp8_config_accepts(tmp_path, monkeypatch):
    import kernels.configs as configs
    import kernels.fp8_configs as fc

    best = Fp8Config("gemm", 32, 128, 4, 4, split_k=4, group_m=1, fuse_quant=True)
    rows = [
        {"n": 4096, "k": 4096, "m": 64, "best": asdict(best), "fp8_us": 7.123, "bf16_us": 10.0,
         "default_us": 19.0},
        {"n": 4096, "k": 4096, "m": 128, "default_us": None},  # nothing passed: no entry
    ]  # fmt: skip
    table = sw.table_of(rows)
    assert table == {"4096,4096": {"64": {**asdict(best), "fp8_us": 7.12, "bf16_us": 10.0,
                                          "default_us": 19.0}}}  # fmt: skip
    monkeypatch.setattr(configs, "CONFIG_DIR", tmp_path)
    configs.kernel_table.cache_clear()
    fc._table_entry.cache_clear()
    configs.table_path("fp8_gemm", "Sweep GPU").write_text(json.dumps(table))
    try:
        assert fp8_table_config("Sweep GPU", 50, 4096, 4096) == best
        assert fp8_table_config("Sweep GPU", 100, 4096, 4096) is None
    finally:
        configs.kernel_table.cache_clear()
        fc._table_entry.cache_clear()


def test_batch_one_candidates_and_a_partial_sweep_keep_the_other_buckets():
    """M = 1 times only the small-M kernel, its CUDA-core product among them (one row, each
    accepted by the table's parser); ``--ms`` merges the swept buckets into the table."""
    from kernels.fp8_configs import parse_table_entry

    first = sw.stage_a(1, 4096, 4096)
    assert all(c.kind == "gemv" for c in first)
    fma = [c for c in first if c.fma]
    assert fma and all(c.block_m == 1 for c in fma) and any(not c.fma for c in first)
    for c in first:
        assert parse_table_entry(asdict(c), 1) == c
    kept = {"1,2": {"16": {"a": 1}, "64": {"b": 2}}, "3,4": {"16": {"c": 3}}}
    merged = sw.merge_tables(kept, {"1,2": {"1": {"d": 4}, "16": {"e": 5}}, "5,6": {"1": {}}})
    assert merged == {"1,2": {"1": {"d": 4}, "16": {"e": 5}, "64": {"b": 2}},
                      "3,4": {"16": {"c": 3}}, "5,6": {"1": {}}}  # fmt: skip
    assert kept["1,2"] == {"16": {"a": 1}, "64": {"b": 2}}  # not modified
    r = subprocess.run(
        [sys.executable, str(REPO / "bench/fp8_sweep.py"), "--ms", "3", "--tiny"],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300,
    )  # fmt: skip
    assert r.returncode == 2 and "--ms takes buckets of" in r.stderr


def test_compile_check_quick_compiles_for_sm90():
    """Also checks (outside the interpreter, which this session runs under) that the sweep's
    warm-up launches specialize as the timed ones: the sweep compiles each configuration on
    small inputs in other processes and then only loads it."""
    stdout = run_compile_check("fp8_compile_check.py", "--quick")
    assert "_fp8_gemm_kernel" in stdout and "FAILED" not in stdout
    assert "warm-up launches specialize as the timed ones" in stdout


def test_a_wrong_nondeterministic_or_failing_configuration_is_rejected(monkeypatch):
    import torch

    import kernels.fp8_gemm as fg

    cfg = Fp8Config("gemm", 16, 64, 4, 1)
    ref = torch.randn(4, 8)
    outs = iter([ref, ref + 1e-3])
    cpu = torch.device("cpu")
    args = (torch.zeros(4, 8), ref, [None], [None], cpu)
    monkeypatch.setattr(fg, "fp8_linear", lambda *a, **kw: ref * 1.01)
    assert sw.check_and_time(cfg, *args, None)[2].startswith("relative error 1.0e-02")
    monkeypatch.setattr(fg, "fp8_linear", lambda *a, **kw: next(outs))
    assert sw.check_and_time(cfg, *args, None)[2] == "two launches differ"
    monkeypatch.setattr(fg, "fp8_linear", lambda *a, **kw: 1 / 0)
    assert sw.check_and_time(cfg, *args, None)[2].startswith("ZeroDivisionError")
    assert sw.check_and_time(cfg, *args, {})[2] == "not compiled within the budget"
    key = sw.compile_key(cfg)
    assert sw.check_and_time(cfg, *args, {key: "OutOfResources"})[2] == "compile failed"
    monkeypatch.setattr(fg, "fp8_linear", lambda *a, **kw: ref)
    us, err, why = sw.check_and_time(cfg, *args, {key: None})
    assert why == "" and err == 0.0 and us > 0


@pytest.fixture
def gemv_variants(monkeypatch):
    """``bench/fp8_sweep.py --gemv-variants``' candidates (the module's mode switch)."""
    monkeypatch.setitem(sw.GEMV_VARIANTS, "on", True)


def test_gemv_variant_candidates_cover_every_option_as_launched(gemv_variants):
    """M = 1 and 16 with --gemv-variants: the built-in configuration first, each option family
    present, every candidate a valid table entry of its bucket that fits the shared memory,
    split counts as launched (so the warm-up compiles what is timed), within the cap, and
    compiled beforehand."""
    from kernels.fp8_configs import gemv_k_split, parse_table_entry

    keys = {sw.compile_key(c) for c in sw.compile_set(sw.SHAPES, sw.VARIANT_MS)}
    want = {
        1: {"dot", "dot scale_ahead", "fma", "fma block_k", "fma bit_cvt", "x_groups",
            "x_groups prefetch"},
        16: {"dot", "dot scale_ahead", "x_groups"},
    }  # fmt: skip
    for _, n, k in sw.SHAPES:
        for m in sw.VARIANT_MS:
            first = sw.stage_a(m, n, k)
            assert first[0] == default_fp8_config(m, n, k)
            assert {sw.family(asdict(c)) for c in first} == want[m]
            second = sw.stage_b(m, n, k, first, set(first), sw.VARIANT_MAX_CANDIDATES - len(first))
            everything = first + second
            assert len(everything) <= sw.VARIANT_MAX_CANDIDATES
            assert len({sw.as_launched(k, c) for c in everything}) == len(everything)
            for cfg in everything:
                assert parse_table_entry(asdict(cfg), m) == cfg
                assert sw.smem_bytes(cfg) <= sw.SMEM_LIMIT
                assert sw.compile_key(cfg) in keys
                if cfg.x_groups:
                    assert cfg.split_k == gemv_k_split(k, cfg)[0]


def test_family_rows_sum_the_fastest_of_each_family():
    """The per-family table: each family's fastest passed configuration per shape, summed;
    TB/s of the weights (bf16: two bytes an element); a family missing a shape has no sum."""
    dot = asdict(Fp8Config("gemv", 16, 64, 4, 4, split_k=4))
    slow = asdict(Fp8Config("gemv", 16, 128, 4, 4, split_k=4))
    bd = asdict(Fp8Config("gemv", 1, 128, 4, 4, split_k=2, x_groups=16))
    rows = [
        {"shape": "a", "n": 1024, "k": 1024, "m": 1, "bf16_us": 4.0, "bf16_err": 1e-3,
         "fp8_us": 2.0, "err": 2e-3, "table": dot, "table_us": 3.0,
         "all": [{**dot, "us": 3.0, "err": 2e-3}, {**slow, "us": 3.5, "err": 2e-3},
                 {**bd, "us": 2.0, "err": 2e-3}]},
        {"shape": "b", "n": 2048, "k": 1024, "m": 1, "bf16_us": 6.0, "bf16_err": 1e-3,
         "fp8_us": 4.0, "err": 3e-3,
         "all": [{**dot, "us": 4.0, "err": 3e-3}, {**bd, "us": None, "err": 1.0}]},
    ]  # fmt: skip
    lines = {f["line"]: f for f in sw.family_rows(rows)}
    assert lines["dot"]["us"] == [3.0, 4.0] and lines["dot"]["sum_us"] == 7.0
    assert lines["dot"]["ratio"] == 0.7 and lines["dot"]["err"] == 3e-3
    fp8_bytes = 3 * 1024 * 1024 + 4 * (8 * 8 + 16 * 8)
    assert abs(lines["dot"]["tbs"] - fp8_bytes / 7e-6 / 1e12) < 1e-9
    assert abs(lines["bf16 F.linear"]["tbs"] - 2 * 3 * 1024 * 1024 / 10e-6 / 1e12) < 1e-9
    assert lines["x_groups"]["us"] == [2.0, None] and lines["x_groups"]["sum_us"] is None
    assert lines["table today"]["us"] == [3.0, None] and lines["best"]["sum_us"] == 6.0
    assert "fma" not in lines  # no candidate of the family


def test_gemv_variants_tiny_run_on_the_interpreter(tmp_path):
    """``--gemv-variants --tiny``: the whole script on the CPU (interpreter, one small shape,
    one tile of each option) -- candidates checked against the reference, timed, the
    per-family table printed and the results written."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRITON_INTERPRET": "1"}
    r = subprocess.run(
        [sys.executable, str(REPO / "bench/fp8_sweep.py"), "--gemv-variants", "--tiny",
         "--out", str(tmp_path), "--workers", "1"],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for line in ("M = 1: fastest of each option family", "M = 16: fastest of each option family",
                 "| x_groups |", "| fma block_k |", "| fma bit_cvt |", "| dot scale_ahead |",
                 "| bf16 F.linear |", "| best |"):  # fmt: skip
        assert line in r.stdout, line
    rows = json.loads((tmp_path / "fp8_sweep.json").read_text())
    assert [row["m"] for row in rows] == [1, 16]
    for row in rows:
        assert row["passed"] == row["tried"]  # every option matches the reference
        assert {sw.family(a) for a in row["all"]} >= (
            {"x_groups", "x_groups prefetch", "fma block_k", "fma bit_cvt"}
            if row["m"] == 1 else {"x_groups", "dot scale_ahead"}
        )  # fmt: skip
