"""``bench/gemv.py``'s sweeps on the CPU (``--tiny``, the Triton interpreter): the fused sweep
writes a table ``kernels.gemv_fused.fused_gemv_config`` reads, a configuration whose result is
wrong is never chosen; and ``bench/gemv_compile_check.py --quick`` compiles the plain and fused
GEMVs (the q/k/v + rotary one included) for sm_90 without a GPU."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.compile_checks import run_compile_check

REPO = Path(__file__).resolve().parents[2]


def _args(**kw) -> argparse.Namespace:
    base = dict(tiny=True, sweep=False, shapes=None, fused_shapes=None, budget_s=1e9, ms=[1, 16])
    base.update(compile_workers=0, compile_budget_s=0.0)
    return argparse.Namespace(**{**base, **kw})


def test_tiny_fused_sweep_writes_a_table_the_kernels_read(tmp_path, monkeypatch):
    r = subprocess.run(
        [sys.executable, str(REPO / "bench/gemv.py"), "--tiny", "--fused", "--out", str(tmp_path)],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "| tiny qkv+norm 64->96 | 1 |" in r.stdout and "| tiny down+swiglu" in r.stdout
    assert "| tiny o+merge 128->64 | 16 |" in r.stdout
    assert "| tiny qkv+norm+rope 64->64 | 1 |" in r.stdout
    table = json.loads((tmp_path / "gemv_fused_cpu.json").read_text())
    assert set(table) == {
        "rms_norm:96,64",
        "swiglu:64,160",
        "attn_merge:64,128",
        "qkv_rope:64,64",
    }
    import kernels.gemv_fused as gf
    from kernels.gemv import GemvConfig

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # read the table, not the interpreter's tiles
    monkeypatch.setattr(gf, "kernel_table", lambda kernel, name: table)
    for key, rows in table.items():
        kind, shape = key.split(":")
        n, k = map(int, shape.split(","))
        for bucket, row in rows.items():
            assert isinstance(row["fused_faster"], bool)
            assert row["fused_us"] > 0 and row["unfused_us"] > 0
            m = 1 if bucket == "m1" else 16
            want = GemvConfig(*(row[f] for f in GemvConfig.__dataclass_fields__))
            got = gf.fused_gemv_config(kind, m, n, k, torch.device("cpu"))
            assert got == (want if row["fused_faster"] else None)


def test_a_wrong_fused_configuration_is_never_chosen(monkeypatch):
    """A fused result off by 5% for one of the two tiny configurations: the sweep skips it and
    keeps the other; when both are wrong, no configuration and no fusion."""
    from bench import gemv as bg
    from bench.gemv_configs import TINY_CONFIGS

    real = bg.gemv_swiglu
    bad = {TINY_CONFIGS[0]}

    def skewed(gate_up, w, bias, cfg):
        out = real(gate_up, w, bias, cfg)
        return out * 1.05 if cfg in bad else out

    monkeypatch.setattr(bg, "gemv_swiglu", skewed)
    g = torch.Generator().manual_seed(0)
    args = _args(fused_shapes=["tiny down+swiglu"])
    table, rows = bg.sweep_fused(args, torch.device("cpu"), g)
    assert [r["config"] for r in rows] == [TINY_CONFIGS[1].__dict__] * 2
    bad.add(TINY_CONFIGS[1])
    table, rows = bg.sweep_fused(args, torch.device("cpu"), g)
    assert rows == [] and table == {
        "swiglu:64,160": {"m1": {"fused_faster": False}, "m16": {"fused_faster": False}}
    }


def test_tiny_plain_sweep_fills_the_row_buckets_the_kernel_reads(monkeypatch):
    """The plain sweep at 1 and 20 rows writes each tiny shape's "m1" and "m64" rows (20 rows
    are the 17-64 bucket), which ``kernels.gemv.gemv_config`` serves to 1 and to 17-64 rows;
    a partial sweep's merge replaces only the buckets it timed."""
    import kernels.gemv as kg
    from bench import gemv as bg

    g = torch.Generator().manual_seed(0)
    args = _args(shapes=["tiny qkv"], ms=[1, 20])
    table, rows = bg.sweep_plain(args, torch.device("cpu"), g)
    assert [r["m"] for r in rows] == [1, 20] and set(table) == {"96,64"}
    assert set(table["96,64"]) == {"m1", "m64"}
    monkeypatch.setattr(kg, "_interpreting", lambda: False)  # read the table, not tiny tiles
    monkeypatch.setattr(kg, "kernel_table", lambda kernel, name: table)
    for m, bucket in ((1, "m1"), (17, "m64"), (64, "m64")):
        row = table["96,64"][bucket]
        want = kg.GemvConfig(*(row[f] for f in kg.GemvConfig.__dataclass_fields__))
        assert kg.gemv_config(m, 96, 64, torch.device("cpu")) == (
            None if row["cublas_faster"] else want
        )
    assert kg.gemv_config(2, 96, 64, torch.device("cpu")) is None  # no m16 row swept
    current = {"96,64": {"m1": {"old": 1}, "m16": {"old": 2}}, "64,160": {"m1": {"old": 3}}}
    merged = bg.merge_partial(current, {"96,64": {"m1": {"new": 1}, "m64": {"new": 4}}})
    assert merged == {
        "96,64": {"m1": {"new": 1}, "m16": {"old": 2}, "m64": {"new": 4}},
        "64,160": {"m1": {"old": 3}},
    }
    assert current["96,64"] == {"m1": {"old": 1}, "m16": {"old": 2}}  # not modified


