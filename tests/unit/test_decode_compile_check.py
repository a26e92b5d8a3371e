"""``bench/decode_compile_check.py --quick`` compiles the split-KV paged decode kernel for sm_90
without a GPU, in every variant the engine launches (pure decode and mixed rows, unsplit and
split, the merge in a second launch or fused into stage 1, the q/k norm + rotary prologue), and
checks the PTX for the synchronisation the fused merge and the prologue rely on. The Triton
interpreter compiles nothing and runs programs one after another, so this is what catches a
variant that no longer builds for the H200 or lost its barrier or acquire-release arrival."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.decode_ptx import sync_error  # noqa: E402 - after the path insert
from bench.pdl_ptx import pdl_order_error  # noqa: E402
from tests.compile_checks import run_compile_check  # noqa: E402


def test_decode_compile_check_quick_compiles_for_sm90():
    stdout = run_compile_check("decode_compile_check.py", "--quick", "--threads", "2")
    assert "FAIL" not in stdout and "12/12 compiled for sm_90" in stdout
    assert "ok   smem" in stdout and "decode split fused-merge qk-rope page=128" in stdout


def test_sync_error_names_what_the_fused_merge_lacks():
    """The PTX check itself, on a hand-written excerpt: each missing piece is named, and a
    variant without the fused merge may hold no atomic."""
    good = (
        "griddepcontrol.wait ;\nst.global.v4.b32 [%rd1], {%r1};\nbar.sync 0;\n"
        "@%p1 atom.global.gpu.acq_rel.add.u32 %r2, [%rd2+0], %r3;\nbar.sync 0;\n"
        "@%p2 ld.global.cg.v4.b32 {%r4}, [%rd3+0];\n"
        "@%p1 atom.global.gpu.relaxed.exch.b32 %r5, [%rd2+0], %r6;\n"
    )  # fmt: skip
    fused = {"FUSED_REDUCE": True, "FUSED_QK": True}
    assert sync_error(good, fused) is None
    assert pdl_order_error(good, True) is None
    assert "acq_rel" in sync_error(good.replace("acq_rel", "relaxed"), fused)
    assert "GPU scope" in sync_error(good.replace(".gpu.acq_rel", ".cta.acq_rel"), fused)
    no_bar = good.replace("bar.sync 0;\n@%p1 atom", "@%p1 atom")
    assert "arrival" in sync_error(no_bar, {"FUSED_REDUCE": True})
    # a barrier elsewhere (the attention loop's, before the store) does not count
    loop_bar = "bar.sync 0;\n" + no_bar.replace("griddepcontrol.wait ;\n", "")
    assert "arrival" in sync_error("griddepcontrol.wait ;\n" + loop_bar, {"FUSED_REDUCE": True})
    assert "reset" in sync_error(good.replace("exch", "or"), fused)
    assert ".cg" in sync_error(good.replace("ld.global.cg", "ld.global"), fused)
    assert "without the fused merge" in sync_error(good, {})
    no_qk_bar = "st.global.b16 [%rd1], %rs1;\nld.global.b16 %rs2, [%rd1];\n"
    assert "prologue's k/v store" in sync_error(no_qk_bar, {"FUSED_QK": True})
    # the loop's barriers after the first read do not count; cp.async reads count as reads
    later_bar = no_qk_bar + "bar.sync 0;\n"
    assert "prologue's k/v store" in sync_error(later_bar, {"FUSED_QK": True})
    async_read = "st.global.b16 [%rd1], %rs1;\ncp.async.cg.shared.global [%r1], [%rd1], 16;\n"
    assert "prologue's k/v store" in sync_error(async_read, {"FUSED_QK": True})
    ok_qk = "st.global.b16 [%rd1], %rs1;\nbar.sync 0;\nld.global.b16 %rs2, [%rd1];\n"
    assert sync_error(ok_qk, {"FUSED_QK": True}) is None
    # a bulk store or a commit before the barrier is not a read
    not_reads = "cp.async.bulk.global.shared::cta [%rd2], [%r1], 16;\ncp.async.bulk.commit_group;\n"
    ok_bulk = ok_qk.replace("bar.sync", not_reads + "bar.sync")
    assert sync_error(ok_bulk, {"FUSED_QK": True}) is None
    bulk_load = "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier [%r1], [%rd3];\n"
    assert sync_error(ok_qk.replace("bar.sync", bulk_load + "bar.sync"), {"FUSED_QK": True})
