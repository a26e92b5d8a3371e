"""``bench/prefill_compile_check.py --quick`` compiles the paged prefill kernel for sm_90 without a
GPU: its default tiles on both paths (the pointer gather over 16-token pages, the KV_TMA loads over
128-token pages), single-pass and split-KV, with and without skipped decode rows, and the split
merge. The Triton interpreter does not compile, so this is what catches a kernel or signature
change that no longer builds for the H200."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_prefill_compile_check_quick_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO)
    r = subprocess.run(
        [sys.executable, str(REPO / "bench/prefill_compile_check.py"), "--quick", "--threads", "2"],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "FAIL" not in r.stdout and "10/10 compiled for sm_90" in r.stdout
    assert "'KV_TMA': True" in r.stdout and "merge TOK=128" in r.stdout