def test_gemv_compile_check_quick_compiles_for_sm90():
    stdout = run_compile_check("gemv_compile_check.py", "--quick")
    assert "FAIL" not in stdout and "22/22 compiled for sm_90" in stdout
    assert "swiglu" in stdout and "rms_norm" in stdout and "qkv_rope" in stdout


def test_a_resweep_keeps_the_decode_step_verdict():
    """A fused row decided by an end-to-end decode-step A/B keeps that verdict through a
    kernel-only re-sweep (new tiles and times, the old fused_faster and its note): "off" always,
    "on" only where the sweep found tiles that passed; rows without one take the sweep's."""
    from bench.gemv import STEP_VERDICT, keep_step_verdicts

    tiles = {"block_n": 128, "block_k": 256, "split_k": 2, "num_warps": 4, "num_stages": 2}
    current = {
        "qkv_rope:4096,1024": {
            "m1": {"fused_faster": False, STEP_VERDICT: "slower in the step", **tiles},
            "m16": {"fused_faster": True, STEP_VERDICT: "faster in the step", **tiles},
        },
        "swiglu:1024,3072": {"m16": {STEP_VERDICT: "no verdict field"}},
        "rms_norm:4096,1024": {"m1": {"fused_faster": True, **tiles}},
    }
    swept = {
        "qkv_rope:4096,1024": {
            "m1": {"fused_faster": True, **tiles, "split_k": 4, "fused_us": 7.0},
            "m16": {"fused_faster": False},  # no configuration passed
        },
        "swiglu:1024,3072": {"m16": {"fused_faster": True, **tiles}},
        "rms_norm:4096,1024": {"m1": {"fused_faster": False, **tiles}},
    }
    notes = keep_step_verdicts(swept, current)
    m1 = swept["qkv_rope:4096,1024"]["m1"]
    want = {**tiles, "split_k": 4, "fused_us": 7.0, STEP_VERDICT: "slower in the step"}
    assert m1 == {"fused_faster": False, **want}
    assert swept["qkv_rope:4096,1024"]["m16"] == {"fused_faster": False}
    assert swept["swiglu:1024,3072"]["m16"]["fused_faster"] is False  # a note without a verdict
    assert swept["rms_norm:4096,1024"]["m1"]["fused_faster"] is False  # no note: the sweep's
    assert len(notes) == 2 and all("from the decode-step A/B" in n for n in notes)
