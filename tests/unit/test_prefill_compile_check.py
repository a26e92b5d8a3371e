"""``bench/prefill_compile_check.py --quick`` compiles the paged prefill kernel for sm_90 without a
GPU: its default tiles on both paths (the pointer gather over 16-token pages, the KV_TMA loads over
128-token pages), single-pass and split-KV, with and without skipped decode rows, and the split
merge. The Triton interpreter does not compile, so this is what catches a kernel or signature
change that no longer builds for the H200."""

from __future__ import annotations

from tests.compile_checks import run_compile_check


def test_prefill_compile_check_quick_compiles_for_sm90():
    stdout = run_compile_check("prefill_compile_check.py", "--quick", "--threads", "2")
    assert "FAIL" not in stdout and "10/10 compiled for sm_90" in stdout
    assert "'KV_TMA': True" in stdout and "merge TOK=128" in stdout
